"""Anchors, blocks, chunked CE vs the unchunked reference, metrics."""
import math

import pytest
import torch

from model.objective import (block_metrics, make_blocks, pack, sample_anchors, valid_anchor_mask, weighted_ce)


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


def test_block_metrics():
    w = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 1], [0, 1, 1, 1, 1.]])
    c = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]).bool()
    m = block_metrics(c, w)
    assert m["acc_num"].item() == 3 + 3 + 3 and m["acc_den"].item() == 11
    # streaks: 2 (slot 3 wrong), 2 (slot 3 unsupervised breaks it), 0
    assert m["streak_num"].item() == 4 and m["streak_den"].item() == 3
