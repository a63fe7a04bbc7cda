"""DRAFTER_SHARDING=fsdp (FSDP2 over the drafter ranks) against DDP: the same gradient after the global loss
normalisation, the same loss curve and export, sharded checkpoints that resume exactly (also onto another number
of drafter ranks, and to and from DDP checkpoints), and a killed shard rank named. Real torchrun jobs on CPU/gloo
with the tiny target of tests/helpers/runs.py: 1 target rank + D drafter ranks.

Runs that change the number of drafter ranks keep D * GRAD_ACCUM (micro-batches per optimizer step) fixed, so every
step sees the same micro-batches and the same global loss weight whatever the split: their losses match the
uninterrupted run's up to the order of float sums.
"""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer import checkpoint as ckpt
import runs

# 10 micro-batches per epoch x 3 epochs; 6 per step (2 drafters x GRAD_ACCUM 3) => 5 steps, saved at 2, 4, 5
RUN = dict(EPOCHS=3, LR=1e-2, GRAD_ACCUM=3, SAVE_EVERY=2, KEEP_LAST=10)
STEPS = 5


def job(assets, out, nproc=3, **kw):
    target, data = assets
    r = runs.run(nproc, runs.base_args(target, data, out, **{**RUN, **kw}))
    assert r.returncode == 0 and f"done: {STEPS} steps" in r.stdout and "ABORT" not in r.stdout, \
        f"exit {r.returncode}\n{r.stdout[-5000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def ddp_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    job(assets, out, DRAFTER_SHARDING="ddp")
    return out


@pytest.fixture(scope="module")
def fsdp_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "run"
    job(assets, out, DRAFTER_SHARDING="fsdp")
    return out


def exported(out, step=STEPS):
    return load_file(ckpt.step_dir(Path(out) / "checkpoints", step) / "drafter" / "model.safetensors")


def resumed_from(src, step, dst):
    """dst/checkpoints holds src's checkpoint `step` only: RESUME=auto continues from it."""
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt.step_dir(src / "checkpoints", step), ckpt.step_dir(dst / "checkpoints", step))
    return dst


def assert_same_curve(got, want, from_step=0, rel=1e-5):
    got, want = runs.losses(got), runs.losses(want)
    steps = [s for s in want if s > from_step]
    assert sorted(s for s in got if s > from_step) == steps
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=rel, abs=1e-7), f"step {s}: {got[s]} != {want[s]}"


def assert_close_exports(got, want):
    """bf16 exports of fp32 masters equal to float tolerance: one bf16 rounding step apart at most."""
    a, b = exported(got), exported(want)
    assert a.keys() == b.keys()
    for k in b:
        assert a[k].dtype == b[k].dtype == torch.bfloat16
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=8e-3, atol=1e-6, msg=k)


# --- the gradient ---------------------------------------------------------------------------------------------------

