"""Serving format: exact round trip, exact key names and config fields."""
import json

import torch
from safetensors.torch import load_file

from model.export import export_drafter, load_drafter


def test_round_trip_exact(build_drafter, tiny_llama_dir, tmp_path):
    d = build_drafter(tiny_llama_dir, num_layers=3, block_size=8, sliding_window_layers=1, sliding_window=32)
    out = export_drafter(d, tmp_path / "drafter")
    out = export_drafter(d, tmp_path / "drafter")                     # overwriting an existing export works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"], "no tmp/old folders left behind"
    d2 = load_drafter(out, device="cpu")
    assert d2.config == d.config
    s1, s2 = d.state_dict(), d2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    d3 = load_drafter(out, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in d3.parameters())


def test_qwen3_export_keys_and_config(build_drafter, tiny_qwen3_dir, tmp_path):
    from transformers import AutoConfig, Qwen3Config
    L, B = 2, 16
    d = build_drafter(tiny_qwen3_dir, num_layers=L, block_size=B)
    H, K = d.config.hidden_size, d.config.num_taps
    out = export_drafter(d, tmp_path / "drafter")
    sd = load_file(out / "model.safetensors")
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    want = {f"layers.{i}.{k}" for i in range(L) for k in per_layer} | {"norm.weight", "fc.weight",
                                                                       "hidden_norm.weight"}
    assert set(sd) == want
    assert sd["fc.weight"].shape == (H, K * H)

    cfg = json.loads((out / "config.json").read_text())
    hf = AutoConfig.from_pretrained(tiny_qwen3_dir)
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["DFlashDraftModel"]
    for k in ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "max_position_embeddings", "vocab_size"]:
        assert cfg[k] == getattr(hf, k), k
    assert cfg["num_hidden_layers"] == L and cfg["layer_types"] == ["full_attention"] * L
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
    assert cfg["attention_bias"] is False and cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"]           # top level, for transformers-4 loaders
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": hf.rope_parameters["rope_theta"]}
    assert cfg["rope_scaling"] is None
    assert cfg["block_size"] == B and cfg["num_target_layers"] == hf.num_hidden_layers
    assert cfg["dflash_config"] == {"mask_token_id": hf.vocab_size - 1,
                                    "target_layer_ids": d.config.target_layer_ids}
    assert cfg["dtype"] == "float32"
    # and transformers itself reads it back as the same Qwen3 config
    q = Qwen3Config.from_pretrained(out)
    assert q.rope_parameters["rope_theta"] == cfg["rope_theta"] and q.num_hidden_layers == L
