"""Serving-format save/load: a folder with config.json (a Qwen3 config + DFlash fields), model.safetensors with bare
keys (bf16 by default), which SGLang, vLLM and z-lab's DFlashDraftModel load (docs/ALGORITHM.md, section 4), and the
modeling code for transformers' `AutoModel.from_pretrained(dir, trust_remote_code=True, dtype="auto")`:
modeling_dflash.py with this project's drafter.py and attention.py beside it (REMOTE_CODE)."""
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.drafter import Drafter, DrafterConfig

MODEL_DIR = Path(__file__).resolve().parent
REMOTE_CODE = ("modeling_dflash.py", "drafter.py", "attention.py")   # copied into every export, as they are
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def serving_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    L = cfg.num_hidden_layers
    n_sliding = cfg.layer_types.count("sliding_attention")
    rope_parameters = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"},   # trust_remote_code: the files beside it
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


def export_drafter(drafter: Drafter, out_dir, dtype=torch.bfloat16, state=None) -> Path:
    """Write config.json, model.safetensors and the modeling code (REMOTE_CODE) to out_dir atomically (tmp folder,
    then os.replace). dtype: the weights' on the way out; bf16 by default, what serving runs next to a bf16 target
    (the trainer's fp32 master weights stay in its state.pt). state: the whole state dict to write instead of
    drafter.state_dict() (a sharded drafter's, gathered: checkpoint.full_state)."""
    out = Path(out_dir)
    state = drafter.state_dict() if state is None else state
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "config.json", "w") as f:
        json.dump(serving_config(drafter.config, dtype), f, indent=2)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in REMOTE_CODE:
        shutil.copyfile(MODEL_DIR / name, tmp / name)
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
        cfg = DrafterConfig.from_serving(json.load(f))
    with torch.device("meta"):
        drafter = Drafter(cfg)
    state = load_file(str(path / "model.safetensors"), device=str(device))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    return drafter
