"""Check that a change keeps training bitwise the same: run short CPU jobs into a folder, then compare two folders.

    python dev/compare_runs.py run OUT [--repo DIR] [--MAX_STEPS=8]   # the jobs below, with DIR's trainer
    python dev/compare_runs.py compare REF NEW                        # metrics rows and final checkpoints, exactly

Each job trains tests/helpers/runs.py's tiny target on its tiny dataset. `compare` drops the wall-clock keys of the metrics
rows and compares the rest with ==, and every tensor of the final checkpoint (state.pt, a sharded checkpoint's
shards, the exported drafter) with torch.equal. Exits 1 on any difference.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# name -> (processes, settings): the one process, 1 target + 1 drafter, 1 target + 2 DDP drafters, the same with
# FSDP2; one more one-process job covers the exp weighting, noise and a chunked loss, and one a DFlash2 drafter
JOBS = {
    "one": (1, {}),
    "t1d1": (2, {}),
    "t1d2_ddp": (3, {"GRAD_ACCUM": 2}),
    "t1d2_fsdp": (3, {"GRAD_ACCUM": 2, "DRAFTER_SHARDING": "fsdp"}),
    "one_exp_noise": (1, {"LOSS_WEIGHTING": "exp", "NOISE": 0.05, "CE_CHUNK": 16, "GRAD_ACCUM": 2}),
    "t1d1_dflash2": (2, {"DRAFTER_ARCH": "dflash2", "CONV_GROUP_SIZE": 8, "SELECTOR_RANK": 8, "SELECTOR_TOP_K": 4}),
}
# checkpoint entries drawn from OS entropy at process start (nothing seeds Python's or NumPy's global RNG, and nothing
# in training draws from them): they differ between any two runs of one commit, so they are not compared
UNSEEDED = ("state.rng.python", "state.rng.numpy")
# metrics keys measured in time (or queue depths, which depend on timing): not compared
TIMING = {"time", "elapsed_s", "tgt_mb_s", "dft_mb_s", "tok_s", "eta_s", "q_pre", "q_hs", "eval_s",
          "target_capacity_tok_s", "drafter_capacity_tok_s", "recommended_split"}


def run_jobs(out: Path, repo: Path, max_steps: int) -> None:
    sys.path[:0] = [str(repo / "tests" / "helpers"), str(repo / "tests")]   # runs.py: tests/helpers/ (before: tests/)
    import runs   # the repo's own test helpers: its tiny target and dataset, its way of starting torchrun
    assert Path(runs.REPO).resolve() == repo.resolve(), f"imported {runs.__file__}, not {repo}'s"
    out.mkdir(parents=True, exist_ok=True)
    target = out / "assets" / "target"
    data = out / "assets" / "data"
    if not target.exists():
        runs.make_target(target)
        runs.make_dataset(data)
    for name, (nproc, kw) in JOBS.items():
        job_dir = out / name
        if (job_dir / "metrics.jsonl").exists():
            sys.exit(f"error: {job_dir} holds a run already: pass an empty folder")
        args = runs.base_args(target, data, job_dir, MAX_STEPS=max_steps, **kw)
        r = runs.run(nproc, args, timeout=600)
        (out / f"{name}.log").write_text(r.stdout + "\n--- stderr\n" + r.stderr)
        if r.returncode != 0:
            sys.exit(f"error: job {name} exited {r.returncode}; see {out / f'{name}.log'}")
        print(f"{name}: {len(runs.metrics(job_dir))} metrics rows", flush=True)


def checkpoint_tensors(job_dir: Path) -> dict:
    """{name: value} of the newest checkpoint: state.pt's tree, the shards (if sharded), the exported drafter."""
    from safetensors.torch import load_file
    step = max((p for p in (job_dir / "checkpoints").iterdir() if p.name.startswith("step_")),
               key=lambda p: int(p.name.split("_")[1]))
    found = {"checkpoint": step.name}
    found.update(flatten("state", torch.load(step / "state.pt", map_location="cpu", weights_only=False)))
    found.update(flatten("export", load_file(step / "drafter" / "model.safetensors")))
    shards = [p for p in step.iterdir() if p.is_dir() and p.name != "drafter"]
    for folder in shards:   # torch.distributed.checkpoint: read back into one state dict
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(folder, Path(tmp) / "whole.pt")
            found.update(flatten(folder.name, torch.load(Path(tmp) / "whole.pt", weights_only=False)))
    return found


def flatten(prefix, obj) -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flatten(f"{prefix}.{key}", val).items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in flatten(f"{prefix}.{i}", val).items()}
    return {prefix: obj}


def same(a, b) -> bool:
    import numpy as np
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a, b)
    return a == b


def compare(ref: Path, new: Path) -> int:
    bad = 0
    for name in JOBS:
        rows = [[{k: v for k, v in json.loads(l).items() if k not in TIMING}
                 for l in (d / name / "metrics.jsonl").read_text().splitlines()] for d in (ref, new)]
        diffs = [f"row {i}: {a} != {b}" for i, (a, b) in enumerate(zip(*rows)) if a != b]
        if len(rows[0]) != len(rows[1]):
            diffs.append(f"{len(rows[0])} rows != {len(rows[1])} rows")
        ta, tb = checkpoint_tensors(ref / name), checkpoint_tensors(new / name)
        diffs += [f"{k} only in one" for k in sorted(ta.keys() ^ tb.keys())]
        diffs += [f"{k} differs" for k in sorted(ta.keys() & tb.keys())
                  if not k.startswith(UNSEEDED) and not same(ta[k], tb[k])]
        n_t = sum(isinstance(v, torch.Tensor) for v in ta.values())
        print(f"{name}: {len(rows[0])} metrics rows, {n_t} checkpoint tensors ({ta['checkpoint']}): "
              + ("SAME" if not diffs else "DIFFERENT\n  " + "\n  ".join(diffs[:20])))
        bad += bool(diffs)
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the jobs into OUT")
    r.add_argument("out", type=Path)
    r.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1], help="the tree to run")
    r.add_argument("--MAX_STEPS", type=int, default=8, help="optimizer steps per job")
    c = sub.add_parser("compare", help="compare two folders written by run")
    c.add_argument("ref", type=Path)
    c.add_argument("new", type=Path)
    a = p.parse_args()
    if a.cmd == "run":
        run_jobs(a.out, a.repo, a.MAX_STEPS)
    else:
        sys.exit(compare(a.ref, a.new))


if __name__ == "__main__":
    main()
