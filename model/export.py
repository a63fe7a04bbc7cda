"""Serving-format save/load: a folder with config.json (a Qwen3 config + DFlash fields) and model.safetensors with
bare keys, which SGLang, vLLM and z-lab's DFlashDraftModel load (spec section 3)."""
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.drafter import Drafter, DrafterConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def serving_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    L = cfg.num_hidden_layers
    n_sliding = cfg.layer_types.count("sliding_attention")
    rope_parameters = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": L,
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": n_sliding > 0,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": L - n_sliding,          # Qwen3's rule: layers >= max_window_layers slide
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        # transformers 4.x loaders (z-lab pins 4.57.1) read only the top-level key and fall back to 10000 silently
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_parameters,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
        "use_cache": True,
    }


def config_from_serving(c: dict) -> DrafterConfig:
    rp = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return DrafterConfig(
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        intermediate_size=c["intermediate_size"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=float(c.get("rope_theta") or rp.get("rope_theta") or 10000.0),
        rope_scaling=scaling or None,
        max_position_embeddings=c["max_position_embeddings"],
        num_hidden_layers=c["num_hidden_layers"],
        num_target_layers=c["num_target_layers"],
        target_layer_ids=list(c["dflash_config"]["target_layer_ids"]),
        block_size=c["block_size"],
        mask_token_id=c["dflash_config"]["mask_token_id"],
        vocab_size=c["vocab_size"],
        layer_types=list(c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]),
        sliding_window=c.get("sliding_window") if c.get("use_sliding_window") else None,
        attention_bias=c.get("attention_bias", False),
    )


def export_drafter(drafter: Drafter, out_dir, dtype=None) -> Path:
    """Write config.json + model.safetensors to out_dir atomically (tmp folder, then os.replace).
    dtype: cast the weights on the way out (default: keep the drafter's)."""
    out = Path(out_dir)
    dtype = dtype or next(drafter.parameters()).dtype
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "config.json", "w") as f:
        json.dump(serving_config(drafter.config, dtype), f, indent=2)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # os.replace cannot overwrite a non-empty folder: move the old one aside first, drop it after the swap
    old = out.with_name(f"{out.name}.old{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def load_drafter(path, device="cpu", dtype=None) -> Drafter:
    """Inverse of export_drafter: built on the meta device, weights assigned straight from the file."""
    path = Path(path)
    with open(path / "config.json") as f:
        cfg = config_from_serving(json.load(f))
    with torch.device("meta"):
        drafter = Drafter(cfg)
    state = load_file(str(path / "model.safetensors"), device=str(device))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    return drafter
