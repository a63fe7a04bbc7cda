"""DFlash2: the DFlash drafter plus (1) a grouped dynamic causal convolution around the attention and the MLP of every
layer, inside the block only, and (2) a candidate selector that rescores the unary top-K of every slot with a
low-rank bilinear term between the predecessor token, the slot's hidden state and the candidate.

Learned from the public sources (our own code): z-lab/dflash dflash/model.py (`DFlash2DraftModel`,
`GroupedDynamicCausalConv`, `CandidateSelector`; inference only), its training ports in vllm-project/speculators
(src/speculators/models/dflash2/) and sgl-project/SpecForge (specforge/modeling/draft/dflash2.py); the checkpoint's
weight names and shapes from the header of z-lab/Qwen3.8-27B-DFlash2 as recorded by mudler/vllm.cpp's port notes.
Checked against z-lab's DFlash2DraftModel (dflash/model.py at 10129599dffb338ff38cfd235a53ca6d3667b4dd) through a
recorded golden (tools/zlab_golden2.py, tests/unit/test_zlab_golden.py): an export loads strictly into it, and its last
hidden states, unary top-K, selector scores and T=0 proposal are ours, with a sliding layer. It differs in precision
only: it scores the candidates in the model's dtype (bf16 when served) over an unsorted top-K, ours in fp32 best
first, so a bf16 rounding flip or tie can make its walk pick another candidate.

The convolution, per sublayer f (attention or MLP) of a layer, on its normed input u [M, H] (M = N*B block rows):
    c = kernel_projection(u)                                   # [M, 2 (input/output side), taps, G], G = H / group
    v[m] = sum_j (base[0, j] + c[m, 0, j]) * u[m - j]          # coefficients shared by the group's channels
    y = f(v)
    out[m] = sum_j (base[1, j] + c[m, 1, j]) * y[m - j]        # the output side reuses c, made from u
"Dynamic": the coefficients of row m are generated from row m's own input (plus a static base kernel); "causal": row
m reads rows m-1 .. m-taps+1 of its own block, a tap before slot 0 reads zero, none crosses a block. base = [1, 0],
kernel_projection = 0 is the identity, so a fresh DFlash2 computes bitwise what its DFlash backbone computes.
Only block rows are convolved: the context keys/values come from the target's features as in DFlash.

The selector, for slot k (hidden h_k after the final norm, the unary logits z_k = lm_head(h_k)), given the token p
chosen (or verified) at slot k-1 and a candidate c among the unary top-K:
    score(p -> c) = z_k[c] + < predecessor_codebook[p] * hidden_projection(h_k), successor_codebook[c] >
At T=0 the draft walks from the verified anchor, taking at each slot the best-scoring candidate given the one before
(selector_walk). successor_codebook starts at zero (SpecForge's choice), so a fresh selector walks the unary argmax.

Training (model/dflash2_loss.py): the block CE of DFlash plus alpha x a K-way CE over the unary top-K, teacher
forced (the predecessor of slot k is the gold token of slot k-1, the anchor's token for slot 1), with the gold token
put in place of the K-th candidate when the top-K misses it (speculators' variant: a K-way CE always has its label,
and the candidate set stays the one serving scores), weighted by the block CE's own position weights (exp decay or
D-PACE). The top-K ids come out of the chunked CE's own loop (objective.weighted_ce(top_k=K)); the candidates' unary
logits are recomputed from the K rows of the lm_head they need (_CandidateLogits), so no second [rows, V] tensor.
The selector CE's gradient reaches the backbone through the candidates' unary logits and hidden_projection(h), as in
speculators' training.

Where the rest of the tree meets it (model/drafters.py's ARCHS row "dflash2", DRAFTER_ARCH=dflash2):
- the trainer builds, restores and shards DFlash2Drafter (drafters.make_config with the row's knobs, the CONV_* /
  SELECTOR_* settings, which the row's check, drafters.dflash2_check, holds against the target and BLOCK_SIZE);
  INIT_FROM a DFlash export warm-starts it through warm_start (the row's warm_start, settings.load_init_from); a
  checkpoint records DRAFTER_ARCH and a resume as another arch is refused; each checkpoint exports through
  export_dflash2.
- the drafter step's loss is drafters.dflash2_train_loss: dflash2_loss (loss_sum = block + SELECTOR_ALPHA x
  selector, so the division by the global sum of w is unchanged) and selector_metrics, taken before the backward
  and logged beside acc and streak (the row's metrics and status, drafters.selector_status: sel_recall, sel_acc,
  sel_streak).
- param_chunks: the layers' chunks hold the convolutions, the selector is one more chunk after the final norm
  (params_ready waits for it before the loss). no_decay_params keeps the base kernels and the codebooks out of
  WEIGHT_DECAY.
- shard_units: the layers, then the selector as its own FSDP2 unit, not resharded after its forward (the metrics
  read it between the loss and the backward). The loss calls the selector's forward, so FSDP2 gathers it.
- memory_terms: the per-layer convolution params and activations, the selector params (with their gradients and
  AdamW state through the planner's drafter_params), the selector loss's [R, K, r] and [c, K, H] temporaries.
- decoding: draft_tokens is the selector walk; DrafterProposer.draft (the HF decode loop), drafts_at_every_anchor
  (the walk and the teacher-forced streak) and the fast loop's DraftState (static shapes, no host sync: graph-safe)
  call it; the fast loop's layers apply the convolutions. DDTree refuses a DFlash2 drafter (its expansion from
  selector_lattice is not written). eval_dflash.py loads either export (drafters.load_export by `architectures`).
- DRAFTER_FP8 converts the layers' attention and MLP projections only: the kernel projections and the selector's
  hidden projection stay bf16.
- attention: without `is_causal` in config.json, z-lab's reference (dflash/model.py at 10129599) and vLLM make
  sliding layers causal inside the block with the window, full layers bidirectional: as ours (DFLASH_SPEC.md), and
  export_dflash2 writes no `is_causal`. z-lab's published DFlash2 drafters say `is_causal: false` with every layer
  sliding (bidirectional in the block, a two-sided window), so fine-tuning one needs a non-causal sliding mask
  (attention.py: causal_block=False with a window) and `is_causal: false` in its export; until then
  DFlash2Config.from_serving refuses an `is_causal` that disagrees with the layer types.
- unary logits: z-lab's reference scales the noise embedding by `input_embedding_scale` and the unary logits by
  `output_multiplier` then soft-caps them (`final_logit_softcapping`) before the selector; all absent (1, 1, none)
  for the Qwen3 drafters, and not implemented here (from_serving refuses a config that sets them): a target that
  needs them needs them in training too.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

from .drafter import DecoderLayer, Drafter, DrafterConfig


# ---------------------------------------------------------------------------
# Config

@dataclass
class DFlash2Config(DrafterConfig):
    conv_kernel_size: int = 2      # taps of each block-local convolution: slot k reads slots k-taps+1 .. k
    conv_group_size: int = 16      # channels sharing one dynamic coefficient (divides hidden_size)
    selector_rank: int = 256       # rank of the bilinear predecessor x hidden x candidate term
    selector_top_k: int = 16       # K: unary candidates the selector rescores per slot

    def __post_init__(self):
        super().__post_init__()
        assert self.hidden_size % self.conv_group_size == 0, \
            f"conv_group_size={self.conv_group_size} does not divide hidden_size={self.hidden_size}"
        assert 1 <= self.conv_kernel_size <= self.block_size, \
            f"conv_kernel_size={self.conv_kernel_size} outside 1..block_size={self.block_size}"
        assert self.selector_rank >= 1, f"selector_rank={self.selector_rank}"
        assert 1 <= self.selector_top_k <= self.vocab_size, \
            f"selector_top_k={self.selector_top_k} outside 1..vocab_size={self.vocab_size}"

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_serving(cls, c: dict) -> "DFlash2Config":
        """Refuses a config that z-lab's DFlash2DraftModel (the serving reference) would run differently from this
        drafter rather than load it wrong: an `is_causal` against the layer rule (sliding layers causal, full
        ones not), or a noise-embedding scale, logit multiplier or soft-cap this project does not implement."""
        d = c["dflash_config"]
        layers = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
        if c.get("is_causal") is not None:
            assert all((t == "sliding_attention") == bool(c["is_causal"]) for t in layers), \
                f"is_causal={c['is_causal']} with layer_types={layers}: not this drafter's attention"
        for name in ("input_embedding_scale", "output_multiplier"):
            assert float(d.get(name, c.get(name, 1.0))) == 1.0, f"{name}={d.get(name, c.get(name))}: not implemented"
        cap = d.get("final_logit_softcapping", c.get("final_logit_softcapping"))
        assert cap is None or float(cap) <= 0, f"final_logit_softcapping={cap}: not implemented"
        return cls.from_drafter(DrafterConfig.from_serving(c), conv_kernel_size=d["conv_kernel_size"],
                                conv_group_size=d["conv_group_size"], selector_rank=d["selector_rank"],
                                selector_top_k=d["selector_top_k"])


# ---------------------------------------------------------------------------
# Grouped dynamic causal convolution, inside the block

def block_conv(x, coef, base, block_size: int):
    """x [M, H] block rows (blocks of block_size contiguous; a last partial block is allowed), coef [M, taps, G]
    dynamic coefficients, base [taps, H] static kernel -> [M, H]:
    out[m] = sum_j (base[j] + coef[m, j] expanded over its group) * x[m - j], where slot(m) >= j (no tap crosses a
    block; before slot 0 is zero)."""
    M, H = x.shape
    taps, G = coef.shape[1], coef.shape[2]
    xg = x.view(M, G, H // G)                                                   # [M, G, gs]
    slot = torch.arange(M, device=x.device) % block_size                       # [M]
    out = None
    for j in range(taps):
        k = base[j].to(x.dtype).view(1, G, H // G) + coef[:, j, :, None]        # [M, G, gs]
        if j == 0:
            term = k * xg
        else:
            prev = torch.cat([xg.new_zeros(j, G, H // G), xg[:-j]])              # row m holds x[m - j]
            term = k * prev * (slot >= j).to(x.dtype)[:, None, None]
        out = term if out is None else out + term
    return out.view(M, H)


class GroupedDynamicCausalConv(nn.Module):
    """The two convolutions around one sublayer: prepare(u) convolves its input and returns the output side's
    coefficients (made from the same u); finish(y, coef) convolves its output."""

    def __init__(self, hidden_size: int, block_size: int, taps: int, group_size: int):
        super().__init__()
        self.block_size, self.taps, self.groups = block_size, taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))     # [input/output side, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """The identity: base [1, 0, ...] on both sides, no dynamic part."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, u):
        coef = self.kernel_projection(u).view(u.shape[0], 2, self.taps, self.groups)      # [M, 2, taps, G]
        return block_conv(u, coef[:, 0], self.base_kernel[0], self.block_size), coef[:, 1]

    def finish(self, y, coef):
        return block_conv(y, coef, self.base_kernel[1], self.block_size)


