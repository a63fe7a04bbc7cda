"""Training objective on the packed layout: anchors, blocks, weighted CE (exp decay or D-PACE), acc and streak
(docs/ALGORITHM.md).

The loss weighting lives here, all of it: `make_blocks` writes the exp decay into the blocks' weights
(LOSS_WEIGHTING=exp trains on them, and the status line's loss reads them under either weighting), `dpace_reweight`
makes D-PACE's weights from the drafter's own predictions, `block_loss` picks between the two, and `decay_weighted`
reads any loss on the exp scale.

Packed layout: sequences back to back, [T] per token (input_ids, loss_mask, doc_ids, positions).
A block for anchor a is [x_a, MASK * (B-1)] at positions a_pos .. a_pos+B-1; slot k predicts x_{a+k}
(same-position prediction), slot 0 is the anchor itself and never supervised.
`prepare` turns a received micro-batch into a `Prepared` one: everything a drafter step reads, on its device.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import ce_kernel, fp8
from model.attention import AttnSpec, make_attn_spec, to_device
from model.fp8 import HeadFP8


def pack(lengths):
    """lengths [b] -> doc_ids [T], positions [T] (position inside its own sequence)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)   # [T]
    starts = torch.cumsum(lengths, 0) - lengths                                                       # [b]
    positions = torch.arange(int(lengths.sum()), device=lengths.device) - starts[doc_ids]            # [T]
    return doc_ids, positions


def valid_anchor_mask(loss_mask, doc_ids):
    """[T] bool: p is an anchor when p and p+1 are both assistant tokens of the same (non-padding) document."""
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:-1] = lm[:-1] & lm[1:] & (doc_ids[:-1] == doc_ids[1:]) & (doc_ids[:-1] >= 0)
    return valid


def sample_anchors(loss_mask, doc_ids, max_anchors, generator, min_per_doc=1):
    """Up to max_anchors valid anchors, uniform without replacement, sorted -> anchor_idx [N] (into the packed [T]).

    When the cap binds, each document first gets min(min_per_doc, its valid count) anchors (so short documents are
    not starved by long ones), then the rest are drawn uniformly from what is left. If the floors alone exceed the
    cap, the cap wins and the floor picks are subsampled uniformly.
    """
    cand = valid_anchor_mask(loss_mask, doc_ids).nonzero().squeeze(1)   # [V]
    V = cand.numel()
    if V <= max_anchors:
        return cand
    u = torch.rand(V, generator=generator, device=generator.device).to(cand.device)   # random priority per anchor
    doc = doc_ids[cand]
    # rank of each candidate inside its document by priority: sort by (doc, u); doc ids are small ints, u in [0, 1)
    order = torch.argsort(doc.double() + u.double())
    sorted_doc = doc[order]
    first = torch.searchsorted(sorted_doc, sorted_doc, right=False)    # start of each doc's run
    rank = torch.empty_like(order)
    rank[order] = torch.arange(V, device=cand.device) - first
    floor = rank < min_per_doc
    # floor picks first (in priority order), then everyone else in priority order
    key = u + (~floor).to(u.dtype)                                       # floor in [0, 1), others in [1, 2)
    pick = torch.argsort(key)[:max_anchors]
    return torch.sort(cand[pick]).values


@dataclass
class Blocks:
    ids: torch.Tensor          # [N, B] long: [x_a, MASK, ...]
    positions: torch.Tensor    # [N, B] long: a_pos + k (position inside the document)
    labels: torch.Tensor       # [N, B] long: x_{a+k} (clamped to a valid id where a+k leaves the document)
    weights: torch.Tensor      # [N, B] float: [k>=1] * [a+k in doc] * loss_mask[a+k] * exp(-(k-1)/gamma)
    anchor_idx: torch.Tensor   # [N] index into the packed [T]
    anchor_doc: torch.Tensor   # [N] document of each anchor


