"""Peak GPU memory per role from the config, the target:drafter split from measured rates, and the start-up check
that names the setting to turn.

    est = estimate(cfg, target_hf_config, world_gpus=8, gpu_mem_bytes=torch.cuda.get_device_properties(0).total_memory)
    print(format_plan(est, rates=(target_tok_s, drafter_tok_s)))
    errors = check_fits(est, gpu_mem_bytes)          # [] or one line per role that cannot fit, naming the knob

`cfg` is the run's settings (trainer.settings.Settings, read as cfg.NAME); nothing here repeats their defaults.
Each role's peak = its static terms (weights, optimizer, queues) + the largest of its phases (the forward with the
chunked CE, or the end of the backward). Every term is a named product of the config and the model sizes. The
per-row constants below were read off the code (what autograd saves, counted with saved_tensors_hooks on a tiny
drafter under bf16 autocast) and are calibrated against the measured peaks that `python -m bench.bench_dflash`
prints next to them: calibration is a one-line edit here.
"""
from dataclasses import dataclass

from model.drafter import default_layer_ids
from model.drafters import ARCHS

GiB = 2 ** 30
FP8, BF16, FP32 = 1, 2, 4

# --- calibration constants ------------------------------------------------------------------------------------------
# target role: no-grad forward of layers 0..last tap (HF decoder, bf16)
TGT_FWD_H = 4.0            # [tokens, H] bf16 buffers alive at the forward's peak (residual, normed input, outputs)
TGT_FWD_I = 3.0            # [tokens, I] bf16 buffers at the MLP's peak (act(gate), up, their product)
TGT_TAP_COPIES = 2.0       # [tokens, K*H] copies after the forward (the K taps + concat, then concat + packed)
TGT_KEEPS_UNUSED = True    # model.target.Target loads the whole model: layers past the last tap + lm_head stay resident
#                             (unsharded; a sharded target, TARGET_SHARDS > 1, never loads them)
TGT_FSDP_PREFETCH = 1.0    # TARGET_SHARDS > 1: layer-sized all-gather outputs alive beside the running FSDP unit's
#                             whole parameters (the embedding or a layer): the next layer's, prefetched under it
# drafter role: bytes autograd keeps per row, in units of the named width (bf16 autocast, fp32 norms/RoPE as coded)
DFT_BLOCK_PER_H = 14.0     # per block token per layer, x H: input norm bf16, q_proj cast, post norm fp32+bf16, gate+up
DFT_BLOCK_RES_PER_H = 4.0  # layers >= 1 also keep their input's fp32 copy (layer 0's input is the frozen embedding)
DFT_BLOCK_PER_QD = 10.0    # x heads*head_dim: q_norm fp32 + bf16, attention query and output bf16
DFT_BLOCK_PER_I = 8.0      # x intermediate: SwiGLU gate, silu, up, product in bf16
DFT_KV_PER_H = 4.0         # per [context ; block] row per layer, x H: the concatenation's bf16 casts for k_proj, v_proj
DFT_KV_PER_KVD = 10.0      # x kv_heads*head_dim: k_norm fp32 + bf16, attention key bf16, value bf16
DFT_CTX_PER_H = 6.0        # per context row, once: hidden_norm's fp32 input + bf16 output
DFT_OUT_PER_H = 10.0       # per block token, once: final norm fp32 + bf16 saved, its fp32 output held by the loop
DFT_ROPE_PER_D = 8.0       # per [context ; block] row, once, x head_dim: fp32 cos and sin
DFT_CE_ROW_PER_H = 8.0     # per supervised row, x H: gathered fp32 hidden + saved fp32 grad_h of the chunked CE
DFT_CE_FP32_COPIES = 2.0   # [CE_CHUNK, vocab] fp32 buffers alive at once inside a CE chunk (logits + logsumexp temp)
DFT_CE_FUSED_COPIES = 1.0  # the same on GPU in bf16: the Triton epilogue writes the grad over the bf16 logits
ONE_PROCESS_AHEAD = 1      # pipe.TargetAhead's default `ahead` (the one process's compiled target forward)
DFT_QUEUE_EXTRA = 2        # received micro-batches alive beyond Q_HS: one training, one prepared and waiting to enter
DFT_DDP_BUCKETS = 1.0      # fp32 gradient copies DDP keeps in its buckets with >= 2 drafter ranks
DFT_FSDP_LAYERS = 2        # DRAFTER_SHARDING=fsdp: unsharded decoder layers alive at once (the running one and the
#                             next one's all-gather; in the backward, its fp32 gradient before the reduce-scatter)
DFT_COMPILED_LAYER_SCALE = 0.68  # COMPILE_DRAFTER=layers: share of the eager per-layer activations (block + kv) a
#                             compiled layer saves (its partitioner can recompute cheap ops in the backward rather
#                             than save them). Fitted to the H200 peaks (test_planner's MEASURED);
#                             saved_tensors_hooks on a layer compiled on the CPU count 0.63
FP32_ACT_SCALE = 2.0       # DTYPE=float32 (no autocast): activation terms scale by about this
# fitting a GPU
FRAGMENTATION = 0.08       # share of the GPU lost between allocated and reserved (expandable_segments keeps it low)
CUDA_CONTEXT = 1 * GiB     # bytes per process outside PyTorch's allocator (CUDA context, cuBLAS, NCCL buffers)