class DFlash2Layer(DecoderLayer):
    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        conv = dict(hidden_size=cfg.hidden_size, block_size=cfg.block_size, taps=cfg.conv_kernel_size,
                    group_size=cfg.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(**conv)
        self.mlp_conv = GroupedDynamicCausalConv(**conv)

    def forward(self, x, ctx, cos, sin, mask):
        u, coef = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, ctx, cos, sin, mask), coef)
        u, coef = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), coef)

    def step(self, x, k_ctx, v_ctx, cos, sin, mask):
        u, coef = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn.step(u, k_ctx, v_ctx, cos, sin, mask), coef)
        u, coef = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), coef)


# ---------------------------------------------------------------------------
# Candidate selector

class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))   # [V, r]
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))     # [V, r]
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)         # [r, H]
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """successor_codebook = 0: the bilinear term starts at zero (the walk is the unary argmax) and the successor
        factor learns first; the other two get signal once it is non-zero."""
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.zeros_(self.successor_codebook)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def forward(self, hidden, prev, cand):
        """transition() as the module's forward: FSDP2 all-gathers the selector (its own unit) around it."""
        return self.transition(hidden, prev, cand)

    def transition(self, hidden, prev, cand):
        """hidden [..., H], prev [...] predecessor ids, cand [..., K] candidate ids -> [..., K] fp32 bilinear scores."""
        ctx = self.predecessor_codebook[prev].float() * self.hidden_projection(hidden).float()    # [..., r]
        return torch.einsum("...r,...kr->...k", ctx, self.successor_codebook[cand].float())