def make_blocks(input_ids, loss_mask, doc_ids, positions, anchor_idx, block_size, gamma, mask_token_id) -> Blocks:
    T, B, dev = input_ids.shape[0], block_size, input_ids.device
    k = torch.arange(B, device=dev)                                      # [B]
    idx = anchor_idx[:, None] + k[None, :]                               # [N, B] packed index of slot k's label
    safe = idx.clamp(max=T - 1)
    anchor_doc = doc_ids[anchor_idx]                                     # [N]
    inside = (idx < T) & (doc_ids[safe] == anchor_doc[:, None])          # [N, B]
    ids = torch.full_like(idx, mask_token_id)
    ids[:, 0] = input_ids[anchor_idx]
    decay = torch.exp(-(k - 1).clamp(min=0).float() / gamma) if gamma else torch.ones(B, device=dev)
    weights = (k >= 1)[None, :] * inside * loss_mask[safe].bool() * decay[None, :]   # [N, B]
    return Blocks(
        ids=ids,
        positions=positions[anchor_idx][:, None] + k[None, :],
        labels=input_ids[safe],
        weights=weights.float(),
        anchor_idx=anchor_idx,
        anchor_doc=anchor_doc,
    )


def micro_seed(seed: int, g: int) -> int:
    """Anchors and noise of micro-batch g depend on (seed, g) only: any split, any resume point, same draws."""
    return (seed * 1_000_003 + g) % (2 ** 63 - 1)


@dataclass
class Prepared:
    """A received micro-batch with its blocks and masks built, ready for one forward/backward (T tokens, N blocks
    of B, R supervised slots)."""
    g: int                     # global micro-batch index
    tokens: int                # T
    num_blocks: int            # N
    features: torch.Tensor     # [T, K*H] target hidden states, on the device
    lengths: torch.Tensor      # [b] CPU, tokens per sequence
    input_ids: torch.Tensor    # [T] CPU, packed
    loss_mask: torch.Tensor    # [T] CPU, packed
    ctx_pos: torch.Tensor      # [T] position of each context row inside its sequence
    block_ids: torch.Tensor    # [N*B] anchor token then MASK
    block_pos: torch.Tensor    # [N*B]
    labels: torch.Tensor       # [N*B]
    weights: torch.Tensor      # [N*B] float, the exp-decay weights (0 = not supervised)
    rows: torch.Tensor         # [R] indices of the supervised slots (weights > 0)
    attn: AttnSpec             # the masks, one per layer type

    def device_tensors(self) -> list[torch.Tensor]:
        """Every device tensor written where this was prepared (a side stream): pipe.handoff orders them before
        their use on another stream."""
        return [self.features, self.ctx_pos, self.block_ids, self.block_pos, self.labels, self.weights, self.rows,
                *self.attn.device_tensors()]


def prepare(p, cfg, seed, max_anchors, min_per_doc, gamma, flex=False, device="cpu", lengths=None) -> Prepared:
    """A packet (g, lengths [b], input_ids [T], loss_mask [T] on the CPU, features [T, K*H]) -> Prepared:
    anchors drawn from (seed, g) and blocks planned on the CPU, moved to `device` once. cfg: the DrafterConfig
    (block_size, mask_token_id, layer_types, sliding_window); flex: BlockMasks (else dense masks), of the fixed
    (Q_LEN, KV_LEN) `lengths` when given (attention.static_lengths)."""
    doc_ids, positions = pack(p.lengths)                                                    # [T], [T]
    gen = torch.Generator().manual_seed(micro_seed(seed, p.g))
    anchors = sample_anchors(p.loss_mask, doc_ids, max_anchors, gen, min_per_doc)            # [N]
    blk = make_blocks(p.input_ids, p.loss_mask, doc_ids, positions, anchors, cfg.block_size, gamma, cfg.mask_token_id)
    w = blk.weights.flatten()                                                               # [N*B]
    rows = (w > 0).nonzero().squeeze(1)                                                     # [R] supervised slots
    attn = make_attn_spec(blk.anchor_idx, blk.anchor_doc, doc_ids, cfg.block_size, cfg.layer_types,
                          cfg.sliding_window, flex, device, lengths)   # a BlockMask is planned on the CPU
    return Prepared(g=p.g, tokens=p.num_tokens, num_blocks=len(anchors), features=p.features, lengths=p.lengths,
                    input_ids=p.input_ids, loss_mask=p.loss_mask, ctx_pos=to_device(positions, device),
                    block_ids=to_device(blk.ids.flatten(), device),
                    block_pos=to_device(blk.positions.flatten(), device),
                    labels=to_device(blk.labels.flatten(), device), weights=to_device(w, device),
                    rows=to_device(rows, device), attn=attn)