# the settings check_fits may suggest, with the step its suggestion is rounded down to and the smallest allowed value
KNOBS = {"MAX_ANCHORS": (8, 1), "TOKEN_BUDGET": (256, 2), "CE_CHUNK": (256, 1), "Q_HS": (1, 1), "SEND_DEPTH": (1, 1)}


# --- model sizes ----------------------------------------------------------------------------------------------------

def _get(c, name, default=None):
    return c.get(name, default) if isinstance(c, dict) else getattr(c, name, default)


@dataclass
class Sizes:
    H: int          # hidden
    nh: int         # attention heads
    nkv: int        # key/value heads
    D: int          # head_dim
    I: int          # intermediate
    V: int          # vocabulary rows
    n_layers: int   # target decoder layers
    tied: bool      # lm_head shares the embedding
    qk_norm: bool   # Qwen3 q_norm / k_norm in the target
    attn_bias: bool
    mlp_bias: bool

    @property
    def qd(self):
        return self.nh * self.D

    @property
    def kvd(self):
        return self.nkv * self.D


def model_sizes(target_hf_config) -> Sizes:
    c = target_hf_config
    if hasattr(c, "get_text_config"):
        c = c.get_text_config()
    H, nh = _get(c, "hidden_size"), _get(c, "num_attention_heads")
    return Sizes(H=H, nh=nh, nkv=_get(c, "num_key_value_heads") or nh, D=_get(c, "head_dim") or H // nh,
                 I=_get(c, "intermediate_size"), V=_get(c, "vocab_size"), n_layers=_get(c, "num_hidden_layers"),
                 tied=bool(_get(c, "tie_word_embeddings", False)),
                 qk_norm=str(_get(c, "model_type", "")).startswith("qwen3"),
                 attn_bias=bool(_get(c, "attention_bias", False)), mlp_bias=bool(_get(c, "mlp_bias", False)))


def target_layer_params(s: Sizes) -> int:
    """Parameters of one target decoder layer (Llama / Qwen3 layout)."""
    attn = s.H * s.qd + 2 * s.H * s.kvd + s.qd * s.H
    attn += (s.qd + 2 * s.kvd + s.H) if s.attn_bias else 0
    mlp = 3 * s.H * s.I + ((2 * s.I + s.H) if s.mlp_bias else 0)
    return attn + mlp + 2 * s.H + (2 * s.D if s.qk_norm else 0)


def target_layer_linear(s: Sizes) -> tuple[int, int]:
    """(weights, output channels) of one target decoder layer's Linear layers: what TARGET_FP8 stores in e4m3, one
    fp32 scale per output channel. Biases and norms stay bf16."""
    weights = s.H * s.qd + 2 * s.H * s.kvd + s.qd * s.H + 3 * s.H * s.I
    return weights, s.qd + 2 * s.kvd + s.H + 2 * s.I + s.H


def drafter_linear_params(s: Sizes, L: int, K: int) -> int:
    """Linear weights of the drafter (what autocast copies to bf16): L layers + fc."""
    return L * (s.H * s.qd + 2 * s.H * s.kvd + s.qd * s.H + 3 * s.H * s.I) + K * s.H * s.H


def drafter_params(s: Sizes, L: int, K: int) -> int:
    """All trainable parameters: L Qwen3-style layers (q_norm/k_norm always) + fc + hidden_norm + norm."""
    bias = L * (s.qd + 2 * s.kvd + s.H) if s.attn_bias else 0
    return drafter_linear_params(s, L, K) + bias + L * (2 * s.D + 2 * s.H) + 2 * s.H


def layer_ids_of(cfg, n_layers: int) -> list[int]:
    ids = cfg.TARGET_LAYER_IDS or ""
    if isinstance(ids, str):
        ids = [int(x) for x in ids.split(",") if x.strip()]
    return list(ids) or default_layer_ids(n_layers, cfg.NUM_TAPS or cfg.NUM_DRAFT_LAYERS)


