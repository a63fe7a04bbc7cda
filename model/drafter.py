"""The DFlash drafter: L Qwen3-style decoder layers with the target's context features injected as extra keys/values
in every layer. No embedding, no lm_head: the caller embeds the block with the target's frozen embedding and applies
the target's lm_head to the output.

Parameter names are the serving-format keys (layers.{i}.self_attn.q_proj.weight, ..., fc.weight, hidden_norm.weight,
norm.weight) so export is a plain state_dict save and z-lab's DFlashDraftModel / SGLang / vLLM load it as is.
"""
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

# relative, so model/export.py can ship this file and attention.py beside the weights (model/modeling_dflash.py)
from . import attention
from .attention import AttnSpec, make_attn_spec


def default_layer_ids(n_layers: int, k: int) -> list[int]:
    """K target layers to tap, spread from layer 1 to n-3 (docs/ALGORITHM.md, section 1; z-lab's
    build_target_layer_ids)."""
    if k == 1:
        return [n_layers // 2]
    return [int(round(1 + i * (n_layers - 4) / (k - 1))) for i in range(k)]


# ---------------------------------------------------------------------------
# Config

def rope_from_hf(cfg) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) of an HF config. transformers 5 nests both in `rope_parameters`;
    4.x configs keep `rope_theta` / `rope_scaling` at the top level."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
    scaling = getattr(cfg, "rope_scaling", None) if not params else params
    scaling = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None            # None = default RoPE; else {"rope_type": "linear" | "llama3", ...}
    max_position_embeddings: int
    num_hidden_layers: int               # L, drafter layers
    num_target_layers: int               # n, layers of the target
    target_layer_ids: list[int]          # K tapped target layers (decoder layer l == HF hidden_states[l + 1])
    block_size: int                      # B
    mask_token_id: int
    vocab_size: int                      # the target's embedding rows (written to config.json for loaders)
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention", one per layer
    sliding_window: int | None = None
    attention_bias: bool = False

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        assert len(self.layer_types) == self.num_hidden_layers, f"{len(self.layer_types)=} != {self.num_hidden_layers=}"
        assert set(self.layer_types) <= {"full_attention", "sliding_attention"}, self.layer_types
        assert "sliding_attention" not in self.layer_types or self.sliding_window, "sliding layers need sliding_window"
        assert all(0 <= l < self.num_target_layers for l in self.target_layer_ids), \
            f"target_layer_ids {self.target_layer_ids} outside 0..{self.num_target_layers - 1}"
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert self.block_size >= 2, "a block is the anchor plus at least one token to draft"

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_drafter(cls, cfg: "DrafterConfig", **own) -> "DrafterConfig":
        """This config class from a DFlash one: cfg's DrafterConfig fields, plus the class's own (a variant's knobs,
        e.g. DFlash2Config's conv_kernel_size=)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(DrafterConfig)}, **own)

    @classmethod
    def from_serving(cls, c: dict) -> "DrafterConfig":
        """The config.json of an export (model/export.py serving_config), read by transformers 4 or 5 alike."""
        rp = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or {k: v for k, v in rp.items() if k != "rope_theta"}
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return cls(
            hidden_size=c["hidden_size"],
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c["head_dim"],
            intermediate_size=c["intermediate_size"],
            rms_norm_eps=c["rms_norm_eps"],
            rope_theta=float(c.get("rope_theta") or rp.get("rope_theta") or 10000.0),
            rope_scaling=scaling or None,
            max_position_embeddings=c["max_position_embeddings"],
            num_hidden_layers=c["num_hidden_layers"],
            num_target_layers=c["num_target_layers"],
            target_layer_ids=list(c["dflash_config"]["target_layer_ids"]),
            block_size=c["block_size"],
            mask_token_id=c["dflash_config"]["mask_token_id"],
            vocab_size=c["vocab_size"],
            layer_types=list(c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]),
            sliding_window=c.get("sliding_window") if c.get("use_sliding_window") else None,
            attention_bias=c.get("attention_bias", False),
        )

    @classmethod
    def from_target(cls, target_hf_config, num_layers, block_size, mask_token_id, target_layer_ids=None,
                    num_taps=None, sliding_window_layers=0, sliding_window=None):
        """Copy the target's sizes. K defaults to num_layers taps (z-lab's convention). With
        sliding_window_layers = s, the last s layers are sliding (Qwen3's max_window_layers = L - s convention)."""
        t = target_hf_config.get_text_config() if hasattr(target_hf_config, "get_text_config") else target_hf_config
        n = t.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_layer_ids(n, num_taps or num_layers)
        assert num_taps is None or num_taps == len(target_layer_ids), f"{num_taps=} != len({target_layer_ids})"
        assert 0 <= sliding_window_layers <= num_layers, f"{sliding_window_layers=} > {num_layers=}"
        if sliding_window_layers:
            sliding_window = sliding_window or getattr(t, "sliding_window", None)
        theta, scaling = rope_from_hf(t)
        return cls(
            hidden_size=t.hidden_size,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
            intermediate_size=t.intermediate_size,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=t.max_position_embeddings,
            num_hidden_layers=num_layers,
            num_target_layers=n,
            target_layer_ids=list(target_layer_ids),
            block_size=block_size,
            mask_token_id=mask_token_id,
            vocab_size=t.vocab_size,
            layer_types=["full_attention"] * (num_layers - sliding_window_layers)
                        + ["sliding_attention"] * sliding_window_layers,
            sliding_window=sliding_window if sliding_window_layers else None,
            attention_bias=bool(getattr(t, "attention_bias", False)),
        )


# ---------------------------------------------------------------------------
# RoPE (fp32 angles, HF-compatible: default, linear, llama3)

def rope_inv_freq(cfg: DrafterConfig, device=None) -> torch.Tensor:
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))  # [D/2]
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv_freq / s["factor"]
    if kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)   # long wavelengths: divide
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled                 # medium: interpolate
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_type {kind!r} is not implemented in model/drafter.py (default, linear, llama3)")


