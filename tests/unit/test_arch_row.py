"""A drafter arch is its row in model/drafters.py ARCHS: a third arch, registered here and named nowhere else, is
checked (check_config runs its Arch.check), configured (drafter_config passes its knob), trained (drafter_step calls
its loss with the settings and keeps its metrics in MicroBatchSums' arch slots), shown (the status line prints its
figures) and resumed (a changed knob is named) through the trainer's generic paths. In-process, about a second."""
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import train_dflash as td
from model import drafters
from model.drafter import Drafter, DrafterConfig
from trainer import checkpoint as ckpt
from trainer import phases, settings
from trainer.micro_batch import autocast_for, make_prepare
from trainer.pipe import Packet
from trainer.status import Meter, status_line

B = 4


@dataclass
class SplitConfig(DrafterConfig):
    split: int = 1                 # the one knob: SPLIT


class SplitDrafter(Drafter):
    arch = "split"


def split_check(c, vocab_size, hidden_size) -> list[str]:
    if hidden_size is not None and hidden_size % c.SPLIT:
        return [f"SPLIT={c.SPLIT} does not divide the hidden size {hidden_size}"]
    return []


def split_loss(drafter, hidden, head_w, item, c):
    """DFlash's loss, under the settings it is handed, plus one metric pair: the supervised rows per block."""
    parts, _ = drafters.dflash_loss(drafter, hidden, head_w, item, c)
    rows = parts.weight_sum.new_full((), float(item.rows.numel()))
    return parts, {"rows_num": rows, "rows_den": rows.new_full((), float(item.labels.numel() // B))}


SPLIT = drafters.Arch(SplitDrafter, SplitConfig, split_loss, drafters.export_drafter, drafters.load_drafter,
                      "SplitDraftModel", "Split", knobs={"SPLIT": "split"}, check=split_check,
                      metrics=("rows_num", "rows_den"),
                      status=lambda m: {"rows": (m["rows_num"] / m["rows_den"], ".2f")} if m["rows_den"] else {})


@pytest.fixture
def split_run(tiny_llama_dir, tmp_path, monkeypatch):
    """The row registered; settings(**kw): the trainer's settings for a split run on the tiny target (SPLIT and
    DRAFTER_ARCH beside train_dflash's constants)."""
    monkeypatch.setitem(drafters.ARCHS, "split", SPLIT)
    # the one other place a new arch is named: DRAFTER_ARCH's comment lists it (settings.CHOICES, read from there)
    monkeypatch.setitem(settings.CHOICES, "DRAFTER_ARCH", (*settings.CHOICES["DRAFTER_ARCH"], "split"))
    (tmp_path / "data").mkdir()

    def make(**kw):
        base = td.defaults(TARGET=str(tiny_llama_dir), DATA=str(tmp_path / "data"), OUT_DIR=str(tmp_path / "out"),
                           DRAFTER_ARCH="split", BLOCK_SIZE=B, NUM_DRAFT_LAYERS=1, MASK_TOKEN_ID=127, EVAL_EVERY=0,
                           MAX_ANCHORS=8, TOKEN_BUDGET=64, CE_CHUNK=5, NOISE=0.0)
        return settings.Settings(**{**base.as_dict(), "SPLIT": 4, **kw})
    return make


def test_check_config_runs_the_rows_check(split_run):
    settings.check_config(split_run(), 1)                        # 4 divides 64: nothing to refuse
    with pytest.raises(SystemExit, match="SPLIT=5 does not divide the hidden size 64"):
        settings.check_config(split_run(SPLIT=5), 1)            # the target's hidden size reached the row's check


def test_drafter_config_passes_the_knob_and_a_resume_names_it(split_run):
    c, dcfg, _, _ = phases.drafter_config(split_run(SPLIT=8), SimpleNamespace(is_master=True))
    assert type(dcfg) is SplitConfig and dcfg.split == 8 and dcfg.block_size == B
    _, old, _, _ = phases.drafter_config(split_run(SPLIT=4), SimpleNamespace(is_master=True))
    assert ckpt.resume_mismatches({"drafter": old.__dict__}, dcfg, {}) == \
        ["SPLIT: the checkpoint has split=4, this run 8"]


def test_a_step_keeps_its_metrics_and_the_status_line_shows_them(split_run, capsys):
    c, dcfg, hf, _ = phases.drafter_config(split_run(), SimpleNamespace(is_master=True))
    torch.manual_seed(0)
    drafter = drafters.ARCHS[c.DRAFTER_ARCH].drafter(dcfg)
    embed = torch.nn.Embedding(hf.vocab_size, hf.hidden_size).requires_grad_(False)
    head_w = torch.randn(hf.vocab_size, hf.hidden_size) * 0.05
    lengths = torch.tensor([12, 9])
    feats = torch.randn(21, dcfg.num_taps * hf.hidden_size)
    item = make_prepare(dcfg, "cpu", False, c)(Packet(0, lengths, torch.randint(0, 126, (21,)),
                                                      torch.ones(21, dtype=torch.uint8), feats))
    sums = td.drafter_step(drafter, embed, head_w, item, B, autocast_for(torch.device("cpu"), torch.float32), c)
    assert sums.arch_sums(SPLIT.metrics) == {"rows_num": item.rows.numel(), "rows_den": item.labels.numel() // B}
    assert not any(sums[len(sums) - 3:])                         # the slots past its two metrics stay 0
    rows = []
    run = SimpleNamespace(d=SimpleNamespace(n_drafters=1, n_targets=1, world=1, colocated=True, is_master=True,
                                            shards=1), step=1, total_steps=2, c=c, watchdog=None, pre_stats={},
                          feed=SimpleNamespace(q=SimpleNamespace(qsize=lambda: 0)), last_eval={},
                          data=SimpleNamespace(plan=SimpleNamespace(num_batches=2)), g_at=lambda step: step,
                          metrics=SimpleNamespace(write=rows.append))
    meter = Meter(torch.stack(sums), t_start=0.0, t_log=0.0, step_at_log=0, tokens=21, micro_batches=1,
                  split_reported=True)
    status_line(run, meter, [], lr=1e-4, now=60.0)
    want = item.rows.numel() / (item.labels.numel() // B)
    assert f" streak={rows[0]['streak']:.2f} rows={want:.2f} lr=" in capsys.readouterr().out
    assert rows[0]["rows"] == want