# --- the estimate ---------------------------------------------------------------------------------------------------

def _term(name, short, nbytes, phases, knob=None):
    """phases: "static" or a tuple of the phase names this buffer is alive in."""
    return {"name": name, "short": short, "bytes": int(nbytes), "phases": phases, "knob": knob}


def _target_terms(s, d, prefix=""):
    T, K, last, N = d["tokens"], d["K"], d["last_layer"], d["shards"]
    fwd, cat = prefix + "forward", prefix + "concat"
    layer = target_layer_params(s)
    used = s.V * s.H + (last + 1) * layer
    unused = (s.n_layers - last - 1) * layer + s.H + (0 if s.tied else s.V * s.H)
    if N > 1:   # model.target.load_sharded: 1/N of what runs, FSDP2 all-gathers one unit at a time, nothing else
        terms = [
            _term(f"target weights: 1/{N} of embedding + layers 0..{last} (bf16, TARGET_SHARDS={N})",
                  "target shard", used * BF16 / N, "static"),
            _term(f"all-gathered: the running unit (embedding or a layer, whole) + {TGT_FSDP_PREFETCH:g} x the next "
                  f"layer's all-gather (prefetch), bf16", "all-gathered",
                  (max(layer, s.V * s.H) + TGT_FSDP_PREFETCH * layer) * BF16, (fwd,)),
        ]
    elif d["target_fp8"]:   # model.fp8.quantize_target: layers 0..last's Linear weights in e4m3 + fp32 row scales
        lin, lin_out = target_layer_linear(s)
        fp8_bytes = (last + 1) * (lin * FP8 + lin_out * FP32)
        terms = [
            _term(f"target weights: layers 0..{last}'s Linear weights in e4m3 with per-row fp32 scales "
                  f"(TARGET_FP8)", "target fp8", fp8_bytes, "static"),
            _term(f"target weights: embedding + layers 0..{last}'s norms (bf16)", "target weights",
                  (used - (last + 1) * lin) * BF16, "static"),
        ]
    else:
        terms = [
            _term(f"target weights: embedding + layers 0..{last} (bf16)", "target weights", used * BF16, "static"),
        ]
    if N == 1:
        terms.append(_term(f"target weights the features never use: layers {last + 1}..{s.n_layers - 1}, final norm, "
                           f"lm_head (model.target.Target keeps the whole model, in bf16)", "unused target weights",
                           unused * BF16 * TGT_KEEPS_UNUSED, "static"))
    terms += [
        _term(f"forward buffers: {TGT_FWD_H:g} x [{T}, {s.H}] + {TGT_FWD_I:g} x [{T}, {s.I}] bf16 (TOKEN_BUDGET)",
              "forward", T * (TGT_FWD_H * s.H + TGT_FWD_I * s.I) * BF16, (fwd,), "TOKEN_BUDGET"),
        _term(f"taps kept while the last tapped layer runs: {K - 1} x [{T}, {s.H}] bf16", "taps so far",
              (K - 1) * T * s.H * BF16, (fwd,), "TOKEN_BUDGET"),
        _term(f"attention mask [b, S, S] bool, b*S <= {T}, S <= {d['max_len']}", "mask", T * d["max_len"], (fwd, cat),
              "TOKEN_BUDGET"),
        _term(f"features: {TGT_TAP_COPIES:g} x [{T}, {K}*{s.H}] bf16 (taps + concat, then concat + packed copy)",
              "concat", TGT_TAP_COPIES * d["feature_bytes"], (cat,), "TOKEN_BUDGET"),
    ]
    if d["inflight"]:
        terms.append(_term(f"features in flight to drafters: SEND_DEPTH+1 = {d['inflight']} x [{T}, {K}*{s.H}] bf16",
                           "in flight", d["inflight"] * d["feature_bytes"], "static", "SEND_DEPTH"))
    return terms


def drafter_layer_params(s: Sizes) -> int:
    """Parameters of one drafter decoder layer: an FSDP2 unit under DRAFTER_SHARDING=fsdp."""
    return drafter_linear_params(s, 1, 0) + ((s.qd + 2 * s.kvd + s.H) if s.attn_bias else 0) + 2 * s.D + 2 * s.H