class DFlash2Drafter(Drafter):
    """Drafter with DFlash2Layers and a candidate_selector. forward / step / context_kv are the Drafter's (the layers
    carry the convolutions); the selector is applied by the caller on the output (selector_walk, dflash2_loss)."""

    layer_class = DFlash2Layer
    arch = "dflash2"

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)
        self.reset_own_parameters()   # after Drafter's init of every Linear: the identity convolutions

    def reset_own_parameters(self):
        """The DFlash2 parameters at their init: identity convolutions, zero transition."""
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        self.candidate_selector.reset_parameters()

    def param_chunks(self) -> list[list[nn.Parameter]]:
        """Drafter's chunks (the convolutions live in the layers) plus the selector, read after the final norm."""
        return [*super().param_chunks(), list(self.candidate_selector.parameters())]

    def shard_units(self) -> list[nn.Module]:
        """The layers, then the selector as its own FSDP2 unit (two [V, r] codebooks: the largest new tensors)."""
        return [*super().shard_units(), self.candidate_selector]

    def no_decay_params(self) -> list[nn.Parameter]:
        """The base kernels (the identity they should stay near, not zero) and the codebooks (embedding-like tables
        whose rows most steps do not read) keep out of weight decay."""
        sel = self.candidate_selector
        return [p for layer in self.layers for conv in (layer.attention_conv, layer.mlp_conv)
                for p in (conv.base_kernel,)] + [sel.predecessor_codebook, sel.successor_codebook]

    @staticmethod
    def memory_terms(H, V, L, M, R, ce_rows, knobs) -> dict:
        """Drafter.memory_terms: per layer two convolutions of 2 x taps x H (base) + 2 x taps x G x H (projection)
        params; the selector 2 x V x r + r x H; per convolution its [M, 2, taps, G] coefficients and an [M, H] tensor
        per side; the selector loss [R, K, r] successor rows and [R, r] twice in fp32, [ce_rows, K, H] lm_head rows."""
        taps, r, K = knobs.CONV_KERNEL_SIZE, knobs.SELECTOR_RANK, knobs.SELECTOR_TOP_K
        G = H // knobs.CONV_GROUP_SIZE
        return {"params": L * 2 * (2 * taps * H + 2 * taps * G * H) + 2 * V * r + r * H,
                "acts": L * 2 * (M * 2 * taps * G + 2 * M * H),
                "loss_fp32": R * K * r + 2 * R * r + 4 * R * K, "loss_bf16": ce_rows * K * H}

    def draft_tokens(self, hidden, lm_head, anchor_ids):
        """The T=0 draft: the selector's walk from the verified anchors (hidden [n, S, H], anchor_ids [n] ->
        tokens [n, S]); static shapes, no host sync."""
        return selector_walk(self.candidate_selector, hidden, lm_head.weight, anchor_ids)


