"""The one mask_mod: dense mask vs a naive loop, padded indices, flex vs SDPA."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from model.attention import block_mask, dense_mask, dflash_mask_mod, static_lengths
from model.objective import pack


def random_layout(seed, n_docs=3, B=4, pad=0):
    """Packed documents (optionally followed by `pad` padding rows, doc -1) and random anchors, valid or not
    (document starts with no context, last tokens whose block runs past the document)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (n_docs,), generator=g)
    doc, pos = pack(lengths)
    doc = torch.cat([doc, torch.full((pad,), -1)])
    pos = torch.cat([pos, torch.zeros(pad, dtype=torch.long)])
    T_real = int(lengths.sum())
    N = int(torch.randint(1, 8, (1,), generator=g))
    anchors = torch.sort(torch.randint(0, T_real, (N,), generator=g)).values
    return doc, pos, anchors, doc[anchors]


def naive_mask(doc, pos, anchors, B, causal_block=False, window=None):
    """Straight from docs/ALGORITHM.md (section 2, the mask), in document positions rather than packed indices, one
    pair at a time."""
    T, N = len(doc), len(anchors)
    M = N * B
    m = torch.zeros(M, T + M, dtype=torch.bool)
    for n in range(N):
        a = int(anchors[n])
        for kq in range(B):
            q_pos = int(pos[a]) + kq
            for j in range(T):
                same_doc = int(doc[j]) == int(doc[a])
                ok = same_doc and int(pos[j]) < int(pos[a])        # strictly before the anchor
                if window is not None:
                    ok = ok and q_pos - int(pos[j]) < window
                m[n * B + kq, j] = ok
            for n2 in range(N):
                for kk in range(B):
                    ok = n2 == n and (not causal_block or kk <= kq)
                    if window is not None:
                        ok = ok and kq - kk < window
                    m[n * B + kq, T + n2 * B + kk] = ok
    return m


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal_block,window", [(False, None), (True, 5)])
def test_dense_mask_equals_naive(seed, causal_block, window):
    B = 4
    doc, pos, anchors, anchor_doc = random_layout(seed, B=B, pad=3 if seed % 2 else 0)
    got = dense_mask(anchors, anchor_doc, doc, B, causal_block=causal_block, sliding_window=window)
    want = naive_mask(doc, pos, anchors, B, causal_block, window)
    assert got.dtype == torch.bool and got.shape == want.shape
    assert torch.equal(got, want)
    assert got.any(dim=1).all(), "every query sees at least its own block (no NaN rows)"