def rope_cos_sin(positions, cfg: DrafterConfig):
    """positions [P] -> cos, sin [P, D] in fp32 (HF layout: the half-dim angles repeated twice)."""
    freqs = positions.float()[:, None] * rope_inv_freq(cfg, positions.device)[None, :]   # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)                                              # [P, D]
    return emb.cos(), emb.sin()


def _apply_rope(x, cos, sin):
    """x [P, heads, D]; cos, sin [P, D]."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _rms_norm(x, weight, eps):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)   # statistics in fp32, like HF
    return weight * x.to(dtype)


# The elementwise functions every layer calls; compile_drafter(..., "elementwise") swaps in fused versions.
apply_rope, rms_norm = _apply_rope, _rms_norm
COMPILE_MODES = ("off", "elementwise", "layers")


def compile_drafter(drafter, mode: str) -> None:
    """GPU speed, same math: "elementwise" fuses RMSNorm and RoPE (eager they are ~10 kernels each, with fp32
    round trips under autocast) into one Triton kernel per call, forward and backward, for every drafter in the
    process; "layers" also compiles each decoder layer whole (norms, RoPE, concatenations, SiLU and residuals
    between the matmuls; flex_attention is a graph break with its own static compile, model.attention.run_flex),
    the fused norms serving hidden_norm and the final norm outside the layers. Shapes are dynamic (the context
    length changes every micro-batch). Call it on the main thread, before any worker thread runs the drafter.
    "off" undoes all of it."""
    global apply_rope, rms_norm
    assert mode in COMPILE_MODES, f"compile mode {mode!r} is not one of {COMPILE_MODES}"
    apply_rope, rms_norm = _apply_rope, _rms_norm       # "off" restores eager everywhere
    for layer in drafter.layers:
        layer._compiled_call_impl = None                # what nn.Module.compile sets
    if mode in ("elementwise", "layers"):
        apply_rope = torch.compile(_apply_rope, dynamic=True)
        rms_norm = torch.compile(_rms_norm, dynamic=True)
    if mode == "layers":
        for layer in drafter.layers:
            layer.compile(dynamic=True)


# ---------------------------------------------------------------------------
# Layers

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.n_head * D, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=bias)
        self.o_proj = nn.Linear(self.n_head * D, H, bias=bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def kv(self, x, cos, sin):
        """x [P, H] -> keys (k_norm, then RoPE at cos, sin [P, D]) and values, both [P, nkv, D]."""
        P, D = x.shape[0], self.head_dim
        k = apply_rope(self.k_norm(self.k_proj(x).view(P, self.n_kv, D)), cos, sin)   # k_norm on all keys
        return k, self.v_proj(x).view(P, self.n_kv, D)

    def forward(self, h, ctx, cos, sin, mask):
        """h [M, H] normed block states; ctx [T, H] shared context; cos, sin [T+M, D]; mask for [M, T+M]."""
        M, T, D = h.shape[0], ctx.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(h).view(M, self.n_head, D))            # [M, nh, D]
        k, v = self.kv(torch.cat([ctx, h], dim=0), cos, sin)               # [T+M, nkv, D]: context rows first
        return self._attend(apply_rope(q, cos[T:], sin[T:]), k, v, mask)

    def step(self, h, k_ctx, v_ctx, cos, sin, mask):
        """Inference with cached context keys/values: h [M, H] normed block states; k_ctx, v_ctx [T, nkv, D] from
        kv() of the context rows (already RoPE'd); cos, sin [M, D] of the block; mask [M, T+M] bool or None (all)."""
        M, D = h.shape[0], self.head_dim
        q = apply_rope(self.q_norm(self.q_proj(h).view(M, self.n_head, D)), cos, sin)   # [M, nh, D]
        k, v = self.kv(h, cos, sin)                                                      # [M, nkv, D]
        return self._attend(q, torch.cat([k_ctx, k]), torch.cat([v_ctx, v]), mask)

    def _attend(self, q, k, v, mask):
        """q [M, nh, D]; k, v [T+M, nkv, D]; mask: dense bool [M, T+M], a flex BlockMask or None -> [M, H]."""
        M, D = q.shape[0], self.head_dim
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))     # [1, heads, len, D]
        gqa = self.n_head != self.n_kv
        if isinstance(mask, BlockMask):
            o = attention.run_flex(q, k, v, mask, gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(o[0].transpose(0, 1).reshape(M, self.n_head * D))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask):
        # ctx is injected as it is: hidden_norm(fc(features)) once, not this layer's input_layernorm
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(self, x, k_ctx, v_ctx, cos, sin, mask):
        x = x + self.self_attn.step(self.input_layernorm(x), k_ctx, v_ctx, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    layer_class = DecoderLayer   # a subclass's own layers (model/dflash2.py), built once
    arch = "dflash"              # its DRAFTER_ARCH (model/drafters.py)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.layers = nn.ModuleList([self.layer_class(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_taps * H, H, bias=False)   # [H, K*H]
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.apply(self._init_weights)
        # params_ready(i): called before the forward first reads chunk i of its parameters (param_chunks:
        # 0 = fc + hidden_norm, 1..L = the layers, L+1 = the final norm). The trainer's overlapped optimizer sets
        # it to wait for that chunk's update; None otherwise.
        self.params_ready = None

    # What the trainer asks of a drafter, so that a variant answers for its own modules: the optimizer's parameter
    # chunks (trainer/optim.py) and the units FSDP2 shards (trainer/phases.py: shard_drafter).
    def reset_own_parameters(self):
        """A variant's own parameters at their init, after every Linear's (a meta build initialised by hand calls
        it too, bench/bench_dflash.py); DFlash has none."""

    def param_chunks(self) -> list[list[nn.Parameter]]:
        """The parameters in the order the forward first reads them: [fc, hidden_norm], each layer, [norm]."""
        return [list(self.fc.parameters()) + list(self.hidden_norm.parameters()),
                *[list(layer.parameters()) for layer in self.layers], list(self.norm.parameters())]

    def shard_units(self) -> list[nn.Module]:
        """The modules DRAFTER_SHARDING=fsdp shards one by one, before the root (which keeps fc and the norms)."""
        return list(self.layers)

    def draft_tokens(self, hidden, lm_head, anchor_ids):
        """The T=0 draft of n blocks: hidden [n, S, H] at the drafted slots, lm_head the target's (nn.Linear),
        anchor_ids [n] the verified anchors (unused here) -> tokens [n, S]: the argmax of each slot."""
        return lm_head(hidden.to(lm_head.weight.dtype)).argmax(-1)

    def no_decay_params(self) -> list[nn.Parameter]:
        """Matrices WEIGHT_DECAY leaves alone (vectors never decay): none in DFlash."""
        return []

    @staticmethod
    def memory_terms(H, V, L, M, R, ce_rows, knobs) -> dict:
        """What this architecture adds to trainer/planner.py's DFlash terms, in elements (the planner applies the
        dtypes): params (trainable: with their gradients and AdamW state), acts (saved forward activations, in the
        activation dtype), loss_fp32 and loss_bf16 (the loss's extra temporaries). H hidden, V vocab, L layers,
        M = N*B block rows, R supervised rows, ce_rows the CE chunk's rows, knobs the trainer's settings."""
        return {"params": 0, "acts": 0, "loss_fp32": 0, "loss_bf16": 0}

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def attn_spec(self, anchor_idx, anchor_doc, doc_ids, flex=False) -> AttnSpec:
        """Masks for one micro-batch (anchor_idx into the packed [T]); build once, pass to forward."""
        c = self.config
        return make_attn_spec(anchor_idx, anchor_doc, doc_ids, c.block_size, c.layer_types, c.sliding_window, flex)

    def forward(self, features, ctx_positions, block_emb, block_positions, attn: AttnSpec):
        """features [T, K*H], ctx_positions [T], block_emb [M, H] (M = N*B), block_positions [M] -> [M, H]."""
        ready = self.params_ready or (lambda i: None)
        ready(0)
        ctx = self.hidden_norm(self.fc(features))                            # [T, H], shared by every layer
        cos, sin = rope_cos_sin(torch.cat([ctx_positions, block_positions]), self.config)  # [T+M, D]
        x = block_emb                                                        # [M, H]
        for i, (layer, kind) in enumerate(zip(self.layers, self.config.layer_types)):
            ready(i + 1)
            x = layer(x, ctx, cos, sin, attn.for_layer(kind))
        ready(len(self.layers) + 1)
        return self.norm(x)

    # -----------------------------------------------------------------------
    # Inference with a context KV cache (eval_dflash.py): the context keys/values of a layer depend only on the
    # features and their positions (never on the block), so they are computed once per committed token and reused.

    def context_kv(self, features, positions) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [T, K*H], positions [T] -> per layer (keys, values) [T, nkv, D], RoPE'd at their positions."""
        ctx = self.hidden_norm(self.fc(features))                            # [T, H]
        cos, sin = rope_cos_sin(positions, self.config)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def step(self, cache: "DrafterCache", block_emb, block_positions, ctx_valid=None):
        """One block against all cached context: block_emb [M, H] at block_positions [M] (consecutive, all after
        the cached context) -> [M, H]. Same visibility as training's mask for an anchor right after the context:
        full layers see all context + the whole block; sliding layers are causal in the block and see keys less
        than sliding_window positions back. ctx_valid [T] bool: which cached rows are context (a static cache,
        model/fastdecode.py, also holds rows past it); None: all of them."""
        cfg = self.config
        cos, sin = rope_cos_sin(block_positions, cfg)                        # [M, D]
        M = block_positions.shape[0]
        visible = None if ctx_valid is None else torch.cat([ctx_valid, ctx_valid.new_ones(M)])   # [T+M]
        masks = {"full_attention": None if visible is None else visible[None]}   # [1, T+M], or None: all
        if "sliding_attention" in cfg.layer_types:
            kp = torch.cat([cache.positions, block_positions])              # [T+M] key positions
            dist = block_positions[:, None] - kp[None, :]                   # [M, T+M]
            masks["sliding_attention"] = (dist >= 0) & (dist < cfg.sliding_window)
            if visible is not None:
                masks["sliding_attention"] &= visible
        x = block_emb
        for layer, kind, (k, v) in zip(self.layers, cfg.layer_types, cache.kv):
            x = layer.step(x, k, v, cos, sin, masks[kind])
        return self.norm(x)


class DrafterCache:
    """Context keys/values of every drafter layer for one sequence (batch 1): append the features of newly
    committed tokens, crop on rollback. kv[i] = (keys, values) [T, nkv, D]; positions [T]."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        p = next(drafter.parameters())
        c = drafter.config
        empty = torch.empty(0, c.num_key_value_heads, c.head_dim, device=p.device, dtype=p.dtype)
        self.kv = [(empty, empty) for _ in range(c.num_hidden_layers)]
        self.positions = torch.empty(0, dtype=torch.long, device=p.device)

    def __len__(self):
        return self.positions.shape[0]

    def append(self, features, positions):
        """features [n, K*H] of tokens at positions [n] (after everything cached so far)."""
        new = self.drafter.context_kv(features, positions)
        self.kv = [(torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(self.kv, new)]
        self.positions = torch.cat([self.positions, positions])

    def crop(self, n: int):
        """Keep the first n context rows."""
        self.kv = [(k[:n], v[:n]) for k, v in self.kv]
        self.positions = self.positions[:n]
