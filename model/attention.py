"""The one DFlash attention mask, and the two ways to run it.

Packed layout: queries are the N*B block tokens (block n = q_idx // B); keys are [T context ; N*B block].
A query of block n sees
  - context kv of its own document strictly before the anchor (the anchor's own hidden state does not exist at
    inference: the target has not run on that token yet),
  - every token of its own block (bidirectional; causal inside the block for sliding-window layers),
  - nothing of any other block.
`dflash_mask_mod` writes this once with tensor ops only; evaluated on broadcast index grids it is the dense bool
mask of the SDPA path (CPU, tests), and flex's create_block_mask on it is the reference BlockMask. The BlockMask
the trainer uses (block_mask) carries `interval_mask_mod`, the same mask as two key intervals per block (cheaper
inside flex's partial tiles); tests compare the two on the padded grid.
"""
import copy
import functools
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

FLEX_BLOCK = 128  # flex_attention's tile; queries are padded to a multiple of it on GPU
# kernel_options every drafter flex_attention call passes (None: torch's defaults for the GPU). Set it with
# set_flex_kernel_options before anything compiles; bench/bench_dflash.py --mode flex times candidates.
FLEX_KERNEL_OPTIONS: dict | None = None


def set_flex_kernel_options(options: dict | None) -> None:
    global FLEX_KERNEL_OPTIONS
    FLEX_KERNEL_OPTIONS = dict(options) if options else None


def flex_kernel_options(q_len: int, kv_len: int, cuda: bool) -> dict | None:
    """FLEX_KERNEL_OPTIONS for one call, plus on a GPU IS_DIVISIBLE when both lengths are multiples of the tile (the
    GPU padding of block_mask guarantees it; without it every load is bounds-checked). Inductor infers it by itself
    only for static shapes, which the trainer's masks have (static_lengths); other callers' may not."""
    opts = dict(FLEX_KERNEL_OPTIONS or {})
    if cuda and q_len % FLEX_BLOCK == 0 and kv_len % FLEX_BLOCK == 0:
        opts.setdefault("IS_DIVISIBLE", True)
    return opts or None


