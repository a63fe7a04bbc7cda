"""DRAFTER_ARCH=dflash2 end to end on CPU: the tiny job logs the selector metrics and writes a DFlash2 export, a
killed run resumes exactly, INIT_FROM a DFlash export starts from the DFlash drafter's loss, DDP and FSDP2 drafters
agree. Real jobs with the tiny target of tests/helpers/runs.py."""
import pytest
import torch
from safetensors.torch import load_file

from runs import base_args, losses, metrics, ok, run, stop_at_step_3_then_resume
from trainer import checkpoint as ckpt

D2 = dict(DRAFTER_ARCH="dflash2", SELECTOR_RANK=8, SELECTOR_TOP_K=8, CONV_GROUP_SIZE=8)


@pytest.mark.job
def test_dflash2_job_logs_selector_metrics_exports_and_resumes_exactly(assets, tmp_path):
    from model.export import load_dflash2
    target, data = assets
    args = dict(D2, EPOCHS=2, LR=5e-3)
    r = ok(run(2, base_args(target, data, tmp_path / "ref", **args)))
    assert "sel_recall=" in r.stdout and "sel_streak=" in r.stdout, r.stdout[-3000:]
    rows = metrics(tmp_path / "ref")
    assert all(0 <= x["sel_recall"] <= 1 and 0 <= x["sel_acc"] <= x["sel_recall"] and x["sel_streak"] >= 0
               for x in rows)
    assert rows[-1]["sel_recall"] > 0
    final = sorted((tmp_path / "ref" / "checkpoints").glob("step_*"))[-1]
    d2 = load_dflash2(final / "drafter")
    assert type(d2).__name__ == "DFlash2Drafter" and d2.config.selector_top_k == 8
    assert d2.candidate_selector.successor_codebook.abs().sum() > 0      # the selector trained
    ref = losses(tmp_path / "ref")

    out = tmp_path / "cut"
    stop_at_step_3_then_resume(2, base_args(target, data, out, **args), out, ref)
    # and the same folder refuses to continue as another arch
    r = run(2, base_args(target, data, out, **{**args, "DRAFTER_ARCH": "dflash", "EPOCHS": 3}))
    assert r.returncode != 0 and "DRAFTER_ARCH: the checkpoint trained a dflash2 drafter" in r.stdout + r.stderr


@pytest.mark.job
def test_init_from_a_dflash_export_starts_at_its_loss(assets, tmp_path):
    """Step 1 of a DFlash2 run warm-started from a DFlash export has the DFlash run's block loss (a fresh DFlash2
    computes its backbone's outputs) and a larger objective (block + alpha x the selector CE)."""
    target, data = assets
    ok(run(1, base_args(target, data, tmp_path / "src", MAX_STEPS=2)))
    export = ckpt.step_dir(tmp_path / "src" / "checkpoints", 2) / "drafter"
    ok(run(1, base_args(target, data, tmp_path / "a", MAX_STEPS=1, INIT_FROM=export)))
    r = ok(run(1, base_args(target, data, tmp_path / "b", MAX_STEPS=1, INIT_FROM=export, **D2)))
    assert "INIT_FROM" in r.stdout
    a, b = metrics(tmp_path / "a")[0], metrics(tmp_path / "b")[0]
    assert b["loss"] == a["loss"] and b["acc"] == a["acc"] and b["streak"] == a["streak"]
    assert b["objective"] > a["objective"]
    assert b["sel_streak"] == pytest.approx(a["streak"])   # successor book at zero: the walk is the argmax


@pytest.mark.job
def test_ddp_and_fsdp_dflash2_drafters_agree(assets, tmp_path):
    target, data = assets
    args = dict(D2, EPOCHS=1, LR=1e-2)
    ok(run(3, base_args(target, data, tmp_path / "ddp", **args)))
    ok(run(3, base_args(target, data, tmp_path / "fsdp", DRAFTER_SHARDING="fsdp", **args)))
    ddp, fsdp = metrics(tmp_path / "ddp"), metrics(tmp_path / "fsdp")
    assert all(x["ddp_weight_spread"] == 0.0 for x in ddp)
    assert [x["step"] for x in ddp] == [x["step"] for x in fsdp]
    for x, y in zip(ddp, fsdp):
        for k in ("loss", "objective", "sel_recall", "sel_acc", "sel_streak"):
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), (x["step"], k)
    step = ddp[-1]["step"]
    wd = load_file(ckpt.step_dir(tmp_path / "ddp" / "checkpoints", step) / "drafter" / "model.safetensors")
    wf = load_file(ckpt.step_dir(tmp_path / "fsdp" / "checkpoints", step) / "drafter" / "model.safetensors")
    assert wd.keys() == wf.keys() and any(k.startswith("candidate_selector.") for k in wd)
    for k in wd:
        torch.testing.assert_close(wf[k].float(), wd[k].float(), rtol=2e-2, atol=2e-3, msg=k)
