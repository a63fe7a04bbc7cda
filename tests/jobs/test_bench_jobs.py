"""bench/bench_dflash.py's CPU path as processes, end to end: every mode of one process and its JSON (never importing
`datasets`), the two-rank pipeline under torchrun over gloo, and --write-assets' target and dataset trained on by the
real train_dflash.py."""
import json
import subprocess
import sys

import pytest

from bench import bench_dflash as bd
from runs import REPO, env, free_port


def test_bench_tiny_runs_end_to_end_without_datasets(tmp_path):
    """CLI, every mode of one process (target, drafter, the printed pipeline commands), mixed lengths, JSON; the
    H200 image has no `datasets`, so the bench must never import it."""
    out = tmp_path / "bench.json"
    code = ("import sys; from bench import bench_dflash as b; "
            f"b.main(['--shape', 'tiny', '--mode', 'all', '--mixed', '--steps', '2', '--warmup', '1', '--cpu', "
            f"'--json', {str(out)!r}]); assert 'datasets' not in sys.modules, 'bench imported datasets'")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout)
    for line in ("| target | tokens/s (real / padded) |",
                 "| drafter | samples/s; context tokens/s (blocks per 1K tokens, per sequence) |",
                 "| drafter | **peak estimate**", "torchrun --standalone --nproc-per-node 2 -m bench.bench_dflash"):
        assert line in r.stdout, line
    res = json.loads(out.read_text())
    t, d = res["target"], res["drafter"]
    assert t["tok_s"] > 0 and t["padded_tok_s"] >= t["tok_s"] and t["tflops"] > 0
    assert d["samples_s"] > 0 and d["ms_per_step"] > 0 and d["anchors_per_step"] <= 8
    assert all(v > 0 for v in d["tflop_per_step"].values())
    assert d["saved_bytes"]["activations"] > 0
    assert len(res["commands"]) == 3 and "--pipe-compute" in res["commands"][1]
    assert res["plan"]["roles"]["drafter"]["total"] > 0


def test_pipeline_two_ranks_on_cpu(tmp_path):
    """torchrun 2 ranks over gloo: rank 0 runs the target forward into pipe.Sender, rank 1 the drafter step from
    pipe.receive through a pipe.Prefetcher; rank 1 reports."""
    out = tmp_path / "pipe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "bench.bench_dflash", "--mode", "pipeline", "--shape", "tiny", "--steps", "3", "--warmup", "1",
           "--pipe-compute", "--json", str(out)]
    r = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    p = json.loads(out.read_text())["pipeline"]
    assert p["compute"] and p["mb_s"] > 0 and p["producer_mb_s"] > 0 and p["feature_gb_s"] > 0
    assert p["feature_mb_per_micro_batch"] == pytest.approx(4 * 64 * 2 * 64 * 4 / 1e6)   # T x K*H fp32
    assert "| pipeline | micro-batches/s consumer (producer) |" in r.stdout


def test_write_assets_feed_the_real_trainer(tmp_path):
    """--write-assets: a random target folder and an Arrow dataset that train_dflash.py trains on as they are."""
    info = bd.main(["--shape", "tiny", "--write-assets", str(tmp_path / "assets"), "--cpu"])
    assert info["rows"] == 512 and info["tokens"] == 512 * 64
    r = subprocess.run([sys.executable, "train_dflash.py", f"--TARGET={info['target']}", f"--DATA={info['data']}",
                        f"--MASK_TOKEN_ID={info['mask_token_id']}", "--NUM_DRAFT_LAYERS=2", "--BLOCK_SIZE=4",
                        "--MAX_ANCHORS=8", "--TOKEN_BUDGET=256", "--MAX_STEPS=2", "--LOG_EVERY=1",
                        f"--OUT_DIR={tmp_path / 'run'}", "--RESUME=scratch"],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "done: 2 steps" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
