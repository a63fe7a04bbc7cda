"""The watchdog that turns any dead or stuck rank into a quick, named exit, and the ending of the job (a failure,
a signal, the normal end). One per rank; the transport (trainer/pipe.py) reports its threads' failures through it."""
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time

import torch


# --- watchdog ---------------------------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # zombie = dead but unreaped
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class Watchdog(threading.Thread):
    """One per rank. Every `interval` s: publish a heartbeat, our state and stats to the c10d store; end this
    process if another rank reported a failure, if a rank on this host is gone, if a rank's heartbeat stopped for
    `heartbeat_timeout` s, or if no rank made progress for `stall_timeout` s once training runs. The first rank to
    see a problem writes the reason under `abort`, so every survivor prints the same line."""

    def __init__(self, store, rank, world, roles, heartbeat_timeout, stall_timeout, interval=1.0, log=print,
                 is_master=False):
        super().__init__(daemon=True, name="watchdog")
        self.is_master = is_master  # exits last, through finished()
        self.store, self.rank, self.world, self.roles = store, rank, world, roles
        self.heartbeat_timeout, self.stall_timeout, self.interval, self.log = (
            heartbeat_timeout, stall_timeout, interval, log)
        self.state = "starting"
        self.recv_state = ""       # pipe.receive's (on the Prefetcher thread), never hiding the main thread's
        self.send_state = ""       # the Sender thread's, likewise
        self.stats = {}            # role-specific numbers for the status line (queue depth, counters)
        self.collect = []          # callables returning more stats, polled here (e.g. a BusyClock)
        self.steady = False        # stall detection only once training runs (start-up can take minutes)
        self.paused = False        # set by pause(): this rank is busy on purpose (an evaluation), peers wait for it
        self._beats = 0
        self._progress = 0
        self._seen = {}            # rank -> (last heartbeat value, local time it changed)
        self._seen_progress = {}   # rank -> (last progress value, local time it changed)
        self._peers = {}           # rank -> (host, pid)
        self.on_abort = []         # callbacks run before exit (flush logs)

    def who(self, r: int) -> str:
        return f"rank {r} ({self.roles[r]})"

    def progress(self):
        self._progress += 1

    @contextlib.contextmanager
    def pause(self, state: str):
        """Work that makes no progress and holds the other ranks up while it runs (the trainer's evaluation):
        published in the heartbeat, so no rank counts it as a stall; the stall clock restarts when it ends.
        Heartbeats go on, so a rank that dies meanwhile is still named at once."""
        before, self.state, self.paused = self.state, state, True
        try:
            yield
        finally:
            self.state, self.paused = before, False
            self._progress += 1

    def start(self):
        self.store.set(f"pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        super().start()

    # -- ending the job --
    def fail(self, reason: str, detail: str = "") -> None:
        """This rank cannot go on: publish why, print it, exit non-zero. Once the job is done (peers exiting close
        their connections, which surfaces here as errors) it is a normal exit instead. A transport error is most
        often the echo of another rank's death: then that death is the reason published."""
        self._exit_if_done()
        msg = f"{self.who(self.rank)}: {reason}"
        culprit = self._culprit(wait=2 * self.interval)
        if culprit:
            detail = f"{detail}\n{msg}".lstrip("\n")
            msg = culprit
        try:
            self.store.compare_set("abort", "", msg)
        except Exception:  # noqa: BLE001 - the store may be gone too; we still exit
            pass
        self._exit(msg, detail)

    def _culprit(self, wait: float) -> str:
        """The reason another rank already published, or a rank on this host whose process is gone, looked for
        during up to `wait` s (its watchdog may be a beat away from naming a death on its own host). The published
        reason first: a rank that named a death and exited is gone too by now (the other shard of a sharded
        target replica, whose all-gather failed), and is not the cause."""
        end = time.monotonic() + wait
        host = socket.gethostname()
        while True:
            try:
                if self.store.check(["abort"]):
                    published = self.store.get("abort").decode()
                    if published:
                        return published
                self._load_peers()
                for r, (h, pid) in self._peers.items():
                    if h == host and not _pid_alive(pid):
                        return f"{self.who(r)} died (process {pid} is gone: killed, crashed or out of memory)"
            except Exception:  # noqa: BLE001 - the store is gone: report our own reason
                return ""
            if time.monotonic() >= end:
                return ""
            time.sleep(0.1)

    def _load_peers(self) -> None:
        if self._peers:
            return
        others = [r for r in range(self.world) if r != self.rank]
        if self.store.check([f"pid/{r}" for r in others]):
            for r in others:
                h, pid = self.store.get(f"pid/{r}").decode().split()
                self._peers[r] = (h, int(pid))

    def _exit(self, msg, detail=""):
        try:   # stdout may be gone (tmux pane or tee killed): the exit below must happen regardless
            if detail:
                print(detail, file=sys.stderr, flush=True)
            self.log(f"ABORT: {msg} -- ending the job")
        except Exception:  # noqa: BLE001
            pass
        self._leave(1)

    def _leave(self, code: int) -> None:
        """Run the on_abort callbacks (flush logs) and end the process; nothing here may keep it alive."""
        for cb in self.on_abort:
            try:
                cb()
            except Exception:  # noqa: BLE001
                pass
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)   # pending point-to-point transfers (targets that ran ahead) would block a clean teardown

    def finished(self) -> None:
        """The master calls this after its last checkpoint: every rank exits 0, the master last."""
        self.store.set("job_done", "1")
        end = time.monotonic() + 15
        others = [f"exited/{r}" for r in range(self.world) if r != self.rank]
        while time.monotonic() < end and not self.store.check(others):
            time.sleep(0.1)
        self._clean_exit()

    def _exit_if_done(self):
        try:
            done = self.store.check(["job_done"])
        except Exception:  # noqa: BLE001 - the store went away with the launcher: nothing left to coordinate
            done = False
        if done:
            self._clean_exit()

    def _clean_exit(self):
        try:
            self.store.set(f"exited/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        self._leave(0)

    def _check_abort(self):
        if self.store.check(["abort"]):
            msg = self.store.get("abort").decode()
            if msg:
                self._exit(f"stopping because {msg}")

    # -- the loop --
    def run(self):
        while True:
            try:
                self._beat()
            except Exception as e:  # noqa: BLE001 - a lost store means the agent or rank 0's host is gone
                self._exit(f"{self.who(self.rank)}: lost the rendezvous store ({type(e).__name__}: {e}); "
                           f"the launcher or another node is gone")
            time.sleep(self.interval)

    def _beat(self):
        self._beats += 1
        now = time.monotonic()
        for fn in self.collect:
            self.stats.update(fn())
        state = self.state + (f"; receiver {self.recv_state}" if self.recv_state else "") + \
            (f"; sender {self.send_state}" if self.send_state else "")
        self.store.set(f"hb/{self.rank}", json.dumps({"beat": self._beats, "progress": self._progress,
                                                      "steady": self.steady, "paused": self.paused, "state": state,
                                                      **self.stats}))
        if not self.is_master:
            self._exit_if_done()
        self._check_abort()
        host = socket.gethostname()
        others = [r for r in range(self.world) if r != self.rank]
        self._load_peers()
        if not self._peers:
            return
        for r in others:
            h, pid = self._peers[r]
            if h == host and not _pid_alive(pid):
                self._abort_for(f"{self.who(r)} died (process {pid} is gone: killed, crashed or out of memory)")
        beats = self.peer_states(others)
        for r, info in beats.items():
            if info is None:
                continue
            last, t = self._seen.get(r, (None, now))
            if info["beat"] != last:
                self._seen[r] = (info["beat"], now)
            elif now - t > self.heartbeat_timeout:
                self._abort_for(f"{self.who(r)} sent no heartbeat for {now - t:.0f}s (host down or frozen)")
        if not self.steady:
            return
        progress = {r: i["progress"] for r, i in beats.items() if i is not None}
        progress[self.rank] = self._progress
        paused = self.paused or any(i and i.get("paused") for i in beats.values())
        for r, p in progress.items():
            if paused or self._seen_progress.get(r, (None,))[0] != p:   # a pause counts as progress throughout
                self._seen_progress[r] = (p, now)
        newest = max(t for _, t in self._seen_progress.values())
        if now - newest > self.stall_timeout:
            beats[self.rank] = {"state": state}
            states = "; ".join(f"{self.who(r)}: {i['state']}" for r, i in sorted(beats.items()) if i)
            self._abort_for(f"no rank made progress for {now - newest:.0f}s (STALL_TIMEOUT={self.stall_timeout:g}); "
                            f"states: {states}")

    def _abort_for(self, msg):
        self._exit_if_done()
        try:
            self.store.compare_set("abort", "", msg)
            msg = self.store.get("abort").decode() or msg
        except Exception:  # noqa: BLE001
            pass
        self._exit(msg)

    def peer_states(self, ranks=None) -> dict:
        ranks = list(range(self.world)) if ranks is None else ranks
        keys = [f"hb/{r}" for r in ranks]
        out = {}
        for r, k in zip(ranks, keys):
            out[r] = json.loads(self.store.get(k)) if self.store.check([k]) else None
        return out


# --- ending the job ------------------------------------------------------------------------------------------------

SECOND_SIGNAL_S = 2.0   # a signal this long after the first ends the job now; sooner it is the same one, forwarded


def fail(watchdog, reason, detail=""):
    """End the job (every rank, through the watchdog) with one line saying why."""
    if watchdog:
        watchdog.fail(reason, detail)
    print(detail, file=sys.stderr)
    sys.exit(f"error: {reason}")


def failure_reason(e: BaseException, device, c) -> str:
    """The one line a failed job ends with: the exception, and for CUDA out of memory what the GPU held and the
    settings that lower it."""
    reason = f"{type(e).__name__}: {e}"
    if "out of memory" in str(e).lower() and torch.cuda.is_available():
        gib = 2 ** 30
        reason = (f"CUDA out of memory on {device}: {torch.cuda.memory_allocated() / gib:.1f} GiB allocated, "
                  f"{torch.cuda.memory_reserved() / gib:.1f} GiB reserved of "
                  f"{torch.cuda.get_device_properties(device).total_memory / gib:.1f} GiB. Lower MAX_ANCHORS "
                  f"(now {c.MAX_ANCHORS}), TOKEN_BUDGET (now {c.TOKEN_BUDGET}) or MAX_BATCH_SIZE (now "
                  f"{c.MAX_BATCH_SIZE})")
    return reason


def on_signals(who, watchdog, ck_root, log) -> threading.Event:
    """SIGTERM / SIGINT set the returned flag, acted on at the next optimizer step boundary; a second one (more than
    SECOND_SIGNAL_S later) ends the job now. who: the rank's log prefix."""
    stop_flag = threading.Event()
    first_signal = []   # when the first one came

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        # the second one ends the job: the next step may never come (a stuck rank, a wait on input). One Ctrl-C
        # reaches a rank twice, from the terminal and forwarded by torchrun a moment later: that is still the first.
        if first_signal and time.monotonic() - first_signal[0] > SECOND_SIGNAL_S:
            fail(watchdog, f"got a second {name}: ending now, without a checkpoint; RESUME=auto continues from the "
                           f"newest complete one in {ck_root}")
        if first_signal:
            return
        first_signal.append(time.monotonic())
        stop_flag.set()
        log(f"{who} got {name}: saving a checkpoint at the next step (send it again to end now)")
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop_flag


def finish(d, watchdog, code):
    sys.stdout.flush()
    sys.stderr.flush()
    if d.colocated:
        sys.exit(code)
    if d.is_master:
        watchdog.finished()   # tells every rank to exit, waits for them, exits 0
    wait_done(d, watchdog)


def wait_done(d, watchdog):
    """Non-master ranks idle here until the master has saved; their watchdog then exits them with code 0."""
    watchdog.state = "finished; waiting for the master's last checkpoint"
    while True:
        time.sleep(1)
