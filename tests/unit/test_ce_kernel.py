"""The Triton CE epilogue (model/ce_kernel.py) compiles for an H200 here, no GPU needed. Its checks against the eager
epilogue (tests/helpers/ce_cases.py) run in tests/jobs/test_ce_kernel_jobs.py (on CPU through Triton's interpreter, a
subprocess) and tests/gpu/test_ce_kernel_cuda.py (compiled, at the real vocabulary size)."""
import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (CPU-only platforms without wheels)")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernel_compiles_for_an_h200_on_a_cpu(dtype):
    """Triton compiles the kernel to an sm_90 cubin here, no GPU needed (its bundled LLVM and ptxas), in every
    specialisation the trainer launches. The interpreter misses what only the compiler checks: 7f7093c's kernel read
    two plain Python floats, which the interpreter ran and the H200 refused at the first launch (NameError: Cannot
    access global variable E4M3_MAX); this test fails on it."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this triton has no ASTSource / GPUTarget ({e})")
    from model import ce_kernel
    sig = dict(x_ptr=f"*{dtype}", y_ptr="*i64", w_ptr="*fp32", lse_ptr="*fp32", xy_ptr="*fp32", arg_ptr="*i32",
               scale_ptr="*fp32", stride="i64", V="constexpr", BLOCK="constexpr", WRITE_GRAD="constexpr",
               FP8_ROWS="constexpr")
    for write_grad, fp8_rows in ((False, False), (True, False), (True, True)):
        src = ASTSource(fn=ce_kernel._ce_rows, signature=sig, constexprs=dict(
            V=151936, BLOCK=ce_kernel.BLOCK, WRITE_GRAD=write_grad, FP8_ROWS=fp8_rows))
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        assert out.asm.get("cubin"), (write_grad, fp8_rows)
