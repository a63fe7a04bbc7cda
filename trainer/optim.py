"""The drafter's AdamW, one parameter group pair per chunk of the forward (fc + hidden_norm, each layer, the final
norm), and on a GPU its step overlapped with the next forward; the LR schedule (`lr_at`).

A drafter step is GPU-bound, and AdamW over ~1B fp32 parameters is a run of memory-bound kernels between one
backward and the next forward (their time: BENCHMARKS.md, Other figures). With `overlap` the step runs on a side
stream chunk by chunk in forward order and records an event per chunk; the next forward waits for each chunk's
event only where it first reads that chunk's parameters (Drafter.params_ready), so the update of layer i+1 runs
while layer i computes. The arithmetic is the same fused AdamW kernel on the same tensors: results are bitwise
those of the plain step (tests/gpu/test_optim_cuda.py on CUDA).

Whoever reads the parameters outside the drafter's forward (checkpoints, evaluation, export, the DDP checksum)
calls wait_all() first.
"""
import math

import torch
from torch.distributed.tensor import DTensor


def lr_at(g, planned_g, peak_lr, warmup_ratio) -> float:
    """The LR at micro-batch g of a run planned over planned_g micro-batches: linear warmup over the first
    warmup_ratio of them, then cosine to 0. A function of data progress, so any target:drafter split and any resume
    point give the same LR at the same g."""
    warm = warmup_ratio * planned_g
    if g < warm:   # capped: a warmup shorter than one optimizer step (fractional warm) must not overshoot LR
        return peak_lr * min(1.0, (g + 1) / warm)
    return peak_lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (g - warm) / max(1.0, planned_g - warm))))


def param_chunks(drafter) -> list[list[torch.nn.Parameter]]:
    """The drafter's parameters in the order its forward first reads them (its own param_chunks). Every trainable
    parameter exactly once (asserted)."""
    chunks = drafter.param_chunks()
    listed = [p for c in chunks for p in c]
    every = [p for p in drafter.parameters() if p.requires_grad]
    assert len(listed) == len(every) and {id(p) for p in listed} == {id(p) for p in every}, \
        "the drafter's param_chunks do not cover its parameters: update it with the drafter's modules"
    return chunks


