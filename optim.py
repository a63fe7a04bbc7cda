"""The drafter's AdamW, one parameter group pair per chunk of the forward (fc + hidden_norm, each layer, the final
norm), and on a GPU its step overlapped with the next forward.

A drafter step is GPU-bound, and AdamW over ~1B fp32 parameters is ~11 ms of memory-bound kernels between one
backward and the next forward (BENCHMARKS.md). With `overlap` the step runs on a side stream chunk by chunk in
forward order and records an event per chunk; the next forward waits for each chunk's event only where it first
reads that chunk's parameters (Drafter.params_ready), so the update of layer i+1 runs while layer i computes. The
arithmetic is the same fused AdamW kernel on the same tensors: results are bitwise those of the plain step
(tests/test_optim.py on CUDA).

Whoever reads the parameters outside the drafter's forward (checkpoints, evaluation, export, the DDP checksum)
calls wait_all() first.
"""
import torch


def param_chunks(drafter) -> list[list[torch.nn.Parameter]]:
    """The drafter's parameters in the order its forward first reads them: [fc, hidden_norm], each layer, [norm].
    Every trainable parameter exactly once (asserted)."""
    chunks = [list(drafter.fc.parameters()) + list(drafter.hidden_norm.parameters())]
    chunks += [list(layer.parameters()) for layer in drafter.layers]
    chunks.append(list(drafter.norm.parameters()))
    listed = [p for c in chunks for p in c]
    every = [p for p in drafter.parameters() if p.requires_grad]
    assert len(listed) == len(every) and {id(p) for p in listed} == {id(p) for p in every}, \
        "param_chunks does not cover the drafter's parameters: update it with the drafter's modules"
    return chunks


class ChunkedAdamW(torch.optim.AdamW):
    """AdamW with groups {"chunk": i, decay} and {"chunk": i, no decay} per chunk (the same groups on every device,
    so checkpoints do not depend on `overlap`). overlap: run step() on a side stream (CUDA only) and let the
    next forward wait per chunk through wait(i)."""

    def __init__(self, chunks, lr, weight_decay, overlap=False, **kw):
        groups = []
        for i, chunk in enumerate(chunks):
            decay, flat = [p for p in chunk if p.dim() >= 2], [p for p in chunk if p.dim() < 2]
            groups += [{"params": ps, "weight_decay": wd, "chunk": i}
                       for ps, wd in ((decay, weight_decay), (flat, 0.0)) if ps]
        super().__init__(groups, lr=lr, weight_decay=weight_decay, **kw)
        self.num_chunks = len(chunks)
        dev = next(p.device for c in chunks for p in c)
        self.overlap = bool(overlap) and dev.type == "cuda"
        self.stream = torch.cuda.Stream(dev) if self.overlap else None
        self.ready: list = [None] * self.num_chunks

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
                       betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    drafter.params_ready = opt.wait if opt.overlap else None
    return opt
