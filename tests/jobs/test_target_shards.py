"""TARGET_SHARDS: target replicas sharded over several target ranks with FSDP2 (model.target.load_sharded), on CPU
with gloo. Real torchrun jobs on the tiny target of tests/helpers/runs.py: what the drafter receives equals the unsharded
target's features, training equals an unsharded job step for step, a stop and a resume continue exactly, a killed
shard rank is named; then the refusals and the planner's terms, in-process."""
import os
import re
import signal
import time

import pytest
import torch

from trainer import planner
import runs
from runs import trainer_cfg
import train_dflash as td
from test_faults import Job, set_faults

STEPS = 5    # odd, with 2 target ranks: rank 0 makes 3 micro-batches, rank 1 two and a one-token forward with rank 0
TAPS = "1,3"   # 3 is the last layer: its tap is the decoder's normed output, which a sharded norm must give too


def args(assets, out, **kw):
    target, data = assets
    return runs.base_args(target, data, out, **{**dict(MAX_STEPS=STEPS, TARGET_LAYER_IDS=TAPS), **kw})


def ok(r):
    assert r.returncode == 0 and "ABORT" not in r.stdout, f"exit {r.returncode}\n{r.stdout[-5000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def unsharded(assets, tmp_path_factory):
    """2 target ranks each holding the whole target + 1 drafter: the losses a sharded job must reproduce."""
    out = tmp_path_factory.mktemp("unsharded") / "run"
    ok(runs.run(3, args(assets, out, TARGET_RANKS=2)))
    return runs.losses(out)


def unsharded_features(target_dir, dump):
    """The features of a dumped micro-batch, recomputed here by the whole (unsharded) target."""
    from model.target import Target
    t = Target(target_dir, "cpu", torch.float32, [int(x) for x in TAPS.split(",")])
    ids, attn = runs.padded(dump["lengths"], dump["input_ids"])
    return t.features(ids, attn)[attn.bool()]                                     # [T, K*H]


def held_shares(log):
    """{target rank: share of the parameters it runs that it holds} from the start-up lines."""
    return {int(r): int(a.replace(",", "")) / int(b.replace(",", ""))
            for r, a, b in re.findall(r"\[rank (\d+) target\] holds ([\d,]+) of the ([\d,]+) target parameters", log)}


