"""Target -> drafter transport and the queues between the stages (the watchdog that ends the job on a dead or
stuck rank is trainer/watchdog.py).

The stages here, in a micro-batch's order: `produce` (q_pre), `Sender`, `receive`, `Prefetcher` (q_hs) or, for the
one process with a compiled target, `TargetAhead`. The route itself, with the one-process variants: ARCHITECTURE.md.

A micro-batch crosses as a `Packet`: a small int64 header over the gloo control group (so the receiver learns
the shapes on the CPU without a GPU sync), then the payload tensors over the data group (NCCL on GPU, gloo on
CPU). Both ends walk their micro-batches in increasing global index `g`, so blocking transfers cannot deadlock.
"""
import collections
import contextlib
import itertools
import queue
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.target import target_features

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADER_LEN = 6  # [magic, g, num_seqs, num_tokens, feature_dim, dtype code]
MAGIC = 0xDF1A5


@dataclass
class Packet:
    g: int                   # global micro-batch index
    lengths: torch.Tensor    # [b] long, tokens per sequence
    input_ids: torch.Tensor  # [T] long, packed (CPU on the drafter side)
    loss_mask: torch.Tensor  # [T] uint8, packed (CPU on the drafter side)
    features: torch.Tensor   # [T, K*H] on the device

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def device_tensors(self) -> list[torch.Tensor]:
        """Its tensors on a GPU (handoff's list, when a packet made on one thread's stream moves to another's)."""
        return [t for t in (self.lengths, self.input_ids, self.loss_mask, self.features) if t.is_cuda]


# --- transfers --------------------------------------------------------------------------------------------------------

def send_packet(p: Packet, dst: int, ctrl, data) -> None:
    header = torch.tensor([MAGIC, p.g, p.lengths.numel(), p.num_tokens, p.features.shape[-1],
                           DTYPES.index(p.features.dtype)], dtype=torch.long)
    dist.send(header, dst, group=ctrl)
    # ids, mask and lengths are small and the drafter plans its blocks from them on the CPU: they go by gloo
    small = torch.cat([p.lengths.cpu(), p.input_ids.cpu().long(), p.loss_mask.cpu().long()])   # [b + 2T]
    dist.send(small, dst, group=ctrl)
    dist.send(p.features.contiguous(), dst, group=data)


def recv_packet(src: int, ctrl, data, device) -> Packet:
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    dist.recv(header, src, group=ctrl)
    magic, g, b, T, F, code = header.tolist()
    if magic != MAGIC:
        raise RuntimeError(f"corrupt packet header from rank {src}: {header.tolist()}")
    small = torch.empty(b + 2 * T, dtype=torch.long)
    dist.recv(small, src, group=ctrl)
    features = torch.empty(T, F, dtype=DTYPES[code], device=device)
    dist.recv(features, src, group=data)
    return Packet(g, small[:b], small[b:b + T], small[b + T:].to(torch.uint8), features)


class Sender(threading.Thread):
    """Target side: sends queued (dst, packet) pairs in order, on its own CUDA stream so compute keeps going."""

    def __init__(self, ctrl, data, depth, watchdog):
        super().__init__(daemon=True, name="sender")
        self.q = queue.Queue(maxsize=depth)
        self.ctrl, self.data, self.watchdog = ctrl, data, watchdog
        self.sent = 0
        self.tokens = 0

    def put(self, dst: int, p: Packet) -> None:
        ready = None
        if p.features.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        wake_put(self.q, (dst, p, ready))   # (the target rank's main thread: a full queue waits in WAKE_S steps)

    def run(self):
        try:
            stream = torch.cuda.Stream() if torch.cuda.is_available() and self.data is not None and \
                dist.get_backend(self.data) == "nccl" else None
            while True:
                dst, p, ready = self.q.get()
                self.watchdog.send_state = f"sending g={p.g} to rank {dst}"
                if stream is not None:
                    with torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        send_packet(p, dst, self.ctrl, self.data)
                    stream.synchronize()  # the payload must outlive the transfer
                else:
                    send_packet(p, dst, self.ctrl, self.data)
                self.watchdog.send_state = f"sent g={p.g} to rank {dst}"
                self.sent += 1
                self.tokens += p.num_tokens
                self.watchdog.progress()
        except Exception as e:  # noqa: BLE001 - any failure here ends the job with a reason
            self.watchdog.fail(f"sender thread: {type(e).__name__}: {e}", traceback.format_exc())


