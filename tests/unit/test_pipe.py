"""pipe.BusyClock; pipe.Prefetcher, the one queue between a micro-batch's source and the training step (drafter ranks,
the one-process mode and the bench), pipe.TargetAhead (the one process's compiled target forward on the main thread),
and checkpoint.resume_point, where a resumed run continues. (A signal that reaches a main thread waiting on a queue:
tests/jobs/test_pipe_jobs.py, a process of its own.)"""
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from trainer import checkpoint as ckpt
from trainer.pipe import BusyClock, Prefetcher, TargetAhead
from trainer.settings import Settings


class Item:
    def __init__(self, g, thread):
        self.g, self.thread = g, thread

    def device_tensors(self):
        return []


def test_prefetcher_prepares_on_its_thread_in_order_and_depth_ahead():
    seen = []

    def packets():
        for g in range(10):
            seen.append(g)
            yield g
    feed = Prefetcher(packets(), lambda g: Item(g, threading.current_thread().name), "cpu", depth=3, name="feeder")
    feed.start()
    deadline = time.time() + 10
    while len(seen) < 4 and time.time() < deadline:   # 3 queued + 1 waiting to be put
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(seen) == 4, "the thread runs exactly depth (+ the one it holds) ahead of the consumer"
    got = [feed.get() for _ in range(10)]
    assert [i.g for i in got] == list(range(10)) and {i.thread for i in got} == {"feeder"}
    assert len(feed.prepare_s) == len(feed.prepare_cpu_s) == 10


def test_prefetcher_error_reaches_the_consumer_or_ends_the_job():
    def packets():
        yield 0
        raise OSError("disk gone")
    feed = Prefetcher(packets(), lambda g: Item(g, ""), "cpu", depth=2, name="feeder")
    feed.start()
    assert feed.get().g == 0
    with pytest.raises(RuntimeError, match=r"^feeder thread: OSError: disk gone$"):
        feed.get()
    failed = []
    feed = Prefetcher(packets(), lambda g: Item(g, ""), "cpu", depth=2, name="receiver",
                      fail=lambda reason, detail: failed.append((reason, detail)))
    feed.start()
    feed.join(timeout=10)
    assert failed and failed[0][0] == "receiver thread: OSError: disk gone" and "Traceback" in failed[0][1]


def test_prefetcher_stop_ends_a_thread_blocked_on_a_full_queue():
    def forever():
        g = 0
        while True:
            yield g
            g += 1
    feed = Prefetcher(forever(), lambda g: Item(g, ""), "cpu", depth=1)
    feed.start()
    feed.get()
    feed.stop()
    assert not feed.is_alive()


def test_target_ahead_forwards_on_the_calling_thread_one_micro_batch_ahead():
    """The one process: the packets (produce's target forward) are drawn on the thread that calls get(), one
    ahead of the micro-batch it returns, and prepared on the feeder thread, in order; a compiled target then never
    runs while another thread compiles (torch.fx's tracing flag is one global of the process)."""
    drawn = []

    def packets():
        for g in range(6):
            drawn.append((g, threading.current_thread().name))
            yield g
    feed = TargetAhead(packets(), lambda g: Item(g, threading.current_thread().name), "cpu", depth=3)
    feed.start()
    time.sleep(0.2)
    assert drawn == [], "nothing is drawn before the first get()"
    first = feed.get()
    assert first.g == 0 and [g for g, _ in drawn] == [0, 1], "get() draws its micro-batch and the next"
    got = [first] + [feed.get() for _ in range(5)]
    assert [i.g for i in got] == list(range(6)) and {i.thread for i in got} == {"feeder"}
    assert {name for _, name in drawn} == {threading.current_thread().name}
    feed.stop()
    assert not feed.thread.is_alive()


def test_target_ahead_raises_the_forwards_error_in_the_caller():
    def packets():
        yield 0
        yield 1
        raise OSError("target forward failed")
    feed = TargetAhead(packets(), lambda g: Item(g, ""), "cpu", depth=2)
    feed.start()
    assert feed.get().g == 0
    with pytest.raises(OSError, match="target forward failed"):
        feed.get()
    feed.stop()


def data(content_hash="a", num_batches=10, rows=40):
    return SimpleNamespace(content_hash=content_hash, num_rows=rows, plan=SimpleNamespace(num_batches=num_batches))


META = {"next_g": 6, "step": 3, "planned_g": 30, "config": {"EPOCHS": 3, "MAX_STEPS": 0},
        "data": {"content_hash": "a", "num_batches": 10, "rows": 40}}
CFG = Settings(EPOCHS=3, MAX_STEPS=0, ALLOW_DATA_CHANGE=False)


def test_resume_point_continues_where_the_checkpoint_stopped():
    assert ckpt.resume_point(None, data(), CFG) == ckpt.ResumePoint()
    rp = ckpt.resume_point(META, data(), CFG)
    assert (rp.start_g, rp.step, rp.planned_g, rp.notes, rp.error) == (6, 3, 30, [], None)
    rp = ckpt.resume_point(META, data(), CFG.replace(EPOCHS=6))          # the schedule's length is re-planned
    assert (rp.start_g, rp.planned_g) == (6, None) and "re-planned" in rp.notes[0]


def test_resume_point_moves_to_the_same_fraction_when_batching_or_data_change():
    rp = ckpt.resume_point(META, data(num_batches=20), CFG)          # same data, another TOKEN_BUDGET
    assert (rp.start_g, rp.planned_g, rp.error) == (12, None, None) and "batching changed" in rp.notes[0]
    rp = ckpt.resume_point(META, data("b", num_batches=5), CFG)      # another dataset: refused ...
    assert "dataset changed" in rp.error and "ALLOW_DATA_CHANGE" in rp.error
    rp = ckpt.resume_point(META, data("b", num_batches=5), CFG.replace(ALLOW_DATA_CHANGE=True))   # ... unless allowed
    assert (rp.start_g, rp.planned_g, rp.error) == (3, None, None) and rp.notes[0].startswith("WARNING: dataset")


def test_busy_clock_skips_the_warmup_units():
    clock = BusyClock(torch.device("cpu"), skip=2)
    for tokens, wait in [(100, 0.05), (200, 0.05), (300, 0.0)]:      # the first two stand for compile steps
        t0 = clock.start()
        time.sleep(wait)
        clock.stop(t0, tokens)
    assert clock.poll()["busy_tok"] == 300 and clock.poll()["busy_s"] < 0.04