def _drafter_terms(s, d, cfg, prefix="", frozen_shared=False):
    L, K, T, M, R, P = d["L"], d["K"], d["tokens"], d["M"], d["R"], d["drafter_params"]
    # fsdp: each of the n drafter ranks keeps 1/n of the fp32 weights, gradients and AdamW state
    fsdp, n = d["fsdp"], d["n_drafters"]
    share, of_n = (1 / n, f", 1/{n} per rank (fsdp)") if fsdp else (1, "")
    act, lay = d["act_scale"], d["layer_act_scale"]
    fwd, bwd = (prefix + "forward",), (prefix + "backward end",)
    block = lay * (L * (DFT_BLOCK_PER_H * s.H + DFT_BLOCK_PER_QD * s.qd + DFT_BLOCK_PER_I * s.I)
                   + (L - 1) * DFT_BLOCK_RES_PER_H * s.H)
    kv = lay * L * (DFT_KV_PER_H * s.H + DFT_KV_PER_KVD * s.kvd)
    once = T * DFT_CTX_PER_H * s.H + (T + M) * DFT_ROPE_PER_D * s.D + M * DFT_OUT_PER_H * s.H
    item = d["feature_bytes"] + (0 if d["flex"] else M * (T + M))     # the SDPA path also holds a dense bool mask
    copies = 0 if d["fp32"] else drafter_linear_params(s, L, K) * BF16
    if cfg.DRAFTER_FP8 and not d["fp32"]:
        # the converted layers' weights are cast to e4m3 instead (model.fp8.convert_drafter; fc stays bf16): counted
        # at 1 byte per weight, 0.90 GiB less at Qwen3-8B shapes with 5 layers, a little under what the H200 measured
        # with rowwise_with_gw_hp; rowwise and tensorwise also save the activations in e4m3 (several GiB less
        # measured), which this leaves out: an overestimate for them (the peaks: BENCHMARKS.md, Other figures)
        copies -= (drafter_linear_params(s, L, K) - drafter_linear_params(s, 0, K)) * (BF16 - FP8)
    terms = [
        _term(f"drafter weights fp32: {L} layers + fc + norms ({P / 1e9:.3f}B params){of_n}", "drafter weights",
              P * FP32 * share, "static"),
        _term(f"AdamW exp_avg + exp_avg_sq fp32{of_n}", "AdamW", 2 * P * FP32 * share, "static"),
        _term(f"received micro-batches: {d['queue_items']} x features [{T}, {K}*{s.H}] bf16"
              + ("" if d["flex"] else f" + dense mask [{M}, {T}+{M}] bool"), "queue", d["queue_items"] * item,
              "static", "Q_HS"),
        _term("autocast bf16 copies of the Linear weights", "bf16 copies", 0 if fsdp else copies, fwd + bwd),
        _term(f"activations, block tokens: {L} layers x {M} rows (MAX_ANCHORS {d['N']} x BLOCK_SIZE {d['B']})"
              + (f", compiled layers save {lay:g} of eager" if lay != 1 else ""),
              "block acts", act * M * block, fwd, "MAX_ANCHORS"),
        _term(f"activations, keys/values: {L} layers x [{T} context + {M} block] rows", "kv acts",
              act * (T + M) * kv, fwd, "TOKEN_BUDGET"),
        _term("activations once: hidden_norm(fc(features)), RoPE cos/sin, final norm", "ctx+out acts", act * once,
              fwd, "TOKEN_BUDGET"),
        _term(f"CE rows: {R} supervised x [{s.H}] fp32 hidden + saved grad", "CE rows", R * DFT_CE_ROW_PER_H * s.H,
              fwd, "MAX_ANCHORS"),
        _term(f"CE chunk: {DFT_CE_FUSED_COPIES:g} x [{d['ce_rows']}, {s.V}] bf16 logits, then grad (Triton epilogue)"
              if d["fused_ce"] else f"CE chunk: {DFT_CE_FP32_COPIES:g} x [{d['ce_rows']}, {s.V}] fp32 logits",
              "CE chunk", (DFT_CE_FUSED_COPIES * BF16 if d["fused_ce"] else DFT_CE_FP32_COPIES * FP32)
              * d["ce_rows"] * s.V, fwd, "CE_CHUNK"),
        _term(f"gradients fp32{of_n}", "grads", P * FP32 * share, bwd),
    ]
    extra = d["arch_extra"]
    if extra["acts"] or extra["loss_fp32"] or extra["loss_bf16"]:   # the arch's own (model/drafters.py ARCHS)
        terms += [_term(f"{cfg.DRAFTER_ARCH}: its layers' extra activations (block-local convolutions)",
                        "arch acts", act * extra["acts"] * BF16, fwd, "MAX_ANCHORS"),
                  _term(f"{cfg.DRAFTER_ARCH}: its loss's extra temporaries (selector candidates)", "arch loss",
                        extra["loss_fp32"] * FP32 + extra["loss_bf16"] * BF16, fwd, "MAX_ANCHORS")]
    if cfg.HEAD_FP8:   # model.fp8.HeadFP8: W twice in e4m3, and each chunk's dL/dlogits quantised once more
        terms += [_term(f"HEAD_FP8: the lm_head [{s.V}, {s.H}] twice in e4m3", "head fp8", 2 * s.V * s.H, "static"),
                  _term(f"HEAD_FP8: a chunk's dL/dlogits [{d['ce_rows']}, {s.V}] in e4m3", "CE chunk fp8",
                        d["ce_rows"] * s.V, fwd, "CE_CHUNK")]
    if fsdp:
        root, layer = P - L * drafter_layer_params(s), drafter_layer_params(s)
        w = FP32 if d["fp32"] else BF16
        units = min(L, DFT_FSDP_LAYERS)
        terms += [
            _term(f"all-gathered weights ({'fp32' if d['fp32'] else 'bf16'}): the root (fc + norms) and {units} "
                  f"layers", "gathered", (root + units * layer) * w, fwd + bwd),
            _term(f"unsharded fp32 gradients before their reduce-scatter: the root and {units} layers",
                  "unsharded grads", (root + units * layer) * FP32, bwd)]
        if cfg.GRAD_ACCUM > 1:   # no sync until the last micro-batch: FSDP2 holds them whole, in fp32
            terms.append(_term(f"unsharded fp32 gradients held across GRAD_ACCUM={cfg.GRAD_ACCUM} micro-batches",
                               "accumulated grads", P * FP32, fwd + bwd))
    if not frozen_shared:
        n = 1 if s.tied else 2
        terms.insert(2, _term(f"frozen embedding{'' if s.tied else ' + lm_head'} [{s.V}, {s.H}] bf16", "frozen io",
                              n * s.V * s.H * BF16, "static"))
    if cfg.EVAL_EVERY:   # the master drafter's tau evaluation loads its own HF target, freed afterwards
        eval_dtype = str(cfg.EVAL_DTYPE)
        terms.append(_term(f"evaluation target ({eval_dtype}, EVAL_EVERY; while it runs the training activations are "
                           f"freed)", "eval target", d["target_params"] * (FP32 if eval_dtype == "float32" else BF16),
                           (prefix + "evaluation",)))
    if d["n_drafters"] > 1 and not fsdp:
        terms.insert(2, _term(f"DDP gradient buckets fp32 ({d['n_drafters']} drafter ranks)", "DDP buckets",
                              DFT_DDP_BUCKETS * P * FP32, "static"))
    return terms


