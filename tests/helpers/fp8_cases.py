"""HEAD_FP8's checks on a device, for tests/unit/test_fp8.py (the CPU, where torch._scaled_mm takes per-row scales)
and tests/gpu/test_fp8_cuda.py (an SM89+ GPU: cuBLAS's FP8 kernels): a random lm_head case, its two GEMMs against their
dequantised operands, and the chunked CE through it against the bf16 lm_head."""
import pytest
import torch

from model import fp8
from model.objective import dpace_reweight, weighted_ce


def head_case(V=512, H=64, M=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(V, H, generator=g) * 0.05).to(torch.bfloat16)
    h = (torch.randn(M, H, generator=g) * torch.rand(M, 1, generator=g) * 6).to(torch.bfloat16)
    return W, h, torch.randint(0, V, (M,), generator=g), torch.rand(M, generator=g)


def check_head_fp8_gemms(device):
    """HeadFP8's two GEMMs (torch._scaled_mm, per-row scales) against the same e4m3 operands multiplied back by
    their scales and multiplied in fp32: equal up to the bf16 output's rounding. Its stored weights are W within
    one e4m3 step, per vocabulary row (logits) and per hidden unit (input gradient). On a GPU: cuBLAS's kernels."""
    W, h, _, _ = (t.to(device) for t in head_case())
    head = fp8.HeadFP8(W)
    rows = head.rows.float() * head.row_scale                                          # [V, H]
    cols = (head.cols.float() * head.col_scale.t()).t()                                # [V, H]
    for deq in (rows, cols):
        torch.testing.assert_close(deq, W.float(), rtol=2 ** -3, atol=1e-6)
    q, s = fp8.quantize_rows(h)
    want = (q.float() * s) @ rows.T
    torch.testing.assert_close(head.logits(h).float(), want, rtol=2 ** -7, atol=1e-2)
    g = torch.randn(h.shape[0], W.shape[0], device=device).to(torch.bfloat16)
    qg, sg = fp8.quantize_rows(g.clone())
    want = (qg.float() * sg) @ cols
    got = head.grad_input(g.clone(), torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)


def check_head_fp8_loss(device, dpace):
    """weighted_ce through HeadFP8 against the same loss through the bf16 lm_head (the chunked CE, and the unchunked
    reference, which a HeadFP8 sends to its bf16 weight): the loss within 1%, the gradient within ~5% but not equal
    (the FP8 GEMMs ran), argmax agreeing on nearly every row; with D-PACE's reweighting too."""
    W, h, y, w = (t.to(device) for t in head_case())
    head = fp8.HeadFP8(W)
    rows = torch.arange(len(y), device=device)
    out = []
    for lm in (W, head, W):
        x = h.clone().requires_grad_()
        rw = dpace_reweight(w, rows, 4, 0.3) if dpace else None
        parts = weighted_ce(x, lm, y, w, chunk_size=32 if lm is head or not out else 0, rows=rows, reweight=rw)
        parts.loss_sum.backward()
        out.append((parts.loss_sum.item(), x.grad.float(), parts.correct))
    (l_ref, g_ref, c_ref), (l8, g8, c8), (l_full, g_full, _) = out
    assert l8 == pytest.approx(l_ref, rel=1e-2) and l_full == pytest.approx(l_ref, rel=1e-3)
    rel = ((g8 - g_ref).norm() / g_ref.norm()).item()
    assert 1e-3 < rel < 0.06, rel
    assert (c8 == c_ref).float().mean() > 0.95
