"""GPU only (skipped on CPU): trainer/optim.py's overlapped step (the update on a side stream, the forward waiting per
chunk) equals the step after the backward, bitwise (the CPU half is tests/unit/test_optim.py)."""
import pytest
import torch

from optim_cases import drafter_inputs
from trainer.optim import make_optimizer, scale_clip_

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")


def test_overlapped_step_equals_plain_step_on_cuda(build_drafter, tiny_qwen3_dir):
    """Three training steps (forward, backward, clip into grad_scale, step) with the update on a side stream and
    the forward waiting per chunk, against the same steps with the update after the backward: bitwise equal
    losses and parameters."""
    dev = torch.device("cuda")
    runs = {}
    for overlap in (False, True):
        d = build_drafter(tiny_qwen3_dir, num_layers=3, seed=2).to(dev)
        opt = make_optimizer(d, 1e-2, 0.1, overlap=overlap)
        assert opt.overlap == overlap and (d.params_ready is not None) == overlap
        inputs = drafter_inputs(d, dev)
        losses = []
        for _ in range(3):
            loss = d(*inputs).float().square().mean()
            loss.backward()
            scale_clip_(list(d.parameters()), torch.ones(1, device=dev), 0.5, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        opt.wait_all()
        runs[overlap] = (torch.stack(losses), [p.detach().clone() for p in d.parameters()])
    assert torch.equal(runs[True][0], runs[False][0])
    assert len(set(runs[True][0].tolist())) == 3, "the parameters changed between steps"
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a, b)