def _role(terms):
    static = sum(t["bytes"] for t in terms if t["phases"] == "static")
    phases = {}
    for t in terms:
        if t["phases"] != "static":
            for ph in t["phases"]:
                phases[ph] = phases.get(ph, 0) + t["bytes"]
    peak = max(phases, key=phases.get) if phases else None
    return {"terms": terms, "static": static, "phases": phases, "peak_phase": peak,
            "total": static + (phases[peak] if peak else 0)}


def usable_bytes(gpu_mem_bytes) -> int:
    return int(gpu_mem_bytes * (1 - FRAGMENTATION) - CUDA_CONTEXT)


def estimate(cfg, target_hf_config, world_gpus: int, gpu_mem_bytes=None, max_len=None) -> dict:
    """Peak memory per role (bytes, what torch.cuda.max_memory_allocated would report) for train_dflash's config
    `cfg` on `world_gpus` GPUs: roles "target" and "drafter", or "target+drafter" on one GPU (colocated).
    Worst case per micro-batch: TOKEN_BUDGET real tokens, MAX_ANCHORS anchors, B-1 supervised slots each.
    max_len (the dataset's longest sequence), if given, bounds the target's attention mask."""
    s = model_sizes(target_hf_config)
    ids = layer_ids_of(cfg, s.n_layers)
    L, K, B, N = cfg.NUM_DRAFT_LAYERS, len(ids), cfg.BLOCK_SIZE, cfg.MAX_ANCHORS
    T = cfg.TOKEN_BUDGET
    colocated = world_gpus <= 1
    n_tgt = 1 if colocated else cfg.TARGET_RANKS
    n_dft = 1 if colocated else world_gpus - n_tgt
    dtype = str(cfg.DTYPE)
    R = N * (B - 1)
    ce_rows = min(cfg.CE_CHUNK or R, R)
    arch_extra = ARCHS[cfg.DRAFTER_ARCH].drafter.memory_terms(s.H, s.V, L, N * B, R, ce_rows, cfg)
    d = dict(L=L, K=K, B=B, N=N, M=N * B, R=R, tokens=T, layer_ids=ids, last_layer=max(ids),
             max_len=min(T, max_len or T), ce_rows=ce_rows, arch_extra=arch_extra,
             feature_bytes=T * K * s.H * BF16, drafter_params=drafter_params(s, L, K) + arch_extra["params"],
             target_params=s.V * s.H * (1 if s.tied else 2) + s.n_layers * target_layer_params(s) + s.H,
             fp32=dtype == "float32", act_scale=FP32_ACT_SCALE if dtype == "float32" else 1.0,
             layer_act_scale=DFT_COMPILED_LAYER_SCALE if cfg.COMPILE_DRAFTER == "layers" else 1.0,
             flex=str(cfg.ATTN) != "sdpa", n_targets=n_tgt, n_drafters=n_dft,
             fsdp=not colocated and cfg.DRAFTER_SHARDING == "fsdp",
             # the planner plans GPU runs: a chunked CE in bf16 there runs model/ce_kernel.py (CE_CHUNK=0 is the
             # unchunked fp32 reference)
             fused_ce=dtype != "float32" and bool(cfg.CE_CHUNK),
             inflight=0 if colocated else cfg.SEND_DEPTH + 1,
             shards=1 if colocated else cfg.TARGET_SHARDS, target_fp8=bool(cfg.TARGET_FP8),
             # one process: the feeder's queue holds Q_HS prepared micro-batches too, full when the target outpaces
             # the drafter (many anchors per token)
             # one process with COMPILE_TARGET: pipe.TargetAhead hands the prepare thread at most AHEAD + 1 of them
             queue_items=(ONE_PROCESS_AHEAD + 1 if colocated and cfg.COMPILE_TARGET else cfg.Q_HS)
             + DFT_QUEUE_EXTRA)
    if colocated:
        roles = {"target+drafter": _role(_target_terms(s, d, "target ")
                                         + _drafter_terms(s, d, cfg, "drafter ", frozen_shared=True))}
    else:
        roles = {"target": _role(_target_terms(s, d)), "drafter": _role(_drafter_terms(s, d, cfg))}
    if gpu_mem_bytes:
        for r in roles.values():
            r["fits"] = r["total"] <= usable_bytes(gpu_mem_bytes)
    return {"roles": roles, "derived": d, "world_gpus": world_gpus, "gpu_mem_bytes": gpu_mem_bytes,
            "split": (n_tgt, n_dft), "colocated": colocated,
            "_inputs": (cfg, target_hf_config, world_gpus, max_len)}


