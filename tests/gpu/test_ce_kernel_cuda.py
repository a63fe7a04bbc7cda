"""GPU only (skipped on CPU): model/ce_kernel.py's Triton CE epilogue compiled, at the real vocabulary size, against
the eager epilogue (tests/helpers/ce_cases.py's checks; on CPU, tests/jobs/test_ce_kernel_jobs.py runs them through
Triton's interpreter)."""
import pytest
import torch

from ce_cases import check_epilogue, check_head_fp8_ce, check_weighted_ce

pytest.importorskip("triton", reason="triton is not installed (CPU-only platforms without wheels)")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_kernel_matches_eager_cuda():
    check_epilogue("cuda", torch.bfloat16, c=64, V=151936, block=2048)
    check_epilogue("cuda", torch.float32, c=8, V=1000, block=256)
    check_weighted_ce("cuda", torch.bfloat16)
    if torch.cuda.get_device_capability() >= (8, 9):
        check_head_fp8_ce("cuda")
