"""Target features vs HF hidden states; MASK token choice; configs of real models; a Hub id from the local cache."""
import json

import pytest
import torch

from conftest import SMOLLM2_DIR
from model.drafter import DrafterConfig
from model.hub import resolve_model_path
from model.target import Target, check_mask_token_id, default_mask_token_id


@pytest.mark.parametrize("target,layer_ids", [("tiny_qwen3_dir", [0, 2, 3]), ("tiny_llama_dir", [0, 2, 3]),
                                              ("tiny_llama_dir", [1, 5])])   # 5: the last layer, after the norm
def test_features_equal_hf_hidden_states(request, target, layer_ids):
    from transformers import AutoModelForCausalLM
    path = request.getfixturevalue(target)
    t = Target(path, dtype=torch.float32, layer_ids=layer_ids)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0                                                         # right padding
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(t.decoder.layers)]
    got = t.features(ids, mask)
    for h in hooks:
        h.remove()
    assert ran == list(range(max(layer_ids) + 1)), "only the layers up to the last tap run"
    assert got.shape == (2, 10, len(layer_ids) * 64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    want = torch.cat([hs[l + 1] for l in layer_ids], dim=-1)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real])
    # the padded row's real tokens equal the same sequence run alone (right padding changes nothing before it)
    alone = t.features(ids[1:, :6], torch.ones(1, 6, dtype=torch.long))
    torch.testing.assert_close(got[1, :6], alone[0], atol=1e-5, rtol=1e-5)
    assert len(t.decoder.layers) == 6, "the layer stack is restored after the truncated run"
    assert not got.requires_grad and not t.embed_tokens.weight.requires_grad
    assert t.num_layers == 6 and t.lm_head_weight.shape == (128, 64)


def test_not_a_causal_lm(tmp_path):
    from transformers import ViTConfig
    ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal LM"):
        Target(tmp_path)
    with pytest.raises(FileNotFoundError):
        Target(tmp_path / "missing")


class FakeTok:
    """len() < embedding rows, as for Qwen3 (151669 tokens, 151936 rows)."""
    def __len__(self):
        return 151669


def test_mask_token_past_tokenizer():
    assert default_mask_token_id(FakeTok(), 151936) == 151669
    check_mask_token_id(151669, FakeTok(), 151936)
    with pytest.raises(ValueError, match="outside the target's embedding"):
        check_mask_token_id(151936, FakeTok(), 151936)


@pytest.mark.skipif(not SMOLLM2_DIR.exists(), reason=f"no SmolLM2 folder at {SMOLLM2_DIR}")
def test_smollm2_mask_token_and_config():
    from transformers import AutoConfig, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    rows = json.loads((SMOLLM2_DIR / "config.json").read_text())["vocab_size"]
    assert len(tok) == rows == 49152
    mask_id = default_mask_token_id(tok, rows)
    assert mask_id == 16 and tok.convert_ids_to_tokens(16) == "<empty_output>"
    check_mask_token_id(mask_id, tok, rows)
    with pytest.raises(ValueError, match="ordinary vocabulary token"):
        check_mask_token_id(500, tok, rows)
    with pytest.raises(ValueError, match="eos"):
        check_mask_token_id(tok.eos_token_id, tok, rows)
    with pytest.raises(ValueError, match="outside"):
        check_mask_token_id(rows, tok, rows)
    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(SMOLLM2_DIR), 5, 16, mask_id)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (576, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None and cfg.num_target_layers == 30
    assert cfg.target_layer_ids == [1, 8, 14, 20, 27]


def test_config_with_top_level_rope_theta():
    # transformers-4 style dict: rope_theta at the top level, no rope_parameters
    from types import SimpleNamespace
    hf = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=128, rms_norm_eps=1e-6, rope_theta=123456.0, rope_scaling=None,
                         max_position_embeddings=512, num_hidden_layers=6, vocab_size=128)
    cfg = DrafterConfig.from_target(hf, 2, 4, 127)
    assert cfg.rope_theta == 123456.0 and cfg.rope_scaling is None


# ---------------------------------------------------------------------------
# A Hub id resolved from the local Hugging Face cache, never the network

def fake_hub_cache(root, repo="Qwen/Qwen3-8B", commit="0123456789abcdef0123456789abcdef01234567", files=("config.json",)):
    """The hub cache layout huggingface_hub writes: models--org--name/refs/main holds the commit, snapshots/<commit>/
    the files. -> the snapshot folder."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in files:
        (snap / f).write_text("{}")
    return snap


def test_resolve_model_path_local_folder_and_hub_cache(tmp_path, monkeypatch):
    local = tmp_path / "local"
    local.mkdir()
    assert resolve_model_path(local) == local and resolve_model_path(str(local)) == local
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = fake_hub_cache(tmp_path / "hub")
    assert resolve_model_path("Qwen/Qwen3-8B") == snap
    # HF_HOME/hub when HF_HUB_CACHE is unset
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snap2 = fake_hub_cache(tmp_path / "home" / "hub", commit="f" * 40)
    assert resolve_model_path("Qwen/Qwen3-8B") == snap2


def test_resolve_model_path_errors_name_the_cache_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("Qwen/Qwen3-8B")
    msg = str(e.value)
    assert str(tmp_path / "hub") in msg and "hf download Qwen/Qwen3-8B" in msg and "local folder" in msg
    fake_hub_cache(tmp_path / "hub", repo="org/partial", files=("tokenizer.json",))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path("org/partial")
    with pytest.raises(FileNotFoundError, match="not a Hub id"):
        resolve_model_path(str(tmp_path / "missing" / "folder"))
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        resolve_model_path(tmp_path / "file.bin")