# --- checks and the split -------------------------------------------------------------------------------------------

def estimate_role(inputs, role_name, overrides, world=None) -> int:
    """`role_name`'s peak for the estimate's inputs with `overrides` (settings) on `world` GPUs (default: its own)."""
    cfg, hf, own_world, max_len = inputs
    return estimate(cfg.replace(**overrides), hf, world or own_world, max_len=max_len)["roles"][role_name]["total"]


def _largest_fitting(knob, role_name, inputs, usable):
    """The largest value of `knob` (others fixed) at which the role fits, or None if even the smallest does not."""
    cfg, _, world, _ = inputs
    step, lo = KNOBS[knob]
    cur = getattr(cfg, knob) or (cfg.MAX_ANCHORS * (cfg.BLOCK_SIZE - 1) if knob == "CE_CHUNK" else 0)

    def fits(v):
        return estimate_role(inputs, role_name, {knob: v}) <= usable
    if cur <= lo or not fits(lo):
        return None
    good, bad = lo, cur                     # fits(good), not fits(bad)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return max(lo, good // step * step) if good >= step else good


def _all_knobs_fitting(role_name, knobs, inputs, usable):
    """All `knobs` scaled down by one common factor: the values at the largest factor that fits, or {}."""
    cfg, _, world, _ = inputs
    knobs = sorted(set(knobs))

    def scaled(f):
        out = {}
        for k in knobs:
            step, lo = KNOBS[k]
            cur = getattr(cfg, k) or cfg.MAX_ANCHORS * (cfg.BLOCK_SIZE - 1)      # CE_CHUNK=0: all rows at once
            v = int(cur * f)
            out[k] = max(lo, v // step * step if v >= step else v)
        return out

    def fits(f):
        return estimate_role(inputs, role_name, scaled(f)) <= usable
    if not fits(0.0):
        return {}
    good, bad = 0.0, 1.0
    for _ in range(20):
        mid = (good + bad) / 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return {k: v for k, v in scaled(good).items() if v < getattr(cfg, k) or (k == "CE_CHUNK" and getattr(cfg, k) == 0)}


def _shards_fitting(inputs, usable):
    """The fewest ranks per target replica (TARGET_SHARDS, at most world - 1: one GPU trains) at which the target
    role fits, or None."""
    cfg, _, world, _ = inputs
    return next((n for n in range(max(2, cfg.TARGET_SHARDS + 1), world)
                 if estimate_role(inputs, "target", {"TARGET_SHARDS": n}) <= usable), None)


def check_fits(estimate: dict, gpu_mem: int) -> list[str]:
    """One error line per role whose peak does not fit `gpu_mem` bytes, naming the settings that would fix it."""
    errors = []
    usable = usable_bytes(gpu_mem)
    cfg, _, world, _ = estimate["_inputs"]
    if world > 1 and not 1 <= cfg.TARGET_RANKS < world:
        errors.append(f"TARGET_RANKS={cfg.TARGET_RANKS} must be between 1 and {world - 1} on {world} GPUs")
        return errors
    shards = cfg.TARGET_SHARDS
    if world > 1 and cfg.TARGET_RANKS % shards:
        errors.append(f"TARGET_RANKS={cfg.TARGET_RANKS} must be a multiple of TARGET_SHARDS={shards}")
        return errors
    for name, r in estimate["roles"].items():
        if r["total"] <= usable:
            continue
        head = (f"{name} role needs {r['total'] / GiB:.1f} GiB at its peak ({r['peak_phase']}) but "
                f"{usable / GiB:.1f} GiB of the {gpu_mem / GiB:.1f} GiB GPU is usable")
        biggest = sorted(r["terms"], key=lambda t: -t["bytes"])[:3]
        why = "; largest: " + ", ".join(f"{t['short']} {t['bytes'] / GiB:.1f}" for t in biggest)
        knobs = sorted({t["knob"] for t in r["terms"] if t["knob"]},
                       key=lambda k: -sum(t["bytes"] for t in r["terms"] if t["knob"] == k))
        smallest = {k: KNOBS[k][1] for k in knobs}
        floor = estimate_role(estimate["_inputs"], name, smallest)
        fixes = []
        for k in knobs:
            v = _largest_fitting(k, name, estimate["_inputs"], usable)
            if v is not None:
                now = getattr(cfg, k) if getattr(cfg, k) or k != "CE_CHUNK" else "0 (unchunked)"
                fixes.append(f"lower {k} (now {now}) to <= {v}")
        if estimate["colocated"]:
            fixes.append("run on 2+ GPUs (TARGET_RANKS puts target and drafter on separate GPUs)")
        n = _shards_fitting(estimate["_inputs"], usable) if name == "target" else None
        if n:   # the target does not fit one GPU: spread each replica over n of them
            ranks = -(-cfg.TARGET_RANKS // n) * n
            fixes.insert(0, f"raise TARGET_SHARDS (now {shards}) to {n}, each replica of the target spread over {n} "
                            f"GPUs (TARGET_RANKS a multiple of it: {ranks if ranks < world else n}; on several nodes "
                            f"keep a replica inside one)")
            floor = min(floor, usable)
        shard = _fsdp_fit(estimate["_inputs"], usable) if name == "drafter" and \
            cfg.DRAFTER_SHARDING != "fsdp" else None
        if shard:
            n, need = shard
            ranks = f"its {n} drafter ranks" if n == world - cfg.TARGET_RANKS else f">= {n} drafter ranks"
            shard = f"set DRAFTER_SHARDING=fsdp ({need / GiB:.1f} GiB per rank on {ranks})"
        if shard and floor > usable:
            errors.append(f"{head}: even at the smallest {', '.join(knobs)} it needs {floor / GiB:.1f} GiB with "
                          f"every drafter rank holding all weights and optimizer state (ddp): {shard}{why}")
        elif shard:
            errors.append(f"{head}: {shard}" + "".join(f", or {f}" for f in fixes) + why)
        elif floor > usable and not estimate["colocated"]:
            errors.append(f"{head}: even at the smallest {', '.join(knobs)} it needs {floor / GiB:.1f} GiB (weights, "
                          f"optimizer state, gradients), so no setting fixes it: a GPU with more memory is needed{why}")
        elif fixes:
            errors.append(f"{head}: " + ", or ".join(fixes) + why)
        else:
            together = _all_knobs_fitting(name, knobs, estimate["_inputs"], usable)
            fix = ", ".join(f"{k} (now {getattr(cfg, k)}) to <= {v}" for k, v in together.items())
            errors.append(f"{head}: no single setting fixes it; lower together {fix}{why}")
    return errors


def _fsdp_fit(inputs, usable, most=256):
    """The fewest drafter ranks, this run's or more (up to `most`), on which the drafter role fits with
    DRAFTER_SHARDING=fsdp: (ranks, peak bytes per rank), or None."""
    cfg, _, world, _ = inputs
    for n in range(max(1, world - cfg.TARGET_RANKS), most + 1):
        need = estimate_role(inputs, "drafter", {"DRAFTER_SHARDING": "fsdp"}, world=cfg.TARGET_RANKS + n)
        if need <= usable:
            return n, need
    return None


def split_rate(t, d, target_tok_s, drafter_tok_s):
    """Pipeline tokens/s of t target and d drafter GPUs: the slower side sets the pace."""
    return min(t * target_tok_s, d * drafter_tok_s)


def recommend_split(target_tok_s: float, drafter_tok_s: float, n_gpus: int, shards: int = 1) -> tuple[int, int]:
    """(targets, drafters), t + d = n_gpus, both >= 1, t a multiple of `shards` (TARGET_SHARDS: each rank of a sharded
    replica still forwards its own micro-batches, so the target rate stays per GPU), maximising min(t * target rate,
    d * drafter rate) (the same as minimising the slower side's time per token); ties go to fewer target ranks."""
    if n_gpus < shards + 1:
        raise ValueError(f"a split needs >= {shards + 1} GPUs (TARGET_SHARDS={shards} + a drafter), got {n_gpus}; "
                         f"one GPU runs target and drafter colocated")
    best = max(range(shards, n_gpus, shards),
               key=lambda t: (split_rate(t, n_gpus - t, target_tok_s, drafter_tok_s), -t))
    return best, n_gpus - best


def fmt_gib(b) -> str:
    """Bytes as GiB: 2 decimals, or 3 significant digits below 1 GiB (the tiny CPU shapes)."""
    g = b / GiB
    return f"{g:.2f}" if g >= 1 else f"{g:.3g}"


def _k(x):
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


def format_plan(estimate: dict, gpu_mem_bytes=None, rates=None, n_gpus=None) -> str:
    """A few start-up lines: each role's peak and its terms, and the split `rates` = (target tok/s, drafter tok/s per
    GPU) recommends for n_gpus (default: the estimate's world size)."""
    gpu_mem_bytes = gpu_mem_bytes or estimate.get("gpu_mem_bytes")
    head = "memory per GPU (trainer/planner.py estimate"
    head += f"; {usable_bytes(gpu_mem_bytes) / GiB:.1f} of {gpu_mem_bytes / GiB:.1f} GiB usable):" if gpu_mem_bytes \
        else "):"
    lines = [head]
    width = max(len(n) for n in estimate["roles"])
    for name, r in estimate["roles"].items():
        alive = [t for t in r["terms"] if t["phases"] == "static" or r["peak_phase"] in t["phases"]]
        parts = " + ".join(f"{t['short']} {fmt_gib(t['bytes'])}" for t in sorted(alive, key=lambda t: -t["bytes"])
                           if t["bytes"])
        flag = "" if r.get("fits", True) else "  DOES NOT FIT"
        lines.append(f"  {name:<{width}} {fmt_gib(r['total']):>6} GiB peak ({r['peak_phase']}) = {parts}{flag}")
    if rates:
        n = n_gpus or estimate["world_gpus"]
        rt, rd = rates
        if n >= 2:
            t, d = recommend_split(rt, rd, n, estimate["derived"]["shards"])
            lines.append(f"split for {n} GPUs at target {_k(rt)} tok/s, drafter {_k(rd)} tok/s per GPU: {t} target : "
                         f"{d} drafter => {_k(split_rate(t, d, rt, rd))} tok/s (targets {_k(t * rt)}, drafters "
                         f"{_k(d * rd)})" + ("" if (t, d) == tuple(estimate["split"]) or estimate["colocated"]
                                             else f"; configured {estimate['split'][0]}:{estimate['split'][1]}"))
        else:
            lines.append(f"one GPU: colocated, {_k(1 / (1 / rt + 1 / rd))} tok/s (target and drafter take turns)")
    return "\n".join(lines)


def format_terms(estimate: dict, measured: dict | None = None) -> str:
    """Markdown table of every term, role by role; `measured` = {role: peak bytes} adds the measured peak."""
    rows = ["| role | term | alive in | GiB |", "|---|---|---|---:|"]
    for name, r in estimate["roles"].items():
        for t in r["terms"]:
            ph = "static" if t["phases"] == "static" else ", ".join(t["phases"])
            rows.append(f"| {name} | {t['name']} | {ph} | {fmt_gib(t['bytes'])} |")
        rows.append(f"| {name} | **peak estimate** (static + {r['peak_phase']}) | | **{fmt_gib(r['total'])}** |")
        if measured and measured.get(name):
            m = measured[name]
            rows.append(f"| {name} | **measured peak** (max_memory_allocated) | | **{fmt_gib(m)}** "
                        f"(estimate/measured {r['total'] / m:.3f}) |")
    return "\n".join(rows)
