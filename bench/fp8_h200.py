"""FP8 on one GPU (SM89+; written for an H200): equal-work figures, FP8, the one-GPU trainer. One line per figure.

    python -m bench.fp8_h200 [--parts limits,split,target,drafter,trainer] [--json fp8.json]
    python -m bench.fp8_h200 --shape tiny --parts split,drafter                  # rehearse on a CPU (no figures)

Random Qwen3-8B (bench_dflash's build), 4 x 3072 tokens per micro-batch, 5 drafter layers, B=16, 2048 blocks per
micro-batch (the anchor density: train_dflash.py's MAX_ANCHORS comment). Parts, in order; each in try/except, so
one failure prints its error and the rest still run:
  limits   measured bf16 and FP8 (rowwise torch._scaled_mm) matmul peaks, and the tok/s limits they give at equal
           work: every FLOP at the bf16 peak, then the FP8-able ones (TARGET_FP8 + DRAFTER_FP8) at the FP8 peak
  split    planner.recommend_split at 512 and 2048 blocks from BENCHMARKS.md's per-role rates (no GPU work)
  target   the feature forward, compiled, bf16 vs TARGET_FP8: tok/s; per tapped layer the features' relative error
           FP8 vs fp32 and bf16 vs fp32 on the same inputs (the fp32 run: the same weights, eager)
  drafter  the drafter step (COMPILE_DRAFTER=layers) at 2048 blocks, bf16 vs DRAFTER_FP8
  trainer  train_dflash.py itself, one process, COMPILE_TARGET + COMPILE_DRAFTER=layers, 2048 blocks, on a random
           target written to --assets (16 GB); tok/s of its status lines after the first 10 steps
Random weights have none of a trained model's massive activations: their FP8 error is a lower bound (--target
reads a real HF folder for the error part instead).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bench import bench_dflash as bd
from model.fp8 import RECIPES, quantize_target
from model.target import Target, target_features
from trainer import planner

ANCHORS = (512, 2048)       # blocks per 4 x 3072 micro-batch: the seeds' default, the peer's work
# per-role rates measured on H200s (BENCHMARKS.md): the compiled target, the compiled drafter's step at each density
TARGET_TOK_S = 44_300
DRAFTER_STEP_S = {512: 0.147, 2048: 0.515}
FP8_DATASHEET_TFLOPS = 1979.0   # H100/H200 SXM dense FP8
REPO = Path(__file__).resolve().parents[1]


def emit(res, key, line, **values):
    """One figure: printed as a line, kept for --json."""
    print(f"{key}: {line}", flush=True)
    res[key] = {"line": line, **values}


def bench_args(args, extra=()):
    """bench_dflash's settings at this bench's shape (--shape; tiny rehearses the parts on a CPU, no figure)."""
    return bd.parse_args(["--shape", args.shape, "--anchors", "2048", "--steps", "5", "--warmup", "3", *extra])


# --- limits -----------------------------------------------------------------------------------------------------------

def fp8_matmul_tflops(device) -> float:
    """An 8192^3 GEMM as TARGET_FP8 runs them: e4m3 operands, per-row scales, bf16 out, fast accumulation."""
    n = bd.PEAK_MATMUL_N if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)

    def mm():
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)
    for _ in range(3):
        mm()
    timer, iters = bd.Timer(device), 20 if device.type == "cuda" else 3
    timer.start()
    for _ in range(iters):
        mm()
    return 2 * n ** 3 * iters / timer.stop() / 1e12


def work_flops(c, anchors):
    """FLOPs of one 4 x 3072 micro-batch at `anchors` blocks: target (matmuls, attention) and the drafter's step
    split into what FP8 can take (the layers' GEMMs) and what stays bf16 (fc, attention, lm_head + CE)."""
    s, L, K, B = c.sizes, c.dcfg.num_hidden_layers, c.dcfg.num_taps, c.dcfg.block_size
    lengths = [3072] * 4
    T, n_run = sum(lengths), max(c.dcfg.target_layer_ids) + 1
    t_mm = n_run * 2 * bd.linear_params_per_layer(s) * T
    t_all = bd.target_flops(s, n_run, lengths)
    ids, mask, attn, n = bd.make_batch(lengths, s.V, c.mask_id, 0)
    _, positions, a = bd.packet_anchors(n, mask[attn.bool()], 0, c.cfg.replace(MAX_ANCHORS=anchors))
    M, R = len(a) * B, len(a) * (B - 1)
    d = bd.drafter_flops(s, L, K, T, M, R, bd.visible_pairs(positions, a, B))
    fc = 4 * K * s.H * s.H * T
    d_fp8 = d["layers on block tokens"] + d["fc + k/v on context"] - fc
    return {"target_fp8able": t_mm, "target_bf16": t_all - t_mm, "drafter_fp8able": d_fp8,
            "drafter_bf16": d["total"] - d_fp8, "tokens": T}


def part_limits(res, c):
    bf16 = bd.peak_matmul_tflops(c.device, torch.bfloat16)
    fp8 = fp8_matmul_tflops(c.device)
    emit(res, "peak matmul", f"bf16 {bf16:.0f} TFLOP/s, FP8 rowwise {fp8:.0f} TFLOP/s measured (8192^3; datasheet "
         f"{bd.DATASHEET_TFLOPS:.0f} / {FP8_DATASHEET_TFLOPS:.0f})", bf16_tflops=bf16, fp8_tflops=fp8)
    for anchors in ANCHORS:
        f = work_flops(c, anchors)
        all_bf16 = sum(v for k, v in f.items() if k != "tokens") / (bf16 * 1e12)
        with_fp8 = (f["target_fp8able"] + f["drafter_fp8able"]) / (fp8 * 1e12) + \
            (f["target_bf16"] + f["drafter_bf16"]) / (bf16 * 1e12)
        tgt, dft = (f["target_fp8able"] + f["target_bf16"]) / 1e12, (f["drafter_fp8able"] + f["drafter_bf16"]) / 1e12
        emit(res, f"limit {anchors} blocks", f"{bd.work_density(anchors, 4, 3072)}: target {tgt:.1f} "
             f"+ drafter {dft:.1f} TFLOP per micro-batch -> bf16 limit "
             f"{f['tokens'] / all_bf16 / 1e3:.1f}K tok/s per GPU; FP8 limit (target and drafter GEMMs at the FP8 peak) "
             f"{f['tokens'] / with_fp8 / 1e3:.1f}K", flops=f, bf16_limit_tok_s=f["tokens"] / all_bf16,
             fp8_limit_tok_s=f["tokens"] / with_fp8)


# --- split ------------------------------------------------------------------------------------------------------------

def part_split(res, _c=None):
    for anchors in ANCHORS:
        dft = 4 * 3072 / DRAFTER_STEP_S[anchors]
        one = 1 / (1 / TARGET_TOK_S + 1 / dft)
        parts = [f"one GPU (target and drafter in turn) {one / 1e3:.1f}K"]
        for n in (2, 8):
            t, d = planner.recommend_split(TARGET_TOK_S, dft, n)
            rate = planner.split_rate(t, d, TARGET_TOK_S, dft)
            parts.append(f"{n} GPUs {t}:{d} => {rate / 1e3:.1f}K ({rate / n / 1e3:.1f}K per GPU)")
        emit(res, f"split {anchors} blocks", f"{bd.work_density(anchors, 4, 3072)}; target {TARGET_TOK_S / 1e3:.1f}K, "
             f"drafter {dft / 1e3:.1f}K tok/s per GPU: " + "; ".join(parts))


# --- target -----------------------------------------------------------------------------------------------------------

def _features(target, batch, c):
    ids, _, attn, _ = batch
    return target_features(target, ids, attn, c.device)                          # [T, K*H]


def _time_forward(target, batch, c, steps):
    for _ in range(2):
        _features(target, batch, c)
    timer = bd.Timer(c.device)
    timer.start()
    for _ in range(steps):
        feats = _features(target, batch, c)
    return timer.stop() / steps, feats


def part_target(res, c, args):
    lengths = [3072] * 4
    batch = bd.make_batch(lengths, c.sizes.V, c.mask_id, 0)
    batch = (batch[0].pin_memory(), batch[1], batch[2].pin_memory(), batch[3])
    ids = c.dcfg.target_layer_ids
    if args.target:
        target = Target(args.target, c.device, torch.bfloat16, ids)
    else:
        target = bd.build_target(c.hf, ids, c.device, torch.bfloat16, seed=0)
    # fp32 reference: the same weights (bf16 values, exact in fp32), eager; then back to bf16 (exact)
    for p in target.model.parameters():
        p.data = p.data.float()
    ref = _features(target, batch, c).float()
    for p in target.model.parameters():
        p.data = p.data.to(torch.bfloat16)
    layers = list(target.decoder.layers)
    flop = bd.target_flops(c.sizes, max(ids) + 1, lengths)
    feats = {}
    for name in ("bf16", "FP8"):
        target.decoder.layers = torch.nn.ModuleList(layers)
        torch._dynamo.reset()
        if name == "FP8":
            quantize_target(target)
        target.compile_layers()
        t0 = time.time()
        dt, f = _time_forward(target, batch, c, args.steps)
        feats[name] = f.float()
        emit(res, f"target {name}", f"compiled feature forward {sum(lengths) / dt / 1e3:.1f}K tok/s, {1e3 * dt:.0f} "
             f"ms per 4 x 3072, {flop / dt / 1e12:.0f} TFLOP/s (compile + timing {time.time() - t0:.0f} s)",
             tok_s=sum(lengths) / dt)
    H = c.sizes.H
    for k, layer in enumerate(ids):
        cols = slice(k * H, (k + 1) * H)
        r = ref[:, cols]

        def rel(x):
            return float((x[:, cols] - r).norm() / r.norm())
        e_bf16, e_fp8 = rel(feats["bf16"]), rel(feats["FP8"])
        e_pair = float((feats["FP8"][:, cols] - feats["bf16"][:, cols]).norm() / feats["bf16"][:, cols].norm())
        emit(res, f"features layer {layer}", f"relative error vs fp32: bf16 {e_bf16:.2e}, FP8 {e_fp8:.2e} "
             f"({e_fp8 / max(e_bf16, 1e-30):.1f}x bf16's); FP8 vs bf16 {e_pair:.2e}", bf16=e_bf16, fp8=e_fp8,
             fp8_vs_bf16=e_pair)
    del target, layers, ref, feats
    torch._dynamo.reset()


# --- drafter ----------------------------------------------------------------------------------------------------------

def part_drafter(res, c, args):
    """The drafter step in bf16 and with DRAFTER_FP8 in each recipe of --drafter-recipes; --profile N prints the
    top CUDA kernels of N more steps of each."""
    variants = [("bf16", [])] + [(f"DRAFTER_FP8 {r}", ["--drafter-fp8", "--drafter-fp8-recipe", r])
                                 for r in args.drafter_recipes.split(",") if r]
    if args.head_fp8:   # each again with the loss's lm_head GEMMs in FP8
        variants += [(f"{name} + HEAD_FP8", [*extra, "--head-fp8"]) for name, extra in variants]
    for name, extra in variants:
        a = bench_args(args, ["--compile-drafter", "layers", "--steps", str(args.steps), "--profile",
                              str(args.profile), *extra])
        d = bd.bench_drafter(a, c)
        emit(res, f"drafter {name}", f"2048 blocks per 4 x 3072 ({bd.work_density(2048, 4, 3072)}): "
             f"{d['ms_per_step']:.1f} ms per step, {d['tok_s'] / 1e3:.1f}K ctx tok/s, {d['tflops']:.0f} TFLOP/s "
             f"(bf16 FLOP count), peak " + (f"{d['peak_mem_bytes'] / 2 ** 30:.2f} GiB" if d["peak_mem_bytes"]
                                             else "n/a (CPU)"), ms_per_step=d["ms_per_step"],
             tok_s=d["tok_s"])
        torch._dynamo.reset()
        c.free()


# --- trainer ----------------------------------------------------------------------------------------------------------

STATUS = re.compile(r"step=(\d+)/\d+ .*\(([\d.]+)(K?)tok/s\)")


def trainer_flags(args) -> list:
    """--trainer-args' flags: each value may hold several, space-separated (--trainer-args="--A=1 --B=2", the one
    form argparse takes for values that start with --)."""
    return [f for a in args.trainer_args for f in a.split()]


def part_trainer(res, c, args):
    a = bench_args(args)
    assets = Path(args.assets).resolve()
    if not (assets / "target" / "config.json").exists():
        bd.write_assets(a, c, assets, rows=4 * (args.trainer_steps + 16))
        c.free()
    cmd = [sys.executable, str(REPO / "train_dflash.py"), f"--TARGET={assets}/target", f"--DATA={assets}/data",
           f"--MASK_TOKEN_ID={c.mask_id}", "--NUM_DRAFT_LAYERS=5", "--BLOCK_SIZE=16", "--MAX_ANCHORS=2048",
           "--TOKEN_BUDGET=12288", f"--MAX_STEPS={args.trainer_steps}", "--EPOCHS=100", "--LOG_EVERY=5",
           "--SAVE_EVERY=1000000", "--KEEP_LAST=1", "--COMPILE_TARGET=1", "--COMPILE_DRAFTER=layers",
           "--OUT_DIR=runs/fp8_h200_trainer", "--RESUME=scratch", *trainer_flags(args)]
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", PYTHONUNBUFFERED="1")
    # the bench's own scratch run: the last call's final checkpoint would make RESUME=scratch refuse this one
    shutil.rmtree(REPO / "runs" / "fp8_h200_trainer", ignore_errors=True)
    t0 = time.time()
    # the log is written as the run goes (a run stopped early keeps what it printed: where it was)
    log_path = REPO / "runs" / "fp8_h200_trainer.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    out = log_path.read_text()
    rates = [(int(m[1]), float(m[2]) * (1e3 if m[3] else 1)) for m in STATUS.finditer(out)]
    # steps 15 .. the one before the last: the last interval has no target forward left to run ahead of its steps
    # (the one process's rate there is the drafter's alone), so it is reported on its own
    steady = [v for s, v in rates if 10 < s < args.trainer_steps]
    last = [v for s, v in rates if s == args.trainer_steps]
    if code or not steady:
        raise RuntimeError(f"trainer exit {code}, {len(rates)} status lines; last output:\n{out[-3000:]}")
    peak = [l for l in out.splitlines() if "peak GPU memory" in l]
    # the run's own settings (a later --NAME=VALUE wins, as in the trainer), so --trainer-args can change them
    anchors, budget = (int([f for f in cmd if f.startswith(f"--{k}=")][-1].split("=", 1)[1])
                       for k in ("MAX_ANCHORS", "TOKEN_BUDGET"))
    emit(res, "trainer one process", f"train_dflash.py, COMPILE_TARGET + COMPILE_DRAFTER=layers "
         f"{' '.join(trainer_flags(args))}, {anchors} blocks per {budget} tokens "
         f"({bd.work_density(anchors, 1, budget).split(' = ')[0]}): {min(steady) / 1e3:.1f}-{max(steady) / 1e3:.1f}K "
         f"tok/s in the status lines of steps 15-{args.trainer_steps - 5}"
         + (f" (the last five steps, with no target forward left ahead: {last[0] / 1e3:.1f}K)" if last else "")
         + f" ({time.time() - t0:.0f} s in all); "
         + (peak[-1].split("] ", 1)[1] if peak else "no peak memory line"), tok_s=steady, last_tok_s=last)


# --- main -------------------------------------------------------------------------------------------------------------

PARTS = {"limits": part_limits, "split": part_split, "target": part_target, "drafter": part_drafter,
         "trainer": part_trainer}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--steps", type=int, default=5, help="timed forwards / drafter steps per variant")
    ap.add_argument("--drafter-recipes", default=RECIPES[0], help="drafter part: DRAFTER_FP8 recipes to time after "
                    "bf16, comma list of " + ", ".join(RECIPES) + " ('' = bf16 only)")
    ap.add_argument("--head-fp8", action="store_true", help="drafter part: each variant also with HEAD_FP8")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="drafter part: profile N more steps of each "
                    "variant and print the top CUDA kernels")
    ap.add_argument("--trainer-steps", type=int, default=30, help="optimizer steps of the trainer run")
    ap.add_argument("--trainer-args", nargs="*", default=[], help="more --NAME=VALUE for the trainer, written "
                    "with '=' and space-separated: --trainer-args='--TARGET_FP8=1 --DRAFTER_FP8=1'")
    ap.add_argument("--assets", default="runs/fp8_h200_assets", help="random target + data for the trainer part")
    ap.add_argument("--target", default="", help="a real HF folder for the target part instead of the random one")
    ap.add_argument("--shape", choices=list(bd.SHAPES), default="qwen3-8b",
                    help="the random target's shape; tiny rehearses the parts on a CPU (their figures mean nothing)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    unknown = [p for p in args.parts.split(",") if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {', '.join(unknown)}; allowed are {', '.join(PARTS)}")
    t_start = time.time()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    c = bd.Context(bench_args(args))   # the trainer's settings at the bench shape (c.cfg)
    res = {"env": bd.environment(c)}
    e = res["env"]
    print(f"fp8_h200: {e['device']}, torch {e['torch']}, git {e['git']}, {e['date']}", flush=True)
    for name in args.parts.split(","):
        fn = PARTS[name]
        t0 = time.time()
        try:
            if name in ("target", "drafter", "trainer"):
                fn(res, c, args)
            else:
                fn(res, c)
        except Exception as err:  # noqa: BLE001 - one part's failure must not lose the others' figures
            traceback.print_exc()
            emit(res, name, f"ERROR {type(err).__name__} after {time.time() - t0:.0f} s: {str(err)[:500]}")
        print(f"({name}: {time.time() - t0:.0f} s)", flush=True)
        c.free()
        if args.json:   # after every part: a run killed later keeps the figures so far
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    print(f"fp8_h200: {time.time() - t_start:.0f} s in all", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return res


if __name__ == "__main__":
    main()