def test_mask_mod_clamps_padded_indices():
    # flex evaluates mask_mod on Q and KV padded to its tile: indices past N*B / T+N*B must not read out of bounds
    B = 4
    doc, pos, anchors, anchor_doc = random_layout(1, B=B)
    T, N = len(doc), len(anchors)
    mod = dflash_mask_mod(anchors, anchor_doc, doc, T, B, N)
    q = torch.arange(N * B + 100)[:, None]
    kv = torch.arange(T + N * B + 100)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    big = mod(zero, zero, q, kv)                                     # would raise IndexError without the clamps
    assert torch.equal(big[: N * B, : T + N * B], dense_mask(anchors, anchor_doc, doc, B))
    assert not big[:, T + N * B:].any(), "padded keys are never visible"
    assert not big[N * B:].any(), "padded queries see nothing"
    bm = block_mask(anchors, anchor_doc, doc, B, pad_to=128)      # the GPU padding, built on CPU
    assert bm.seq_lengths == (128, -(-(T + N * B) // 128) * 128)    # both padded to the tile
    # the interval mask_mod a fast-path BlockMask carries, unpadded (CPU): rows up to flex's tile are readable
    # and see nothing past N*B; keys past T+N*B are never visible
    small = block_mask(anchors, anchor_doc, doc, B).mask_mod(zero, zero, torch.arange(128)[:, None], kv)
    rows = min(128, big.shape[0])
    assert torch.equal(small[:rows], big[:rows]) and not small[N * B:].any()


def test_block_mask_covers_dense():
    # the BlockMask's block sparsity must keep every visible (q, kv) pair: expand its block grid and compare
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([150, 90, 70])
    doc, pos = pack(lengths)
    B = 8
    anchors = torch.sort(torch.randperm(int(lengths.sum()) - 1, generator=g)[:40]).values
    dense = dense_mask(anchors, doc[anchors], doc, B)
    bm = block_mask(anchors, doc[anchors], doc, B, pad_to=128)
    blocks = bm.to_dense()[0, 0].bool()                             # [q blocks, kv blocks]
    grid = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)[: dense.shape[0], : dense.shape[1]]
    assert not (dense & ~grid).any()
    assert (~grid).any(), "the layout should leave some kv blocks out entirely"


def test_flex_equals_sdpa_dense():
    # flex_attention has no backward on CPU, so this is a no-grad forward check (eager flex; GPU uses compiled)
    B, nh, nkv, D = 4, 4, 2, 16
    doc, pos, anchors, anchor_doc = random_layout(3, B=B, pad=2)
    T, M = len(doc), len(anchors) * B
    torch.manual_seed(0)
    q = torch.randn(1, nh, M, D)
    k, v = torch.randn(2, 1, nkv, T + M, D)
    from torch.nn.attention.flex_attention import flex_attention
    for causal_block, window in [(False, None), (True, 6)]:
        dm = dense_mask(anchors, anchor_doc, doc, B, causal_block, window)
        bm = block_mask(anchors, anchor_doc, doc, B, causal_block, window, pad_to=128)
        assert bm.seq_lengths == (128, 128)                           # queries and keys padded to the tile
        qp = F.pad(q, (0, 0, 0, 128 - M))
        kp, vp = (F.pad(x, (0, 0, 0, 128 - (T + M)), value=1e4) for x in (k, v))   # padded keys: loud if seen
        with torch.no_grad():
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=dm, enable_gqa=True)
            got = flex_attention(qp, kp, vp, block_mask=bm, enable_gqa=True)[:, :, :M]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_block_mask_equals_create_block_mask(seed):
    """The interval-built BlockMask has exactly the partial and full tiles create_block_mask finds by evaluating
    every pair: packed and padded layouts, bidirectional and sliding layers, flex's 128-row padding and none."""
    from model.attention import block_mask_reference
    g = torch.Generator().manual_seed(seed)
    B = [4, 8, 16, 5, 12, 3][seed % 6]                              # also blocks that straddle 128-row tiles
    lengths = torch.randint(20, 400, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
    doc, pos = pack(lengths)
    if seed % 2:                                                    # padded layout: -1 rows between documents
        doc = torch.cat([torch.cat([doc[doc == i], torch.full((7,), -1)]) for i in range(len(lengths))])
    valid = torch.nonzero(doc >= 0).squeeze(1)
    n = min(len(valid), int(torch.randint(1, 90, (1,), generator=g)))
    anchors = torch.sort(valid[torch.randperm(len(valid), generator=g)[:n]]).values
    fixed = static_lengths(128, B, 2000)                           # the trainer's GPU masks: one fixed length
    for causal_block, window in [(False, None), (True, 37), (False, 200)]:
        for pad, lens in ((1, None), (128, None), (128, fixed)):
            args = (anchors, doc[anchors], doc, B, causal_block, window)
            want = block_mask_reference(*args, pad_to=pad, lengths=lens)
            got = block_mask(*args, pad_to=pad, lengths=lens)
            assert got.seq_lengths == want.seq_lengths == (lens or got.seq_lengths)
            for w, x in [(want.to_dense(), got.to_dense()),
                         (*[BlockMask.from_kv_blocks(m.full_kv_num_blocks, m.full_kv_indices).to_dense()
                            for m in (want, got)],)]:
                assert torch.equal(x, w), (causal_block, window, pad, lens)
            # the mask_mod it carries (its tensors padded to the mask's lengths) is the dense mask, nothing outside
            q_len, kv_len = got.seq_lengths
            zero = torch.zeros((), dtype=torch.int32)
            grid = got.mask_mod(zero, zero, torch.arange(q_len, dtype=torch.int32)[:, None],
                                torch.arange(kv_len, dtype=torch.int32)[None, :])
            M, T = len(anchors) * B, len(doc)
            assert torch.equal(grid[:M, :T + M], dense_mask(*args)) and not grid[M:].any() and \
                not grid[:, T + M:].any(), (causal_block, window, pad, lens)


def test_static_lengths_pad_to_whole_tiles_and_refuse_what_does_not_fit():
    assert static_lengths(512, 16, 12288) == (8192, 20480)
    assert static_lengths(10, 5, 100) == (128, 256)               # 50 queries; 100 + 50 keys
    doc = torch.zeros(300, dtype=torch.long)
    anchors = torch.arange(10, 30)
    bm = block_mask(anchors, doc[anchors], doc, 4, lengths=(128, 512))
    assert bm.seq_lengths == (128, 512)
    tiles = bm.to_dense()[0, 0]
    assert tiles.shape == (1, 4) and not tiles[0, 3].any(), "the padding's key tiles hold no blocks (no compute)"
    with pytest.raises(AssertionError, match="does not fit the mask lengths"):
        block_mask(anchors, doc[anchors], doc, 4, lengths=(128, 256))   # 300 + 80 keys > 256


def test_block_mask_falls_back_when_documents_interleave():
    from model.attention import block_mask_reference
    doc = torch.tensor([0] * 20 + [1] * 20 + [0] * 20)            # document 0 in two pieces
    anchors = torch.tensor([5, 25, 45])
    got, want = block_mask(anchors, doc[anchors], doc, 4), block_mask_reference(anchors, doc[anchors], doc, 4)
    assert torch.equal(got.to_dense(), want.to_dense())
    # planned on the CPU for another device: every tensor the mask_mod reads travels with the mask ("meta" stands
    # in for a GPU here; tests/gpu/test_flex_cuda.py runs the fallback on one)
    moved = block_mask(anchors, doc[anchors], doc, 4, device="meta")
    captured = [c.cell_contents for c in moved.mask_mod.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    assert len(captured) >= 3 and all(t.device.type == "meta" for t in captured), [t.device for t in captured]
    assert all(t.device.type == "meta" for t in moved.as_tuple() if isinstance(t, torch.Tensor))


def test_block_mask_tile_boundaries():
    """Anchors right at a tile edge: the first q tile's smallest anchor is 255, so context tile [128, 256) misses
    exactly its last column for that row (strict <): partial, not full; likewise a window start one column inside a
    tile. Off-by-one intervals flip them."""
    from model.attention import block_mask_reference
    doc = torch.zeros(600, dtype=torch.long)
    for anchors in (torch.arange(255, 271), torch.arange(256, 272), torch.arange(383, 399)):
        for B in (16, 4):
            # window 150 with anchors 256..: the first q tile's latest window start is 256+7+15-150+1 = 129
            for causal_block, window in [(False, None), (True, 130), (True, 150), (False, 150)]:
                args = (anchors, doc[anchors], doc, B, causal_block, window)
                want, got = block_mask_reference(*args, pad_to=128), block_mask(*args, pad_to=128)
                for m in (want, got):
                    m.full = BlockMask.from_kv_blocks(m.full_kv_num_blocks, m.full_kv_indices).to_dense()
                assert torch.equal(got.to_dense(), want.to_dense()) and torch.equal(got.full, want.full)


@pytest.mark.parametrize("layout", ["packed", "interleaved"])
def test_attn_spec_lists_every_tensor_its_masks_read(layout):
    """AttnSpec.device_tensors (what pipe.handoff hands from the side stream to the training stream): each mask's
    index tensors and every tensor its mask_mod captured (the reference: the mask_mod's closure cells), for the
    interval fast path and the create_block_mask fallback, full and sliding masks; dense masks are themselves."""
    from model.attention import make_attn_spec
    doc = torch.tensor([0] * 20 + [1] * 20 + ([0] * 20 if layout == "interleaved" else [2] * 20))
    anchors = torch.tensor([5, 25, 45])
    types = ["full_attention", "sliding_attention"]
    spec = make_attn_spec(anchors, doc[anchors], doc, 4, types, sliding_window=8, flex=True)
    got = {id(t) for t in spec.device_tensors()}
    for m in (spec.full, spec.sliding):
        want = [t for t in m.as_tuple() if isinstance(t, torch.Tensor)]
        want += [c.cell_contents for c in m.mask_mod.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
        assert len(want) > 3 and {id(t) for t in want} <= got
    dense = make_attn_spec(anchors, doc[anchors], doc, 4, types, sliding_window=8, flex=False)
    assert [id(t) for t in dense.device_tensors()] == [id(dense.full), id(dense.sliding)]
