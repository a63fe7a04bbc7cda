"""The CE epilogue as one hand-written Triton kernel (GPU): per row of a [c, V] logits chunk, one pass computes the
running max, sum of exp, argmax and the target's logit (online softmax), and a second pass writes dL/dlogits over
the logits in place. Two reads and one write of the bf16 chunk, no fp32 [c, V] temporaries.

With HEAD_FP8 the second pass also divides each row by its e4m3 scale, which it knows before the pass: the
gradient's largest entry in a row is the label's, |w (p_y - 1)| = w (1 - p_y), since every other entry is w p_i and
the p_i (i != y) sum to 1 - p_y. So the FP8 operand costs one cast instead of a reduction and three more passes over
the chunk (abs-amax, divide, clamp). Where p_y rounds to 1 (1 - p_y below fp32's 6e-8) the scale is floored, the
row's entries saturate at +-448 x that floor, and its error stays below 6e-8 w, as its true values do.

model.objective uses it on CUDA tensors when Triton is importable; its eager epilogue is the reference
(tests/helpers/ce_cases.py compares both: tests/jobs/test_ce_kernel_jobs.py on CPU through Triton's interpreter,
TRITON_INTERPRET=1; tests/gpu/test_ce_kernel_cuda.py on a GPU).
"""
import os

import torch

from model.fp8 import E4M3_MAX

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs without triton: the eager epilogue is used
    triton = None

BLOCK, NUM_WARPS = 2048, 4   # vocabulary columns per loop iteration (one row per program), warps per program


if triton is not None:
    # a kernel reads constexpr globals only (compiled Triton refuses plain floats; the interpreter does not)
    _E4M3_MAX, _F32_TINY = tl.constexpr(E4M3_MAX), tl.constexpr(torch.finfo(torch.float32).tiny)

    @triton.jit
    def _ce_rows(x_ptr, y_ptr, w_ptr, lse_ptr, xy_ptr, arg_ptr, scale_ptr, stride, V: tl.constexpr,
                 BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr, FP8_ROWS: tl.constexpr):
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
        xy = tl.load(base + y).to(tl.float32)
        tl.store(lse_ptr + row, lse)
        tl.store(xy_ptr + row, xy)
        tl.store(arg_ptr + row, first)
        if WRITE_GRAD:            # dL/dlogits = w * (softmax - onehot), over the logits
            if FP8_ROWS:          # divided by the row's e4m3 scale: amax |dL/dlogits| = w * (1 - p_y) (see below)
                scale = tl.maximum(w * (1.0 - tl.exp(xy - lse)) / _E4M3_MAX, _F32_TINY)
                tl.store(scale_ptr + row, scale)
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = tl.load(base + idx, mask=idx < V, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - (idx == y).to(tl.float32)) * w
                if FP8_ROWS:
                    g = tl.minimum(tl.maximum(g / scale, -_E4M3_MAX), _E4M3_MAX)
                tl.store(base + idx, g.to(x_ptr.dtype.element_ty), mask=idx < V)


def available(t: torch.Tensor) -> bool:
    """The kernel serves this tensor: Triton is installed and t is on a GPU (or Triton runs interpreted, tests)."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def ce_epilogue(logits, y, w, need_grad, fp8_rows=False, block=BLOCK, num_warps=NUM_WARPS):
    """logits [c, V] (bf16 or fp32, row-contiguous; overwritten by the gradient when need_grad), y [c] long,
    w [c] fp32 -> (CE_r [c] fp32, argmax == y [c], dL/dlogits of sum_r w_r CE_r [c, V] in the logits' dtype or
    None). fp8_rows (HEAD_FP8): the gradient comes as the pair (dL/dlogits / s [c, V], clamped to +-448, in the
    logits' dtype; s [c, 1] fp32), s the per-row e4m3 scale, so that one cast makes the FP8 operand
    (model.fp8.HeadFP8.grad_input). The same results as model.objective._eager_epilogue up to summation order."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [c, V] with contiguous rows"
    c, V = logits.shape
    lse = torch.empty(c, dtype=torch.float32, device=logits.device)
    xy = torch.empty_like(lse)
    arg = torch.empty(c, dtype=torch.int32, device=logits.device)
    scale = torch.empty(c, 1, dtype=torch.float32, device=logits.device) if fp8_rows else lse   # (unused: lse)
    if c:
        _ce_rows[(c,)](logits, y, w, lse, xy, arg, scale, logits.stride(0), V=V, BLOCK=block, WRITE_GRAD=need_grad,
                       FP8_ROWS=bool(fp8_rows and need_grad), num_warps=num_warps)
    g = (logits, scale) if need_grad and fp8_rows else logits if need_grad else None
    return lse - xy, arg.long() == y, g
