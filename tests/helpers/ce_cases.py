"""The Triton CE epilogue (model/ce_kernel.py) against the eager epilogue: per-row CE, argmax == label (ties go to
the first index, as torch.argmax), and dL/dlogits; HEAD_FP8's row scales; the whole chunked CE with both, exp-decay
and D-PACE weights. tests/gpu/test_ce_kernel_cuda.py runs the checks compiled on a GPU; run as a script with
TRITON_INTERPRET=1 (which Triton reads at import), `interpreted()` runs them on CPU through Triton's interpreter
(tests/jobs/test_ce_kernel_jobs.py) and prints "ok"."""
import functools

import pytest
import torch


def check_epilogue(device, dtype, c, V, block):
    """The kernel == the eager epilogue on one chunk with ties inside a block and across blocks."""
    from model import ce_kernel, objective
    g = torch.Generator().manual_seed(c * V)
    x = (torch.randn(c, V, generator=g) * 4).to(dtype).to(device)
    top = x.float().max() + 1
    x[0, 3] = x[0, 5] = top                          # tie inside the first block: 3 wins
    x[1, 2] = x[1, V - 1] = top                      # tie across blocks, different lanes: 2 wins
    x[2, 7] = x[2, 7 + block] = top                  # tie across blocks in the same lane: 7 wins
    y = torch.randint(0, V, (c,), generator=g).to(device)
    y[0], y[1], y[2], y[3] = 3, 2, 7, int(x[3].float().argmax())
    w = (torch.rand(c, generator=g) * (torch.rand(c, generator=g) > 0.2)).to(device)
    ref = objective._eager_epilogue(x.clone(), y, w, True)
    for need_grad in (True, False):
        got = ce_kernel.ce_epilogue(x.clone(), y, w, need_grad, block=block)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-4)
        assert torch.equal(got[1], ref[1]), "argmax == label differs"
        assert got[1][:4].all(), "ties resolve to the first index"
        if need_grad:
            assert got[2].dtype == dtype
            tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=8e-3)  # bf16: 1 ulp at 1
            torch.testing.assert_close(got[2].float(), ref[2].float(), **tol)
        else:
            assert got[2] is None
    # HEAD_FP8's fp8_rows: each row's scale is its gradient's largest |entry| / 448 (the label's entry, known before
    # the pass that writes the row), the written rows are the gradient divided by it; kernel == eager
    exact = objective._eager_epilogue(x.float().clone(), y, w, True)[2]                        # fp32 dL/dlogits [c, V]
    want_scale = (exact.abs().amax(1, keepdim=True) / 448).clamp(min=torch.finfo(torch.float32).tiny)
    for fn in (objective._eager_epilogue, functools.partial(ce_kernel.ce_epilogue, block=block)):
        ce, ok, (scaled, scale) = fn(x.clone(), y, w, True, fp8_rows=True)
        torch.testing.assert_close(ce, ref[0], rtol=1e-5, atol=1e-4)
        assert torch.equal(ok, ref[1]) and scaled.dtype == dtype and scale.shape == (c, 1)
        torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=0)
        assert scaled.float().abs().max() <= 448
        assert (scaled.float().abs().amax(1) > 440).sum() == (w > 0).sum(), "each weighted row reaches e4m3's top"
        # bf16: one ulp (the interpreter rounds some values toward zero, as the plain gradient test allows)
        tol = dict(rtol=1e-5, atol=1e-3) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
        torch.testing.assert_close(scaled.float(), exact / want_scale, **tol)


def check_head_fp8_ce(device):
    """The chunked CE through a HeadFP8 with the kernel == with the eager epilogue (both hand the gradient over
    divided by its row scales), and near the bf16 lm_head's."""
    from model import fp8, objective
    torch.manual_seed(2)
    M, H, V = 44, 16, 304
    hidden = torch.randn(M, H).to(torch.bfloat16).to(device)
    W = (torch.randn(V, H) * 0.5).to(torch.bfloat16).to(device)
    labels, weights = torch.randint(0, V, (M,)).to(device), (torch.rand(M) * (torch.rand(M) > 0.3)).to(device)

    def run(kind, lm):
        objective.set_ce_kernel(kind)
        h = hidden.clone().requires_grad_()
        p = objective.weighted_ce(h, lm, labels, weights, chunk_size=16)
        p.loss_sum.backward()
        return p.loss_sum.detach(), h.grad.float()
    head = fp8.HeadFP8(W)
    try:
        ref, got, bf16 = run("eager", head), run("auto", head), run("auto", W)
    finally:
        objective.set_ce_kernel("auto")
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)
    # an entry of dL/dlogits one bf16 ulp apart can round to the neighbouring e4m3 value: compare the whole gradient
    assert ((got[1] - ref[1]).norm() / ref[1].norm()).item() < 1e-2
    assert got[0].item() == pytest.approx(bf16[0].item(), rel=2e-2)
    rel = ((got[1] - bf16[1]).norm() / bf16[1].norm()).item()
    assert 1e-3 < rel < 0.1, rel


def check_weighted_ce(device, dtype):
    """The whole chunked CE with the kernel == with the eager epilogue: loss, correct, grads of hidden; with the
    given weights and with D-PACE's (made from the per-row CE after the chunks)."""
    from model import objective
    torch.manual_seed(1)
    M, H, V, B = 44, 16, 301, 4
    hidden, W = torch.randn(M, H).to(dtype).to(device), (torch.randn(V, H) * 0.5).to(dtype).to(device)
    labels = torch.randint(0, V, (M,)).to(device)
    weights = (torch.rand(M) * (torch.rand(M) > 0.3)).to(device)
    rows = (weights > 0).nonzero().squeeze(1)

    def run(kind, dpace):
        objective.set_ce_kernel(kind)
        h = hidden.clone().requires_grad_()
        reweight = objective.dpace_reweight(weights, rows, B, 0.5) if dpace else None
        p = objective.weighted_ce(h, W, labels, weights, chunk_size=16, rows=rows, reweight=reweight)   # 3 chunks
        (p.loss_sum * 0.7).backward()
        return p.loss_sum.detach(), p.weight_sum, p.correct, h.grad

    for dpace in (False, True):
        try:
            ref, got = run("eager", dpace), run("auto", dpace)
        finally:
            objective.set_ce_kernel("auto")
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got[0], ref[0], **tol)
        torch.testing.assert_close(got[1], ref[1], **tol)
        assert torch.equal(got[2], ref[2])
        torch.testing.assert_close(got[3], ref[3], **tol)


def interpreted():
    for dtype in (torch.float32, torch.bfloat16):
        check_epilogue("cpu", dtype, c=6, V=301, block=128)     # the last block of each row is partial
        check_weighted_ce("cpu", dtype)
    from runs import cpu_rowwise_scaled_mm_missing
    if why := cpu_rowwise_scaled_mm_missing():
        print(f"head fp8 not checked: {why}")
    else:
        check_head_fp8_ce("cpu")
    print("ok")


if __name__ == "__main__":
    interpreted()
