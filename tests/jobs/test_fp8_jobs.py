"""The trainer refuses FP8 before loading anything where it cannot run: TARGET_FP8 / DRAFTER_FP8 / HEAD_FP8 on a CPU,
HEAD_FP8 for a vocabulary that is not a multiple of 16 and with the unchunked loss. Real jobs with the tiny target of
tests/helpers/runs.py (no torchao needed: each stops at the start-up check)."""
import json

from runs import base_args, make_dataset, make_target, run


def test_trainer_refuses_fp8_on_a_cpu_before_loading_anything(tmp_path):
    target, data = make_target(tmp_path / "target"), make_dataset(tmp_path / "data")
    # DEVICE=cpu: on a GPU machine "auto" would pick the GPU, where FP8 is allowed
    r = run(1, base_args(target, data, tmp_path / "out", DEVICE="cpu", TARGET_FP8=True, DRAFTER_FP8=True,
                         HEAD_FP8=True))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "error: TARGET_FP8 needs an SM89+ GPU" in r.stderr and "DRAFTER_FP8 needs an SM89+ GPU" in r.stderr
    assert "HEAD_FP8 needs an SM89+ GPU" in r.stderr
    assert "Traceback" not in r.stderr and "load target" not in r.stdout
    assert not (tmp_path / "out").exists(), "nothing written"


def test_trainer_refuses_head_fp8_for_a_vocabulary_not_a_multiple_of_16(tmp_path):
    target, data = make_target(tmp_path / "target"), make_dataset(tmp_path / "data")
    cfg = json.loads((target / "config.json").read_text())
    cfg["vocab_size"] = cfg["vocab_size"] + 1
    (target / "config.json").write_text(json.dumps(cfg))
    r = run(1, base_args(target, data, tmp_path / "out", HEAD_FP8=True))
    assert r.returncode == 1 and f"[{cfg['vocab_size']}, {cfg['hidden_size']}] in multiples of 16" in r.stderr, \
        r.stderr[-2000:]


def test_trainer_refuses_head_fp8_with_the_unchunked_loss(tmp_path):
    target, data = make_target(tmp_path / "target"), make_dataset(tmp_path / "data")
    r = run(1, base_args(target, data, tmp_path / "out", HEAD_FP8=True, CE_CHUNK=0))
    assert r.returncode == 1 and "HEAD_FP8 runs in the chunked loss only" in r.stderr, r.stderr[-2000:]
