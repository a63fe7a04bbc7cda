"""Anchors, blocks, chunked CE vs the unchunked reference, D-PACE weights vs a loop reference, metrics."""
import math

import pytest
import torch

from model.objective import (block_metrics, dpace_reweight, dpace_weights, make_blocks, pack, sample_anchors,
                             valid_anchor_mask, weighted_ce)


def test_pack():
    doc, pos = pack([3, 1, 2])
    assert doc.tolist() == [0, 0, 0, 1, 2, 2]
    assert pos.tolist() == [0, 1, 2, 0, 0, 1]


def test_valid_anchor_mask():
    doc, _ = pack([4, 3])
    lm = torch.tensor([0, 1, 1, 1, 1, 1, 0], dtype=torch.uint8)
    # p=3: next token is another document; p=5: next is not assistant; p=6: last token
    assert valid_anchor_mask(lm, doc).tolist() == [False, True, True, False, True, False, False]


def test_sample_anchors_cap_floor_seed():
    doc, _ = pack([200, 5, 6])
    lm = torch.ones(len(doc), dtype=torch.uint8)
    valid = valid_anchor_mask(lm, doc)
    g = lambda: torch.Generator().manual_seed(7)
    a = sample_anchors(lm, doc, 10, g(), min_per_doc=2)
    assert len(a) == 10 and torch.equal(a, torch.sort(a).values) and len(set(a.tolist())) == 10
    assert valid[a].all()
    counts = torch.bincount(doc[a], minlength=3)
    assert (counts >= 2).all(), f"short documents starved: {counts.tolist()}"
    assert torch.equal(a, sample_anchors(lm, doc, 10, g(), min_per_doc=2)), "same seed, same anchors"
    assert not torch.equal(a, sample_anchors(lm, doc, 10, torch.Generator().manual_seed(8), min_per_doc=2))
    assert torch.equal(sample_anchors(lm, doc, 10_000, g()), valid.nonzero().squeeze(1)), "under the cap: all"
    # uniform over the long document: every candidate gets picked eventually
    seen = torch.zeros(len(doc), dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        seen[sample_anchors(lm, doc, 10, gen)] = True
    assert torch.equal(seen, valid)


def test_make_blocks_same_position_labels_and_weights():
    ids = torch.arange(100, 110)                       # token at packed index i is 100 + i
    lens = [6, 4]
    doc, pos = pack(lens)
    lm = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1, 1, 1])
    anchors = torch.tensor([1, 7])
    B, gamma, MASK = 4, 2.0, 99
    b = make_blocks(ids, lm, doc, pos, anchors, B, gamma, MASK)
    assert b.ids.tolist() == [[101, MASK, MASK, MASK], [107, MASK, MASK, MASK]]
    assert b.positions.tolist() == [[1, 2, 3, 4], [1, 2, 3, 4]]
    # slot k predicts the token AT a+k (not a+k+1)
    assert b.labels[0].tolist() == [101, 102, 103, 104]
    assert b.labels[1, :3].tolist() == [107, 108, 109]
    d = [math.exp(-k / gamma) for k in range(3)]
    # anchor 1: slot 3 (index 4) is not assistant; anchor 7: slot 3 runs past the end of the packed batch
    torch.testing.assert_close(b.weights, torch.tensor([[0, d[0], d[1], 0], [0, d[0], d[1], 0]]))
    assert b.anchor_doc.tolist() == [0, 1]
    # a block running into the next document stops there
    b2 = make_blocks(ids, torch.ones(10), doc, pos, torch.tensor([4]), B, gamma, MASK)
    assert b2.weights[0].tolist() == [0, 1, 0, 0]


def test_chunked_ce_matches_reference():
    torch.manual_seed(0)
    M, H, V = 37, 16, 50
    hidden = torch.randn(M, H, )
    W = torch.randn(V, H, )
    labels = torch.randint(0, V, (M,))
    weights = torch.rand(M) * (torch.rand(M) > 0.3)
    res = {}
    for chunk in (0, 5, 64):
        h, w = hidden.clone().requires_grad_(), W.clone().requires_grad_()   # trainable lm_head copy
        p = weighted_ce(h, w, labels, weights, chunk_size=chunk)
        (p.loss_sum * 0.7).backward()                                        # non-unit upstream grad
        res[chunk] = (p.loss_sum.detach(), p.weight_sum, p.correct, h.grad, w.grad)
    for chunk in (5, 64):
        for got, want in zip(res[chunk], res[0]):
            if want.dtype == torch.bool:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # fp32 logits in both
    assert not res[0][2][weights == 0].any(), "unsupervised rows are never counted correct"
    assert (res[0][3][weights == 0] == 0).all(), "rows with weight 0 get no gradient"
    # frozen lm_head: only hidden gets a gradient
    h = hidden.clone().requires_grad_()
    weighted_ce(h, W, labels, weights, chunk_size=8).loss_sum.backward()
    torch.testing.assert_close(h.grad, res[0][3] / 0.7)


