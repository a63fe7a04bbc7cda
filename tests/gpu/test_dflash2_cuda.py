"""GPU only (skipped on CPU): the fast loop with a DFlash2 drafter on CUDA graphs, fp32, against its eager steps and
the HF decode loop (the CPU half, eager, is tests/unit/test_dflash2_integration.py)."""
import copy

import pytest
import torch

from dflash2_cases import B, build_dflash2, walkers  # noqa: F401 (fixtures)
from model.decode import DrafterProposer, speculative_decode
from model.fastdecode import FastDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CUDA-graph path")


def test_cuda_graphs_walk_equals_eager_and_the_decode_loop(small_vocab, walkers):
    """On a GPU, fp32: the fast loop's graph replays (convolutions and the selector's walk captured) give the eager
    steps' tokens and steps, and the HF decode loop's."""
    path, model, rows = small_vocab
    model = copy.deepcopy(model).cuda()
    prompts = [r["input_ids"] for r in rows]
    n = max(map(len, prompts)) + 30 + B - 1
    graphs, eager = FastDecoder(model, n), FastDecoder(model, n, cuda_graphs=False)
    assert graphs.cuda_graphs
    for d2 in walkers:
        d2 = copy.deepcopy(d2).cuda()
        prop, sg, se = DrafterProposer(d2, model), graphs.drafter(d2, B), eager.drafter(d2, B)
        for p in prompts:
            want = speculative_decode(model, p, prop, B, 30, set())
            assert graphs.speculative(p, sg, 30, set()) == eager.speculative(p, se, 30, set()) == want
