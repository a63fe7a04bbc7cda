"""DFlash throughput and memory benchmark on random-initialised targets of real shapes; nothing is downloaded, and
nothing is written except by --write-assets.

    python -m bench.bench_dflash --mode target  --shape qwen3-8b [--mixed] [--compile]   # (a) target capacity, (d)
    python -m bench.bench_dflash --mode drafter --shape qwen3-8b [--mixed]               # (b) drafter capacity, (d)
    python -m bench.bench_dflash --mode drafter --arch dflash2 [--selector-top-k 16 ...] # (b) for a DFlash2 drafter
    python -m bench.bench_dflash --mode pipeline                                         # (c) prints the commands below
    torchrun --standalone --nproc-per-node 2 -m bench.bench_dflash --mode pipeline [--pipe-compute]   # (c), (e)
    python -m bench.bench_dflash --mode all --json bench.json                            # target + drafter (+ commands)
    python -m bench.bench_dflash --write-assets DIR --shape qwen3-8b      # random target + data for train_dflash.py
    python -m bench.bench_dflash --shape tiny --steps 2                                  # CPU smoke test (SDPA, fp32)

What the trainer does is called, not copied: the target is a model.target.Target (built from a config instead of
from_pretrained) run through model.target.target_features; the drafter's micro-batches go through
model.objective.prepare (micro_batch.make_prepare) on a pipe.Prefetcher, fed synthetic packets instead of the network;
the drafter step is train_dflash's drafter_step + optimizer_step for one rank and GRAD_ACCUM=1, with the settings
c.cfg. The transport is pipe.Sender -> pipe.receive -> pipe.Prefetcher.
--arch (DRAFTER_ARCH) picks the drafter from model.drafters.ARCHS, built as the trainer builds it (make_config with
the row's knobs); each arch's own settings (Arch.knobs, Arch.loss_settings) are flags, the setting lower-cased with
dashes (DFlash2's --conv-kernel-size, --conv-group-size, --selector-rank, --selector-top-k, --selector-alpha), checked
as the trainer checks them (Arch.check); every mode that runs a drafter runs any arch, and the JSON ("arch") and the
report's header name it.
Settings not on the command line (GAMMA, CE_CHUNK, Q_HS, SEND_DEPTH, ...) default to train_dflash's constants (read,
never written: Context.cfg, a trainer.settings.Settings from td.defaults, holds this run's values).
Every mode prints the planner's memory estimate (trainer/planner.py) next to the measured peak.
"""
import argparse
import functools
import gc
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from collections import deque
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.profiler import ProfilerActivity, profile as torch_profile
from transformers import AutoModelForCausalLM

import train_dflash as td
from data.batching import BatchPlan
from model import ce_kernel, fp8, objective
from model.attention import dflash_mask_mod, flex_kernel_options, set_flex_kernel_options, to_device, \
    warmup_flex_attention
from model.drafter import DrafterConfig, compile_drafter
from model.drafters import ARCHS, make_config
from model.fp8 import convert_drafter, quantize_target
from model.objective import micro_seed, pack, sample_anchors, set_ce_kernel
from model.target import Target, target_features
from train_dflash import drafter_step, optimizer_step
from trainer import planner
from trainer.micro_batch import autocast_for, make_prepare, mask_lengths
from trainer.optim import make_optimizer
from trainer.pipe import Packet, Prefetcher, Sender, receive
from trainer.settings import RANGES

# --- shapes -----------------------------------------------------------------------------------------------------------
# name: family, layers, hidden, heads, kv heads, head_dim, intermediate, vocab, rope_theta, tied embeddings, MASK id
SHAPES = {
    "qwen3-8b":  ("qwen3", 36, 4096, 32, 8, 128, 12288, 151936, 1e6, False, 151669),
    "qwen3-32b": ("qwen3", 64, 5120, 64, 8, 128, 25600, 151936, 1e6, False, 151669),
    "smol":      ("llama", 30,  576,  9, 3,  64,  1536,  49152, 1e5, True,      16),   # SmolLM2-135M
    "tiny":      ("qwen3",  6,   64,  4, 2,  16,   128,    128, 1e4, False,    127),   # CPU tests
}
DATASHEET_TFLOPS = 989.0    # H100/H200 SXM dense bf16, the usual MFU denominator
PEAK_MATMUL_N = 8192        # the measured peak: an N^3 bf16 matmul
SYNTH_PROMPT_FRAC = 0.25    # leading share of every synthetic sequence that is prompt (loss_mask 0)
INIT_STD = 0.02             # random init of every matrix (norm weights 1)
ASSETS_DIR = "runs/bench_assets"   # --write-assets: where the printed trainer command looks
DEFAULTS = dict(seq=3072, anchors=512, block=16, layers=5, min_len=550)      # the benchmark shape
TINY_DEFAULTS = dict(seq=64, anchors=8, block=4, layers=2, min_len=16)       # --shape tiny: seconds on a CPU


# --- models -----------------------------------------------------------------------------------------------------------

def hf_config(shape: str):
    fam, n, H, nh, nkv, D, I, V, theta, tied, _ = SHAPES[shape]
    cls = transformers.Qwen3Config if fam == "qwen3" else transformers.LlamaConfig
    return cls(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=n, num_attention_heads=nh,
               num_key_value_heads=nkv, head_dim=D, max_position_embeddings=40960, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": theta}, tie_word_embeddings=tied)


@torch.no_grad()
def _init_random_(module: nn.Module, seed: int) -> None:
    """Matrices ~ N(0, INIT_STD), norm weights 1, biases 0, generated where the parameters live."""
    dev = next(module.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, INIT_STD, generator=gen)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)


