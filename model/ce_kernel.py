"""The CE epilogue as one hand-written Triton kernel (GPU): per row of a [c, V] logits chunk, one pass computes the
running max, sum of exp, argmax and the target's logit (online softmax), and a second pass writes dL/dlogits over
the logits in place. Two reads and one write of the bf16 chunk, no fp32 [c, V] temporaries.

model.objective uses it on CUDA tensors when Triton is importable; its eager epilogue is the reference
(tests/test_ce_kernel.py runs both, on CPU through Triton's interpreter, TRITON_INTERPRET=1).
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs without triton: the eager epilogue is used
    triton = None

BLOCK, NUM_WARPS = 2048, 4   # vocabulary columns per loop iteration (one row per program), warps per program


if triton is not None:
    @triton.jit
    def _ce_rows(x_ptr, y_ptr, w_ptr, lse_ptr, xy_ptr, arg_ptr, stride, V: tl.constexpr, BLOCK: tl.constexpr,
                 WRITE_GRAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        y = tl.load(y_ptr + row)
        w = tl.load(w_ptr + row)
        offs = tl.arange(0, BLOCK)
        # per-lane running max, sum of exp and first index of the max; reduced across lanes once, after the loop,
        # so the streaming loop has no block-wide reductions
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        arg = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            arg = tl.where(x > m, idx, arg)                      # strict: a lane keeps its first maximum
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that have seen only padding
            s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
        row_max = tl.max(m, 0)
        lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
        first = tl.min(tl.where(m == row_max, arg, V), 0)        # torch.argmax's tie rule: the first index
        tl.store(lse_ptr + row, lse)
        tl.store(xy_ptr + row, tl.load(base + y).to(tl.float32))
        tl.store(arg_ptr + row, first)
        if WRITE_GRAD:            # dL/dlogits = w * (softmax - onehot), over the logits
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = tl.load(base + idx, mask=idx < V, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - (idx == y).to(tl.float32)) * w
                tl.store(base + idx, g.to(x_ptr.dtype.element_ty), mask=idx < V)


def available(t: torch.Tensor) -> bool:
    """The kernel serves this tensor: Triton is installed and t is on a GPU (or Triton runs interpreted, tests)."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def ce_epilogue(logits, y, w, need_grad, block=BLOCK, num_warps=NUM_WARPS):
    """logits [c, V] (bf16 or fp32, row-contiguous; overwritten by the gradient when need_grad), y [c] long,
    w [c] fp32 -> (CE_r [c] fp32, argmax == y [c], dL/dlogits of sum_r w_r CE_r [c, V] in the logits' dtype or
    None). The same results as model.objective._eager_epilogue up to summation order."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [c, V] with contiguous rows"
    c, V = logits.shape
    lse = torch.empty(c, dtype=torch.float32, device=logits.device)
    xy = torch.empty_like(lse)
    arg = torch.empty(c, dtype=torch.int32, device=logits.device)
    if c:
        _ce_rows[(c,)](logits, y, w, lse, xy, arg, logits.stride(0), V=V, BLOCK=block, WRITE_GRAD=need_grad,
                       num_warps=num_warps)
    return lse - xy, arg.long() == y, logits if need_grad else None
