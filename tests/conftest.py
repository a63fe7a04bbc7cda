"""Shared fixtures: tiny random Qwen3 and Llama targets saved as local HF folders, and a drafter factory."""
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)   # 2 shared cores: tests are tiny, threads only add contention

SMOLLM2_DIR = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "smollm2-135m-instruct"
ZLAB_REPO = Path("/work/.mirror/z-lab+dflash/repo")   # bare git dir of the public reference inference code

TINY = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, num_hidden_layers=6, max_position_embeddings=512, rms_norm_eps=1e-6)


def _save_tiny(cls_name, out, **extra):
    import transformers
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name + "Config")(**TINY, **extra)
    model = getattr(transformers, cls_name + "ForCausalLM")(cfg)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return _save_tiny("Qwen3", tmp_path_factory.mktemp("tiny_qwen3"), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return _save_tiny("Llama", tmp_path_factory.mktemp("tiny_llama"),
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


@pytest.fixture(scope="session")
def build_drafter():
    """build_drafter(target_dir, num_layers=2, block_size=4, seed=0, **kw) -> Drafter (fp32, CPU).
    The MASK id is the last row of the tiny vocab."""
    from transformers import AutoConfig
    from model.drafter import Drafter, DrafterConfig

    def build(target_dir, num_layers=2, block_size=4, seed=0, **kw):
        hf = AutoConfig.from_pretrained(target_dir, local_files_only=True)
        cfg = DrafterConfig.from_target(hf, num_layers, block_size, mask_token_id=hf.vocab_size - 1, **kw)
        torch.manual_seed(seed)
        return Drafter(cfg)
    return build
