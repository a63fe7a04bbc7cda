"""Count the aten ops one step of model/fastdecode.py runs, per component: a faithful proxy for a CUDA graph
replay's cost at batch 1 with a small model, where every kernel is launch-bound (SmolLM2-135M's fp32 weights are
~0.1 ms of reads at an H200's bandwidth, a small part of a greedy step's measured time: BENCHMARKS.md, Generation and
decoding speed).

    python -m tools.count_ops [--target DIR] [--block-size 16] [--drafter-layers 5] [--device cuda --profile 20]
        [--dtype float32|bfloat16] [--drafter-dtype bfloat16] [--max-len 1024] [--time 200]

Runs one _greedy_step and one _spec_step eagerly under a TorchDispatchMode after a short prompt's prefill, with a
random drafter (op counts do not depend on weights: the steps have static shapes). Each op is charged to the
innermost function of COMPONENTS on its Python stack. "kernels" counts the ops that do work; "views" the ones that
only make a new tensor header (is_view, or in METADATA_OPS), which launch nothing on a GPU. An aten op is a kernel
launch or a few: CPU SDPA, cuBLAS and the embedding differ in detail, the counts do not. What counts cannot show
is a kernel's own duration (a 16-row fp32 matmul against a 1-row one): --profile N runs each step N times eagerly
under torch.profiler and prints the ops by self time, on a GPU its kernels' device time. --time N measures what a
decode pays per step: N replays of each step's CUDA graph on a GPU (eager steps on a CPU), in ms per step, over a
cache of --max-len positions (the fast loop attends to its whole static cache under a mask, so its length is part
of the cost; eval_dflash sizes it to the longest prompt + --max-new-tokens + B - 1).
"""
import time
import argparse
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.fastdecode import ATTENTION
from model.target import DEFAULT_TARGET

# qualname of a function -> the component its ops count for (the innermost one on the stack wins)
COMPONENTS = {
    "FastDecoder._layer": "target layers",
    "FastDecoder.forward": "target embed/mask/norm/head",
    "DraftState._layer": "drafter layers",
    "DraftState.hidden": "drafter embed/mask/norm/head",
    "DraftState.propose": "drafter embed/mask/norm/head",
    "DraftState.write": "context-cache update",
    "FastDecoder._greedy_step": "acceptance/bookkeeping",
    "FastDecoder._spec_step": "acceptance/bookkeeping",
}
METADATA_OPS = {"detach", "alias", "lift_fresh", "_reshape_alias", "t", "transpose", "expand", "unsqueeze",
                "squeeze", "view", "slice", "select", "permute", "as_strided", "_unsafe_view"}


def component() -> str:
    f = sys._getframe(2)
    while f is not None:
        name = COMPONENTS.get(f.f_code.co_qualname)
        if name:
            return name
        f = f.f_back
    return "other"


class OpCounter(TorchDispatchMode):
    """counts[(component, "kernels" | "views")] = Counter of aten op names."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kind = "views" if func.is_view or name in METADATA_OPS else "kernels"
        self.counts.setdefault((component(), kind), Counter())[name] += 1
        return func(*args, **(kwargs or {}))


def count(step) -> OpCounter:
    with torch.no_grad(), OpCounter() as c:
        step()
    return c


def table(c: OpCounter) -> str:
    names = sorted({k for k, _ in c.counts}, key=lambda k: list(COMPONENTS.values()).index(k)
                   if k in COMPONENTS.values() else 99)
    rows = [f"{'component':30s} {'kernels':>8s} {'views':>6s}  top kernels"]
    for k in names:
        ker, vw = c.counts.get((k, "kernels"), Counter()), c.counts.get((k, "views"), Counter())
        top = ", ".join(f"{n} {m}" for n, m in ker.most_common(6))
        rows.append(f"{k:30s} {sum(ker.values()):8d} {sum(vw.values()):6d}  {top}")
    tk = sum(sum(v.values()) for (k, kind), v in c.counts.items() if kind == "kernels")
    tv = sum(sum(v.values()) for (k, kind), v in c.counts.items() if kind == "views")
    rows.append(f"{'total':30s} {tk:8d} {tv:6d}")
    return "\n".join(rows)


def kernels(c: OpCounter) -> int:
    return sum(sum(v.values()) for (_, kind), v in c.counts.items() if kind == "kernels")


PROMPT = list(range(1, 9))    # token ids of the prefill before the counted steps


def build(target, block_size, drafter_layers, device="cpu", dtype=torch.float32, max_len=0, drafter_dtype=None,
          attention="sdpa"):
    """-> (FastDecoder after a prefill, DraftState with the prompt's context written); max_len: the static caches'
    positions (0: just enough for the prompt and two blocks); drafter_dtype: the drafter's (None: the target's),
    as eval_dflash --drafter-dtype runs it; attention: FastDecoder's (eval_dflash --attention)."""
    from transformers import AutoModelForCausalLM
    from model.drafter import Drafter, DrafterConfig
    from model.fastdecode import FastDecoder
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True).eval()
    cfg = DrafterConfig.from_target(model.config, drafter_layers, block_size,
                                    mask_token_id=model.config.vocab_size - 1)
    torch.manual_seed(0)
    fast = FastDecoder(model.to(device), max(max_len, len(PROMPT) + 2 * block_size), attention=attention)
    d = fast.drafter(Drafter(cfg).to(device, drafter_dtype or dtype).eval(), block_size)
    with torch.no_grad():
        d.write(fast._prefill(PROMPT, d.taps), fast.positions[:len(PROMPT)])
    return fast, d