def dflash2_keys(drafter: DFlash2Drafter) -> set[str]:
    """The state-dict keys a DFlash checkpoint does not have."""
    return {k for k in drafter.state_dict() if ".attention_conv." in k or ".mlp_conv." in k
            or k.startswith("candidate_selector.")}


def warm_start(drafter: DFlash2Drafter, dflash_state: dict, assign: bool = False) -> None:
    """Load a DFlash drafter's state dict into a DFlash2 drafter: every backbone key must match (names and shapes),
    the DFlash2 parameters are reset to their init (identity convolutions, zero transition), so the warm-started
    drafter drafts exactly what the DFlash one did. assign: a meta-device build takes the state's tensors
    (load_state_dict(assign=True)) and its DFlash2 parameters are materialised on the state's device and dtype."""
    new = dflash2_keys(drafter)
    extra = sorted(k for k in dflash_state if k in new)
    assert not extra, f"the DFlash state already holds DFlash2 keys {extra[:4]}: load it with load_state_dict"
    missing, unexpected = drafter.load_state_dict(dflash_state, strict=False, assign=assign)
    assert not unexpected, f"keys the DFlash2 drafter does not have: {unexpected[:8]}"
    assert set(missing) == new, f"backbone keys missing from the DFlash state: {sorted(set(missing) - new)[:8]}"
    if assign:
        like = next(iter(dflash_state.values()))
        for m in [c for layer in drafter.layers for c in (layer.attention_conv, layer.mlp_conv)] \
                + [drafter.candidate_selector]:
            m.to_empty(device=like.device).to(like.dtype)
    drafter.reset_own_parameters()