def build_target(hf_cfg, layer_ids, device, dtype, attn_implementation=None, compile_layers=False, seed=0,
                 fp8=False):
    """A model.target.Target around a random HF model built on the meta device and materialised on `device`
    (an 8B model in seconds on a GPU; no fp32 CPU init, no files). fp8: TARGET_FP8 (before compiling, as the
    trainer does)."""
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, **kw)
    model.to_empty(device=device)
    _init_random_(model, seed)
    # to_empty leaves non-persistent buffers (RoPE inv_freq) uninitialised and unties lm_head: rebuild both
    rebuilt = set()
    for name, m in list(model.named_modules()):
        if "inv_freq" in m._buffers:
            fresh = type(m)(m.config).to(device)          # computed from the config, on the CPU, then moved
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], fresh)
            rebuilt.add(name)
    left = [n for n, _ in model.named_buffers() if n.rsplit(".", 1)[0] not in rebuilt]
    assert not left, f"buffers the random build does not initialise: {left}"
    if getattr(hf_cfg, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.eval().requires_grad_(False)
    # Target.__init__ without from_pretrained: the same attributes, so Target.features runs unchanged
    t = Target.__new__(Target)
    t.model, t.sharded = model, False
    t.hf_config = model.config.get_text_config()
    t.num_layers = t.hf_config.num_hidden_layers
    t.decoder = model.get_decoder()
    t.layer_ids = list(layer_ids)
    t.embed_tokens = model.get_input_embeddings()
    t.lm_head_weight = model.get_output_embeddings().weight
    t.device, t.dtype = torch.device(device), t.embed_tokens.weight.dtype
    if fp8:
        quantize_target(t)
    if compile_layers:
        t.compile_layers()
    return t


def build_drafter(dcfg, device, seed=0):
    """The drafter of dcfg's arch (model.drafters.ARCHS: the row whose config class dcfg is, so a DrafterConfig
    builds a DFlash Drafter, a DFlash2Config a DFlash2Drafter) in fp32 (the master weights), initialised on
    `device` like Drafter._init_weights; a DFlash2 drafter's convolutions and selector then at their own init
    (identity convolutions, zero transition: reset_own_parameters), as the trainer's drafter starts."""
    arch = next(a for a in ARCHS.values() if type(dcfg) is a.config)
    with torch.device("meta"):
        d = arch.drafter(dcfg)
    d.to_empty(device=device)
    _init_random_(d, seed)
    d.reset_own_parameters()
    return d


def frozen_io(hf_cfg, device, dtype, seed=1):
    """The target's embedding and lm_head as model.target.load_frozen_io returns them, random."""
    V, H = hf_cfg.vocab_size, hf_cfg.hidden_size
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.empty(V, H, device=device, dtype=dtype).normal_(0.0, INIT_STD, generator=gen)
    embed = nn.Embedding.from_pretrained(w, freeze=True)
    head = w if hf_cfg.tie_word_embeddings else torch.empty_like(w).normal_(0.0, INIT_STD, generator=gen)
    return embed, head.requires_grad_(False)


# --- synthetic micro-batches ------------------------------------------------------------------------------------------

def batch_lengths(args, n: int) -> list[list[int]]:
    """Sequence lengths of n micro-batches: batch x seq, or (--mixed) lengths uniform in [min_len, seq] cut into
    micro-batches by the trainer's data.batching.BatchPlan under TOKEN_BUDGET = batch * seq."""
    if not args.mixed:
        return [[args.seq] * args.batch for _ in range(n)]
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.batch * args.seq
    per = max(1, budget // args.min_len)
    lens = torch.randint(args.min_len, args.seq + 1, (n * per + 16,), generator=gen).tolist()
    batches = BatchPlan(lens, budget, td.MAX_BATCH_SIZE, seed=args.seed).epoch(0)
    return [[lens[i] for i in b] for b in batches[:n]]


def make_batch(lengths, vocab, mask_id, g):
    """Padded CPU tensors as data.loader.Data.batch returns them: input_ids, loss_mask, attention_mask [b, S],
    lengths [b]. Prompt = the first SYNTH_PROMPT_FRAC of each sequence; tokens never the MASK id."""
    gen = torch.Generator().manual_seed(g)
    b, S = len(lengths), max(lengths)
    ids = torch.randint(0, vocab - 1, (b, S), generator=gen)
    ids[ids == mask_id] = vocab - 1
    mask = torch.zeros(b, S, dtype=torch.uint8)
    attn = torch.zeros(b, S, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, int(n * SYNTH_PROMPT_FRAC):n] = 1
        attn[i, :n] = 1
    ids = ids * attn
    return ids, mask, attn, torch.tensor(lengths, dtype=torch.long)


# --- timing and FLOPs -------------------------------------------------------------------------------------------------

class Timer:
    """Wall seconds between start() and stop(); CUDA events on the current stream on a GPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e0.record()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            e1.synchronize()
            return self.e0.elapsed_time(e1) / 1e3
        return time.perf_counter() - self.t0


def peak_matmul_tflops(device, dtype) -> float:
    n = PEAK_MATMUL_N if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    timer, iters = Timer(device), 20 if device.type == "cuda" else 3
    timer.start()
    for _ in range(iters):
        a @ b
    return 2 * n ** 3 * iters / timer.stop() / 1e12


def linear_params_per_layer(s) -> int:
    return s.H * s.qd + 2 * s.H * s.kvd + s.qd * s.H + 3 * s.H * s.I


def target_flops(s, n_run_layers, lengths) -> float:
    """Forward FLOPs of the feature forward on the real tokens: matmuls of layers 0..last tap + causal attention."""
    T = sum(lengths)
    causal_pairs = sum(n * (n + 1) / 2 for n in lengths)
    return n_run_layers * (2 * linear_params_per_layer(s) * T + 4 * s.nh * s.D * causal_pairs)


def visible_pairs(positions, anchors, B) -> int:
    """(query, key) pairs one full-attention drafter layer computes: block token of anchor a sees the a_pos context
    tokens of its document before the anchor and the B tokens of its block."""
    return int(B * (positions[anchors] + B).sum())


def drafter_flops(s, L, K, T, M, R, pairs, dcfg=None) -> dict:
    """Training FLOPs of one drafter step. Weights on block tokens: 6/param/token. fc on the context: forward +
    weight grad only (features need no grad) = 4. k/v projections on the context: 6. Attention: 4 per visible pair
    per head_dim per head forward, twice that backward. lm_head is frozen: forward + grad to the hidden = 4.
    dcfg a DFlash2Config: also its convolutions and selector (dflash2_flops)."""
    out = {"layers on block tokens": 6 * L * linear_params_per_layer(s) * M,
           "fc + k/v on context": 4 * K * s.H * s.H * T + 6 * L * 2 * s.H * s.kvd * T,
           "attention": 12 * s.nh * s.D * pairs * L,
           "lm_head + CE": 4 * R * s.H * s.V}
    if dcfg is not None and hasattr(dcfg, "selector_top_k"):
        out["dflash2 convolutions + selector"] = dflash2_flops(s, dcfg, L, M, R)
    out["total"] = sum(out.values())
    return out


def dflash2_flops(s, dcfg, L, M, R) -> float:
    """A DFlash2 drafter's matmuls beyond DFlash's (model/dflash2.py), training: per layer two kernel_projections
    [H -> 2 x taps x G] on the block rows (6/param/token); on the supervised rows the selector's hidden_projection
    [H -> r] (6), the K candidates' unary logits from frozen lm_head rows (forward + grad to the hidden = 4 x K x H)
    and the bilinear [K, r] scores (6 x K x r). The convolutions' elementwise taps are left out, as norms are."""
    taps, G, r, k = dcfg.conv_kernel_size, dcfg.conv_groups, dcfg.selector_rank, dcfg.selector_top_k
    return 6 * L * 2 * s.H * 2 * taps * G * M + R * (6 * s.H * r + 4 * k * s.H + 6 * k * r)


# --- (a) target capacity ----------------------------------------------------------------------------------------------

def bench_target(args, c) -> dict:
    t0 = time.time()
    target = build_target(c.hf, c.dcfg.target_layer_ids, c.device, c.dtype, args.target_attn, args.compile, args.seed,
                          args.target_fp8)
    build_s = time.time() - t0
    warmup = max(args.warmup, 2) if args.compile else args.warmup
    lens = batch_lengths(args, warmup + args.steps)
    batches = [make_batch(l, c.sizes.V, c.mask_id, g) for g, l in enumerate(lens)]
    if c.device.type == "cuda":
        batches = [(ids.pin_memory(), m, attn.pin_memory(), n) for ids, m, attn, n in batches]
    inflight = deque(maxlen=c.cfg.SEND_DEPTH + 1)      # feature tensors pipe.Sender may still hold

    def forward(b):
        ids, _mask, attn, _n = b
        inflight.append(target_features(target, ids, attn, c.device))             # [T, K*H]
    for b in batches[:warmup]:
        forward(b)
    c.reset_peak()
    timer = Timer(c.device)
    timer.start()
    for b in batches[warmup:]:
        forward(b)
    dt = timer.stop()
    peak = c.peak_mem()
    prof = profile(args.profile, lambda: forward(batches[-1]), c)
    timed = lens[warmup:]
    real, padded = sum(map(sum, timed)), sum(len(l) * max(l) for l in timed)
    flops = sum(target_flops(c.sizes, max(c.dcfg.target_layer_ids) + 1, l) for l in timed)
    out = {"build_s": build_s, "attn_implementation": target.model.config._attn_implementation,
           "compiled": bool(args.compile), "fp8": args.target_fp8, "micro_batches": len(timed), "seconds": dt,
           "tok_s": real / dt, "padded_tok_s": padded / dt, "ms_per_micro_batch": 1e3 * dt / len(timed),
           "tflops": flops / dt / 1e12, "peak_mem_bytes": peak, "profile": prof}
    out.update(c.mfu(out["tflops"]))
    del target, inflight, batches
    if args.compile:
        torch._dynamo.reset()          # compiled layers keep the model alive; the drafter mode needs the memory
    c.free()
    return out


def profile(n, fn, c, rows=30, trace=None):
    """n more calls of fn under torch.profiler -> the top kernels by device time, as printed (empty when n = 0);
    trace: also write the timeline there (chrome trace JSON: where the GPU waits, and on what)."""
    if not n:
        return ""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if c.device.type == "cuda" else [])
    c.sync()
    with torch_profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        c.sync()
    if trace:
        prof.export_chrome_trace(trace)
    key = "self_cuda_time_total" if c.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
    print(table, flush=True)
    return table


# --- (b) drafter capacity ---------------------------------------------------------------------------------------------

def synthetic_feed(c, lens):
    """A drafter rank's Prefetcher without the network: each micro-batch's features drawn on the device, the
    trainer's prepare (anchors, blocks, masks) on its side stream into a queue of Q_HS."""
    packets = (synthetic_packet(c, lens[g % len(lens)], g) for g in itertools.count())
    return Prefetcher(packets, make_prepare(c.dcfg, c.device, c.flex, c.cfg), c.device, c.cfg.Q_HS, name="feeder")


class DrafterRig:
    """One drafter rank: fp32 master weights, the frozen embedding / lm_head, the trainer's AdamW and its step."""

    def __init__(self, c, seed=0, compile_mode="off", ce_kernel="auto", overlap=True, drafter_fp8=False,
                 fp8_recipe=fp8.RECIPES[0], head_fp8=False):
        self.c = c
        self.drafter = build_drafter(c.dcfg, c.device, seed)
        if drafter_fp8:                                    # DRAFTER_FP8, in the trainer's order
            convert_drafter(self.drafter, recipe=fp8_recipe)
        compile_drafter(self.drafter, compile_mode)        # "off" included: a previous rig's mode is undone
        set_ce_kernel(ce_kernel)
        self.embed, self.head_w = frozen_io(c.hf, c.device, c.dtype)
        if head_fp8:                                       # HEAD_FP8: the loss's lm_head GEMMs in FP8
            self.head_w = fp8.HeadFP8(self.head_w)
        params = list(self.drafter.parameters())
        self.params = params
        self.opt = make_optimizer(self.drafter, c.cfg.LR, c.cfg.WEIGHT_DECAY, overlap=overlap)
        self.autocast = autocast_for(c.device, c.dtype)
        self.step_w = torch.zeros(1, device=c.device, dtype=torch.float64)
        self.sums = None          # the last step's MicroBatchSums, on the device (read after the timing only)

    def step(self, item, probe=None, saved_hooks=None):
        """The trainer's step for one drafter rank, GRAD_ACCUM=1: train_dflash.drafter_step + optimizer_step."""
        sums = self.sums = drafter_step(self.drafter, self.embed, self.head_w, item, self.c.dcfg.block_size,
                                        self.autocast, self.c.cfg, probe=probe, saved_hooks=saved_hooks)
        self.step_w += sums.objective_w
        optimizer_step(self.params, self.opt, self.step_w, self.c.cfg.GRAD_CLIP)
        if probe:
            probe("optimizer")


class SavedBytes:
    """saved_tensors_hooks that add up what autograd keeps for backward, per storage, split into bf16 copies of
    weights and activations; parameters, the frozen tensors and the received features are not counted."""

    def __init__(self, rig, item):
        self.skip = {t.untyped_storage().data_ptr() for t in
                     [*rig.params, rig.embed.weight, getattr(rig.head_w, "weight", rig.head_w), item.features]}
        self.wshapes = {tuple(p.shape) for p in rig.params if p.dim() == 2}
        self.wshapes |= {s[::-1] for s in self.wshapes}
        self.seen = {}

    def pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            copy = t.dtype != torch.float32 and tuple(t.shape) in self.wshapes
            self.seen[ptr] = ("weight copies" if copy else "activations", st.nbytes())
        return t

    def totals(self):
        out = {"weight copies": 0, "activations": 0}
        for kind, n in self.seen.values():
            out[kind] += n
        return out

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


_FEATURES: dict = {}


def synthetic_features(c, T):
    """[T, K*H] random features, a fresh buffer like a received one (the queue's memory stays the trainer's), copied
    from one pool drawn once per process: drawing fresh ones per micro-batch put RNG kernels on the GPU inside the
    timed step (BENCHMARKS.md, Other figures), where a drafter rank only receives (a copy's worth of memory
    traffic)."""
    width = c.dcfg.num_taps * c.sizes.H
    key = (str(c.device), c.dtype, width)
    pool = _FEATURES.get(key)
    if pool is None or pool.shape[0] < T:
        g = torch.Generator(device=c.device).manual_seed(1234)
        pool = _FEATURES[key] = torch.randn(max(T, c.cfg.TOKEN_BUDGET), width, device=c.device, dtype=c.dtype,
                                            generator=g)
    return pool[:T].clone()


def packet_anchors(lengths, loss_mask, g, s):
    """(doc_ids, positions, anchors) of micro-batch g as model.objective.prepare draws them (same seed)."""
    doc_ids, positions = pack(lengths)
    anchors = sample_anchors(loss_mask, doc_ids, s.MAX_ANCHORS, torch.Generator().manual_seed(micro_seed(s.SEED, g)),
                             s.MIN_ANCHORS_PER_DOC)
    return doc_ids, positions, anchors


def synthetic_packet(c, lengths, g):
    """What a drafter rank receives for micro-batch g of these sequence lengths: tokens packed, random features."""
    ids, mask, attn, n = make_batch(lengths, c.sizes.V, c.mask_id, g)
    keep = attn.bool()
    return Packet(g, n, ids[keep], mask[keep], synthetic_features(c, int(n.sum())))


def bench_drafter(args, c) -> dict:
    if args.switch_interval:   # how often the feeder thread must hand the GIL back to the main (launching) thread
        sys.setswitchinterval(args.switch_interval)
    t0 = time.time()
    rig = DrafterRig(c, args.seed, args.compile_drafter, args.ce_kernel, bool(args.overlap_optimizer),
                     args.drafter_fp8, args.drafter_fp8_recipe, args.head_fp8)
    build_s = time.time() - t0
    compile_s = 0.0
    if c.flex:   # the trainer's order: compile on the main thread before the receiver thread starts
        t0 = time.time()
        warmup_flex_attention(c.device, c.dtype, c.dcfg.num_attention_heads, c.dcfg.num_key_value_heads,
                              c.dcfg.head_dim, c.dcfg.block_size,
                              mask_lengths(c.dcfg, c.device, c.flex, c.cfg))
        compile_s = time.time() - t0
    lens = batch_lengths(args, 64)
    feeder = synthetic_feed(c, lens)
    feeder.start()
    try:
        t0 = time.time()
        for _ in range(args.warmup if args.compile_drafter == "off" else max(args.warmup, 3)):   # 2 shapes compile
            rig.step(feeder.get())
        warmup_s = time.time() - t0
        c.reset_peak()
        timer, waited, items = Timer(c.device), 0.0, []
        timer.start()
        for _ in range(args.steps):
            w = time.perf_counter()
            item = feeder.get()
            waited += time.perf_counter() - w
            rig.step(item)
            items.append((item.g, item.lengths, item.loss_mask, item.tokens, item.num_blocks, item.rows.numel()))
            del item
        rig.opt.wait_all()      # the last step's overlapped update is inside the timed span
        dt = timer.stop()
        peak = c.peak_mem()
        arch = arch_figures(rig)
        phases, saved = instrumented_step(rig, feeder, c)
        prof = profile(args.profile, lambda: rig.step(feeder.get()), c, trace=args.trace)
    finally:
        feeder.stop()
    B, L, K = c.dcfg.block_size, c.dcfg.num_hidden_layers, c.dcfg.num_taps
    flops, samples, tokens = {}, 0, 0
    for g, n, loss_mask, T, N, R in items:
        _, positions, anchors = packet_anchors(n, loss_mask, g, c.cfg)
        assert len(anchors) == N, "anchor draw differs from make_prepare's"
        f = drafter_flops(c.sizes, L, K, T, N * B, R, visible_pairs(positions, anchors, B), c.dcfg)
        flops = {k: flops.get(k, 0) + v for k, v in f.items()}
        samples += len(n)
        tokens += T
    steps = len(items)
    blocks = sum(i[4] for i in items)
    out = {**arch, "build_s": build_s, "flex_compile_s": compile_s, "warmup_s": warmup_s, "steps": steps,
           "seconds": dt, "ms_per_step": 1e3 * dt / steps, "samples_s": samples / dt, "tok_s": tokens / dt,
           "anchors_per_step": blocks / steps, "blocks_per_1k_tokens": 1e3 * blocks / tokens,
           "blocks_per_sequence": blocks / samples,
           "supervised_rows_per_step": sum(i[5] for i in items) / steps,
           "tflops": flops["total"] / dt / 1e12, "tflop_per_step": {k: v / steps / 1e12 for k, v in flops.items()},
           "prepare_ms": 1e3 * sum(feeder.prepare_s) / max(1, len(feeder.prepare_s)),
           "prepare_cpu_ms": 1e3 * sum(feeder.prepare_cpu_s) / max(1, len(feeder.prepare_cpu_s)),
           "prepare_med_ms": 1e3 * _median(feeder.prepare_s), "prepare_cpu_med_ms": 1e3 * _median(feeder.prepare_cpu_s),
           "queue_wait_ms": 1e3 * waited / steps, "peak_mem_bytes": peak, "phases": phases, "saved_bytes": saved,
           "compile_drafter": args.compile_drafter, "fp8": args.drafter_fp8 and args.drafter_fp8_recipe,
           "head_fp8": args.head_fp8, "ce_kernel": args.ce_kernel,
           "overlap_optimizer": bool(rig.opt.overlap),
           "profile": prof}
    out.update(c.mfu(out["tflops"]))
    del rig, feeder
    c.free()
    return out


def arch_figures(rig) -> dict:
    """What tells the drafters apart in a result: the arch, its parameters, and the last timed step's figures of the
    arch's own metrics as the trainer's status line shows them (Arch.status; DFlash2's sel_recall, sel_acc,
    sel_streak: proof that its loss ran), None for an arch without any."""
    a = ARCHS[rig.drafter.arch]
    shown = a.status({k: float(v) for k, v in rig.sums.arch_sums(a.metrics).items()})
    return {"arch": rig.drafter.arch, "drafter_params": sum(p.numel() for p in rig.params),
            "arch_metrics": {name: v for name, (v, _) in shown.items()} or None}


# --- (b') flex_attention kernel options at the drafter's mask ------------------------------------------------------

FLEX_CANDIDATES = {   # name -> kernel_options (None: torch's defaults for this GPU, head_dim and dtype)
    "default": None,
    "USE_TMA": {"USE_TMA": True},
    "USE_TMA + ROWS_GUARANTEED_SAFE": {"USE_TMA": True, "ROWS_GUARANTEED_SAFE": True},
    "fwd 128x128 w8 s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "bwd 64/64 w4 s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 64/128 w8 s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                         "bwd_num_warps": 8, "bwd_num_stages": 2},
}


