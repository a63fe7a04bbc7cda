"""trainer/optim.py: the drafter's chunked AdamW equals the plain two-group AdamW (on CUDA the overlapped step, side
stream and the forward waiting per chunk, equals the step after the backward, bitwise: tests/gpu/test_optim_cuda.py);
scale_clip_ against mul_ + clip_grad_norm_; the LR schedule."""
import copy

import pytest
import torch

from optim_cases import drafter_inputs
from trainer.optim import ChunkedAdamW, make_optimizer, param_chunks, scale_clip_


def test_param_chunks_follow_the_forward(build_drafter, tiny_qwen3_dir):
    d = build_drafter(tiny_qwen3_dir, num_layers=3)
    chunks = param_chunks(d)
    assert len(chunks) == 3 + 2
    assert chunks[0][0] is d.fc.weight and chunks[-1] == [d.norm.weight]
    assert all(any(p is q for q in d.layers[i].parameters()) for i in range(3) for p in chunks[i + 1])
    calls = []
    d.params_ready = calls.append
    d(*drafter_inputs(d, "cpu"))
    assert calls == [0, 1, 2, 3, 4], "the forward announces each chunk before it first reads it, in order"


def test_chunked_adamw_equals_two_group_adamw(build_drafter, tiny_qwen3_dir):
    """Same updates as the trainer's former optimizer (decay on matrices, none on norms), over steps with grad_scale
    and weight decay; the state dict round-trips into a fresh optimizer and continues identically."""
    ref_d, got_d = (build_drafter(tiny_qwen3_dir, num_layers=2, seed=1) for _ in range(2))
    params = list(ref_d.parameters())
    ref = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    got = ChunkedAdamW(param_chunks(got_d), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)
    assert {g["weight_decay"] for g in got.param_groups if g["params"][0].dim() < 2} == {0.0}
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        if step == 2:   # checkpoint and resume in the middle
            state = got.state_dict()
            got = ChunkedAdamW(param_chunks(got_d), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                               fused=True)
            got.load_state_dict(state)
        scale = torch.tensor([0.5 + step])
        for p, q in zip(ref_d.parameters(), got_d.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ref.grad_scale = got.grad_scale = scale
        ref.step()
        got.step()
    moved = 0
    for (name, p), q in zip(ref_d.named_parameters(), got_d.parameters()):
        assert torch.equal(p, q), name
        moved += int(not torch.equal(p, build_drafter(tiny_qwen3_dir, num_layers=2, seed=1).state_dict()[name]))
    assert moved == len(params), "every parameter was updated"


def test_reads_the_former_two_group_optimizer_state(build_drafter, tiny_qwen3_dir):
    """A checkpoint written before the chunked groups (AdamW([matrices, vectors]) over drafter.parameters()) loads
    with its moments and step counts moved to the same parameters: continuing from it equals continuing the old
    optimizer, bitwise. A state of another shape is refused with the counts."""
    old_d, new_d = (build_drafter(tiny_qwen3_dir, num_layers=2, seed=3) for _ in range(2))
    params = list(old_d.parameters())
    old = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)

    def grads():
        return [torch.randn(p.shape, generator=g) for p in params]
    for _ in range(2):
        for p, x in zip(old_d.parameters(), grads()):
            p.grad = x
        old.step()
    new_d.load_state_dict(old_d.state_dict())
    new = make_optimizer(new_d, 5e-3, 0.0)                       # other settings: the checkpoint's win, as in torch
    new.load_state_dict(copy.deepcopy(old.state_dict()))          # as from a file: no tensors shared with `old`
    assert {grp["lr"] for grp in new.param_groups} == {1e-2}
    assert {grp["weight_decay"] for grp in new.param_groups if grp["params"][0].dim() >= 2} == {0.1}
    for _ in range(2):
        gs = grads()
        for d in (old_d, new_d):
            for p, x in zip(d.parameters(), gs):
                p.grad = x.clone()
        old.step()
        new.step()
    for (name, p), q in zip(old_d.named_parameters(), new_d.parameters()):
        assert torch.equal(p, q), name
    small = torch.optim.AdamW([{"params": params[:3]}, {"params": params[-1:]}], lr=1e-2)
    with pytest.raises(ValueError, match="groups of \\[3, 1\\] parameters"):
        make_optimizer(build_drafter(tiny_qwen3_dir, num_layers=2), 1e-2, 0.0).load_state_dict(small.state_dict())


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])     # clipping binds / does not
def test_scale_clip_equals_mul_then_clip_grad_norm(max_norm):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    scale = torch.tensor([0.37])                          # the trainer passes a [1] tensor
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    got = [torch.nn.Parameter(torch.zeros(s)) for s in shapes] + [torch.nn.Parameter(torch.zeros(2))]   # no grad
    for p, q, x in zip(ref, got, grads):
        p.grad, q.grad = x.clone(), x.clone()
    for p in ref:
        p.grad.mul_(scale)
    want_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    norm = scale_clip_(got, scale, max_norm)
    torch.testing.assert_close(norm, want_norm)
    for p, q in zip(ref, got):
        torch.testing.assert_close(q.grad, p.grad)
    assert got[-1].grad is None


def test_scale_clip_hands_the_factor_to_a_fused_optimizer():
    """With a fused AdamW (the trainer's on GPU; fused AdamW runs on CPU too) the factor goes to the optimizer's
    grad_scale instead of a multiply: the updated parameters equal mul_ + clip_grad_norm_ + a plain step's."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    init = [torch.randn(s, generator=g) for s in shapes]
    scale = torch.tensor([0.37])
    for max_norm in (1e-3, 1e3):
        ps = {k: [torch.nn.Parameter(x.clone()) for x in init] for k in ("ref", "got")}
        opts = {k: torch.optim.AdamW(v, lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
                for k, v in ps.items()}
        for _ in range(3):                                 # grad_scale is set again before every step
            grads = [torch.randn(s, generator=g) * 5 for s in shapes]
            for k in ps:
                for p, x in zip(ps[k], grads):
                    p.grad = x.clone()
            for p in ps["ref"]:
                p.grad.mul_(scale)
            want = torch.nn.utils.clip_grad_norm_(ps["ref"], max_norm)
            opts["ref"].step()
            norm = scale_clip_(ps["got"], scale, max_norm, opts["got"])
            torch.testing.assert_close(ps["got"][0].grad, grads[0], rtol=0, atol=0)   # left as they were
            opts["got"].step()
            torch.testing.assert_close(norm, want)
            for p, q in zip(ps["ref"], ps["got"]):
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ps["got"][0], init[0]), "the parameters moved"
