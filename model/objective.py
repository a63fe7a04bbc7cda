"""Training objective on the packed layout: anchors, blocks, decay-weighted CE, acc and streak.

Packed layout: sequences back to back, [T] per token (input_ids, loss_mask, doc_ids, positions).
A block for anchor a is [x_a, MASK * (B-1)] at positions a_pos .. a_pos+B-1; slot k predicts x_{a+k}
(same-position prediction), slot 0 is the anchor itself and never supervised.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import ce_kernel


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


# ---------------------------------------------------------------------------
# Weighted cross-entropy through the frozen lm_head, chunked over rows

@dataclass
class LossParts:
    loss_sum: torch.Tensor     # 0-dim, sum_r w_r * CE_r, carries grad
    weight_sum: torch.Tensor   # 0-dim, sum_r w_r (no grad)
    correct: torch.Tensor      # [M] bool: argmax == label on supervised rows, False elsewhere


def _eager_epilogue(logits, y, w, need_grad):
    """One chunk's CE from its logits: logits [c, V] as the matmul made them (bf16 under autocast), y [c] long,
    w [c] fp32 -> (sum_r w_r CE_r, argmax == y [c], dL/dlogits [c, V] in the logits' dtype, None if not needed).
    In place on one fp32 [c, V] buffer (fewest temporaries). On GPU model.ce_kernel does the same in one kernel."""
    x = logits.float()                                                           # [c, V] fp32, this chunk only
    lse = torch.logsumexp(x, dim=-1)                                             # [c]
    loss = ((lse - x.gather(1, y[:, None]).squeeze(1)) * w).sum()
    correct = x.argmax(-1) == y
    if not need_grad:
        return loss, correct, None
    g = x.sub_(lse[:, None]).exp_()                                              # softmax in place
    g[torch.arange(len(y), device=g.device), y] -= 1.0
    return loss, correct, g.mul_(w[:, None]).to(logits.dtype)                   # dL/dlogits [c, V]


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
    the forward (fused linear + CE, as in Liger), so no [rows, V] logits outlive their chunk."""

    @staticmethod
    def forward(ctx, h, W, labels, w, chunk_size):
        want_gW = ctx.needs_input_grad[1]
        ctx.W_dtype = W.dtype
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_W = torch.zeros_like(W, dtype=torch.float32) if want_gW else None
        need_grad = grad_h is not None or grad_W is not None
        for s in range(0, h.shape[0], chunk_size):
            hc, yc, wc = h[s:s + chunk_size], labels[s:s + chunk_size], w[s:s + chunk_size].float()
            logits = hc @ W.T                                                    # [c, V]
            loss_c, correct[s:s + chunk_size], g = _pick_epilogue(logits)(logits, yc, wc, need_grad)
            loss += loss_c
            if g is None:
                continue
            if grad_h is not None:
                grad_h[s:s + chunk_size] = g @ W
            if grad_W is not None:
                grad_W += (g.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_W)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grad_h, grad_W = ctx.saved_tensors
        gh = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        gW = (grad_W * grad_loss).to(ctx.W_dtype) if grad_W is not None else None
        return gh, gW, None, None, None


def weighted_ce(hidden, lm_head_weight, labels, weights, chunk_size=4096, rows=None) -> LossParts:
    """hidden [M, H], lm_head_weight [V, H], labels [M], weights [M]. Rows with weight 0 never reach the lm_head.
    chunk_size=0: the plain unchunked reference (full [rows, V] logits). rows: the indices of weights > 0 when the
    caller planned them on the CPU (finding them here on a GPU is a device-to-host sync)."""
    if rows is None:
        rows = (weights > 0).nonzero().squeeze(1)                                # [R]
    h, y, w = hidden[rows], labels[rows], weights[rows]
    if chunk_size:
        if not torch.is_grad_enabled():   # eval: the Function would otherwise compute gradients nobody reads
            h, lm_head_weight = h.detach(), lm_head_weight.detach()
        loss_sum, ok = _ChunkedLinearCE.apply(h, lm_head_weight, y, w, chunk_size)
    else:
        logits = (h @ lm_head_weight.T).float()                                  # [R, V]
        loss_sum = (F.cross_entropy(logits, y, reduction="none") * w.float()).sum()
        ok = logits.argmax(-1) == y
    correct = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    correct[rows] = ok
    return LossParts(loss_sum=loss_sum, weight_sum=w.float().sum().detach(), correct=correct)


def block_metrics(correct, weights):
    """correct, weights [N, B] -> sums for all-reduce: acc = acc_num / acc_den over supervised slots (k >= 1),
    streak = streak_num / streak_den = mean accepted prefix per block (an unsupervised slot breaks the streak)."""
    sup = weights > 0
    ok = (correct & sup)[:, 1:].float()                                          # [N, B-1], slot 0 never counts
    return dict(
        acc_num=ok.sum(),
        acc_den=sup[:, 1:].sum().float(),
        streak_num=torch.cumprod(ok, dim=1).sum(),
        streak_den=torch.tensor(float(correct.shape[0]), device=correct.device),
    )