def doc_mask_mod_twin(bm, packet, c):
    """bm's tiles with the document-compare mask_mod (model.attention.dflash_mask_mod, tensors padded as the trainer
    padded them before interval_mask_mod): what the mask_mod's own cost is inside the partial tiles."""
    B = c.dcfg.block_size
    q_len, kv_len = bm.seq_lengths
    ctx_doc, _, a_idx = packet_anchors(packet.lengths, packet.loss_mask, packet.g, c.cfg)
    T, N = ctx_doc.shape[0], a_idx.shape[0]
    n_pad = -(-q_len // B) - N
    i32 = lambda x: to_device(torch.tensor(x, dtype=torch.int32), c.device)   # noqa: E731
    mod = dflash_mask_mod(to_device(F.pad(a_idx, (0, n_pad)), c.device),
                          to_device(F.pad(ctx_doc[a_idx], (0, n_pad), value=-2), c.device),
                          to_device(F.pad(ctx_doc, (0, kv_len - T), value=-1), c.device), i32(T), B, i32(N))
    return BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mod, seq_lengths=bm.seq_lengths)


def bench_flex(args, c) -> dict:
    """One drafter layer's flex_attention, forward and forward + backward, on the real mask of a bench micro-batch
    (the trainer's prepare), for each kernel_options candidate (--flex-options: only that one, against the
    default). Each candidate compiles its own kernels (~10-30 s)."""
    if not c.flex:
        raise SystemExit("--mode flex needs a GPU: flex_attention has no backward on the CPU")
    cands = dict(FLEX_CANDIDATES) if not args.flex_options else \
        {"default": None, "given": json.loads(args.flex_options)}
    if args.flex_variants:   # the ways the step's call differs from the standalone one, one at a time
        cands = {"default": None, "dynamic shapes + IS_DIVISIBLE (the compiled layer's call)": "dynamic",
                 "q/k/v strided as in the layer ([1, S, H, D].transpose(1, 2))": "strided",
                 "the same tiles with the document mask_mod (dflash_mask_mod, before interval_mask_mod)": "docmod"}
    packet = synthetic_packet(c, batch_lengths(args, 1)[0], 0)
    item = make_prepare(c.dcfg, c.device, c.flex, c.cfg)(packet)
    bm = item.attn.full
    q_len, kv_len = bm.seq_lengths
    nh, nkv, D, B = c.dcfg.num_attention_heads, c.dcfg.num_key_value_heads, c.dcfg.head_dim, c.dcfg.block_size
    a_pos = item.block_pos.view(-1, B)[:, 0].cpu()           # each anchor's position inside its document
    pairs = int(B * (a_pos + B).sum())                         # = visible_pairs
    fwd_flop = 4 * nh * D * pairs
    g = torch.Generator(device=c.device).manual_seed(0)
    q = torch.randn(1, nh, q_len, D, device=c.device, dtype=c.dtype, generator=g).requires_grad_()
    k = torch.randn(1, nkv, kv_len, D, device=c.device, dtype=c.dtype, generator=g).requires_grad_()
    v = torch.randn(1, nkv, kv_len, D, device=c.device, dtype=c.dtype, generator=g).requires_grad_()
    dout = torch.randn(1, nh, q_len, D, device=c.device, dtype=c.dtype, generator=g)
    rows, ref = [], None
    for name, opts in cands.items():
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=opts == "dynamic")
        q, k, v = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() if opts == "strided"
                   else x.detach().contiguous().requires_grad_() for x in (q, k, v))
        if opts == "dynamic":
            opts = flex_kernel_options(q_len, kv_len, True)
        elif opts == "strided":
            opts = None
        mask = bm
        if opts == "docmod":
            mask, opts = doc_mask_mod_twin(bm, packet, c), None
        t0 = time.time()
        try:
            out = fn(q, k, v, block_mask=mask, enable_gqa=nh != nkv, kernel_options=opts)
            out.backward(dout)
            c.sync()
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot run is a result, not the end of the sweep
            rows.append({"name": name, "options": opts, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"flex {name}: {rows[-1]['error']}", flush=True)
            continue
        compile_s = time.time() - t0
        grads = [x.grad.float().clone() for x in (q, k, v)]
        got = [out.detach().float()] + grads
        if ref is None:
            ref = got
        err = max(float((a - b).abs().max()) for a, b in zip(got, ref))
        times = {}
        for phase in ("fwd", "fwd+bwd"):
            for _ in range(2):
                o = fn(q, k, v, block_mask=mask, enable_gqa=nh != nkv, kernel_options=opts)
                if phase == "fwd+bwd":
                    o.backward(dout)
            timer = Timer(c.device)
            timer.start()
            for _ in range(args.steps):
                o = fn(q, k, v, block_mask=mask, enable_gqa=nh != nkv, kernel_options=opts)
                if phase == "fwd+bwd":
                    o.backward(dout)
            times[phase] = timer.stop() / args.steps
            for x in (q, k, v):
                x.grad = None
        bwd = times["fwd+bwd"] - times["fwd"]
        rows.append({"name": name, "options": opts, "compile_s": compile_s, "fwd_ms": 1e3 * times["fwd"],
                     "bwd_ms": 1e3 * bwd, "fwd_tflops": fwd_flop / times["fwd"] / 1e12,
                     "bwd_tflops": 2 * fwd_flop / bwd / 1e12, "max_abs_diff_vs_default": err})
        r = rows[-1]
        print(f"flex {name}: fwd {r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.0f} TFLOP/s), bwd {r['bwd_ms']:.3f} ms "
              f"({r['bwd_tflops']:.0f} TFLOP/s), compile {compile_s:.0f} s, max |diff| vs default {err:.3g}",
              flush=True)
    torch._dynamo.reset()
    return {"q_len": q_len, "kv_len": kv_len, "visible_pairs": pairs, "heads": [nh, nkv, D], "rows": rows}


def bench_ce(args, c) -> dict:
    """The CE epilogue alone on one [CE_CHUNK, V] chunk of bf16 logits, per kernel: ms, the bandwidth of its
    minimum traffic (one read and one write of the chunk), and its largest difference from the eager epilogue."""
    rows_n, V = c.cfg.CE_CHUNK, c.sizes.V
    g = torch.Generator(device=c.device).manual_seed(0)
    logits = (torch.randn(rows_n, V, device=c.device, generator=g) * 2).to(c.dtype)
    y = torch.randint(0, V, (rows_n,), device=c.device, generator=g)
    w = torch.rand(rows_n, device=c.device, generator=g)
    kernels = {"eager": objective._eager_epilogue}
    if ce_kernel.available(logits):
        kernels["triton"] = ce_kernel.ce_epilogue
        for block, warps in ((4096, 8), (1024, 4), (2048, 8)):   # the kernel's block / warps, against its default
            kernels[f"triton {block}/{warps}"] = functools.partial(ce_kernel.ce_epilogue, block=block, num_warps=warps)
    ref = objective._eager_epilogue(logits.clone(), y, w, True)
    out = {"rows": rows_n, "vocab": V, "kernels": {}}
    for name, fn in kernels.items():
        got = fn(logits.clone(), y, w, True)
        diff = max(float((got[0] - ref[0]).abs().max()), float((got[2].float() - ref[2].float()).abs().max()))
        same_argmax = bool(torch.equal(got[1], ref[1]))
        buf = logits.clone()
        for _ in range(3):
            fn(buf, y, w, True)
        timer = Timer(c.device)
        timer.start()
        for _ in range(args.steps):
            fn(buf, y, w, True)
        ms = 1e3 * timer.stop() / args.steps
        out["kernels"][name] = {"ms": ms, "gb_s": 2 * logits.numel() * logits.element_size() / ms / 1e6,
                                "max_abs_diff_vs_eager": diff, "same_argmax": same_argmax}
        print(f"CE epilogue {name}: {ms:.3f} ms per [{rows_n}, {V}] chunk, max |diff| vs eager {diff:.3g}", flush=True)
    return out


def _median(xs):
    return float(torch.tensor(xs, dtype=torch.float64).median()) if xs else float("nan")


def instrumented_step(rig, feeder, c):
    """One more step with the queue full. GPU: memory allocated at each phase boundary and the peak inside each
    phase. CPU: what autograd saves (saved_tensors_hooks; not on the GPU, where active hooks would recompile the
    compiled flex_attention)."""
    item = feeder.get()
    end = time.time() + 30
    while not feeder.q.full() and time.time() < end:     # steady state: Q_HS waiting + one prepared + this one
        time.sleep(0.05)
    time.sleep(0.2)
    cuda = c.device.type == "cuda"
    saved = SavedBytes(rig, item)
    phases = {}

    def probe(name):
        torch.cuda.synchronize()
        phases[name] = {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}
        torch.cuda.reset_peak_memory_stats()
    if cuda:
        probe("before step")
        rig.step(item, probe)
    else:
        rig.step(item, saved_hooks=saved.hooks())
    return phases, (None if cuda else saved.totals())


# --- (c, e) pipeline --------------------------------------------------------------------------------------------------

class _Watch:
    """The part of trainer.watchdog.Watchdog that pipe.Sender and pipe.receive use."""
    state = recv_state = ""

    def progress(self):
        pass

    def fail(self, reason, detail=""):
        print(detail, file=sys.stderr, flush=True)
        print(f"ABORT: {reason}", flush=True)
        os._exit(1)


class _Arrived:
    """Transport-only prepare(): the packet as it arrived."""

    def __init__(self, p):
        self.p, self.features, self.tokens, self.g = p, p.features, p.num_tokens, p.g

    def device_tensors(self):
        return [self.features]


def pipeline_commands(args) -> list[str]:
    """The pipeline's commands at this shape and arch: the bench under torchrun, and train_dflash.py itself (a
    DFlash2 drafter's results and run folder named for it)."""
    shape = f"--shape {args.shape} --seq {args.seq} --batch {args.batch} --anchors {args.anchors} " \
            f"--block {args.block} --layers {args.layers}" + (" --mixed" if args.mixed else "")
    knobs = {name: getattr(args, name.lower()) for name in ARCH_FLAGS if getattr(args, name.lower()) is not None}
    arch = sfx = trainer_arch = ""
    if args.arch != "dflash":
        arch = f" --arch {args.arch}" + "".join(f" {ARCH_FLAGS[name]} {v}" for name, v in knobs.items())
        sfx = f"_{args.arch}"
        trainer_arch = f"--DRAFTER_ARCH={args.arch} " + "".join(f"--{name}={v} " for name, v in knobs.items())
    env = "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    tr = f"{env}torchrun --standalone --nproc-per-node 2 -m bench.bench_dflash --mode pipeline {shape}{arch} --steps 20"
    assets = ASSETS_DIR
    return [f"{tr} --json pipeline_transport{sfx}.json",
            f"{tr} --pipe-compute --json pipeline_compute{sfx}.json",
            f"python -m bench.bench_dflash --write-assets {assets} {shape} && {env}torchrun --standalone "
            f"--nproc-per-node 2 train_dflash.py --TARGET={assets}/target --DATA={assets}/data "
            f"--MASK_TOKEN_ID={SHAPES[args.shape][-1]} --TARGET_RANKS=1 --NUM_DRAFT_LAYERS={args.layers} "
            f"--BLOCK_SIZE={args.block} --MAX_ANCHORS={args.anchors} --TOKEN_BUDGET={args.batch * args.seq} "
            f"{trainer_arch}--MAX_STEPS=60 --LOG_EVERY=10 --SAVE_EVERY=1000000 --KEEP_LAST=1 "
            f"--OUT_DIR=runs/bench_pipeline{sfx} --RESUME=scratch"]


def bench_pipeline(args, c) -> dict:
    """World size 1: the commands. Under torchrun with 2 ranks: rank 0 produces (the target forward with
    --pipe-compute, else a ready feature tensor) through pipe.Sender, rank 1 consumes through pipe.receive and a
    Prefetcher (the drafter step with --pipe-compute)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return {"commands": pipeline_commands(args)}
    if world != 2:
        sys.exit(f"error: --mode pipeline runs on exactly 2 ranks (torchrun --nproc-per-node 2), got {world}")
    cuda = c.device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", device_id=c.device if cuda else None)
    rank, data, ctrl = dist.get_rank(), dist.group.WORLD, dist.new_group(backend="gloo")
    n = args.warmup + args.steps
    lens = batch_lengths(args, n)
    K, H = c.dcfg.num_taps, c.sizes.H
    out = {"compute": bool(args.pipe_compute), "micro_batches": args.steps}
    watch = _Watch()
    if rank == 0:
        target = build_target(c.hf, c.dcfg.target_layer_ids, c.device, c.dtype, args.target_attn, args.compile,
                              args.seed) if args.pipe_compute else None
        ready = None if target else torch.randn(args.batch * args.seq, K * H, device=c.device, dtype=c.dtype)
        sender = Sender(ctrl, data, c.cfg.SEND_DEPTH, watch)
        sender.start()
        dist.barrier(group=ctrl)                       # both sides built (compiles done) before the clock starts
        c.reset_peak()
        t0 = None
        for g in range(n):
            if g == args.warmup:
                t0 = time.perf_counter()
            ids, mask, attn, ln = make_batch(lens[g], c.sizes.V, c.mask_id, g)
            keep = attn.bool()
            if cuda:                                   # pipe.produce pins its batches
                ids, attn = ids.pin_memory(), attn.pin_memory()
            feats = target_features(target, ids, attn, c.device) if target else ready[:int(ln.sum())]
            sender.put(1, Packet(g, ln, ids[keep], mask[keep], feats))
        while sender.sent < n:
            time.sleep(0.001)
        out["producer_mb_s"] = args.steps / (time.perf_counter() - t0)
        out["target_peak_mem_bytes"] = c.peak_mem()
    else:
        rig = DrafterRig(c, args.seed, args.compile_drafter) if args.pipe_compute else None
        if rig and c.flex:
            warmup_flex_attention(c.device, c.dtype, c.dcfg.num_attention_heads, c.dcfg.num_key_value_heads,
                                  c.dcfg.head_dim, c.dcfg.block_size,
                                  mask_lengths(c.dcfg, c.device, c.flex, c.cfg))
        prepare = make_prepare(c.dcfg, c.device, c.flex, c.cfg) if rig else _Arrived
        receiver = Prefetcher(receive(((g, 0) for g in range(n)), ctrl, data, c.device, watch), prepare, c.device,
                              c.cfg.Q_HS, name="receiver", fail=watch.fail)
        dist.barrier(group=ctrl)
        receiver.start()
        nbytes = tokens = samples = 0
        timer = Timer(c.device)
        for g in range(n):
            if g == args.warmup:
                c.reset_peak()
                timer.start()
            item = receiver.get()
            if rig:
                rig.step(item)
            if g >= args.warmup:
                nbytes += item.features.numel() * item.features.element_size()
                tokens += item.tokens
                samples += len(lens[g])
        dt = timer.stop()
        out.update(seconds=dt, mb_s=args.steps / dt, feature_gb_s=nbytes / dt / 1e9, tok_s=tokens / dt,
                   samples_s=samples / dt, feature_mb_per_micro_batch=nbytes / args.steps / 1e6,
                   drafter_peak_mem_bytes=c.peak_mem())
    parts = [None, None]
    dist.all_gather_object(parts, out, group=ctrl)
    dist.barrier(group=ctrl)
    dist.destroy_process_group()
    merged = {**parts[1], "producer_mb_s": parts[0]["producer_mb_s"],
              "target_peak_mem_bytes": parts[0]["target_peak_mem_bytes"], "rank": rank}
    return merged


# --- assets for running train_dflash.py itself at a bench shape ---------------------------------------------------

def write_assets(args, c, out: Path, rows: int = 512) -> dict:
    """The one thing that writes files (--write-assets DIR): a random target of the shape as an HF folder (config +
    safetensors, no tokenizer: pass MASK_TOKEN_ID) and a synthetic prepared dataset of `rows` sequences in the
    Arrow layout data.loader.read_arrow_dataset reads (lengths: seq, or uniform in [min_len, seq] with --mixed), so
    the trainer's pipeline can be measured at the bench shape without weights or data."""
    out.mkdir(parents=True, exist_ok=True)
    target = build_target(c.hf, c.dcfg.target_layer_ids, c.device, c.dtype, seed=args.seed)
    target.model.save_pretrained(out / "target", max_shard_size="5GB")
    del target
    c.free()
    gen = torch.Generator().manual_seed(args.seed)
    lens = [args.seq] * rows if not args.mixed else \
        torch.randint(args.min_len, args.seq + 1, (rows,), generator=gen).tolist()
    ids, masks = [], []
    for i, n in enumerate(lens):
        b_ids, b_mask, _, _ = make_batch([n], c.sizes.V, c.mask_id, args.seed * 1_000_003 + i)
        ids.append(b_ids[0].to(torch.int32).tolist())
        masks.append(b_mask[0].tolist())
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                      "loss_mask": pa.array(masks, type=pa.list_(pa.uint8()))})
    data = out / "data"
    data.mkdir(exist_ok=True)
    with pa.OSFile(str(data / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (data / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return {"target": str(out / "target"), "data": str(data), "rows": rows, "tokens": sum(lens),
            "mask_token_id": c.mask_id}


# --- report -----------------------------------------------------------------------------------------------------------

def _k(x):
    return planner._k(x)


def _gib(b):
    return "n/a" if b is None else planner.fmt_gib(b)


def work_density(anchors, batch, seq) -> str:
    """The drafter's work per token, which every throughput figure must be read at, in both units (train_dflash.py's
    MAX_ANCHORS comment)."""
    return f"{1e3 * anchors / (batch * seq):.0f} blocks/1K tok = SpecForge num_anchors {anchors / batch:.0f}/seq"


def report(res, c) -> str:
    """The markdown report: the run's header, one table of every role's figures, then the memory and kernel
    sections of the modes that ran."""
    a = res["args"]
    work = work_density(a["anchors"], a["batch"], a["seq"])
    est = res["plan"]["roles"]
    t, d, p = res.get("target"), res.get("drafter"), res.get("pipeline")
    rows = [*_target_rows(t, est), *_drafter_rows(d, est), *_pipeline_rows(p, work),
            *_split_rows(t, d, work)]
    rows += [(role, "ERROR", res[role]["error"]) for role in ("target", "drafter", "pipeline")
             if res.get(role, {}).get("error")]
    lines = [*_report_header(res, c, work), "", "| role | metric | value |", "|---|---|---|",
             *(f"| {role} | {metric} | {value} |" for role, metric, value in rows)]
    lines += _drafter_phase_table(d, est)
    lines += _memory_terms(res, p)
    lines += _ce_table(res.get("ce"))
    lines += _flex_table(res.get("flex"))
    if res.get("commands"):
        lines += ["", "(c) pipeline commands: the bench's synthetic pipeline (transport only, then target forward + "
                      "drafter step), and train_dflash.py itself on a random target and synthetic data of this shape:"]
        lines += [f"    {x}" for x in res["commands"]]
    return "\n".join(lines)


def arch_knobs(c) -> dict:
    """The settings of c that shape its arch's drafter and loss beyond DFlash's (arch_settings; none for
    DFlash)."""
    return {name: getattr(c, name) for name in arch_settings(c.DRAFTER_ARCH)}


def arch_label(c) -> str:
    """The drafter arch as the report's header names it: "dflash", or "dflash2 (--conv-kernel-size 2
    --conv-group-size 16 --selector-rank 256 --selector-top-k 16 --selector-alpha 1)"."""
    knobs = " ".join(f"{ARCH_FLAGS[name]} {v:g}" for name, v in arch_knobs(c).items())
    return f"{c.DRAFTER_ARCH} ({knobs})" if knobs else c.DRAFTER_ARCH


def _report_header(res, c, work) -> list[str]:
    """The shape, the drafter (its arch first), the software and the matmul peak the MFU figures are read
    against."""
    a = res["args"]
    return [f"## DFlash bench: {a['shape']}, {a['batch']} x {a['seq']} tokens "
            f"({'mixed ' + str(a['min_len']) + '..' + str(a['seq']) if a['mixed'] else 'fixed'}), drafter "
            f"{arch_label(c.cfg)} L={a['layers']} B={a['block']} anchors={a['anchors']} ({work}) "
            f"taps={c.dcfg.target_layer_ids}",
            f"{res['env']['device']}, torch {res['env']['torch']}, transformers {res['env']['transformers']}, "
            f"{str(c.dtype).removeprefix('torch.')}, drafter attention {'flex' if c.flex else 'sdpa'}"
            + (f"; matmul peak {res['peak_tflops']:.4g} TFLOP/s measured ({DATASHEET_TFLOPS:g} datasheet)"
               if res.get("peak_tflops") else "")]


def _target_rows(t, est) -> list[tuple]:
    """(role, metric, value) rows of (a), the target's capacity against its estimate in `est` (the plan's
    roles); none when it did not run or failed."""
    if not t or "error" in t:
        return []
    return [("target", "tokens/s (real / padded)", f"{_k(t['tok_s'])} / {_k(t['padded_tok_s'])}"),
            ("target", "ms per micro-batch", f"{t['ms_per_micro_batch']:.1f}"),
            ("target", "TFLOP/s; MFU vs measured / datasheet peak",
             f"{t['tflops']:.4g}; {t['mfu_measured']:.1%} / {t['mfu_datasheet']:.1%}"),
            ("target", "peak GiB measured / estimate (estimate/measured)", _vs(t["peak_mem_bytes"], est["target"])),
            ("target", "attention, compiled layers, build s", f"{t['attn_implementation']}, {t['compiled']}, "
                                                              f"{t['build_s']:.1f}")]


def _drafter_rows(d, est) -> list[tuple]:
    """(role, metric, value) rows of (b), the drafter's capacity; none when it did not run or failed."""
    if not d or "error" in d:
        return []
    est = est["drafter"]
    rows = [("drafter", "samples/s; context tokens/s (blocks per 1K tokens, per sequence)",
             f"{d['samples_s']:.2f}; {_k(d['tok_s'])} ({d['blocks_per_1k_tokens']:.0f}, "
             f"{d['blocks_per_sequence']:.0f})"),
            ("drafter", "ms per step (anchors, supervised rows)",
             f"{d['ms_per_step']:.1f} ({d['anchors_per_step']:.0f}, {d['supervised_rows_per_step']:.0f})"),
            ("drafter", "TFLOP/s; MFU vs measured / datasheet peak",
             f"{d['tflops']:.4g}; {d['mfu_measured']:.1%} / {d['mfu_datasheet']:.1%}"),
            ("drafter", "TFLOP per step: " + " / ".join(k for k in d["tflop_per_step"] if k != "total"),
             " / ".join(f"{v:.4g}" for k, v in d["tflop_per_step"].items() if k != "total")
             + f" (total {d['tflop_per_step']['total']:.4g})"),
            ("drafter", "prepare ms on the feeder thread, wall (median) / its CPU time (median); main thread queue "
                        "wait ms per step", f"{d['prepare_ms']:.1f} ({d['prepare_med_ms']:.1f}) / "
                                            f"{d['prepare_cpu_ms']:.1f} ({d['prepare_cpu_med_ms']:.1f}); "
                                            f"{d['queue_wait_ms']:.1f}"),
            ("drafter", "peak GiB measured / estimate (estimate/measured)", _vs(d["peak_mem_bytes"], est))]
    if d["saved_bytes"]:
        rows.append(("drafter", "saved for backward GiB: activations, bf16 weight copies (measured / estimate)",
                     f"{_gib(d['saved_bytes']['activations'])} / {_gib(_est_acts(est))}, "
                     f"{_gib(d['saved_bytes']['weight copies'])} / {_gib(_est_term(est, 'bf16 copies'))}"))
    rows.append(("drafter", "COMPILE_DRAFTER, CE kernel, optimizer overlapped, flex compile s, build s, warmup s",
                 f"{d['compile_drafter']}, {d['ce_kernel']}, {d.get('overlap_optimizer')}, "
                 f"{d['flex_compile_s']:.1f}, {d['build_s']:.1f}, {d['warmup_s']:.1f}"))
    return rows


def _pipeline_rows(p, work) -> list[tuple]:
    """(role, metric, value) rows of (c), the pipeline this process measured; none when it only printed the
    commands, did not run or failed."""
    if not p or "error" in p or "commands" in p:
        return []
    return [("pipeline", "micro-batches/s consumer (producer)", f"{p['mb_s']:.2f} ({p['producer_mb_s']:.2f})"),
            ("pipeline", "features GB/s, MB per micro-batch", f"{p['feature_gb_s']:.1f}, "
                                                              f"{p['feature_mb_per_micro_batch']:.0f}"),
            ("pipeline", "samples/s; tokens/s" + (f" (target fwd + drafter step, {work})" if p["compute"] else
                                                  " (transport only)"), f"{p['samples_s']:.2f}; {_k(p['tok_s'])}")]


def _split_rows(t, d, work) -> list[tuple]:
    """(role, metric, value) rows of planner.recommend_split on 2, 4 and 8 GPUs from the measured target and
    drafter rates; none unless both ran."""
    if not (t and d and "error" not in t and "error" not in d):
        return []
    per_sample = d["tok_s"] / d["samples_s"]
    rows = []
    for n in (2, 4, 8):
        nt, nd = planner.recommend_split(t["tok_s"], d["tok_s"], n)
        rate = planner.split_rate(nt, nd, t["tok_s"], d["tok_s"])
        rows.append(("split", f"{n} GPUs: planner.recommend_split from these rates ({work})",
                     f"{nt} target : {nd} drafter => {_k(rate)} tok/s, {_k(rate / n)} tok/s = "
                     f"{rate / n / per_sample:.2f} samples/s per GPU"))
    return rows


def _drafter_phase_table(d, est) -> list[str]:
    """The drafter's memory at the end of each phase of one step, beside the planner terms it should match."""
    if not (d and "error" not in d and d["phases"]):
        return []
    e = est["drafter"]
    fwd = {t["short"]: t["bytes"] for t in e["terms"] if t["phases"] != "static" and "forward" in t["phases"]}
    grads = _est_term(e, "grads")
    guess = {"before step": (e["static"], "allocated: static terms"),
             "forward": (e["static"] + sum(v for k, v in fwd.items() if not k.startswith("CE")),
                         "allocated: static + bf16 copies + activations"),
             "CE": (e["static"] + e["phases"]["forward"], "peak: static + forward phase (the role's peak)"),
             "backward": (e["static"] + grads, "allocated: static + gradients (autocast copies freed)")}
    lines = ["", "drafter memory through one step (GiB), measured against the planner's terms:",
             "| phase | allocated at its end | peak inside | estimate | compare with |",
             "|---|---:|---:|---:|---|"]
    for name, ph in d["phases"].items():
        g, what = guess.get(name, (None, ""))
        lines.append(f"| {name} | {_gib(ph['allocated'])} | {_gib(ph['peak'])} | "
                     f"{_gib(g) if g is not None else ''} | {what} |")
    return lines


def _memory_terms(res, p) -> list[str]:
    """The planner's estimate term by term beside the peaks measured (by the roles, or by the pipeline's ranks when
    they ran the real roles), and whether it fits this GPU."""
    measured = {r: res[r]["peak_mem_bytes"] for r in ("target", "drafter")
                if res.get(r) and "error" not in res[r] and res[r].get("peak_mem_bytes")}
    if p and p.get("compute") and "error" not in p:     # the pipeline's ranks ran the real roles
        for r in ("target", "drafter"):
            measured.setdefault(r, p.get(f"{r}_peak_mem_bytes"))
    lines = ["", "memory estimate, term by term (trainer/planner.py; calibrate its constants against the measured "
                 "rows):", planner.format_terms(res["plan_full"], measured)]
    gpu_mem = res["env"]["gpu_mem_bytes"]
    if gpu_mem:
        errs = planner.check_fits(res["plan_full"], gpu_mem)
        lines.append("planner.check_fits on this GPU: " + ("fits" if not errs else "; ".join(errs)))
    return lines


def _ce_table(ce) -> list[str]:
    """(b'') the CE epilogue kernels on one chunk of logits, when --mode ce ran."""
    if not ce or "error" in ce:
        return []
    lines = ["", f"(b'') the CE epilogue alone, one [{ce['rows']}, {ce['vocab']}] chunk of logits",
             "| kernel | ms | GB/s of one read + one write | max abs diff vs eager | argmax == eager's |",
             "|---|---:|---:|---:|---|"]
    for name, r in ce["kernels"].items():
        lines.append(f"| {name} | {r['ms']:.3f} | {r['gb_s']:.0f} | {r['max_abs_diff_vs_eager']:.3g} | "
                     f"{r['same_argmax']} |")
    return lines


def _flex_table(fx) -> list[str]:
    """(b') flex_attention's kernel options on the bench mask, when --mode flex ran."""
    if not fx or "error" in fx:
        return []
    lines = ["", f"(b') one drafter layer's flex_attention on the bench mask: q {fx['q_len']}, kv {fx['kv_len']}, "
                 f"heads/kv heads/dim {fx['heads']}, {fx['visible_pairs']:,} visible pairs; TFLOP/s on those "
                 "pairs (backward = 2x forward FLOPs)",
             "| kernel_options | fwd ms (TFLOP/s) | bwd ms (TFLOP/s) | compile s | max abs diff vs default |",
             "|---|---:|---:|---:|---:|"]
    for r in fx["rows"]:
        label = f"{r['name']}: `{json.dumps(r['options'])}`"
        lines.append(f"| {label} | error: {r['error']} | | | |" if "error" in r else
                     f"| {label} | {r['fwd_ms']:.3f} ({r['fwd_tflops']:.0f}) | {r['bwd_ms']:.3f} "
                     f"({r['bwd_tflops']:.0f}) | {r['compile_s']:.0f} | {r['max_abs_diff_vs_default']:.3g} |")
    return lines


def _est_term(role, short):
    return sum(t["bytes"] for t in role["terms"] if t["short"] == short)


def _est_acts(role):
    """The activation terms (the arch's own included: zero for DFlash) that saved_bytes' activations measure."""
    return sum(_est_term(role, s) for s in ("block acts", "kv acts", "ctx+out acts", "CE rows", "arch acts",
                                            "arch loss"))


def _vs(measured, role_est):
    if not measured:
        return f"n/a / {_gib(role_est['total'])}"
    return f"{_gib(measured)} / {_gib(role_est['total'])} ({role_est['total'] / measured:.3f})"


# --- main -------------------------------------------------------------------------------------------------------------

class Context:
    """Device, dtype, shapes and the trainer's settings for this run."""

    def __init__(self, args):
        cuda = torch.cuda.is_available() and not args.cpu
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local)
        self.device = torch.device("cuda", local) if cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if cuda else torch.float32       # train_dflash's DTYPE=auto
        self.flex = cuda                                              # train_dflash's ATTN=auto
        # the trainer's settings (its constants' defaults), with those that shape a micro-batch set as given
        given = {name: getattr(args, name.lower()) for name in ("CE_CHUNK", "Q_HS", "SEND_DEPTH", *ARCH_FLAGS)
                 if getattr(args, name.lower()) is not None}
        self.cfg = td.defaults(MAX_ANCHORS=args.anchors, BLOCK_SIZE=args.block, NUM_DRAFT_LAYERS=args.layers,
                               TOKEN_BUDGET=args.batch * args.seq, TARGET_RANKS=1,
                               DTYPE="bfloat16" if cuda else "float32", ATTN="flex" if self.flex else "sdpa",
                               COMPILE_DRAFTER=args.compile_drafter, DRAFTER_ARCH=args.arch, **given)
        self.max_len = args.seq                                       # the planner's bound on the target's mask
        if args.flex_options and args.mode != "flex":
            set_flex_kernel_options(json.loads(args.flex_options))
        self.hf = hf_config(args.shape)
        self.mask_id = SHAPES[args.shape][-1]
        self.sizes = planner.model_sizes(self.hf)
        dcfg = DrafterConfig.from_target(self.hf, args.layers, args.block, self.mask_id,
                                         num_taps=self.cfg.NUM_TAPS or None)
        errs = arch_errors(self.cfg, self.sizes)
        if errs:
            sys.exit("error: " + "; ".join(errs))
        # the trainer's drafter_config: the arch's config from the DFlash one
        self.dcfg = make_config(self.cfg.DRAFTER_ARCH, dcfg, self.cfg)
        self.peak_tflops = None

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_mem(self):
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def free(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def mfu(self, tflops):
        return {"mfu_measured": tflops / self.peak_tflops if self.peak_tflops else float("nan"),
                "mfu_datasheet": tflops / DATASHEET_TFLOPS}


def arch_settings(arch: str) -> tuple:
    """The settings an arch reads beyond DFlash's (model/drafters.py: Arch.knobs, then Arch.loss_settings)."""
    return (*ARCHS[arch].knobs, *ARCHS[arch].loss_settings)


# each arch's own settings: train_dflash's constant -> the bench's flag, the name lower-cased with dashes (default:
# the constant, through td.defaults)
ARCH_FLAGS = {name: "--" + name.lower().replace("_", "-") for arch in ARCHS for name in arch_settings(arch)}
# the bench's flags of the settings an arch's check may name beside its own
SHAPE_FLAGS = {"BLOCK_SIZE": "--block", "NUM_DRAFT_LAYERS": "--layers", "MAX_ANCHORS": "--anchors"}


def in_flags(msg: str) -> str:
    """A trainer message in the bench's flags: NAME=v -> --name v (NAME) for an arch's own setting, --flag v for
    SHAPE_FLAGS'; --NAME=v -> --name v; --NAME -> --name."""
    for name, flag in {**ARCH_FLAGS, **SHAPE_FLAGS}.items():
        own = f" ({name})" if name in ARCH_FLAGS else ""
        msg = re.sub(rf"--{name}=([^\s,;:)]+)", rf"{flag} \1", msg)
        msg = re.sub(rf"--{name}\b", flag, msg)
        msg = re.sub(rf"(?<![\w-]){name}=([^\s,;:)]+)", rf"{flag} \1{own}", msg)
    return msg


def arch_errors(c, sizes) -> list[str]:
    """What train_dflash's check_config (trainer/settings.py) refuses in the arch's own settings, in the bench's
    flags: a setting below its range, then what the arch's check refuses (model/drafters.py Arch.check) against the
    sizes of --shape, its target (DFlash2: a convolution group that does not divide the hidden size, more selector
    candidates than the vocabulary, more taps than BLOCK_SIZE). The trainer refuses no mode with any arch
    (DRAFTER_FP8, HEAD_FP8, COMPILE_DRAFTER all run dflash2), so neither does the bench."""
    errs = []
    for name in arch_settings(c.DRAFTER_ARCH):
        lo, strict = RANGES[name]
        v = getattr(c, name)
        if not math.isfinite(v) or (v <= lo if strict else v < lo):
            errs.append(f"{ARCH_FLAGS[name]} {v} ({name}) must be {'>' if strict else '>='} {lo:g}")
    if errs:
        return errs
    return [in_flags(e) for e in ARCHS[c.DRAFTER_ARCH].check(c, sizes.V, sizes.H)]


def environment(c) -> dict:
    dev = torch.cuda.get_device_name(c.device) if c.device.type == "cuda" else "cpu"
    mem = torch.cuda.get_device_properties(c.device).total_memory if c.device.type == "cuda" else None
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return {"device": dev, "gpu_mem_bytes": mem, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "git": rev, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "argv": " ".join(sys.argv)}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["target", "drafter", "pipeline", "flex", "ce", "all"], default="all",
                    help="all = target, drafter, pipeline; flex (only when named): kernel_options sweep of one "
                         "drafter layer's flex_attention")
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    ap.add_argument("--seq", type=int, help="tokens per sequence (--mixed: the longest) [3072; tiny 64]")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch; TOKEN_BUDGET = batch * seq [4]")
    ap.add_argument("--anchors", type=int, help="MAX_ANCHORS [512; tiny 8]")
    ap.add_argument("--block", type=int, help="BLOCK_SIZE [16; tiny 4]")
    ap.add_argument("--layers", type=int, help="NUM_DRAFT_LAYERS [5; tiny 2]")
    ap.add_argument("--mixed", action="store_true", help="lengths uniform in [--min-len, --seq], packed by BatchPlan")
    ap.add_argument("--min-len", type=int, help="shortest sequence with --mixed [550; tiny 16]")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (micro-batches)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile each target decoder layer (COMPILE_TARGET)")
    ap.add_argument("--target-fp8", action="store_true", help="TARGET_FP8: the target's Linear layers in FP8")
    ap.add_argument("--drafter-fp8", action="store_true", help="DRAFTER_FP8: the drafter's Linear layers train in FP8")
    ap.add_argument("--drafter-fp8-recipe", default=fp8.RECIPES[0], choices=list(fp8.RECIPES),
                    help="DRAFTER_FP8_RECIPE: torchao's float8 training recipe")
    ap.add_argument("--head-fp8", action="store_true", help="HEAD_FP8: the loss's lm_head GEMMs in FP8")
    ap.add_argument("--compile-drafter", default="off", choices=["off", "elementwise", "layers"],
                    help="COMPILE_DRAFTER: fused RMSNorm + RoPE, or each drafter layer compiled whole")
    ap.add_argument("--ce-kernel", default="auto", choices=["auto", "eager"],
                    help="the CE epilogue (model.objective.set_ce_kernel); auto = the Triton kernel on GPU")
    ap.add_argument("--overlap-optimizer", type=int, default=1, choices=[0, 1],
                    help="OVERLAP_OPTIMIZER: AdamW on a side stream under the next forward (1) or after the backward")
    ap.add_argument("--trace", default=None, metavar="FILE", help="--profile: also write a chrome trace (drafter)")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="sys.setswitchinterval for the drafter run (Python's default: 0.005 s)")
    ap.add_argument("--flex-variants", action="store_true",
                    help="--mode flex: static vs dynamic shapes, contiguous vs the layer's strided q/k/v, and "
                         "the interval vs the document mask_mod on the same tiles")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile N more steps and print the top CUDA kernels (torch.profiler)")
    ap.add_argument("--target-attn", default=None, help="HF attn_implementation of the target (default: HF's pick, "
                                                        "as Target.from_pretrained gets it)")
    ap.add_argument("--pipe-compute", action="store_true", help="pipeline: real target forward and drafter step")
    ap.add_argument("--ce-chunk", type=int, default=None, help="CE_CHUNK (default: train_dflash's)")
    ap.add_argument("--arch", choices=list(ARCHS), default="dflash",
                    help="DRAFTER_ARCH: the drafter the step trains (model/drafters.py ARCHS) [dflash]")
    for name, flag in ARCH_FLAGS.items():   # each arch's own settings (arch_settings)
        archs = ", ".join(a for a in ARCHS if name in arch_settings(a))
        ap.add_argument(flag, type=type(getattr(td, name)), default=None,
                        help=f"{name}, --arch {archs} (default: train_dflash's)")
    ap.add_argument("--q-hs", type=int, default=None, help="Q_HS (default: train_dflash's)")
    ap.add_argument("--send-depth", type=int, default=None, help="SEND_DEPTH (default: train_dflash's)")
    ap.add_argument("--flex-options", default=None, metavar="JSON",
                    help="kernel_options for the drafter's flex_attention (model.attention.set_flex_kernel_options); "
                         "--mode flex: time only these against the default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    ap.add_argument("--json", default=None, help="write every number to this file")
    ap.add_argument("--write-assets", default=None, metavar="DIR",
                    help="only write DIR/target (random HF folder of --shape) and DIR/data (synthetic prepared "
                         "dataset) for running train_dflash.py itself, then exit")
    args = ap.parse_args(argv)
    for k, v in (TINY_DEFAULTS if args.shape == "tiny" else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.mixed and not 2 <= args.min_len <= args.seq:
        ap.error(f"--min-len {args.min_len} must be in 2..--seq {args.seq}")
    stray = [name for name in ARCH_FLAGS if getattr(args, name.lower()) is not None
             and name not in arch_settings(args.arch)]
    if stray:   # another arch's setting: the step would train this arch without it
        owner = next(a for a in ARCHS if stray[0] in arch_settings(a))
        title = ARCHS[owner].title
        ap.error(f"{', '.join(ARCH_FLAGS[n] for n in stray)} "
                 f"{f'is a {title} knob' if len(stray) == 1 else f'are {title} knobs'}, and --arch is {args.arch}: "
                 f"add --arch {owner}")
    return args


def main(argv=None) -> dict:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


def run(args) -> dict:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # as launch.sh runs the trainer
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and args.mode != "pipeline":
        sys.exit(f"error: under torchrun (WORLD_SIZE={world}) only --mode pipeline runs; the other modes measure "
                 f"one GPU: run them with python -m bench.bench_dflash")
    torch.manual_seed(args.seed)
    if world > 1 and (not torch.cuda.is_available() or args.cpu):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))     # the two CPU ranks share the cores
    c = Context(args)
    errs = [e for name, flag in (("TARGET_FP8", "--target-fp8"), ("DRAFTER_FP8", "--drafter-fp8"),
                                 ("HEAD_FP8", "--head-fp8"))
            if getattr(args, name.lower()) and (e := fp8.check(name, c.device, fix=f"leave out {flag}"))]
    if errs:
        sys.exit("error: " + "; ".join(errs))
    if args.write_assets:
        t0 = time.time()
        info = write_assets(args, c, Path(args.write_assets))
        print(f"wrote {info['target']} and {info['data']} ({info['rows']} rows, {info['tokens']:,} tokens) in "
              f"{time.time() - t0:.0f}s; train with --MASK_TOKEN_ID={info['mask_token_id']} (no tokenizer)")
        return info
    env = environment(c)
    gpu_mem = env["gpu_mem_bytes"]
    plan = planner.estimate(c.cfg, c.hf, world_gpus=2, gpu_mem_bytes=gpu_mem, max_len=c.max_len)
    res = {"arch": c.cfg.DRAFTER_ARCH, "args": vars(args), "env": env, "settings": {k: getattr(c.cfg, k) for k in
           ("TOKEN_BUDGET", "MAX_ANCHORS", "BLOCK_SIZE", "NUM_DRAFT_LAYERS", "CE_CHUNK", "Q_HS", "SEND_DEPTH",
            "GAMMA", "MAX_BATCH_SIZE", "DRAFTER_ARCH", *arch_knobs(c.cfg))},
           "target_layer_ids": c.dcfg.target_layer_ids,
           "plan_full": plan, "plan": {k: v for k, v in plan.items() if not k.startswith("_")}}
    modes = ["target", "drafter", "pipeline"] if args.mode == "all" else [args.mode]
    if "target" in modes or "drafter" in modes:
        c.peak_tflops = res["peak_tflops"] = peak_matmul_tflops(c.device, c.dtype)
    failed = False
    for mode in modes:
        fn = {"target": bench_target, "drafter": bench_drafter, "pipeline": bench_pipeline, "flex": bench_flex,
              "ce": bench_ce}[mode]
        try:
            out = fn(args, c)
        except Exception as e:  # noqa: BLE001 - one mode's failure must not lose the others' numbers
            if args.mode != "all":
                raise
            traceback.print_exc()
            out, failed = {"error": f"{type(e).__name__}: {e}"}, True
        c.free()                                            # after the except: its traceback held the tensors
        if mode == "pipeline" and "commands" in out:
            res["commands"] = out["commands"]
        else:
            res[mode] = out
    if res.get("pipeline", {}).get("rank", 1) == 0:
        return res                                          # the consumer rank reports
    print(report(res, c), flush=True)
    if args.json:
        res.pop("plan_full")
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"wrote {args.json}")
    if failed:
        sys.exit(1)
    return res


if __name__ == "__main__":
    main()
