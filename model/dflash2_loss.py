"""DFlash2's training objective on the packed layout (model/dflash2.py describes the model): the block CE of DFlash
plus alpha x the selector's K-way CE over the unary top-K, teacher forced, under the block CE's own weights; and the
selector's metrics. Apart from model/dflash2.py so that file ships in exports without the trainer's objective."""
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from model import objective
from model.dflash2 import selector_lattice, walk_lattice


# ---------------------------------------------------------------------------
# Selector loss on the packed layout

class _CandidateLogits(torch.autograd.Function):
    """h [R, H], W [V, H] (frozen), cand [R, K] -> h_r . W[cand[r, k]] [R, K] fp32, chunk by chunk: only [c, K, H]
    lm_head rows at a time, in the forward and in the backward."""

    @staticmethod
    def forward(ctx, h, W, cand, chunk_size):
        assert not ctx.needs_input_grad[1], "the selector loss reads a frozen lm_head"
        out = torch.empty(cand.shape, dtype=torch.float32, device=h.device)
        step = chunk_size or h.shape[0] or 1
        for s in range(0, h.shape[0], step):
            out[s:s + step] = torch.einsum("ch,ckh->ck", h[s:s + step], W[cand[s:s + step]].to(h.dtype)).float()
        ctx.save_for_backward(W, cand)
        ctx.chunk_size, ctx.h_dtype = step, h.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        W, cand = ctx.saved_tensors
        step = ctx.chunk_size
        gh = torch.empty(cand.shape[0], W.shape[1], dtype=ctx.h_dtype, device=grad.device)
        for s in range(0, cand.shape[0], step):
            rows = W[cand[s:s + step]]                                             # [c, K, H] in W's dtype
            gh[s:s + step] = torch.einsum("ck,ckh->ch", grad[s:s + step].to(rows.dtype), rows).to(ctx.h_dtype)
        return gh, None, None, None


def training_candidates(top_ids, gold):
    """top_ids [R, K] unary top-K, gold [R] -> (candidates [R, K] with gold in place of the K-th where the top-K
    misses it, the gold's index [R], hit [R] bool: gold was in the unary top-K)."""
    K = top_ids.shape[1]
    match = top_ids == gold[:, None]                                                   # [R, K]
    hit = match.any(1)
    cand = top_ids.clone()
    cand[:, -1] = torch.where(hit, top_ids[:, -1], gold)
    target = torch.where(hit, match.int().argmax(1), torch.full_like(gold, K - 1))
    return cand, target, hit


@dataclass
class SelectorParts:
    loss_sum: torch.Tensor     # 0-dim, sum_r w_r * CE_sel_r, carries grad
    ce: torch.Tensor           # [R] fp32 selector CE of each row (no grad)
    correct: torch.Tensor      # [R] bool: teacher-forced pick == gold (and gold was a real candidate)
    hit: torch.Tensor          # [R] bool: gold in the unary top-K (recall@K)


def selector_loss(selector, hidden, lm_head_weight, labels, rows, w, top_ids, chunk_size=4096) -> SelectorParts:
    """hidden [M, H] (M = N*B), labels [M] (slot 0 of a block holds its anchor's token), rows [R] the supervised
    slots (k >= 1), w [R] their weights (no grad), top_ids [R, K] the unary top-K of those rows
    (objective.weighted_ce(top_k=K).top_ids) -> the K-way teacher-forced selector CE."""
    h, gold, prev = hidden[rows], labels[rows], labels[rows - 1]          # slot k's predecessor: slot k-1's gold
    cand, target, hit = training_candidates(top_ids, gold)
    W = lm_head_weight.detach()
    if not torch.is_grad_enabled():
        h = h.detach()
    scores = _CandidateLogits.apply(h, W, cand, chunk_size) + selector(h, prev, cand)   # [R, K]
    ce = F.cross_entropy(scores, target, reduction="none")                                        # [R]
    correct = hit & (scores.argmax(1) == target)
    return SelectorParts(loss_sum=(ce * w.float()).sum(), ce=ce.detach(), correct=correct, hit=hit)


def dflash2_loss(drafter, hidden, lm_head_weight, item, weighting, dpace_alpha, chunk_size, alpha):
    """objective.block_loss plus alpha x the selector CE under the same weights, for a Prepared micro-batch (hidden
    [N*B, H]) -> (LossParts whose loss_sum is block + alpha x selector, SelectorParts). The step divides the
    gradients by the global sum of the same w, unchanged."""
    assert weighting in objective.WEIGHTINGS, f"LOSS_WEIGHTING={weighting!r}"
    B, K = drafter.config.block_size, drafter.config.selector_top_k
    reweight = objective.dpace_reweight(item.weights, item.rows, B, dpace_alpha) if weighting == "dpace" else None
    parts = objective.weighted_ce(hidden, lm_head_weight, item.labels, item.weights, chunk_size, rows=item.rows,
                                  reweight=reweight, top_k=K)
    w = reweight(parts.ce) if reweight else item.weights.index_select(0, item.rows)            # [R], no grad
    W = lm_head_weight.weight if isinstance(lm_head_weight, objective.HeadFP8) else lm_head_weight
    sel = selector_loss(drafter.candidate_selector, hidden, W, item.labels, item.rows, w, parts.top_ids, chunk_size)
    return replace(parts, loss_sum=parts.loss_sum + alpha * sel.loss_sum), sel


@torch.no_grad()
def selector_metrics(selector, hidden, lm_head_weight, item, block_size, sel: SelectorParts, top_ids,
                     chunk_size=4096) -> dict:
    """Sums for all-reduce, as objective.block_metrics: recall@K = sel_recall_num / sel_den (gold in the unary
    top-K), teacher-forced accuracy = sel_tf_acc_num / sel_den, and path_streak_num / path_streak_den: the accepted
    prefix per block of the selector's own T=0 walk from its anchor (its picks as the predecessors), an unsupervised
    slot ending it, as block_metrics' streak does for the unary argmax. top_ids [R, K]: weighted_ce's, no new
    [rows, V] logits; unsupervised slots get dummy candidates (the streak has ended before them)."""
    M, K, B = item.labels.shape[0], top_ids.shape[1], block_size
    N, rows = M // B, item.rows
    W = lm_head_weight.detach()
    ids = torch.zeros(M, K, dtype=torch.long, device=hidden.device)
    ids[rows] = top_ids
    vals = torch.zeros(M, K, dtype=torch.float32, device=hidden.device)
    vals[rows] = _CandidateLogits.apply(hidden[rows].detach(), W, top_ids, chunk_size)
    labels = item.labels.view(N, B)
    ids, vals = ids.view(N, B, K)[:, 1:], vals.view(N, B, K)[:, 1:]
    path = walk_lattice(selector_lattice(selector, hidden.detach().view(N, B, -1)[:, 1:], vals, ids, labels[:, 0]),
                        ids)                                                                    # [N, B-1]
    ok = ((path == labels[:, 1:]) & (item.weights.view(N, B)[:, 1:] > 0)).float()
    return dict(sel_recall_num=sel.hit.sum().float(), sel_tf_acc_num=sel.correct.sum().float(),
                sel_den=ok.new_full((), float(rows.shape[0])),   # a fill on the device, no host copy
                path_streak_num=torch.cumprod(ok, dim=1).sum(),
                path_streak_den=ok.new_full((), float(N)))