def dpace_loop(q, sup, alpha):
    """D-PACE written out slot by slot: w_k = sum over supervised j >= k of prod_{i <= j} s_i, with
    s_i = (1 - alpha) q_i + alpha on supervised slots and 1 on the others."""
    N, B = len(q), len(q[0])
    w = [[0.0] * B for _ in range(N)]
    for n in range(N):
        for k in range(B):
            if not sup[n][k]:
                continue
            for j in range(k, B):
                if sup[n][j]:
                    prod = 1.0
                    for i in range(j + 1):
                        prod *= (1 - alpha) * q[n][i] + alpha if sup[n][i] else 1.0
                    w[n][k] += prod
    return w


def test_dpace_weights_by_hand():
    q = torch.tensor([[0.9, 0.6, 0.2, 1.0], [0.9, 0.2, 0.7, 0.6]])     # slot 0 (the anchor) is never supervised
    sup = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 1]]).bool()            # block 1: slot 2 unsupervised, passes through
    # alpha 0.5: s = 0.8 0.6 1.0 -> reach 0.8 0.48 0.48; block 1: s = 0.6 (1) 0.8 -> reach 0.6 - 0.48
    want = torch.tensor([[0, 0.8 + 0.48 + 0.48, 0.48 + 0.48, 0.48], [0, 0.6 + 0.48, 0, 0.48]])
    torch.testing.assert_close(dpace_weights(q, sup, 0.5), want)
    torch.testing.assert_close(torch.tensor(dpace_loop(q.tolist(), sup.tolist(), 0.5)), want)
    # alpha 1: every s is 1, w_k counts the supervised slots from k on; alpha 0: the plain acceptance products
    torch.testing.assert_close(dpace_weights(q, sup, 1.0), torch.tensor([[0, 3, 2, 1], [0, 2, 0, 1.]]))
    torch.testing.assert_close(dpace_weights(q, sup, 0.0),
                               torch.tensor([[0, .6 + .12 + .12, .12 + .12, .12], [0, .2 + .12, 0, .12]]))
    g = torch.Generator().manual_seed(3)
    q, sup = torch.rand(6, 5, generator=g), torch.rand(6, 5, generator=g) > 0.3
    for alpha in (0.0, 0.3, 1.0):
        torch.testing.assert_close(dpace_weights(q, sup, alpha), torch.tensor(dpace_loop(q.tolist(), sup.tolist(), alpha)))


@pytest.mark.parametrize("chunk", [0, 3, 64])
def test_dpace_ce_equals_reference(chunk):
    """weighted_ce with D-PACE weights, unchunked and chunked (the fused path computes the gradients before the
    weights exist and scales them afterwards) == a reference: full logits, q = softmax at the label, weights from
    the slot loop, detached, loss sum_r w_r CE_r by autograd."""
    torch.manual_seed(0)
    N, B, H, V, alpha = 5, 4, 16, 50, 0.3
    hidden, W = torch.randn(N * B, H), torch.randn(V, H) * 0.3
    labels = torch.randint(0, V, (N * B,))
    decay = torch.tensor([0.0, 1.0, 0.7, 0.5]).repeat(N)                 # what make_blocks gives: exp decay ...
    decay[[6, 13, 14, 15]] = 0                                           # ... with holes and an empty block
    rows = (decay > 0).nonzero().squeeze(1)

    h = hidden.clone().requires_grad_()
    logits = (h @ W.T).float()
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")              # [N*B]
    q = torch.exp(-ce.detach()).view(N, B)
    w = torch.tensor(dpace_loop(q.tolist(), (decay > 0).view(N, B).tolist(), alpha)).flatten()
    want_loss = (w * ce).sum()
    (want_loss * 0.7).backward()

    got_h = hidden.clone().requires_grad_()
    p = weighted_ce(got_h, W, labels, decay, chunk_size=chunk, rows=rows, reweight=dpace_reweight(decay, rows, B, alpha))
    (p.loss_sum * 0.7).backward()
    torch.testing.assert_close(p.loss_sum.detach(), want_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p.weight_sum, w.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_h.grad, h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(p.ce, ce.detach()[rows], rtol=1e-5, atol=1e-6)
    assert torch.equal(p.correct, (logits.argmax(-1) == labels) & (decay > 0))
    # not the exp-decay loss: the D-PACE weights really replaced the given ones
    assert abs(float(p.weight_sum) - float(decay.sum())) > 0.1


def test_block_metrics():
    w = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 1], [0, 1, 1, 1, 1.]])
    c = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]).bool()
    m = block_metrics(c, w)
    assert m["acc_num"].item() == 3 + 3 + 3 and m["acc_den"].item() == 11
    # streaks: 2 (slot 3 wrong), 2 (slot 3 unsupervised breaks it), 0
    assert m["streak_num"].item() == 4 and m["streak_den"].item() == 3
