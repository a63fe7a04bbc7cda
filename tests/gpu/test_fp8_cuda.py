"""GPU only (skipped without an SM89+ GPU): HEAD_FP8's GEMMs on cuBLAS's FP8 kernels against their dequantised
operands, and the chunked CE through them against the bf16 lm_head (tests/helpers/fp8_cases.py's checks; the CPU
half is tests/unit/test_fp8.py)."""
import pytest
import torch

from fp8_cases import check_head_fp8_gemms, check_head_fp8_loss
from model import fp8

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= fp8.MIN_CAPABILITY
pytestmark = pytest.mark.skipif(not FP8_GPU, reason="needs an SM89+ GPU (the FP8 GEMM kernels)")


def test_head_fp8_gemms_against_their_dequantised_operands():
    check_head_fp8_gemms("cuda")


@pytest.mark.parametrize("dpace", [False, True])
def test_head_fp8_loss_and_gradient_near_bf16(dpace):
    check_head_fp8_loss("cuda", dpace)