@pytest.mark.job
def test_fsdp_gradient_is_the_globally_normalised_sum():
    """Two drafter ranks, two micro-batches each with different loss weights, no sync on the first (FSDP2's
    set_requires_gradient_sync), then the trainer's optimizer_step with plain SGD at lr 1: every weight moves by
    exactly the gradient of sum(w * loss) over all four micro-batches divided by their summed w, computed by one
    unsharded drafter. AdamW would hide a wrong scale (it is invariant to it), SGD does not."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={runs.free_port()}",
           __file__]
    r = subprocess.run(cmd, cwd=runs.REPO, env=runs.env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "GRADIENTS MATCH" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def _gradient_worker():
    """Run by the test above under torchrun (2 processes): both are drafter ranks (TARGET_RANKS = 0 here)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from trainer.phases import shard_drafter
    from train_dflash import optimizer_step
    from model.drafter import Drafter, DrafterConfig
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                        max_position_embeddings=512, num_hidden_layers=2, num_target_layers=4,
                        target_layer_ids=[1, 2], block_size=4, mask_token_id=0, vocab_size=64)

    def micro_batch(i):   # [T, K*H] features, positions, [M, H] block embeddings and positions, masks, weights
        g = torch.Generator().manual_seed(100 + i)
        T, anchors = 12, torch.tensor([2, 7])
        block_pos = (anchors[:, None] + torch.arange(4)).reshape(-1)
        doc = torch.zeros(T, dtype=torch.long)
        w = torch.rand(8, generator=g) * (1 + i)              # a different total weight per micro-batch
        return (torch.randn(T, 64, generator=g), torch.arange(T), torch.randn(8, 32, generator=g), block_pos,
                anchors, doc, w)

    def loss_sum(model, drafter, mb):
        feats, pos, emb, block_pos, anchors, doc, w = mb
        h = model(feats, pos, emb, block_pos, drafter.attn_spec(anchors, doc[anchors], doc))   # [M, H]
        return (w * h.pow(2).mean(-1)).sum(), w.sum().double()

    torch.manual_seed(0)
    sharded = Drafter(cfg)
    before = {k: v.clone() for k, v in sharded.state_dict().items()}
    d = type("D", (), {"drafters": group, "device": torch.device("cpu"), "dtype": torch.float32})()
    shard_drafter(d, sharded)
    opt = torch.optim.SGD(sharded.parameters(), lr=1.0)
    step_w = torch.zeros(1, dtype=torch.float64)
    mine = [micro_batch(2 * rank + m) for m in range(2)]
    for m, mb in enumerate(mine):
        sharded.set_requires_gradient_sync(m == 1)
        loss, w = loss_sum(sharded, sharded, mb)
        loss.backward()
        step_w += w
    optimizer_step(list(sharded.parameters()), opt, step_w, 1e9, n_drafters=world, group=group)   # 1e9: no clip
    after = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sharded.state_dict().items()}

    torch.manual_seed(0)
    plain = Drafter(cfg)
    total, total_w = 0.0, 0.0
    for i in range(2 * world):
        loss, w = loss_sum(plain, plain, micro_batch(i))
        total, total_w = total + loss, total_w + w
    (total / total_w.float()).backward()
    grads = dict(plain.named_parameters())
    if rank == 0:
        for k in before:
            torch.testing.assert_close(before[k] - after[k], grads[k].grad, rtol=1e-4, atol=1e-7, msg=k)
        print("GRADIENTS MATCH", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --- the trainer ----------------------------------------------------------------------------------------------------

@pytest.mark.job
def test_fsdp_trains_like_ddp_and_exports_the_same_drafter(ddp_run, fsdp_run):
    assert_same_curve(fsdp_run, ddp_run)
    assert_close_exports(fsdp_run, ddp_run)
    assert all(r["ddp_weight_spread"] is None for r in runs.metrics(fsdp_run))
    # the sharded checkpoint: state.pt without weights, the shards (one file per drafter rank + DCP's .metadata)
    folder = ckpt.step_dir(fsdp_run / "checkpoints", STEPS)
    ckpt.verify(folder)
    state = torch.load(folder / "state.pt", weights_only=False)
    assert "drafter" not in state and "optimizer" not in state and state["next_g"] == STEPS * 6
    assert sorted(p.name for p in (folder / ckpt.SHARDS).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.job
def test_a_sharded_checkpoint_without_its_metadata_is_incomplete(fsdp_run, tmp_path):
    folder = tmp_path / "step"
    shutil.copytree(ckpt.step_dir(fsdp_run / "checkpoints", 2), folder)
    man = folder / "MANIFEST.json"
    man.write_text(man.read_text().replace('"shards/.metadata"', '"shards/metadata-gone"'))
    with pytest.raises(ckpt.CheckpointError, match="does not list shards/.metadata"):
        ckpt.verify(folder)


@pytest.mark.job
def test_sharded_checkpoint_resumes_exactly(assets, fsdp_run, tmp_path):
    out = resumed_from(fsdp_run, 2, tmp_path / "run")
    r = job(assets, out, DRAFTER_SHARDING="fsdp")
    assert "RESUMING from step 2" in r.stdout
    assert_same_curve(out, fsdp_run, from_step=2, rel=1e-6)
    a, b = exported(out), exported(fsdp_run)
    assert all(torch.equal(a[k], b[k]) for k in b), "the resumed run ends with other weights"


@pytest.mark.job
@pytest.mark.parametrize("drafters", [1, 3])
def test_sharded_checkpoint_resumes_onto_another_number_of_drafter_ranks(assets, fsdp_run, tmp_path, drafters):
    """Saved by 2 drafter ranks, resumed by 1 (GRAD_ACCUM 6) or 3 (GRAD_ACCUM 2): DCP reshards."""
    out = resumed_from(fsdp_run, 2, tmp_path / "run")
    r = job(assets, out, nproc=1 + drafters, DRAFTER_SHARDING="fsdp", GRAD_ACCUM=6 // drafters)
    assert "RESUMING from step 2" in r.stdout and f"now 1 targets : {drafters} drafters" in r.stdout
    assert_same_curve(out, fsdp_run, from_step=2)
    assert_close_exports(out, fsdp_run)


@pytest.mark.job
@pytest.mark.parametrize("written,resumed", [("fsdp", "ddp"), ("ddp", "fsdp")])
def test_checkpoints_resume_across_ddp_and_fsdp(assets, ddp_run, fsdp_run, tmp_path, written, resumed):
    src = {"ddp": ddp_run, "fsdp": fsdp_run}[written]
    out = resumed_from(src, 2, tmp_path / "run")
    r = job(assets, out, DRAFTER_SHARDING=resumed)
    assert "RESUMING from step 2" in r.stdout
    assert_same_curve(out, src, from_step=2)
    assert_close_exports(out, src)


@pytest.mark.job
def test_fsdp_refuses_the_one_process_mode(assets, tmp_path):
    target, data = assets
    r = runs.run(1, runs.base_args(target, data, tmp_path / "out", DRAFTER_SHARDING="fsdp"))
    assert r.returncode != 0 and "DRAFTER_SHARDING=fsdp shards the drafter over the drafter ranks" in r.stderr, \
        r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_kill9_of_a_shard_rank_ends_the_job_naming_it(assets, tmp_path):
    """A drafter rank killed while its peer waits on it in FSDP2's all-gather / reduce-scatter."""
    from test_faults import Job, check_named_dead
    target, data = assets
    j = Job(runs.base_args(target, data, tmp_path / "run", **{**RUN, "EPOCHS": 30}, DRAFTER_SHARDING="fsdp"))
    try:
        j.wait_for("step=2/")
        os.kill(j.pids[2], signal.SIGKILL)
        code, _ = j.finish(60)
    finally:
        j.close()
    assert code not in (None, 0) and "ABORT" in j.text, j.text[-5000:]
    check_named_dead(j.text, 2)


if __name__ == "__main__":   # the worker of test_fsdp_gradient_is_the_globally_normalised_sum (PYTHONPATH: repo)
    torch.set_num_threads(1)
    _gradient_worker()
