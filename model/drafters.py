"""The drafter architectures, one row each: DRAFTER_ARCH names a row, and the rest of the tree reads the row (its
classes, its knobs and their checks, its training loss and the status line's figures of it, its warm start, its
export and loader) instead of naming a variant. What a drafter does itself (param_chunks, shard_units,
draft_tokens, memory_terms) is a method of its class. The trainer hands the row its settings `c` (duck-typed: the
constants as attributes, c.NAME); nothing here imports the trainer."""
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from model import objective
from model.dflash2 import DFlash2Config, DFlash2Drafter, dflash2_keys, warm_start
from model.dflash2_loss import dflash2_loss, selector_metrics
from model.drafter import Drafter, DrafterConfig
from model.export import export_dflash2, export_drafter, load_dflash2, load_drafter


def dflash_loss(drafter, hidden, head_w, item, c):
    """objective.block_loss under c.LOSS_WEIGHTING, c.DPACE_ALPHA, c.CE_CHUNK -> (LossParts, {}): DFlash has no
    metrics beyond block_metrics'."""
    return objective.block_loss(hidden, head_w, item, drafter.config.block_size, c.LOSS_WEIGHTING, c.DPACE_ALPHA,
                                c.CE_CHUNK), {}


def dflash2_train_loss(drafter, hidden, head_w, item, c):
    """dflash2_loss (block CE + c.SELECTOR_ALPHA x the selector CE) -> (LossParts, selector_metrics' sums). The
    metrics are taken before the backward, while FSDP2 still holds the selector gathered."""
    if drafter.params_ready:   # the overlapped optimizer: the selector chunk's update has run
        drafter.params_ready(len(drafter.layers) + 2)
    parts, sel = dflash2_loss(drafter, hidden, head_w, item, c.LOSS_WEIGHTING, c.DPACE_ALPHA, c.CE_CHUNK,
                              c.SELECTOR_ALPHA)
    W = head_w.weight if isinstance(head_w, objective.HeadFP8) else head_w
    return parts, selector_metrics(drafter.candidate_selector, hidden, W, item, drafter.config.block_size, sel,
                                   parts.top_ids, c.CE_CHUNK)


def dflash2_check(c, vocab_size, hidden_size) -> list[str]:
    """What DFlash2's knobs rule out: a convolution group that does not divide the hidden size, more selector
    candidates than the vocabulary (both the target's; None: its config.json is missing, refused elsewhere), more
    taps than a block."""
    errs = []
    H, V = hidden_size, vocab_size
    if H is not None and c.CONV_GROUP_SIZE >= 1 and H % c.CONV_GROUP_SIZE:
        errs.append(f"CONV_GROUP_SIZE={c.CONV_GROUP_SIZE} does not divide the drafter's hidden size {H} (the "
                    f"target's): pick a divisor of {H}, e.g. --CONV_GROUP_SIZE={math.gcd(H, 16)}")
    if V is not None and c.SELECTOR_TOP_K > V:
        errs.append(f"SELECTOR_TOP_K={c.SELECTOR_TOP_K} exceeds the vocabulary ({V} tokens): set "
                    f"--SELECTOR_TOP_K={min(16, V)}")
    if c.CONV_KERNEL_SIZE > c.BLOCK_SIZE:
        errs.append(f"CONV_KERNEL_SIZE={c.CONV_KERNEL_SIZE} exceeds BLOCK_SIZE={c.BLOCK_SIZE} (a tap never crosses "
                    f"a block): set --CONV_KERNEL_SIZE to at most {c.BLOCK_SIZE}")
    return errs


def dflash2_warm_start(drafter, state) -> bool:
    """A DFlash export's state (fp32 or bf16) into a DFlash2 drafter, if that is what it is (the drafter's keys
    less dflash2_keys): the backbone's weights, the DFlash2 parameters at their init, so it drafts as the DFlash one
    did. False, the drafter untouched, for any other state."""
    keys = drafter.state_dict().keys()
    if keys - state.keys() != dflash2_keys(drafter) or state.keys() - keys:
        return False
    warm_start(drafter, {k: v.float() for k, v in state.items()})
    return True


# the selector metrics' keys (selector_metrics'), in the order the trainer's sums hold them
SELECTOR_METRICS = ("sel_recall_num", "sel_tf_acc_num", "sel_den", "path_streak_num", "path_streak_den")