def receive(schedule, ctrl, data, device, watchdog):
    """Drafter side: the Packets of `schedule` (an iterator of (g, src)), received in order; feeds a Prefetcher."""
    for g, src in schedule:
        watchdog.recv_state = f"waiting for g={g} from rank {src}"
        p = recv_packet(src, ctrl, data, device)
        if p.g != g:
            raise RuntimeError(f"expected micro-batch g={g} from rank {src}, got g={p.g}: the ranks disagree on "
                               f"the plan (different config or dataset?)")
        watchdog.recv_state = f"received g={g}"
        yield p


class StopPoint:
    """The first micro-batch not to make: the schedule's end, or the earlier one the master publishes in the store
    under `stop_g` once a rank asked to stop (a signal), so the target ranks stop where the drafters do."""

    def __init__(self, store, total_g: int):
        self.store, self.g = store, total_g

    def __call__(self) -> int:
        if self.store and self.store.check(["stop_g"]):
            self.g = int(self.store.get("stop_g"))
        return self.g


class Replica:
    """The target ranks that share one sharded target (TARGET_SHARDS, model.target.load_sharded): FSDP all-gathers
    each layer's weights inside every forward, so all of them must run the same number of forwards or the last one
    waits forever. Each rank still forwards its own micro-batches; before its k-th forward the replica agrees on
    the stop point (the smallest any of them has read: a stop published between two ranks' reads cannot split
    them), and a rank whose k-th micro-batch is past it while a peer's is not runs a one-token forward with them.
    member_gs: the g's each member makes, in order (Schedule.target_gs of each rank), the same list on every rank."""

    def __init__(self, group, member_gs, index):
        self.group, self.member_gs, self.index = group, list(member_gs), index

    def agree(self, k, stop_g):
        """-> (the agreed stop point, whether another member's k-th micro-batch comes before it)."""
        t = torch.tensor([stop_g], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        stop_g = int(t)
        peers = any(k < len(gs) and gs[k] < stop_g for i, gs in enumerate(self.member_gs) if i != self.index)
        return stop_g, peers


def produce(data, gs, target, device, depth, stop=None, watchdog=None, clock=None, stats=None, replica=None):
    """Target side: yields the Packets of micro-batches `gs` (in order). data.batch(g) pads them on a prefetch thread
    (q_pre, `depth` ahead; pinned on a GPU), the target forward runs on the calling thread. Stops before the g
    `stop()` names. The q_pre depth goes to stats["q"] (the watchdog's, published to the master, or the given dict);
    `clock` (a BusyClock) times the forwards. replica (a Replica): the target is sharded, forwards are kept in step
    with the replica's other ranks."""
    stats = watchdog.stats if watchdog else stats
    q_pre = queue.Queue(maxsize=depth)

    def prefetch():
        try:
            for g in gs:
                ids, mask, attn, lens = data.batch(g)
                if device.type == "cuda":
                    ids, attn = ids.pin_memory(), attn.pin_memory()
                q_pre.put((g, ids, mask, attn, lens))
            q_pre.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            if watchdog:
                watchdog.fail(f"prefetch thread: {type(e).__name__}: {e}", traceback.format_exc())
            q_pre.put(e)   # the one-process mode has no watchdog: its feeder thread raises it on
    threading.Thread(target=prefetch, daemon=True, name="prefetch").start()
    done = False                                                          # this rank's g's are all made
    for k in itertools.count():
        item = None if done else wake_get(q_pre)
        if isinstance(item, BaseException):
            raise RuntimeError(f"prefetch thread: {type(item).__name__}: {item}") from item
        stop_g = stop() if stop is not None else None
        peers = False
        if replica is not None:
            stop_g, peers = replica.agree(k, stop_g)
        done = item is None or (stop_g is not None and item[0] >= stop_g)
        if done:
            if not peers:
                return
            if watchdog:
                watchdog.state = f"one-token forward {k} with the replica's other ranks (none left here)"
            one = torch.ones(1, 1, dtype=torch.long)
            target_features(target, one, one, device)
            continue
        g, ids, mask, attn, lens = item
        if watchdog:
            watchdog.state = f"target forward g={g}"
        if stats is not None:
            stats["q"] = q_pre.qsize()
        keep = attn.bool()
        t0 = clock.start() if clock else None
        feats = target_features(target, ids, attn, device)
        if clock:
            clock.stop(t0, int(lens.sum()))
        yield Packet(g, lens, ids[keep], mask[keep], feats)


WAKE_S = 0.2   # the longest wake_get() or wake_put() sleeps before the main thread's signal handlers get their turn


def wake_get(q: queue.Queue):
    """q.get() in waits of WAKE_S. Python runs signal handlers on the main thread, between bytecodes: a signal the
    kernel hands to another thread (e.g. one stuck in a target forward) while the main thread sleeps in an untimed
    q.get() has its handler wait for the queue's next item, which may never come (CPython 3.11, tried: SIGTERM sent
    to a sleeping thread, the main thread in q.get(), the handler ran only once another signal reached the main
    thread). Each timed wait's return lets the handler run."""
    while True:
        try:
            return q.get(timeout=WAKE_S)
        except queue.Empty:
            pass


def wake_put(q: queue.Queue, item) -> None:
    """q.put(item), in waits of WAKE_S when the queue is full (wake_get's reason)."""
    while True:
        try:
            return q.put(item, timeout=WAKE_S)
        except queue.Full:
            pass


class Prefetcher(threading.Thread):
    """Packets in, prepared micro-batches out, `depth` ahead of the consumer. The thread draws each packet from
    `packets` (an iterator that runs here: `receive` on a drafter rank, `produce`'s target forward in the one-process
    mode, synthetic packets in the bench), runs `prepare(packet)` on it (model.objective.prepare: anchors, blocks,
    masks, built off the training thread) and queues the result; on a GPU all of it on the thread's own CUDA stream,
    each item with an event that get() makes the consumer's stream wait on (handoff). An error on the thread ends the
    job through `fail(reason, detail)` (a drafter rank's watchdog) or, without one, is raised by the next get()."""

    def __init__(self, packets, prepare, device, depth, name="feeder", fail=None):
        super().__init__(daemon=True, name=name)
        self.packets, self.prepare, self.device, self.fail = packets, prepare, torch.device(device), fail
        self.q = queue.Queue(maxsize=depth)                # q_hs
        self.halt = threading.Event()
        self.prepare_s = []      # wall seconds per prepare() call (the bench reports them)
        self.prepare_cpu_s = []  # this thread's CPU seconds in them (wall - CPU = waiting: the GIL, blocking copies)

    def run(self):
        try:
            cuda = self.device.type == "cuda"
            stream = torch.cuda.Stream(self.device) if cuda else None
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for p in self.packets:
                    t, cpu = time.perf_counter(), time.thread_time()
                    item = self.prepare(p)
                    self.prepare_s.append(time.perf_counter() - t)
                    self.prepare_cpu_s.append(time.thread_time() - cpu)
                    if not self._put((item, stream.record_event() if cuda else None)):
                        return
        except BaseException as e:  # noqa: BLE001 - ends the job, or handed to the consumer with its traceback
            if self.fail:
                self.fail(f"{self.name} thread: {type(e).__name__}: {e}", traceback.format_exc())
            self._put((e, None))

    def _put(self, entry) -> bool:
        while not self.halt.is_set():
            try:
                self.q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def get(self):
        item, done = wake_get(self.q)
        if isinstance(item, BaseException):
            raise RuntimeError(f"{self.name} thread: {type(item).__name__}: {item}") from item
        return handoff(item, done, self.device)

    def stop(self):
        """End the thread (the bench's; a trainer's ends with its process)."""
        self.halt.set()
        self.join(timeout=30)


class TargetAhead:
    """The one process's feed with a compiled target (COMPILE_TARGET): the target forward runs on the calling (main)
    thread, `ahead` micro-batches before the training step needs them, and a Prefetcher thread prepares them (q_hs)
    on its own stream. get() as a Prefetcher's.

    A compiled target is not run on the feeder thread: torch.fx's symbolic tracing sets one flag for the whole
    process, not one thread, and dynamo raises when a compiled function runs while that flag is on. The feeder's
    compiled forward failed so on an H200 ("Detected that you are using FX to symbolically trace a dynamo-optimized
    function") while the main thread compiled the drafter. On the main thread, compiles and forwards take turns. A
    large target is GPU-bound, so little is lost (BENCHMARKS.md: at Qwen3-8B shapes the one process ran at the sum
    of the target's and the drafter's times either way), and with the forward a micro-batch ahead the GPU's queue
    holds the next target forward behind each drafter step. An eager target stays on the feeder thread (Prefetcher
    over produce): a small one is launch-bound, and its kernels are then launched beside the drafter's."""

    def __init__(self, packets, prepare, device, depth, ahead=1):
        self.packets, self.device, self.ahead = iter(packets), torch.device(device), ahead
        self.cuda = self.device.type == "cuda"
        self.inbox = queue.Queue()        # (packet, its event on this thread's stream); None: no more packets
        self.handed = 0                   # packets handed to the thread and not yet taken back by get()
        self.ended = False
        self.thread = Prefetcher(self._received(), prepare, device, depth, name="feeder")
        self.q = self.thread.q            # q_hs, for the status line

    def _received(self):                  # runs on the thread, on its stream
        while (entry := wake_get(self.inbox)) is not None:
            yield handoff(*entry, self.device)

    def start(self):
        self.thread.start()

    def get(self):
        while not self.ended and self.handed <= self.ahead:
            try:
                p = next(self.packets)    # the target forward, here
            except StopIteration:
                self.ended = True
                self.inbox.put(None)
                break
            self.inbox.put((p, torch.cuda.current_stream(self.device).record_event() if self.cuda else None))
            self.handed += 1
        item = self.thread.get()
        self.handed -= 1
        return item

    def stop(self):
        self.inbox.put(None)
        self.thread.stop()


def handoff(item, done, device):
    """An item written on a side thread's CUDA stream (event `done`), made safe for this thread's stream: order
    its writes before our use, and keep its memory from being reused before our use ends."""
    if done is not None:
        cur = torch.cuda.current_stream(device)
        cur.wait_event(done)
        for t in item.device_tensors():
            t.record_stream(cur)
    return item


class BusyClock:
    """Seconds and tokens a role spends computing, so the master can measure each role's capacity (not only the
    pipeline's rate, which the slower role sets). On GPU: CUDA events around each unit of work, summed by the
    watchdog thread once they have completed, so the hot loop never syncs. The first `skip` units are not counted:
    they include torch.compile's compiles (COMPILE_*, flex_attention at the real mask lengths) and allocator
    warm-up.
    """

    SKIP = 3

    def __init__(self, device, skip=SKIP):
        self.cuda = device.type == "cuda"
        self.pending = collections.deque()   # (start event, end event, tokens), appended by the worker thread
        self.seconds, self.tokens = 0.0, 0
        self.skip = skip

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, t0, tokens):
        if self.skip > 0:
            self.skip -= 1
            return
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pending.append((t0, e, tokens))
        else:
            self.seconds += time.perf_counter() - t0
            self.tokens += tokens

    def poll(self) -> dict:
        while self.pending and self.pending[0][1].query():
            s, e, tok = self.pending.popleft()
            self.seconds += s.elapsed_time(e) / 1000
            self.tokens += tok
        return {"busy_s": self.seconds, "busy_tok": self.tokens}