def check_features(target_dir, out, n):
    dumps = sorted((out / "dump").glob("g*.pt"))
    assert [int(p.stem[1:]) for p in dumps] == list(range(n)), "every micro-batch exactly once"
    for p in dumps:
        got = torch.load(p)
        want = unsharded_features(target_dir, got)
        assert got["features"].shape == want.shape and want.abs().max() > 0.1   # real hidden states, not zeros
        torch.testing.assert_close(got["features"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.job
def test_one_sharded_replica_gives_the_unsharded_features_and_losses(assets, unsharded, tmp_path):
    """2 target ranks as one replica (each holds half the target) + 1 drafter."""
    out = tmp_path / "run"
    r = ok(runs.run(3, args(assets, out, TARGET_RANKS=2, TARGET_SHARDS=2, DUMP_BATCHES=100)))
    shares = held_shares(r.stdout)
    assert sorted(shares) == [0, 1] and all(0.4 < s < 0.6 for s in shares.values()), shares
    assert "1 target replica x TARGET_SHARDS=2" in r.stdout and "target replica 0 shard 2/2" in r.stdout
    assert re.search(r"q_pre=\[\d+, \d+\]", r.stdout), "the replica's ranks in one group of the status line"
    check_features(assets[0], out, STEPS)
    got = runs.losses(out)
    assert sorted(got) == sorted(unsharded) == list(range(1, STEPS + 1))
    for s in unsharded:
        assert got[s] == pytest.approx(unsharded[s], rel=1e-5), f"step {s}: {got[s]} != {unsharded[s]}"


@pytest.mark.job
@pytest.mark.slow
def test_two_sharded_replicas_give_the_unsharded_features(assets, tmp_path):
    """4 target ranks as 2 replicas of 2 + 1 drafter (5 processes: 16 s on 2 idle cores, far more when shared)."""
    out = tmp_path / "run"
    r = ok(runs.run(5, args(assets, out, TARGET_RANKS=4, TARGET_SHARDS=2, DUMP_BATCHES=100, MAX_STEPS=7), timeout=400))
    assert sorted(held_shares(r.stdout)) == [0, 1, 2, 3]
    assert "2 target replicas x TARGET_SHARDS=2" in r.stdout and re.search(r"q_pre=\[\d+, \d+ \| \d+, \d+\]", r.stdout)
    check_features(assets[0], out, 7)


@pytest.mark.job
def test_sigterm_then_resume_of_a_sharded_job_matches_the_unsharded_run(assets, unsharded, tmp_path, monkeypatch):
    """A stop published while the replica's ranks forward (they agree on it before each forward), then RESUME=auto:
    the loss curve is the uninterrupted one."""
    out = tmp_path / "run"
    set_faults(monkeypatch, SLOW_FORWARD=0.3)            # ~0.3 s per step: the stop lands mid-run
    job = Job(args(assets, out, TARGET_RANKS=2, TARGET_SHARDS=2))
    try:
        job.wait_for("step=1/")
        os.killpg(job.proc.pid, signal.SIGTERM)
        code, _ = job.finish(90)
    finally:
        job.close()
    assert code is not None and "stopped at step" in job.text and "ABORT" not in job.text, job.text[-5000:]
    stopped = max(runs.losses(out))
    assert stopped < STEPS, "the stop came after the end"
    set_faults(monkeypatch)
    r = ok(runs.run(3, args(assets, out, TARGET_RANKS=2, TARGET_SHARDS=2)))
    assert f"RESUMING from step {stopped}" in r.stdout
    got = runs.losses(out)
    assert sorted(got) == sorted(unsharded)
    for s in unsharded:
        assert got[s] == pytest.approx(unsharded[s], rel=1e-5), f"step {s}: {got[s]} != {unsharded[s]}"


@pytest.mark.job
def test_kill9_of_a_shard_rank_ends_the_job_naming_it(assets, tmp_path, monkeypatch):
    """Rank 1 dies while rank 0, its replica's other shard, waits on it in an all-gather (or the replica's
    agreement)."""
    set_faults(monkeypatch, SLOW_FORWARD=0.5)
    job = Job(args(assets, tmp_path / "run", TARGET_RANKS=2, TARGET_SHARDS=2, MAX_STEPS=0, EPOCHS=2))
    try:
        job.wait_for("step=1/")
        time.sleep(0.2)
        os.kill(job.pids[1], signal.SIGKILL)
        code, _ = job.finish(60)
    finally:
        job.close()
    assert code is not None and code != 0, job.text[-5000:]
    aborts = [l for l in job.text.splitlines() if "ABORT" in l]
    assert aborts and all("rank 1 (target) died (process" in l for l in aborts), aborts


# --- refusals and the planner, in-process -----------------------------------------------------------------------------

@pytest.mark.parametrize("world,settings,message", [
    (4, dict(TARGET_RANKS=3, TARGET_SHARDS=2), "TARGET_RANKS=3 is not a multiple of TARGET_SHARDS=2"),
    (1, dict(TARGET_SHARDS=2), "TARGET_SHARDS=2 needs a torchrun job"),
    (3, dict(TARGET_RANKS=2, TARGET_SHARDS=2, COMPILE_TARGET=True),
     "COMPILE_TARGET does not work with TARGET_SHARDS=2"),
    (3, dict(TARGET_RANKS=2, TARGET_SHARDS=2, TARGET_FP8=True), "TARGET_FP8 does not work with TARGET_SHARDS=2"),
    (3, dict(TARGET_SHARDS=0), "TARGET_SHARDS=0 must be >= 1"),
])
def test_bad_shard_settings_are_refused(assets, tmp_path, monkeypatch, world, settings, message):
    target, data = assets
    for k, v in dict(TARGET=str(target), DATA=str(data), OUT_DIR=str(tmp_path / "out"), **settings).items():
        monkeypatch.setattr(td, k, v)
    with pytest.raises(SystemExit) as e:
        td.check_config(world)
    assert message in str(e.value.code)
    monkeypatch.setattr(td, "TARGET_SHARDS", 1)
    monkeypatch.setattr(td, "COMPILE_TARGET", False)
    monkeypatch.setattr(td, "TARGET_FP8", False)
    monkeypatch.setattr(td, "TARGET_RANKS", 1)
    td.check_config(world)                                # the same config without sharding is fine


QWEN25_72B = dict(hidden_size=8192, num_hidden_layers=80, intermediate_size=29568, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=152064, model_type="qwen2", attention_bias=True,
                  tie_word_embeddings=False)
QWEN3_32B = dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=25600, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, model_type="qwen3", tie_word_embeddings=False)
H200 = 143771 * 2 ** 20


def h200_cfg(**kw):
    return trainer_cfg(**{**dict(TOKEN_BUDGET=4 * 3072, MAX_ANCHORS=512, BLOCK_SIZE=16, NUM_DRAFT_LAYERS=5,
                                 TARGET_RANKS=4, DTYPE="bfloat16", ATTN="flex"), **kw})


def target_terms(hf, shards):
    role = planner.estimate(h200_cfg(TARGET_SHARDS=shards), hf, 8, H200)["roles"]["target"]
    return role, {t["short"]: t["bytes"] for t in role["terms"]}


@pytest.mark.parametrize("hf", [QWEN25_72B, QWEN3_32B], ids=["72B", "32B"])
def test_planner_splits_the_target_weights_over_the_shards(hf):
    whole, t1 = target_terms(hf, 1)
    s = planner.model_sizes(hf)
    last = max(planner.layer_ids_of(h200_cfg(), s.n_layers))
    runs_params = s.V * s.H + (last + 1) * planner.target_layer_params(s)
    assert t1["target weights"] == runs_params * planner.BF16 and t1["unused target weights"] > 0
    for n in (2, 4):
        role, tn = target_terms(hf, n)
        assert tn["target shard"] == int(runs_params * planner.BF16 / n)
        assert "unused target weights" not in tn, "a sharded target never loads the layers past the last tap"
        layer = planner.target_layer_params(s) * planner.BF16
        assert tn["all-gathered"] == max(layer, s.V * s.H * planner.BF16) + planner.TGT_FSDP_PREFETCH * layer
        # activations and transfers do not shrink: each rank forwards its own micro-batches
        assert tn["forward"] == t1["forward"] and tn["in flight"] == t1["in flight"]
        assert role["total"] < whole["total"]


def test_planner_recommends_target_shards_when_the_target_does_not_fit_one_gpu():
    est = planner.estimate(h200_cfg(TARGET_SHARDS=1), QWEN25_72B, 8, H200)
    assert not est["roles"]["target"]["fits"]
    errs = planner.check_fits(est, H200)
    assert len(errs) == 1 and "target role needs" in errs[0] and "raise TARGET_SHARDS (now 1) to 2" in errs[0], errs
    assert planner.check_fits(planner.estimate(h200_cfg(TARGET_SHARDS=2), QWEN25_72B, 8, H200), H200) == []
    # only one GPU per replica is left for drafting: not enough GPUs for a replica of any width -> refused, no advice
    small = planner.estimate(h200_cfg(TARGET_RANKS=1, TARGET_SHARDS=1), QWEN25_72B, 2, H200)
    assert "a GPU with more memory is needed" in " ".join(planner.check_fits(small, H200))
    bad = planner.estimate(h200_cfg(TARGET_RANKS=3, TARGET_SHARDS=2), QWEN25_72B, 8, H200)
    assert planner.check_fits(bad, H200) == ["TARGET_RANKS=3 must be a multiple of TARGET_SHARDS=2"]


def test_recommended_split_keeps_whole_replicas():
    assert planner.recommend_split(1.0, 1.0, 8) == (4, 4)
    assert planner.recommend_split(1.0, 3.0, 8) == (6, 2)
    assert planner.recommend_split(1.0, 3.0, 8, shards=4) == (4, 4)    # 6 target ranks are no whole 4-rank replicas
    with pytest.raises(ValueError, match="TARGET_SHARDS=4"):
        planner.recommend_split(1.0, 1.0, 4, shards=4)


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_load_sharded_equals_the_whole_target(tiny_qwen3_dir, tmp_path, weights):
    """load_sharded on a one-rank group against Target's from_pretrained (an untied Qwen3: q/k norms, the last
    layer tapped), reading rows from the safetensors files or, for weights it cannot read by name (here a .bin),
    through the whole model on the CPU. The row split over 2 ranks is the torchrun test's."""
    import torch.distributed as dist
    from model.target import Target
    folder = tiny_qwen3_dir
    if weights == "bin":
        import shutil
        from safetensors.torch import load_file
        folder = tmp_path / "bin"
        folder.mkdir()
        shutil.copy(tiny_qwen3_dir / "config.json", folder)
        torch.save(load_file(tiny_qwen3_dir / "model.safetensors"), folder / "pytorch_model.bin")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{runs.free_port()}", rank=0, world_size=1)
    try:
        sharded = Target(folder, "cpu", torch.float32, [1, 5], shard_group=dist.new_group([0]))
        assert len(sharded.decoder.layers) == 6 and sharded.lm_head_weight is None
        whole = Target(tiny_qwen3_dir, "cpu", torch.float32, [1, 5])
        ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
        attn = torch.ones(2, 9, dtype=torch.long)
        attn[1, 5:] = 0
        torch.testing.assert_close(sharded.features(ids, attn), whole.features(ids, attn), rtol=0, atol=0)
        short = Target(folder, "cpu", torch.float32, [0, 2], shard_group=dist.new_group([0]))
        assert len(short.decoder.layers) == 3, "layers past the last tap are never built"
        torch.testing.assert_close(short.features(ids, attn), whole.features(ids, attn, [0, 2]), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
