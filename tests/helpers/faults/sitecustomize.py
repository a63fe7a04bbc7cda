"""Fault injection for tests/jobs/test_faults.py, loaded by every process of a test run through PYTHONPATH.

Inert unless one of these environment variables is set (the test sets them; torchrun passes them to the ranks):

    FAULT_RANK=R              only the process with RANK=R injects (default: every rank)
    FAULT_SLOW_FORWARD=S      each Target.features call sleeps S seconds first (spreads a run out in time, so
                              a kill at a random moment lands at a random step; results are unchanged)
    FAULT_HANG_FORWARD=N      the N-th Target.features call (1-based) never returns; the watchdog thread and its
                              heartbeats keep running: a rank stuck in a kernel or a collective, not a dead one
    FAULT_SLOW_SEND=S         each pipe.send_packet sleeps S seconds first (a slow link: the sender thread lags
                              behind the target's forwards)
    FAULT_SLOW_SAVE=N:S       the N-th checkpoint state.pt write stops half-way for S seconds (the file is on
                              disk, truncated, inside the .tmp- folder) and prints FAULT_MARK_SAVE first
    FAULT_SAVE_ENOSPC=N       the N-th state.pt write writes half its bytes, then raises OSError(ENOSPC)
    FAULT_BATCH_ERROR=N       the N-th data.batching.BatchPlan.batch call raises RuntimeError (an error on the
                              thread that pads micro-batches)
    FAULT_SLOW_EVAL=S         each trainer.evaluate.evaluate call sleeps S seconds first (a long in-training evaluation)

Every injection prints one line starting with "FAULT:" so a test can wait for it. The patches attach when the
trainer imports the module concerned (model.target, trainer.checkpoint, trainer.pipe), so nothing heavy is imported here.
"""
import errno
import importlib.abc
import importlib.machinery
import io
import os
import sys
import time

FAULT_MARK_SAVE = "FAULT: slow save"


def _mine() -> bool:
    want = os.environ.get("FAULT_RANK")
    return want is None or os.environ.get("RANK", "0") == want


def _say(msg: str) -> None:
    print(f"FAULT: {msg} (rank {os.environ.get('RANK', '0')}, pid {os.getpid()})", flush=True)


def _patch_target(mod) -> None:
    slow = float(os.environ.get("FAULT_SLOW_FORWARD", 0) or 0)
    hang_at = int(os.environ.get("FAULT_HANG_FORWARD", 0) or 0)
    orig = mod.Target.features
    calls = [0]

    def features(self, *a, **kw):
        calls[0] += 1
        if hang_at and calls[0] == hang_at:
            _say(f"hanging in target forward call {calls[0]}")
            while True:          # the main thread is stuck; the watchdog thread keeps beating
                time.sleep(3600)
        if slow:
            time.sleep(slow)
        return orig(self, *a, **kw)
    mod.Target.features = features


def _patch_checkpoint(mod) -> None:
    slow = os.environ.get("FAULT_SLOW_SAVE", "")
    slow_n, slow_s = (int(slow.split(":")[0]), float(slow.split(":")[1])) if slow else (0, 0.0)
    enospc_n = int(os.environ.get("FAULT_SAVE_ENOSPC", 0) or 0)
    torch = mod.torch
    orig = torch.save
    saves = [0]

    def save(obj, f, *a, **kw):
        name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else str(getattr(f, "name", ""))
        if os.path.basename(name) != "state.pt":
            return orig(obj, f, *a, **kw)
        saves[0] += 1
        if saves[0] not in (slow_n, enospc_n):
            return orig(obj, f, *a, **kw)
        buf = io.BytesIO()
        orig(obj, buf, *a, **kw)
        data = buf.getvalue()
        out = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
        try:
            out.write(data[: len(data) // 2])
            out.flush()
            if saves[0] == enospc_n:
                _say(f"disk full while writing {name} (save {saves[0]})")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
            _say(f"slow save {name} (save {saves[0]}): half written, pausing {slow_s:g}s")
            time.sleep(slow_s)
            out.write(data[len(data) // 2:])
        finally:
            if out is not f:
                out.close()
    torch.save = save


def _patch_pipe(mod) -> None:
    slow = float(os.environ.get("FAULT_SLOW_SEND", 0) or 0)
    orig = mod.send_packet

    def send_packet(*a, **kw):
        time.sleep(slow)
        return orig(*a, **kw)
    if slow:
        mod.send_packet = send_packet


def _patch_batching(mod) -> None:
    at = int(os.environ.get("FAULT_BATCH_ERROR", 0) or 0)
    orig = mod.BatchPlan.batch
    calls = [0]

    def batch(self, g):
        calls[0] += 1
        if at and calls[0] == at:
            _say(f"error in batch call {calls[0]} (g={g})")
            raise RuntimeError(f"injected fault in BatchPlan.batch(g={g})")
        return orig(self, g)
    mod.BatchPlan.batch = batch


def _patch_eval(mod) -> None:
    slow = float(os.environ.get("FAULT_SLOW_EVAL", 0) or 0)
    orig = mod.evaluate

    def evaluate(*a, **kw):
        _say(f"slow evaluation, {slow:g}s (enable_thinking={kw.get('enable_thinking')})")
        time.sleep(slow)
        return orig(*a, **kw)
    if slow:
        mod.evaluate = evaluate


_PATCHES = {"model.target": _patch_target, "trainer.checkpoint": _patch_checkpoint, "trainer.pipe": _patch_pipe,
            "data.batching": _patch_batching, "trainer.evaluate": _patch_eval}


class _Hook(importlib.abc.MetaPathFinder):
    """Runs a patch right after the named module executes (the trainer imports them lazily, inside main)."""

    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec


# a trainer process (a torchrun worker or the one-process mode) with a fault switched on; the torchrun agent never
# imports the patched modules
if _mine() and any(os.environ.get(k) for k in ("FAULT_SLOW_FORWARD", "FAULT_HANG_FORWARD", "FAULT_SLOW_SAVE",
                                               "FAULT_SAVE_ENOSPC", "FAULT_SLOW_SEND", "FAULT_BATCH_ERROR",
                                               "FAULT_SLOW_EVAL")):
    sys.meta_path.insert(0, _Hook())
