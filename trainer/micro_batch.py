"""One drafter step as a function of explicit settings: the trainer's loop and the bench (bench/bench_dflash.py)
call the same `make_prepare`, `drafter_step` and `optimizer_step` with the run's settings `c`
(trainer.settings.Settings, read as c.NAME: SEED, MAX_ANCHORS, MIN_ANCHORS_PER_DOC, TOKEN_BUDGET, GAMMA,
LOSS_WEIGHTING, DPACE_ALPHA, NOISE, CE_CHUNK, SELECTOR_ALPHA; train_dflash.py's constants of those names give units
and allowed values)."""
import contextlib
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from model.attention import static_lengths
from model.drafters import SELECTOR_METRICS, arch_of, unwrap
from model.objective import block_metrics, decay_weighted, micro_seed, prepare
from trainer.optim import scale_clip_


class StepSums(NamedTuple):
    """A micro-batch's sums (0-dim float64 tensors, on the device until the log interval); summed over micro-batches
    and drafter ranks, the status line divides them in pairs."""
    loss: torch.Tensor          # sum w * CE under the exp decay (the status line's loss, whatever the weighting)
    loss_w: torch.Tensor        # sum of those w
    acc_num: torch.Tensor       # correct supervised slots
    acc_den: torch.Tensor       # supervised slots
    streak_num: torch.Tensor    # accepted prefix lengths, summed over blocks
    streak_den: torch.Tensor    # blocks
    objective: torch.Tensor     # sum w * CE under LOSS_WEIGHTING: what the gradients hold
    objective_w: torch.Tensor   # sum of those w: the step's normaliser
    # a drafter with a candidate selector (DFlash2, model/drafters.py SELECTOR_METRICS); 0 for DFlash
    sel_recall_num: torch.Tensor    # supervised slots whose gold is in the unary top-K
    sel_tf_acc_num: torch.Tensor    # ... that the teacher-forced selector picks
    sel_den: torch.Tensor           # supervised slots
    path_streak_num: torch.Tensor   # accepted prefix of the selector's own walk, summed over blocks
    path_streak_den: torch.Tensor   # blocks

    @classmethod
    def zeros(cls, device) -> torch.Tensor:
        """[fields] float64 zeros: the running sums of micro-batches' StepSums, stacked (the status line's meter)."""
        return torch.zeros(len(cls._fields), device=device, dtype=torch.float64)


def mask_lengths(cfg, device, flex, c):
    """The flex masks' fixed (Q_LEN, KV_LEN) on a GPU: max_anchors blocks against token_budget context rows, so
    flex_attention compiles once, for static shapes. None (each mask its own length) for the CPU's masks."""
    if not flex or torch.device(device).type != "cuda":
        return None
    return static_lengths(c.MAX_ANCHORS, cfg.block_size, c.TOKEN_BUDGET)


def make_prepare(cfg, device, flex, c):
    """Packet -> Prepared (model.objective.prepare) with these settings."""
    return functools.partial(prepare, cfg=cfg, seed=c.SEED, max_anchors=c.MAX_ANCHORS,
                             min_per_doc=c.MIN_ANCHORS_PER_DOC, gamma=c.GAMMA, flex=flex, device=device,
                             lengths=mask_lengths(cfg, device, flex, c))


def drafter_step(model, embed, head_w, item, block_size, autocast, c, sync=True, probe=None,
                 saved_hooks=None) -> StepSums:
    """One micro-batch's forward, loss and backward: the gradients accumulate sum(w * CE) until optimizer_step.
    sync=False: a DDP model skips its gradient all-reduce (not the step's last micro-batch). probe(phase) and
    saved_hooks: the bench's instruments."""
    probe = probe or (lambda phase: None)
    feats = item.features                                                                    # [T, K*H]
    if c.NOISE:
        gen = torch.Generator(device=feats.device).manual_seed(micro_seed(c.SEED, item.g))
        feats = feats + (torch.rand(feats.shape, generator=gen, device=feats.device, dtype=torch.float32)
                         * 2 - 1).mul_(c.NOISE).to(feats.dtype)
    no_sync = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):   # FSDP2: reduce-scatter only after the step's last micro-batch
        model.set_requires_gradient_sync(sync)
    with no_sync, autocast:
        with saved_hooks or contextlib.nullcontext():
            hidden = model(feats, item.ctx_pos, embed(item.block_ids), item.block_pos, item.attn)   # [N*B, H]
            probe("forward")
            parts, extra = arch_of(model).loss(unwrap(model), hidden, head_w, item, c.LOSS_WEIGHTING, c.DPACE_ALPHA,
                                               c.CE_CHUNK, c.SELECTOR_ALPHA)
            probe("CE")
        parts.loss_sum.backward()
    probe("backward")
    zero = parts.weight_sum.new_zeros(())
    bm = block_metrics(parts.correct.view(-1, block_size), item.weights.view(-1, block_size))
    sums = torch.stack([*decay_weighted(parts, item, c.LOSS_WEIGHTING), bm["acc_num"], bm["acc_den"],
                        bm["streak_num"], bm["streak_den"], parts.loss_sum.detach(), parts.weight_sum,
                        *[extra.get(k, zero) for k in SELECTOR_METRICS]]).double()
    return StepSums(*sums.unbind())


def optimizer_step(params, opt, step_w, grad_clip, n_drafters=1, group=None):
    """The update after a step's micro-batches. Global normalisation: the gradients hold sum(w * CE) (averaged over
    the n_drafters ranks of `group` by DDP's all-reduce, or FSDP2's reduce-scatter, which averages the same way),
    step_w [1] this rank's sum of w: divide by the global one."""
    if n_drafters > 1:
        dist.all_reduce(step_w, group=group)
    scale_clip_(params, (n_drafters / step_w.clamp(min=1e-12)).float(), grad_clip, opt)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_w.zero_()


def autocast_for(device, dtype):
    return torch.autocast("cuda", dtype=dtype) if device.type == "cuda" and dtype != torch.float32 \
        else torch.autocast("cpu", enabled=False)
