"""A micro-batch on a drafter rank: `make_prepare` turns an arrived Packet into the drafter's inputs (anchors, blocks,
mask: model.objective.prepare) with the run's settings `c` (trainer.settings.Settings: SEED, MAX_ANCHORS,
MIN_ANCHORS_PER_DOC, TOKEN_BUDGET, GAMMA), and `MicroBatchSums` holds what train_dflash.drafter_step measured on it for
the status line. The drafter step itself and the optimizer step sit beside the loop in train_dflash.py; the bench
(bench/bench_dflash.py) calls the same functions."""
import functools
from typing import NamedTuple

import torch

from model.attention import static_lengths
from model.objective import prepare


class MicroBatchSums(NamedTuple):
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
    # the drafter arch's own sums: its loss's metrics (model/drafters.py Arch.metrics) in that order, 0 past them and
    # for an arch without any (DFlash); Arch.status turns them into the status line's figures
    arch_0: torch.Tensor
    arch_1: torch.Tensor
    arch_2: torch.Tensor
    arch_3: torch.Tensor
    arch_4: torch.Tensor

    @classmethod
    def of(cls, arch=(), **sums) -> "MicroBatchSums":
        """From every generic field by name and the arch's sums in Arch.metrics' order (into arch_0, ...; the rest
        0), all 0-dim tensors on one device: stacked and made float64 at once."""
        slots = [f for f in cls._fields if f.startswith("arch_")]
        assert len(arch) <= len(slots), f"{len(arch)} arch metrics, {len(slots)} slots in MicroBatchSums"
        assert set(sums) == set(cls._fields) - set(slots), sorted(set(sums) ^ (set(cls._fields) - set(slots)))
        zero = sums["objective_w"].new_zeros(())
        sums.update(zip(slots, [*arch, *[zero] * (len(slots) - len(arch))]))
        return cls(*torch.stack([sums[f] for f in cls._fields]).double().unbind())

    def arch_sums(self, metrics) -> dict:
        """{metric: sum} of the arch's metrics (Arch.metrics), read from their slots."""
        return {m: getattr(self, f"arch_{i}") for i, m in enumerate(metrics)}

    @classmethod
    def zeros(cls, device) -> torch.Tensor:
        """[fields] float64 zeros: the running sums of micro-batches' MicroBatchSums, stacked (the status line's
        meter)."""
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


def autocast_for(device, dtype):
    return torch.autocast("cuda", dtype=dtype) if device.type == "cuda" and dtype != torch.float32 \
        else torch.autocast("cpu", enabled=False)