def profile(fast, step, n) -> str:
    """step run n times eagerly under torch.profiler (each from the prompt's end: a step moves `start`) -> the
    table of ops by self time (device time on a GPU), per step."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    cuda = fast.start.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        step()                                                   # lazy inits outside the profile
        with torch_profile(activities=acts) as prof:
            for _ in range(n):
                fast.start.fill_(len(PROMPT))
                step()
            sync()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=15)


def time_steps(fast, d, n) -> dict:
    """ms per step of the greedy and the speculative step: n CUDA-graph replays each on a GPU (the graphs the fast
    loop replays), n eager runs on a CPU; every run starts from the prompt's end (a step moves `start`)."""
    out = {}
    for key, step in (("greedy", fast._greedy_step), ("speculative", lambda: fast._spec_step(d))):
        with torch.inference_mode():
            fast._ready(key, step)
            fast.start.fill_(len(PROMPT))
            fast._launch(key, step)                                  # one untimed run (lazy inits, clocks)
            sync = torch.cuda.synchronize if fast.cuda_graphs else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fast.start.fill_(len(PROMPT))
                fast._launch(key, step)
            sync()
            out[key] = (time.perf_counter() - t0) / n * 1e3
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEFAULT_TARGET), help="an HF folder (default: the SmolLM2 demo target)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the counts are the same; --profile differs)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="also profile N eager runs of each step")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="target and drafter dtype")
    ap.add_argument("--drafter-dtype", default=None, choices=("float32", "bfloat16"),
                    help="the drafter's, when not the target's (eval_dflash --drafter-dtype)")
    ap.add_argument("--attention", default="sdpa", choices=ATTENTION,
                    help="the attention of both steps (eval_dflash --attention)")
    ap.add_argument("--max-len", type=int, default=0, help="static cache positions (0: prompt + 2 blocks)")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="also time N runs of each step (CUDA graphs "
                                                                       "on a GPU)")
    a = ap.parse_args(argv)
    fast, d = build(a.target, a.block_size, a.drafter_layers, a.device, getattr(torch, a.dtype), a.max_len,
                    getattr(torch, a.drafter_dtype) if a.drafter_dtype else None, a.attention)
    greedy, spec = count(fast._greedy_step), count(lambda: fast._spec_step(d))
    if a.profile:
        print(f"greedy step x {a.profile}\n{profile(fast, fast._greedy_step, a.profile)}\n")
        print(f"speculative step x {a.profile}\n{profile(fast, lambda: fast._spec_step(d), a.profile)}\n")
    print(f"greedy step ({len(fast.layers)} target layers)\n{table(greedy)}\n")
    print(f"speculative step (B={d.B}, {d.config.num_hidden_layers} drafter layers)\n{table(spec)}\n")
    print(f"kernels: greedy {kernels(greedy)}, speculative {kernels(spec)} "
          f"({kernels(spec) / kernels(greedy):.2f}x)")
    if a.time:
        ms = time_steps(fast, d, a.time)
        how = "CUDA-graph replays" if fast.cuda_graphs else "eager runs"
        dts = a.dtype + (f", drafter {a.drafter_dtype}" if a.drafter_dtype else "") + f", {a.attention} attention"
        print(f"time per step ({a.time} {how}, {dts}, {fast.max_len}-position caches, {a.device}): greedy "
              f"{ms['greedy']:.3f} ms, speculative {ms['speculative']:.3f} ms "
              f"({ms['speculative'] / ms['greedy']:.2f}x): a drafter of tau {ms['speculative'] / ms['greedy']:.2f} "
              f"breaks even")
    return greedy, spec


if __name__ == "__main__":
    main()
