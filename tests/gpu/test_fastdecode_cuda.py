"""GPU only (skipped on CPU): model/fastdecode.py's CUDA-graph path, fp32, against its eager steps and the HF decode
loop (the CPU half, eager, is tests/unit/test_fastdecode.py)."""
import copy

import pytest
import torch

from fastdecode_cases import B, MAX_NEW, random_prompts, trained  # noqa: F401 (a fixture)
from model.decode import DrafterProposer, greedy_decode, speculative_decode
from model.fastdecode import FastDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CUDA-graph path")


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_cuda_graphs_equal_eager_and_the_decode_loop(trained, attention):
    """On a GPU, fp32: graph replays give the eager steps' tokens and steps, and the HF decode loop's; two drafters
    (two graphs sharing the greedy graph's pool) and prompts of several lengths through one decoder."""
    model, drafter, prompts = trained
    model, drafters = copy.deepcopy(model).cuda(), [copy.deepcopy(drafter).cuda() for _ in range(2)]
    torch.manual_seed(5)
    with torch.no_grad():
        for p in drafters[1].parameters():                  # a second, different drafter for the same target
            p += 0.01 * torch.randn_like(p)
    prompts = prompts + random_prompts(128, (9, 17), seed=3)
    n = max(map(len, prompts)) + MAX_NEW + B - 1
    graphs, eager = FastDecoder(model, n, attention=attention), FastDecoder(model, n, cuda_graphs=False,
                                                                            attention=attention)
    assert graphs.cuda_graphs and not eager.cuda_graphs
    for d in drafters:
        proposer, sg, se = DrafterProposer(d, model), graphs.drafter(d, B), eager.drafter(d, B)
        for p in prompts:
            want = speculative_decode(model, p, proposer, B, MAX_NEW, set())
            assert graphs.speculative(p, sg, MAX_NEW, set()) == eager.speculative(p, se, MAX_NEW, set()) == want
            assert graphs.greedy(p, MAX_NEW, set()) == eager.greedy(p, MAX_NEW, set()) == greedy_decode(
                model, p, MAX_NEW, set())
    assert len(graphs.graphs) == 3                          # greedy + one per drafter
