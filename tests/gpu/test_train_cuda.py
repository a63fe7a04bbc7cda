"""The GPU path of the trainer (NCCL transport, flex_attention, bf16): the same checks as tests/jobs/test_train.py.
Skipped without 2 GPUs; run on the device machine with `python -m pytest tests/gpu/test_train_cuda.py`."""
import re

import pytest
import torch

from runs import base_args, make_dataset, make_target, metrics, padded, run

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.job
def test_nccl_features_equal_direct_and_flex_training_learns(tmp_path):
    from model.drafter import default_layer_ids
    from model.target import Target
    target = make_target(tmp_path / "target", hidden=64, head_dim=16)      # flex needs head_dim >= 16
    data = make_dataset(tmp_path / "data")
    out = tmp_path / "out"
    r = run(2, base_args(target, data, out, EPOCHS=12, LR=1e-2, DUMP_BATCHES=6))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "attention=flex" in r.stdout and "torch.bfloat16" in r.stdout
    # each GPU rank reports its peak memory at the end, next to the planner's estimate
    for who in ("rank 0 target", "rank 1 drafter"):
        assert re.search(rf"\[{who}\] peak GPU memory: [\d.]+ GiB allocated \(planner estimate [\d.]+ GiB, "
                         rf"estimate/measured [\d.]+\)", r.stdout), r.stdout[-3000:]
    t = Target(target, "cuda", torch.bfloat16, default_layer_ids(4, 1))
    worst = 0.0
    for p in sorted((out / "dump").glob("g*.pt")):
        got = torch.load(p)
        pad, attn = padded(got["lengths"], got["input_ids"])
        want = t.features(pad.cuda(), attn.cuda())[attn.cuda().bool()].cpu()
        assert got["features"].dtype == torch.bfloat16 and got["features"].shape == want.shape
        worst = max(worst, (got["features"].float() - want.float()).abs().max().item())
    print(f"max |NCCL-received - direct| = {worst}")
    assert worst == 0.0, f"features changed in transit or differ from a direct forward: max diff {worst}"
    rows = metrics(out)
    head, tail = rows[:3], rows[-5:]
    mean = lambda rs, k: sum(x[k] for x in rs) / len(rs)
    assert mean(tail, "acc") > mean(head, "acc") + 0.15, [round(x["acc"], 3) for x in rows]
