"""One drafter step as a function of explicit settings: the trainer's loop and the bench (bench/bench_dflash.py)
call the same `make_prepare`, `drafter_step` and `optimizer_step` with a `StepConfig`, read from train_dflash.py's
constants of the same names (`StepConfig.of(config)`)."""
import contextlib
import functools
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.distributed as dist

from model.attention import static_lengths
from model.drafters import SELECTOR_METRICS, arch_of, unwrap
from model.objective import block_metrics, decay_weighted, micro_seed, prepare
from trainer.optim import scale_clip_


@dataclass(frozen=True)
class StepConfig:
    """The settings a micro-batch's preparation and a drafter step read; each is train_dflash's constant of the
    upper-case name (its comment there gives units and allowed values)."""
    seed: int
    max_anchors: int
    min_anchors_per_doc: int
    token_budget: int
    gamma: float
    loss_weighting: str
    dpace_alpha: float
    noise: float
    ce_chunk: int
    grad_clip: float
    selector_alpha: float = 1.0   # DRAFTER_ARCH=dflash2: the selector CE's weight beside the block CE

    @classmethod
    def of(cls, settings: dict) -> "StepConfig":
        """From a {NAME: value} dict of the trainer's settings (train_dflash's config)."""
        return cls(**{f.name: settings[f.name.upper()] for f in fields(cls)})


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


def mask_lengths(cfg, device, flex, s: StepConfig):
    """The flex masks' fixed (Q_LEN, KV_LEN) on a GPU: max_anchors blocks against token_budget context rows, so
    flex_attention compiles once, for static shapes. None (each mask its own length) for the CPU's masks."""
    if not flex or torch.device(device).type != "cuda":
        return None
    return static_lengths(s.max_anchors, cfg.block_size, s.token_budget)


def make_prepare(cfg, device, flex, s: StepConfig):
    """Packet -> Prepared (model.objective.prepare) with these settings."""
    return functools.partial(prepare, cfg=cfg, seed=s.seed, max_anchors=s.max_anchors,
                             min_per_doc=s.min_anchors_per_doc, gamma=s.gamma, flex=flex, device=device,
                             lengths=mask_lengths(cfg, device, flex, s))


def drafter_step(model, embed, head_w, item, block_size, autocast, s: StepConfig, sync=True, probe=None,
                 saved_hooks=None) -> StepSums:
    """One micro-batch's forward, loss and backward: the gradients accumulate sum(w * CE) until optimizer_step.
    sync=False: a DDP model skips its gradient all-reduce (not the step's last micro-batch). probe(phase) and
    saved_hooks: the bench's instruments."""
    probe = probe or (lambda phase: None)
    feats = item.features                                                                    # [T, K*H]
    if s.noise:
        gen = torch.Generator(device=feats.device).manual_seed(micro_seed(s.seed, item.g))
        feats = feats + (torch.rand(feats.shape, generator=gen, device=feats.device, dtype=torch.float32)
                         * 2 - 1).mul_(s.noise).to(feats.dtype)
    no_sync = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):   # FSDP2: reduce-scatter only after the step's last micro-batch
        model.set_requires_gradient_sync(sync)
    with no_sync, autocast:
        with saved_hooks or contextlib.nullcontext():
            hidden = model(feats, item.ctx_pos, embed(item.block_ids), item.block_pos, item.attn)   # [N*B, H]
            probe("forward")
            parts, extra = arch_of(model).loss(unwrap(model), hidden, head_w, item, s.loss_weighting, s.dpace_alpha,
                                               s.ce_chunk, s.selector_alpha)
            probe("CE")
        parts.loss_sum.backward()
    probe("backward")
    zero = parts.weight_sum.new_zeros(())
    bm = block_metrics(parts.correct.view(-1, block_size), item.weights.view(-1, block_size))
    sums = torch.stack([*decay_weighted(parts, item, s.loss_weighting), bm["acc_num"], bm["acc_den"],
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
