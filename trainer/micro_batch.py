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
    # a drafter with a candidate selector (DFlash2, model/drafters.py SELECTOR_METRICS); 0 for DFlash
    sel_recall_num: torch.Tensor    # supervised slots whose gold is in the unary top-K
    sel_tf_acc_num: torch.Tensor    # ... that the teacher-forced selector picks
    sel_den: torch.Tensor           # supervised slots
    path_streak_num: torch.Tensor   # accepted prefix of the selector's own walk, summed over blocks
    path_streak_den: torch.Tensor   # blocks

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