# ---------------------------------------------------------------------------
# Weighted cross-entropy through the frozen lm_head, chunked over rows

@dataclass
class LossParts:
    loss_sum: torch.Tensor     # 0-dim, sum_r w_r * CE_r, carries grad
    weight_sum: torch.Tensor   # 0-dim, sum_r w_r (no grad)
    correct: torch.Tensor      # [M] bool: argmax == label on supervised rows, False elsewhere
    ce: torch.Tensor           # [R] fp32 CE of each row in `rows` (no grad)
    top_ids: torch.Tensor | None = None   # [R, top_k] the unary top-K ids of each row (weighted_ce(top_k=K)), or None


def _eager_epilogue(logits, y, w, need_grad, fp8_rows=False):
    """One chunk's CE from its logits: logits [c, V] as the matmul made them (bf16 under autocast), y [c] long,
    w [c] fp32 -> (CE_r [c] fp32, argmax == y [c], dL/dlogits of sum_r w_r CE_r [c, V] in the logits' dtype, None
    if not needed). In place on one fp32 [c, V] buffer (fewest temporaries). On GPU model.ce_kernel does the same
    in one kernel. fp8_rows (HEAD_FP8): the gradient as (dL/dlogits / s, clamped to +-448; s [c, 1] fp32, each
    row's e4m3 scale, its largest entry w (1 - p_y) / 448: model/ce_kernel.py says why)."""
    x = logits.float()                                                           # [c, V] fp32, this chunk only
    lse = torch.logsumexp(x, dim=-1)                                             # [c]
    ce = lse - x.gather(1, y[:, None]).squeeze(1)                                # [c]
    correct = x.argmax(-1) == y
    if not need_grad:
        return ce, correct, None
    g = x.sub_(lse[:, None]).exp_()                                              # softmax in place
    at_y = torch.arange(len(y), device=g.device), y
    if fp8_rows:
        scale = (w * (1.0 - g[at_y]) / fp8.E4M3_MAX).clamp_(min=torch.finfo(torch.float32).tiny)[:, None]  # [c, 1]
    g[at_y] -= 1.0
    g.mul_(w[:, None])
    if fp8_rows:
        return ce, correct, (g.div_(scale).clamp_(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(logits.dtype), scale)
    return ce, correct, g.to(logits.dtype)                                       # dL/dlogits [c, V]


CE_KERNELS = ("auto", "eager")
_ce_kernel = "auto"         # auto: the Triton kernel (model.ce_kernel) on GPU tensors, the eager epilogue elsewhere


def set_ce_kernel(kind: str) -> None:
    """Which epilogue the chunked CE runs: auto (the Triton kernel where it runs, else eager) | eager."""
    global _ce_kernel
    assert kind in CE_KERNELS, f"CE kernel {kind!r} is not one of {CE_KERNELS}"
    _ce_kernel = kind


def _pick_epilogue(logits):
    return ce_kernel.ce_epilogue if _ce_kernel == "auto" and ce_kernel.available(logits) else _eager_epilogue


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_r w_r * CE(h_r @ W.T, y_r), one chunk of rows at a time. The gradients are computed chunk by chunk in
    the forward (fused linear + CE, as in Liger), so no [rows, V] logits outlive their chunk.

    reweight: None (w is final), or w = reweight(CE [R]) made after the last chunk from the per-row CE (D-PACE: the
    weights depend on the drafter's own predictions). The chunks then run with unit weights and each row of grad_h
    is scaled by its w_r afterwards, which is exact (row r's gradient is w_r times its unit-weight gradient); the
    lm_head must be frozen then, as grad_W sums over rows and would need every w_r before the first chunk."""

    @staticmethod
    def forward(ctx, h, W, labels, w, chunk_size, reweight, head8=None, top_k=0):
        want_gW = ctx.needs_input_grad[1]
        assert not (want_gW and reweight), "weights made from the CE itself need a frozen lm_head"
        assert not (want_gW and head8), "HEAD_FP8 quantises a frozen lm_head once"
        ctx.W_dtype = W.dtype
        ce = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)        # [R]
        correct = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        top = torch.empty(h.shape[0], top_k, dtype=torch.long, device=h.device)   # [R, K], [R, 0] without top_k
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_W = torch.zeros_like(W, dtype=torch.float32) if want_gW else None
        need_grad = grad_h is not None or grad_W is not None
        w_run = torch.ones_like(w, dtype=torch.float32) if reweight else w.float()
        for s in range(0, h.shape[0], chunk_size):
            hc, yc, wc = h[s:s + chunk_size], labels[s:s + chunk_size], w_run[s:s + chunk_size]
            logits = head8.logits(hc) if head8 is not None else hc @ W.T       # [c, V]
            if top_k:   # before the epilogue, which may write the gradient over the logits
                top[s:s + chunk_size] = logits.topk(top_k, dim=-1).indices
            ce[s:s + chunk_size], correct[s:s + chunk_size], g = _pick_epilogue(logits)(
                logits, yc, wc, need_grad, fp8_rows=head8 is not None)
            if g is None:
                continue
            if head8 is not None:   # g: (dL/dlogits / its row scales, the scales); grad_W is None (asserted)
                grad_h[s:s + chunk_size] = head8.grad_input(g[0], h.dtype, scale=g[1])
                continue
            if grad_h is not None:
                grad_h[s:s + chunk_size] = g @ W
            if grad_W is not None:
                grad_W += (g.T @ hc).float()
        w = reweight(ce).float() if reweight else w_run                          # [R], no grad
        if reweight and grad_h is not None:
            grad_h.copy_(grad_h * w[:, None])                                    # in fp32, rounded once
        weight_sum = w.sum()
        ctx.save_for_backward(grad_h, grad_W)
        ctx.mark_non_differentiable(correct, ce, weight_sum, top)
        return (ce * w).sum(), correct, ce, weight_sum, top

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct, _grad_ce, _grad_weight_sum, _grad_top):
        grad_h, grad_W = ctx.saved_tensors
        gh = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        gW = (grad_W * grad_loss).to(ctx.W_dtype) if grad_W is not None else None
        return gh, gW, None, None, None, None, None, None


def weighted_ce(hidden, lm_head_weight, labels, weights, chunk_size=4096, rows=None, reweight=None,
                top_k=0) -> LossParts:
    """hidden [M, H], lm_head_weight [V, H] (or a model.fp8.HeadFP8 around it: HEAD_FP8, the chunked path's two GEMMs
    in FP8; the unchunked reference uses its bf16 weight), labels [M], weights [M]. Rows with weight 0 never reach
    the lm_head. chunk_size=0: the plain unchunked reference (full [rows, V] logits). rows: the indices of weights > 0
    when the caller planned them on the CPU (finding them here on a GPU is a device-to-host sync). reweight: None, or
    CE [R] (detached, of the rows) -> the weights [R] that replace weights[rows] (dpace_reweight). top_k: also the
    ids of each row's top_k logits (LossParts.top_ids, DFlash2's selector candidates), taken chunk by chunk from
    the logits the CE computes anyway."""
    head8 = lm_head_weight if isinstance(lm_head_weight, HeadFP8) else None
    lm_head_weight = head8.weight if head8 is not None else lm_head_weight
    if rows is None:
        rows = (weights > 0).nonzero().squeeze(1)                                # [R]
    h, y, w = hidden[rows], labels[rows], weights[rows]
    if chunk_size:
        if not torch.is_grad_enabled():   # eval: the Function would otherwise compute gradients nobody reads
            h, lm_head_weight = h.detach(), lm_head_weight.detach()
        loss_sum, ok, ce, weight_sum, top = _ChunkedLinearCE.apply(h, lm_head_weight, y, w, chunk_size, reweight,
                                                                   head8, top_k)
    else:
        logits = (h @ lm_head_weight.T).float()                                  # [R, V]
        ce_grad = F.cross_entropy(logits, y, reduction="none")                   # [R]
        ce = ce_grad.detach()
        w = (reweight(ce) if reweight else w).float()
        loss_sum, weight_sum = (ce_grad * w).sum(), w.sum().detach()
        ok = logits.argmax(-1) == y
        top = logits.topk(top_k, dim=-1).indices
    correct = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    correct[rows] = ok
    return LossParts(loss_sum=loss_sum, weight_sum=weight_sum, correct=correct, ce=ce, top_ids=top if top_k else None)


# ---------------------------------------------------------------------------
# D-PACE weights (vLLM speculators' default weighting): weight each slot by how much the expected
# accepted length depends on it

def dpace_weights(q, supervised, alpha):
    """q [N, B]: the drafter's probability of each slot's label (detached); supervised [N, B] bool -> [N, B].

    With s_i = (1 - alpha) q_i + alpha on supervised slots and 1 elsewhere (slot 0 and slots past the document
    pass through), w_k = sum over supervised j >= k of prod_{i <= j} s_i on supervised k, 0 elsewhere. Unsmoothed
    (alpha = 0) the expected accepted length is E = sum_j prod_{i <= j} q_i and dE/dlog q_k = w_k, so
    sum_k w_k CE_k (CE_k = -log q_k, w detached) has the gradient of -E: a slot counts as much as the acceptance
    that rides on it. alpha > 0 keeps later slots trained while q is still near 0 (early training)."""
    s = torch.where(supervised, (1 - alpha) * q + alpha, torch.ones_like(q))      # [N, B]
    reach = torch.cumprod(s, dim=1) * supervised                                 # [N, B] prod_{i <= j} s_i
    return reach.flip(1).cumsum(1).flip(1) * supervised                          # [N, B] suffix sums


def dpace_reweight(weights, rows, block_size, alpha):
    """For weighted_ce(..., rows=rows, reweight=...): CE [R] of the rows -> D-PACE weights [R]. weights [N*B] marks
    the supervised slots (> 0; their exp decay is not used); rows are its indices > 0, in order."""
    supervised = (weights > 0).view(-1, block_size)                             # [N, B]

    def reweight(ce):
        q = torch.zeros(weights.shape, dtype=torch.float32, device=ce.device)   # [N*B]
        q[rows] = torch.exp(-ce)
        return dpace_weights(q.view(-1, block_size), supervised, alpha).flatten()[rows]
    return reweight


WEIGHTINGS = ("dpace", "exp")   # LOSS_WEIGHTING's values


def block_loss(hidden, lm_head_weight, item, block_size, weighting, dpace_alpha, chunk_size) -> LossParts:
    """weighted_ce of a Prepared micro-batch (hidden [N*B, H]) under LOSS_WEIGHTING `weighting`: exp trains on the
    decay make_blocks wrote into item.weights; dpace on D-PACE's weights (dpace_alpha), made from the drafter's own
    predictions (detached) after the last chunk. Either way the gradients hold sum(w * CE); the step divides them
    by the global sum of the same w."""
    assert weighting in WEIGHTINGS, f"LOSS_WEIGHTING={weighting!r}: allowed are {', '.join(WEIGHTINGS)}"
    reweight = dpace_reweight(item.weights, item.rows, block_size, dpace_alpha) if weighting == "dpace" else None
    return weighted_ce(hidden, lm_head_weight, item.labels, item.weights, chunk_size, rows=item.rows,
                       reweight=reweight)


def decay_weighted(parts, item, weighting):
    """(sum w * CE, sum w) under the exp decay of item.weights whatever the weighting: the status line's loss, so
    runs with either weighting read on one scale."""
    if weighting == "exp":
        return parts.loss_sum.detach(), parts.weight_sum
    w = item.weights.index_select(0, item.rows)                                              # [R]
    return (w * parts.ce).sum(), w.sum()


def block_metrics(correct, weights):
    """correct, weights [N, B] -> sums for all-reduce: acc = acc_num / acc_den over supervised slots (k >= 1),
    streak = streak_num / streak_den = mean accepted prefix per block (an unsupervised slot breaks the streak)."""
    sup = weights > 0
    ok = (correct & sup)[:, 1:].float()                                          # [N, B-1], slot 0 never counts
    return dict(
        acc_num=ok.sum(),
        acc_den=sup[:, 1:].sum().float(),
        streak_num=torch.cumprod(ok, dim=1).sum(),
        streak_den=ok.new_full((), float(correct.shape[0])),   # a fill on the device, no host copy
    )