def dflash_mask_mod(anchor_pos, anchor_doc, ctx_doc, ctx_len, block_size, num_blocks,
                    causal_block=False, sliding_window=None):
    """mask_mod(b, h, q_idx, kv_idx) -> bool for N blocks of B tokens against [T context ; N*B block] keys.

    anchor_pos [N]: index of each anchor in the packed [T]; anchor_doc [N]: its document; ctx_doc [T]: document of
    every context row (-1 = padding, never visible). ctx_len, num_blocks: T and N, ints or 0-dim int32 tensors on
    the mask's device; the mask_mod holds them as tensors, so a compiled flex kernel over it (the bench's
    comparison with interval_mask_mod) reads them instead of baking them in. Query rows past N*B (flex's padding)
    see nothing. causal_block / sliding_window: the sliding-window variant.
    """
    # int32 like flex's q_idx / kv_idx: int64 scalars would turn the kernel's index arithmetic into 64-bit
    # divisions (the static kernel ran slower with them: BENCHMARKS.md, Other figures)
    T, N = (x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int32, device=ctx_doc.device)
            for x in (ctx_len, num_blocks))
    B = block_size

    def mask_mod(b, h, q_idx, kv_idx):
        # flex pads Q and KV up to its tile: clamp every index used to read a tensor so padded rows stay in bounds
        n = torch.minimum(q_idx // B, N - 1)                    # block of the query
        kq = q_idx - n * B                                      # slot of the query inside its block
        a, d = anchor_pos[n], anchor_doc[n]
        is_ctx = kv_idx < T
        c = torch.minimum(kv_idx, T - 1)                        # safe context index
        ctx_ok = is_ctx & (ctx_doc[c] == d) & (kv_idx < a)      # strict <: never the anchor's own features
        kb = torch.clamp(kv_idx - T, min=0)                     # index into the N*B block keys
        kk = kb % B                                             # slot of the key inside its block
        blk_ok = (~is_ctx) & (kb // B == n)                     # padded kv (kb >= N*B) has kb // B >= N != n
        if causal_block:
            blk_ok = blk_ok & (kk <= kq)
        if sliding_window is not None:
            # same document => packed index distance == position distance; the query sits at a + kq
            ctx_ok = ctx_ok & (a + kq - kv_idx < sliding_window)
            blk_ok = blk_ok & (kq - kk < sliding_window)
        return (ctx_ok | blk_ok) & (q_idx < N * B)

    mask_mod.tensors = [t for t in (anchor_pos, anchor_doc, ctx_doc, T, N) if isinstance(t, torch.Tensor)]
    return mask_mod


def _mask_args(anchor_pos, anchor_doc, ctx_doc, block_size, causal_block, sliding_window):
    return dict(anchor_pos=anchor_pos, anchor_doc=anchor_doc, ctx_doc=ctx_doc, ctx_len=ctx_doc.shape[0],
                block_size=block_size, num_blocks=anchor_pos.shape[0], causal_block=causal_block,
                sliding_window=sliding_window)


def dense_mask(anchor_pos, anchor_doc, ctx_doc, block_size, causal_block=False, sliding_window=None):
    """The same mask_mod on broadcast index grids -> bool [N*B, T+N*B] for SDPA."""
    T, M = ctx_doc.shape[0], anchor_pos.shape[0] * block_size
    mod = dflash_mask_mod(**_mask_args(anchor_pos, anchor_doc, ctx_doc, block_size, causal_block, sliding_window))
    q = torch.arange(M, device=ctx_doc.device)[:, None]           # [M, 1]
    kv = torch.arange(T + M, device=ctx_doc.device)[None, :]      # [1, T+M]
    zero = torch.zeros((), dtype=torch.long, device=ctx_doc.device)
    return mod(zero, zero, q, kv)                                 # [M, T+M]


def block_mask_reference(anchor_pos, anchor_doc, ctx_doc, block_size, causal_block=False, sliding_window=None,
                         pad_to=None, lengths=None) -> BlockMask:
    """The BlockMask flex's own create_block_mask makes from the mask_mod: it evaluates every (q, kv) pair (vmap,
    eager), far slower than block_mask's intervals (on a CPU: BENCHMARKS.md, Other figures). The reference for
    block_mask below."""
    T, M = ctx_doc.shape[0], anchor_pos.shape[0] * block_size
    q_len, kv_len = _lengths(M, T, pad_to, lengths, ctx_doc.device)
    mod = dflash_mask_mod(**_mask_args(anchor_pos, anchor_doc, ctx_doc, block_size, causal_block, sliding_window))
    return create_block_mask(mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=ctx_doc.device)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """CPU -> GPU without blocking the calling thread: through pinned memory (PyTorch's caching host allocator keeps
    the pinned block until the copy has run). A blocking or pageable copy would wait on the calling thread's stream
    (the feeder threads plan on the CPU while the main thread trains). Anything else: plain .to()."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def block_mask_to(bm: BlockMask, device) -> BlockMask:
    """BlockMask.to(device) with to_device's non-blocking copies (BlockMask.to copies each tensor blocking)."""
    attrs = getattr(bm, "_TENSOR_ATTRS", None)
    if torch.device(device).type != "cuda" or attrs is None:
        return bm.to(device)
    out = copy.copy(bm)
    for a in attrs:
        t = getattr(bm, a, None)
        if isinstance(t, torch.Tensor):
            setattr(out, a, to_device(t, device))
    return out


def _pad_unit(pad_to, device) -> int:
    """block_mask's default padding: flex's tile for a GPU mask, none on the CPU."""
    return pad_to if pad_to is not None else (FLEX_BLOCK if torch.device(device).type == "cuda" else 1)


def _padded(n, pad_to, device):
    unit = _pad_unit(pad_to, device)
    return -(-n // unit) * unit


def static_lengths(max_blocks, block_size, max_context) -> tuple[int, int]:
    """(Q_LEN, KV_LEN) that hold every micro-batch of up to max_blocks blocks and max_context context rows, in
    whole flex tiles. Masks padded to them give flex_attention one shape for the whole run: it compiles once,
    static (the dynamic-shape kernel is slower: BENCHMARKS.md, Other figures), and padded tiles hold no blocks, so they
    cost no compute."""
    M = max_blocks * block_size
    return _padded(M, FLEX_BLOCK, None), _padded(max_context + M, FLEX_BLOCK, None)


def _lengths(M, T, pad_to, lengths, device) -> tuple[int, int]:
    if lengths is None:
        return _padded(M, pad_to, device), _padded(T + M, pad_to, device)
    q_len, kv_len = lengths
    assert M <= q_len and T + M <= kv_len, (
        f"a micro-batch of {M} block tokens and {T} context tokens does not fit the mask lengths {lengths}: "
        "raise MAX_ANCHORS or TOKEN_BUDGET to what the batches hold")
    return q_len, kv_len


def block_mask(anchor_pos, anchor_doc, ctx_doc, block_size, causal_block=False, sliding_window=None,
               pad_to=None, device=None, lengths=None) -> BlockMask:
    """flex_attention BlockMask of the same mask, its tile structure computed from intervals instead of pairs, its
    mask_mod interval_mask_mod.
    Q_LEN and KV_LEN are padded to a multiple of `pad_to` (default: 128 when the mask is for a GPU, none on CPU):
    few distinct shapes reach the compiled kernel, and lengths that are multiples of its tile allow IS_DIVISIBLE
    (no bounds checks; padded keys are never visible, see the mask_mod). run_flex pads queries and keys to match.
    Inputs may live on the CPU (the trainer plans there) and the mask is moved to `device` (default: the inputs'
    device).

    Every query row sees at most two key intervals: context [start of its document, anchor) (cut by the window for
    sliding layers) and a slice of its own block. So a [128 x 128] tile is partial when some row's intervals meet it
    and full when every row's cover it, which is what create_block_mask finds by evaluating all pairs
    (block_mask_reference; tests compare them exactly). Without causal_block and sliding_window all rows of a block
    share their intervals, so the coverage is computed per block and reduced over each tile's range of blocks with
    prefix sums ([N, kv_tiles] work instead of [rows, kv_tiles]). Needs each document's context rows to be contiguous
    (packed or padded layouts); otherwise falls back to the reference. lengths: fixed (Q_LEN, KV_LEN) instead,
    from static_lengths."""
    device = torch.device(device) if device is not None else ctx_doc.device
    T, B, N = ctx_doc.shape[0], block_size, anchor_pos.shape[0]
    M = N * B
    q_len, kv_len = _lengths(M, T, pad_to, lengths, device)
    cpu = torch.device("cpu")
    ap, ad, cd = anchor_pos.to(cpu), anchor_doc.to(cpu), ctx_doc.to(cpu)
    runs = cd[torch.cat([torch.tensor([True]), cd[1:] != cd[:-1]])]                    # one entry per run of a doc
    runs = runs[runs >= 0]                                                               # padding (-1) may repeat
    if runs.numel() != torch.unique(runs).numel() or N == 0:
        ref = block_mask_reference(ap, ad, cd, block_size, causal_block, sliding_window, _pad_unit(pad_to, device),
                                   lengths)
        # moving a BlockMask moves its index tensors, not the tensors its mask_mod captured: give the moved mask a
        # mask_mod over copies on `device` (a CPU tensor read inside a GPU kernel is an illegal access)
        out = block_mask_to(ref, device)
        out.mask_mod = dflash_mask_mod(**_mask_args(*(to_device(x, device) for x in (ap, ad, cd)), block_size,
                                                    causal_block, sliding_window))
        return out
    TILE = FLEX_BLOCK
    q_tiles = -(-q_len // TILE)
    kv_tiles = -(-kv_len // TILE)
    first = torch.full((int(cd.max()) + 2,), T, dtype=torch.long)                       # first context row of a doc
    valid = cd >= 0
    first.scatter_reduce_(0, cd[valid], torch.arange(T)[valid], reduce="amin")
    s = torch.arange(kv_tiles) * TILE                                                    # tile [s, s + TILE)
    e = torch.clamp(s + TILE, max=kv_len)

    def overlap(x0, x1):                                                                 # [rows, kv_tiles]
        return (torch.minimum(x1[:, None], e[None]) - torch.maximum(x0[:, None], s[None])).clamp(min=0)

    if not causal_block and sliding_window is None:
        nb = torch.arange(N)
        c0 = first[ad.clamp(min=0)]
        cover = overlap(c0, torch.maximum(ap, c0)) + overlap(T + nb * B, T + nb * B + B)  # [N, kv_tiles]
        zero = torch.zeros(1, kv_tiles, dtype=torch.long)
        pf = torch.cat([zero, (cover == TILE).long().cumsum(0)])                           # [N+1, kv_tiles]
        pa = torch.cat([zero, (cover > 0).long().cumsum(0)])
        r0 = torch.arange(q_tiles) * TILE                                                # first row of each q tile
        r1 = torch.clamp(r0 + TILE, max=M) - 1                                           # its last live row
        n0, n1 = torch.clamp(r0 // B, max=N - 1), torch.clamp(r1 // B, max=N - 1)        # its range of blocks
        dead = (r0 + TILE > M)[:, None]                      # rows past N*B see nothing: such a tile is never full
        full = (pf[n1 + 1] - pf[n0] == (n1 - n0 + 1)[:, None]) & ~dead
        partial = (pa[n1 + 1] - pa[n0] > 0) & ~full & (r0 < M)[:, None]
        return _assemble(partial, full, ap, c0, T, block_size, causal_block, sliding_window, q_len, kv_len, device)
    # per query row (rows past N*B see nothing, in the mask_mod and in create_block_mask's padding past Q_LEN)
    q = torch.arange(q_tiles * TILE)
    n = torch.clamp(q // B, max=N - 1)
    kq = q - n * B
    a, d = ap[n], ad[n]
    c0, c1 = first[d.clamp(min=0)], a.clone()                                            # context [c0, c1)
    lo, hi = torch.zeros_like(q), torch.full_like(q, B)                                  # slots [lo, hi) of the block
    if causal_block:
        hi = torch.clamp(kq + 1, max=B)
    if sliding_window is not None:
        c0 = torch.maximum(c0, a + kq - sliding_window + 1)
        lo = torch.clamp(kq - sliding_window + 1, min=0)
    b0, b1 = T + n * B + lo, T + n * B + torch.maximum(hi, lo)
    dead = q >= M
    c1, b1 = torch.where(dead, c0, c1), torch.where(dead, b0, b1)
    c1 = torch.maximum(c1, c0)
    seen = (overlap(c0, c1) + overlap(b0, b1)).view(q_tiles, TILE, kv_tiles)
    full = (seen == TILE).all(1)                                                         # [q_tiles, kv_tiles]
    partial = (seen > 0).any(1) & ~full
    return _assemble(partial, full, ap, first[ad.clamp(min=0)], T, block_size, causal_block, sliding_window, q_len,
                     kv_len, device)


def interval_mask_mod(ctx_lo, ctx_hi, blk_lo, block_size, causal_block=False, sliding_window=None):
    """dflash_mask_mod rewritten with each block's two key intervals, for layouts whose documents' context rows are
    contiguous (block_mask's fast path; tests compare it with dflash_mask_mod on the padded grid). Block n sees
    context keys [ctx_lo[n], ctx_hi[n]) (start of its document, its anchor) and block keys [blk_lo[n], blk_lo[n]+B).
    No key-side gather, no document compare: flex evaluates the mask_mod on every element of a partial tile, ~a
    quarter of the tiles it computes for the drafter. Tensors [n_pad] int32, n_pad covering every query row the
    kernel can evaluate; rows of padded blocks get empty intervals (they see nothing)."""
    B = block_size

    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // B
        lo, hi = ctx_lo[n], ctx_hi[n]
        ctx_ok = (kv_idx >= lo) & (kv_idx < hi)
        r = kv_idx - blk_lo[n]                                  # slot of the key inside the query's block
        blk_ok = (r >= 0) & (r < B)
        if causal_block or sliding_window is not None:
            kq = q_idx - n * B                                  # slot of the query inside its block
            if causal_block:
                blk_ok = blk_ok & (r <= kq)
            if sliding_window is not None:                      # the query sits at document index hi + kq
                ctx_ok = ctx_ok & (hi + kq - kv_idx < sliding_window)
                blk_ok = blk_ok & (kq - r < sliding_window)
        return ctx_ok | blk_ok

    mask_mod.tensors = [ctx_lo, ctx_hi, blk_lo]
    return mask_mod


def _assemble(partial, full, anchor_pos, ctx_first, T, block_size, causal_block, sliding_window, q_len, kv_len,
              device) -> BlockMask:
    """[q_tiles, kv_tiles] partial / full tiles -> the BlockMask with interval_mask_mod, on `device`. ctx_first [N]:
    first context row of each anchor's document."""
    def ordered(blocks):   # -> num [1, 1, q_tiles], indices [1, 1, q_tiles, kv_tiles] (listed blocks first)
        num = blocks.sum(-1, dtype=torch.int32)
        idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None], idx[None, None]
    # the mask_mod's tensors, sized by q_len alone (rounded up to flex's tile, which it may evaluate): with fixed
    # lengths every micro-batch's mask_mod has the same shapes, so the static flex kernel compiles once
    N = anchor_pos.shape[0]
    n_pad = -(-_padded(q_len, FLEX_BLOCK, None) // block_size)
    lo = torch.zeros(n_pad, dtype=torch.int32)
    hi = torch.zeros(n_pad, dtype=torch.int32)
    start = torch.full((n_pad,), -block_size, dtype=torch.int32)  # padded blocks: r = kv + B >= B, no block keys
    lo[:N], hi[:N] = ctx_first.to(torch.int32), torch.maximum(anchor_pos, ctx_first).to(torch.int32)
    start[:N] = (T + torch.arange(N) * block_size).to(torch.int32)
    mod = interval_mask_mod(*(to_device(x, device) for x in (lo, hi, start)), block_size, causal_block,
                            sliding_window)
    return block_mask_to(BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=FLEX_BLOCK,
                                                  mask_mod=mod, seq_lengths=(q_len, kv_len)), device)


# ---------------------------------------------------------------------------
# Per-layer-type masks for one micro-batch

Mask = Union[torch.Tensor, BlockMask]


@dataclass
class AttnSpec:
    """Masks of one micro-batch, one per layer type; built once by the caller, shared by all drafter layers."""
    full: Mask                      # full_attention layers: bidirectional inside the block
    sliding: Mask | None = None     # sliding_attention layers: causal inside the block + window on context

    @property
    def is_flex(self) -> bool:
        return isinstance(self.full, BlockMask)

    def device_tensors(self) -> list[torch.Tensor]:
        """The masks' tensors: dense masks, or a BlockMask's index tensors and the tensors its mask_mod reads
        (`mask_mod.tensors`, set by dflash_mask_mod / interval_mask_mod), so a caller that built them on a side
        stream can hand them to another (pipe.handoff)."""
        out = []
        for m in (self.full, self.sliding):
            if isinstance(m, torch.Tensor):
                out.append(m)
            elif m is not None:
                out += [t for t in m.as_tuple() if isinstance(t, torch.Tensor)]
                out += getattr(m.mask_mod, "tensors", [])
        return out

    def for_layer(self, layer_type: str) -> Mask:
        if layer_type == "sliding_attention":
            assert self.sliding is not None, "AttnSpec has no sliding-window mask but the drafter has sliding layers"
            return self.sliding
        return self.full


def make_attn_spec(anchor_pos, anchor_doc, ctx_doc, block_size, layer_types, sliding_window=None,
                   flex=False, device=None, lengths=None) -> AttnSpec:
    """device: where the masks are used (default: the inputs'). A BlockMask is planned on the inputs' device (the
    trainer passes CPU tensors) and moved; a dense mask is built where it is used. lengths: a BlockMask's fixed
    (Q_LEN, KV_LEN) (static_lengths)."""
    if flex:
        build = functools.partial(block_mask, device=device, lengths=lengths)
    else:
        to = device if device is not None else ctx_doc.device
        anchor_pos, anchor_doc, ctx_doc = anchor_pos.to(to), anchor_doc.to(to), ctx_doc.to(to)
        build = dense_mask
    full = build(anchor_pos, anchor_doc, ctx_doc, block_size)
    sliding = None
    if "sliding_attention" in layer_types:
        sliding = build(anchor_pos, anchor_doc, ctx_doc, block_size, causal_block=True, sliding_window=sliding_window)
    return AttnSpec(full=full, sliding=sliding)


# ---------------------------------------------------------------------------
# Compiled flex_attention: built once per process, warmed on the main thread

@functools.cache
def compiled_flex_attention():
    # one compiled callable per process; compiling from several threads at once raises
    # "Detected that you are using FX to symbolically trace a dynamo-optimized function". Static shapes: the
    # trainer's masks all have one length (static_lengths), and the static kernel is the faster one.
    return torch.compile(flex_attention, dynamic=False)


@torch.compiler.disable
def run_flex(q, k, v, mask: BlockMask, gqa: bool):
    """q [1, nh, M, D], k, v [1, nkv, T+M, D] -> [1, nh, M, D] through flex_attention with the BlockMask, padding
    q and k/v to its lengths. A graph break on purpose: inside a drafter layer compiled with dynamic shapes
    (COMPILE_DRAFTER=layers) the flex kernel would be compiled for dynamic shapes too; here it gets its own static
    compile. Eager flex on CPU (forward only; tests)."""
    M = q.shape[2]
    q_len, kv_len = mask.seq_lengths
    if q_len > M:
        q = F.pad(q, (0, 0, 0, q_len - M))
    if kv_len > k.shape[2]:                                                         # padded keys are never visible
        k, v = (F.pad(x, (0, 0, 0, kv_len - x.shape[2])) for x in (k, v))
    flex = compiled_flex_attention() if q.is_cuda else flex_attention
    return flex(q, k, v, block_mask=mask, enable_gqa=gqa,
                kernel_options=flex_kernel_options(q_len, kv_len, q.is_cuda))[:, :, :M]


def warmup_flex_attention(device, dtype=torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                          lengths=None):
    """Compile flex_attention (forward, and backward on GPU) on the calling thread. Call it on the main thread
    before any worker thread runs the drafter. The kernel recompiles for other head counts / head_dim / dtype /
    mask lengths, so pass the drafter's own and the lengths its masks will have (static_lengths)."""
    device = torch.device(device)
    doc = torch.zeros(3 * block_size, dtype=torch.long, device=device)                 # one document, T = 3B
    anchors = torch.tensor([block_size, 2 * block_size], device=device)
    bm = block_mask(anchors, torch.zeros_like(anchors), doc, block_size, lengths=lengths)
    M, T = bm.seq_lengths
    grad = device.type != "cpu"   # flex has no backward on CPU
    q = torch.randn(1, num_heads, M, head_dim, device=device, dtype=dtype, requires_grad=grad)
    k = torch.randn(1, num_kv_heads, T, head_dim, device=device, dtype=dtype, requires_grad=grad)
    v = torch.randn(1, num_kv_heads, T, head_dim, device=device, dtype=dtype, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        out = run_flex(q, k, v, bm, num_heads != num_kv_heads)
        if grad:
            out.sum().backward()
