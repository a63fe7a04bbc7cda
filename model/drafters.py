"""The drafter architectures, one row each: DRAFTER_ARCH names a row, and the rest of the tree reads the row (its
classes, its training loss, its export and loader) instead of naming a variant. What a drafter does itself
(param_chunks, shard_units, draft_tokens, memory_terms) is a method of its class."""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from model import objective
from model.dflash2 import DFlash2Config, DFlash2Drafter
from model.dflash2_loss import dflash2_loss, selector_metrics
from model.drafter import Drafter, DrafterConfig
from model.export import export_dflash2, export_drafter, load_dflash2, load_drafter


def dflash_loss(drafter, hidden, head_w, item, weighting, dpace_alpha, chunk_size, selector_alpha=0.0):
    """objective.block_loss -> (LossParts, {}): DFlash has no metrics beyond block_metrics'."""
    return objective.block_loss(hidden, head_w, item, drafter.config.block_size, weighting, dpace_alpha,
                                chunk_size), {}


def dflash2_train_loss(drafter, hidden, head_w, item, weighting, dpace_alpha, chunk_size, selector_alpha=1.0):
    """dflash2_loss (block CE + selector_alpha x the selector CE) -> (LossParts, selector_metrics' sums). The
    metrics are taken before the backward, while FSDP2 still holds the selector gathered."""
    if drafter.params_ready:   # the overlapped optimizer: the selector chunk's update has run
        drafter.params_ready(len(drafter.layers) + 2)
    parts, sel = dflash2_loss(drafter, hidden, head_w, item, weighting, dpace_alpha, chunk_size, selector_alpha)
    W = head_w.weight if isinstance(head_w, objective.HeadFP8) else head_w
    return parts, selector_metrics(drafter.candidate_selector, hidden, W, item, drafter.config.block_size, sel,
                                   parts.top_ids, chunk_size)


@dataclass(frozen=True)
class Arch:
    drafter: type            # the nn.Module (fp32 master weights in training)
    config: type             # its config dataclass
    loss: Callable           # (drafter, hidden, head_w, item, weighting, dpace_alpha, chunk_size, selector_alpha)
    export: Callable         # (drafter, out_dir, dtype, state, **card) -> Path
    load: Callable           # (path, device, dtype) -> drafter
    serving_name: str        # config.json's architectures[0]


ARCHS = {
    "dflash": Arch(Drafter, DrafterConfig, dflash_loss, export_drafter, load_drafter, "DFlashDraftModel"),
    "dflash2": Arch(DFlash2Drafter, DFlash2Config, dflash2_train_loss, export_dflash2, load_dflash2,
                    "DFlash2DraftModel"),
}
# the selector metrics' keys, in the order the trainer's sums hold them (zero for an arch without a selector)
SELECTOR_METRICS = ("sel_recall_num", "sel_tf_acc_num", "sel_den", "path_streak_num", "path_streak_den")


def unwrap(model) -> Drafter:
    """The drafter inside torch.compile's and DDP's wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def arch_of(drafter) -> Arch:
    return ARCHS[unwrap(drafter).arch]


def make_config(arch: str, dcfg: DrafterConfig, **knobs):
    """The arch's config from the DFlash one: dflash2's knobs (conv_kernel_size=, conv_group_size=, selector_rank=,
    selector_top_k=) are ignored by dflash."""
    return dcfg if arch == "dflash" else DFlash2Config.from_drafter(dcfg, **knobs)


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