# ---------------------------------------------------------------------------
# T=0 proposal: the selector's walk from the verified anchor

def candidates(hidden, lm_head_weight, top_k):
    """hidden [..., H] -> (unary logits of the top-K [..., K] fp32, their ids [..., K]), best first."""
    logits = (hidden.to(lm_head_weight.dtype) @ lm_head_weight.T).float()                # [..., V]
    vals, ids = logits.topk(top_k, dim=-1)
    return vals, ids


def selector_lattice(selector, hidden, cand_logits, cand_ids, anchor_ids):
    """Edge scores of every slot: hidden [n, S, H] of the S drafted slots (block slots 1..B-1), cand_logits and
    cand_ids [n, S, K], anchor_ids [n] -> [n, S, K (predecessor candidate), K (candidate)]. Slot 0's predecessor is
    the anchor (its K rows are equal); slot s's are the candidates of slot s-1."""
    n, S, K = cand_ids.shape
    prev = torch.cat([anchor_ids[:, None, None].expand(n, 1, K), cand_ids[:, :-1]], dim=1)     # [n, S, K]
    ctx = (selector.predecessor_codebook[prev].float()
           * selector.hidden_projection(hidden).float()[:, :, None])                            # [n, S, K, r]
    succ = selector.successor_codebook[cand_ids].float()                                        # [n, S, K, r]
    return cand_logits.float()[:, :, None, :] + torch.einsum("nspr,nscr->nspc", ctx, succ)


def walk_lattice(lattice, cand_ids):
    """lattice [n, S, K, K], cand_ids [n, S, K] -> tokens [n, S]: at each slot the best candidate given the one
    chosen before (static shapes, no host sync)."""
    n, S, K = cand_ids.shape
    rows = torch.arange(n, device=cand_ids.device)
    pick = torch.zeros(n, dtype=torch.long, device=cand_ids.device)   # slot 0: every predecessor row is the anchor
    out = []
    for s in range(S):
        pick = lattice[rows, s, pick].argmax(-1)                                             # [n]
        out.append(cand_ids[rows, s, pick])
    return torch.stack(out, dim=1)


def selector_walk(selector, hidden, lm_head_weight, anchor_ids):
    """The T=0 draft of n blocks: hidden [n, S, H] (the drafter's output at the drafted slots), anchor_ids [n] the
    verified anchors -> tokens [n, S]."""
    vals, ids = candidates(hidden, lm_head_weight, selector.top_k)
    return walk_lattice(selector_lattice(selector, hidden, vals, ids, anchor_ids), ids)