def selector_status(m) -> dict:
    """The interval's summed selector metrics -> the status line's figures: recall@K of the unary top-K, the
    teacher-forced pick, the selector's own walk; none without a supervised slot."""
    if not m["sel_den"]:
        return {}
    return {"sel_recall": (m["sel_recall_num"] / m["sel_den"], ".3f"),
            "sel_acc": (m["sel_tf_acc_num"] / m["sel_den"], ".3f"),
            "sel_streak": (m["path_streak_num"] / max(m["path_streak_den"], 1), ".2f")}


@dataclass(frozen=True)
class Arch:
    drafter: type            # the nn.Module (fp32 master weights in training); its `arch` is the row's key
    config: type             # its config dataclass: DrafterConfig's fields, then one per knob
    loss: Callable           # (drafter, hidden, head_w, item, c) -> (LossParts, {metric: 0-dim sum}); c: the run's
    #                          settings (LOSS_WEIGHTING, DPACE_ALPHA, CE_CHUNK and what the arch's loss reads)
    export: Callable         # (drafter, out_dir, dtype, state, **card) -> Path
    load: Callable           # (path, device, dtype) -> drafter
    serving_name: str        # config.json's architectures[0]
    title: str               # its name in messages ("DFlash2")
    knobs: dict = field(default_factory=dict)   # the settings that shape its config: setting -> config field
    #                                              (make_config; an export writes them in dflash_config)
    loss_settings: tuple = ()                    # the settings its loss reads beyond DFlash's (the bench's flags)
    check: Callable = lambda c, vocab_size, hidden_size: []   # -> errors in the knobs a user can fix (check_config;
    #                                              the target's sizes, None without its config.json)
    warm_from: str | None = None                 # the arch whose export can start a run of this one (INIT_FROM) ...
    warm_start: Callable | None = None           # ... (drafter, state) -> bool: took it (False: not such an export)
    metrics: tuple = ()                          # the keys of its loss's sums, in MicroBatchSums' arch slots' order
    status: Callable = lambda sums: {}           # {metric: summed value} -> {name: (value, format)}: metrics.jsonl's
    #                                              keys and the status line's name=value, in order ({}: nothing)


ARCHS = {
    "dflash": Arch(Drafter, DrafterConfig, dflash_loss, export_drafter, load_drafter, "DFlashDraftModel", "DFlash"),
    "dflash2": Arch(DFlash2Drafter, DFlash2Config, dflash2_train_loss, export_dflash2, load_dflash2,
                    "DFlash2DraftModel", "DFlash2",
                    knobs={"CONV_KERNEL_SIZE": "conv_kernel_size", "CONV_GROUP_SIZE": "conv_group_size",
                           "SELECTOR_RANK": "selector_rank", "SELECTOR_TOP_K": "selector_top_k"},
                    loss_settings=("SELECTOR_ALPHA",), check=dflash2_check, warm_from="dflash",
                    warm_start=dflash2_warm_start, metrics=SELECTOR_METRICS, status=selector_status),
}


def unwrap(model) -> Drafter:
    """The drafter inside torch.compile's and DDP's wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def arch_of(drafter) -> Arch:
    return ARCHS[unwrap(drafter).arch]


def make_config(arch: str, dcfg: DrafterConfig, c):
    """The arch's config from the DFlash one: dcfg itself for an arch without knobs, else its config class's
    from_drafter with each knob's value from the settings c (Arch.knobs)."""
    a = ARCHS[arch]
    if type(dcfg) is a.config and not a.knobs:
        return dcfg
    return a.config.from_drafter(dcfg, **{name: getattr(c, setting) for setting, name in a.knobs.items()})


def export_arch(path) -> str:
    """The arch of an exported drafter folder, from its config.json's architectures."""
    names = json.loads((Path(path) / "config.json").read_text()).get("architectures") or ["DFlashDraftModel"]
    for name, a in ARCHS.items():
        if a.serving_name in names:
            return name
    return "dflash"


def load_export(path, device="cpu", dtype=None):
    """Any exported drafter, its loader picked by its config.json."""
    return ARCHS[export_arch(path)].load(path, device=device, dtype=dtype)


def export(drafter, out_dir, dtype=torch.bfloat16, state=None, **card) -> Path:
    return arch_of(drafter).export(unwrap(drafter), out_dir, dtype, state, **card)
