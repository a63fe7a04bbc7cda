"""trainer/status.py's status line, directly: one line per log interval with the fixed key order, the units in the
keys, and the metrics.jsonl row it writes, from known sums. In-process, well under a second."""
from types import SimpleNamespace

import pytest
import torch

from trainer.micro_batch import MicroBatchSums
from trainer.settings import Settings
from trainer.status import Meter, fmt_eta, status_line


def one_process_run(rows, arch="dflash"):
    d = SimpleNamespace(n_drafters=1, n_targets=1, world=1, colocated=True, is_master=True, shards=1)
    return SimpleNamespace(d=d, step=10, total_steps=100, c=Settings(DRAFTER_SHARDING="ddp", NOISE=0.0,
                                                              LOSS_WEIGHTING="exp", TOKEN_BUDGET=64,
                                                              DRAFTER_ARCH=arch),
                           watchdog=None, pre_stats={"q": 3}, feed=SimpleNamespace(q=SimpleNamespace(qsize=lambda: 2)),
                           data=SimpleNamespace(plan=SimpleNamespace(num_batches=40)), g_at=lambda step: step,
                           last_eval={}, metrics=SimpleNamespace(write=rows.append))


def test_the_status_line_reads_the_interval_in_a_fixed_order(capsys):
    rows = []
    run = one_process_run(rows)
    sums = MicroBatchSums(*torch.tensor([6.0, 3.0, 5.0, 10.0, 8.0, 4.0, 6.0, 3.0] + [0.0] * 5, dtype=torch.float64).unbind())
    meter = Meter(torch.stack(sums), t_start=0.0, t_log=0.0, step_at_log=0, tokens=6400, micro_batches=10,
                  split_reported=True)
    status_line(run, meter, [], lr=3e-4, now=120.0)
    line = capsys.readouterr().out.strip()
    assert line == ("[2m] step=10/100 loss=2.000 acc=0.500 streak=2.00 lr=3.0e-04 noise=0.000 | "
                    "tgt=0.08b/s dft=0.08b/s (53tok/s) | q_pre=[3] q_hs=[2] | epoch~0.25 ETA=18m")
    row = rows[0]
    assert list(row)[:5] == ["time", "elapsed_s", "step", "total_steps", "loss"]
    assert (row["loss"], row["objective"], row["acc"], row["streak"]) == (2.0, 2.0, 0.5, 2.0)
    assert row["tok_s"] == pytest.approx(6400 / 120) and row["eta_s"] == pytest.approx(90 * 120 / 10)
    assert not meter.sums.any() and (meter.tokens, meter.micro_batches, meter.step_at_log) == (0, 0, 10)


def test_a_dflash2_status_line_adds_the_selector_figures(capsys):
    """DRAFTER_ARCH=dflash2: its metrics' sums (model/drafters.py SELECTOR_METRICS, in MicroBatchSums' arch slots)
    become sel_recall, sel_acc and sel_streak, after streak on the line and in the row."""
    rows = []
    run = one_process_run(rows, arch="dflash2")
    one = lambda v: torch.tensor(v, dtype=torch.float64)   # noqa: E731
    sums = MicroBatchSums.of(loss=one(6.0), loss_w=one(3.0), acc_num=one(5.0), acc_den=one(10.0), streak_num=one(8.0),
                             streak_den=one(4.0), objective=one(6.0), objective_w=one(3.0),
                             arch=[one(8.0), one(6.0), one(10.0), one(6.0), one(4.0)])
    meter = Meter(torch.stack(sums), t_start=0.0, t_log=0.0, step_at_log=0, tokens=6400, micro_batches=10,
                  split_reported=True)
    status_line(run, meter, [], lr=3e-4, now=120.0)
    line = capsys.readouterr().out.strip()
    assert line == ("[2m] step=10/100 loss=2.000 acc=0.500 streak=2.00 sel_recall=0.800 sel_acc=0.600 "
                    "sel_streak=1.50 lr=3.0e-04 noise=0.000 | tgt=0.08b/s dft=0.08b/s (53tok/s) | q_pre=[3] q_hs=[2] "
                    "| epoch~0.25 ETA=18m")
    assert (rows[0]["sel_recall"], rows[0]["sel_acc"], rows[0]["sel_streak"]) == (0.8, 0.6, 1.5)


def test_eta_units():
    assert [fmt_eta(s) for s in (5, 120, 7200, 2 * 86400, float("inf"))] == ["5s", "2m", "2.0h", "2.0d", "?"]