class ChunkedAdamW(torch.optim.AdamW):
    """AdamW with groups {"chunk": i, decay} and {"chunk": i, no decay} per chunk (the same groups on every device,
    so checkpoints do not depend on `overlap`). overlap: run step() on a side stream (CUDA only) and let the
    next forward wait per chunk through wait(i)."""

    def __init__(self, chunks, lr, weight_decay, overlap=False, module_order=None, no_decay=(), **kw):
        """module_order: the model's parameters in module order (drafter.parameters()), to read checkpoints of the
        former two-group optimizer (load_state_dict). no_decay: matrices kept out of weight decay, with the vectors
        (the drafter's no_decay_params)."""
        self.module_order = list(module_order) if module_order is not None else None
        skip = {id(p) for p in no_decay}
        groups = []
        for i, chunk in enumerate(chunks):
            decay = [p for p in chunk if p.dim() >= 2 and id(p) not in skip]
            flat = [p for p in chunk if p.dim() < 2 or id(p) in skip]
            groups += [{"params": ps, "weight_decay": wd, "chunk": i}
                       for ps, wd in ((decay, weight_decay), (flat, 0.0)) if ps]
        super().__init__(groups, lr=lr, weight_decay=weight_decay, **kw)
        self.num_chunks = len(chunks)
        dev = next(p.device for c in chunks for p in c)
        self.overlap = bool(overlap) and dev.type == "cuda"
        self.stream = torch.cuda.Stream(dev) if self.overlap else None
        self.ready: list = [None] * self.num_chunks

    def load_state_dict(self, state_dict):
        """Also takes the state of the optimizer this one replaced, AdamW([matrices, vectors]) over
        drafter.parameters() (checkpoints written before the chunked groups): its per-parameter state is moved to
        the same parameters here, so such a run resumes with its moments and step counts."""
        groups = state_dict["param_groups"]
        if len(groups) == 2 and "chunk" not in groups[0] and len(self.param_groups) != 2:
            state_dict = self._from_two_groups(state_dict)
        super().load_state_dict(state_dict)

    def _from_two_groups(self, sd):
        if self.module_order is None:
            raise ValueError("a two-group optimizer state needs module_order to be read")
        old = [p for p in self.module_order if p.dim() >= 2] + [p for p in self.module_order if p.dim() < 2]
        sizes = [len(g["params"]) for g in sd["param_groups"]]
        if sizes != [sum(p.dim() >= 2 for p in old), sum(p.dim() < 2 for p in old)]:
            raise ValueError(f"the saved optimizer has groups of {sizes} parameters; this drafter has "
                             f"{sum(p.dim() >= 2 for p in old)} matrices and {sum(p.dim() < 2 for p in old)} vectors")
        at = {id(p): i for i, p in enumerate(old)}                   # parameter -> its index in the saved state
        saved_index = [i for g in sd["param_groups"] for i in g["params"]]
        state, new_groups, j = {}, [], 0
        for g in self.param_groups:
            src = sd["param_groups"][0 if g["params"][0].dim() >= 2 else 1]
            ids = []
            for p in g["params"]:
                k = saved_index[at[id(p)]]
                if k in sd["state"]:
                    state[j] = sd["state"][k]
                ids.append(j)
                j += 1
            new_groups.append({**{k: v for k, v in src.items() if k != "params"}, "chunk": g["chunk"], "params": ids})
        return {"state": state, "param_groups": new_groups}

    def step(self, closure=None):
        if not self.overlap:
            return super().step(closure)
        assert closure is None, "ChunkedAdamW with overlap takes no closure"
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)                        # the gradients, the clip factor
        groups = self.param_groups
        # the gradients are freed on the main stream (zero_grad) while this stream may still read them: the
        # allocator must not hand their memory to the next forward before these kernels ran
        for g in groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.record_stream(self.stream)
        scale = getattr(self, "grad_scale", None)
        if isinstance(scale, torch.Tensor):
            scale.record_stream(self.stream)
        try:
            with torch.cuda.stream(self.stream):
                for i in range(self.num_chunks):
                    self.param_groups = [g for g in groups if g["chunk"] == i]
                    super().step()
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self.ready[i] = ev
        finally:
            self.param_groups = groups
        return None

    def wait(self, i: int) -> None:
        """The current stream waits until chunk i's update has run (no host sync)."""
        ev = self.ready[i]
        if ev is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(ev)
            self.ready[i] = None

    def wait_all(self) -> None:
        for i in range(self.num_chunks):
            self.wait(i)


def make_optimizer(drafter, lr, weight_decay, overlap=False) -> ChunkedAdamW:
    """The trainer's optimizer (the bench's too): fused on a GPU, fp32 master weights; with overlap the drafter's
    forward waits per chunk (drafter.params_ready)."""
    dev = next(drafter.parameters()).device
    opt = ChunkedAdamW(param_chunks(drafter), lr=lr, weight_decay=weight_decay, overlap=overlap,
                       module_order=drafter.parameters(), no_decay=drafter.no_decay_params(), betas=(0.9, 0.95),
                       eps=1e-8, fused=dev.type == "cuda")
    drafter.params_ready = opt.wait if opt.overlap else None
    return opt


def scale_clip_(params, scale, max_norm: float, opt=None):
    """Gradients times scale, then their global norm clipped to max_norm: the result of a per-parameter mul_
    followed by clip_grad_norm_ (the norm of the scaled gradients is scale times the norm of the unscaled ones).
    scale: a 0-dim or [1] tensor on the gradients' device (no host sync). Returns the scaled norm, before clipping.
    With a fused torch optimizer as opt the gradients are left as they are and the factor goes to its next step
    (opt.grad_scale, which GradScaler uses too: the fused AdamW kernel divides each gradient by it as it reads it),
    which saves a pass over every gradient; otherwise one foreach multiply. FSDP2's DTensor gradients: the norm is
    the global one (reduced over the shards), the factor the same on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    scale = scale.reshape(())
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):   # FSDP2 shards: every rank's share in it, the norm of the whole gradient
        total = total.full_tensor()
    total = total * scale
    coef = scale * torch.clamp(max_norm / (total + 1e-6), max=1.0)                # clip_grad_norm_'s coefficient
    if opt is not None and opt.defaults.get("fused"):
        opt.grad_scale = (1.0 / coef).reshape(1).float()
    else:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
