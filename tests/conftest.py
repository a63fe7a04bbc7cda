"""Shared fixtures: tiny random Qwen3 and Llama targets saved as local HF folders (and an 8-token one), the Qwen3
tokenizer, a drafter factory, and the trainer tests' target + dataset (`assets`, one per test module;
tests/helpers/runs.py builds them). A topic's own helpers and fixtures shared by two tiers (a unit test and its GPU or
job half) live in tests/helpers/ (<topic>_cases.py, stub_server.py), imported by name.

The tiers are where a file lives: tests/unit (in-process), tests/jobs (every test marked `job` here, by its path),
tests/gpu (skips without CUDA); tests/unit/test_tiers.py keeps processes and CUDA-only tests out of tests/unit."""
import lzma
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))                 # the repository: its packages
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))           # runs, server
torch.set_num_threads(1)   # 2 shared cores: tests are tiny, threads only add contention

SMOLLM2_DIR = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "smollm2-135m-instruct"
# the public reference inference code (z-lab/dflash) as a bare git dir, a checkout or a folder holding dflash/model.py,
# from DFLASH_ZLAB_REPO where a machine has one; unset, the path names the variable, does not exist, and the tests
# that compare against it skip saying so
ZLAB_REPO = Path(os.environ.get("DFLASH_ZLAB_REPO") or "$DFLASH_ZLAB_REPO-unset")
QWEN3_TOKENIZER = Path(__file__).resolve().parent / "fixtures" / "qwen3_tokenizer"
JOBS = Path(__file__).resolve().parent / "jobs"

TINY = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, num_hidden_layers=6, max_position_embeddings=512, rms_norm_eps=1e-6)


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects, so `-m "not job"` leaves them out
def pytest_collection_modifyitems(items):
    """Every test under tests/jobs is a `job` (it starts a torchrun or subprocess job): the tier is the folder."""
    for item in items:
        if JOBS in item.path.parents:
            item.add_marker(pytest.mark.job)


def _save_tiny(cls_name, out, **extra):
    import transformers
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name + "Config")(**TINY, **extra)
    model = getattr(transformers, cls_name + "ForCausalLM")(cfg)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(target folder, prepared dataset) of tests/helpers/runs.py for the torchrun jobs of one test module."""
    import runs
    root = tmp_path_factory.mktemp("assets")
    return runs.make_target(root / "target"), runs.make_dataset(root / "data")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return _save_tiny("Qwen3", tmp_path_factory.mktemp("tiny_qwen3"), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return _save_tiny("Llama", tmp_path_factory.mktemp("tiny_llama"),
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny random Qwen3 with 8 tokens (a random drafter then often guesses right, so steps of every length
    occur) and 3 prompts of different lengths: (folder, model, rows)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vocab8")
    Qwen3ForCausalLM(Qwen3Config(**{**TINY, "vocab_size": 8}, tie_word_embeddings=False)).save_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(2)
    rows = [{"id": f"p{i}", "category": "c", "input_ids": torch.randint(0, 7, (n,), generator=g).tolist()}
            for i, n in enumerate((3, 11, 26))]
    return path, model, rows


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """The real Qwen3 tokenizer (tests/fixtures/qwen3_tokenizer, unpacked), no model."""
    d = tmp_path_factory.mktemp("qwen3_tokenizer")
    (d / "tokenizer.json").write_bytes(lzma.open(QWEN3_TOKENIZER / "tokenizer.json.xz").read())
    shutil.copy(QWEN3_TOKENIZER / "tokenizer_config.json", d)
    return d


@pytest.fixture(scope="session")
def tiny_smollm2(tmp_path_factory):
    """A random 1-layer Llama (hidden 16) with the real SmolLM2 tokenizer and chat template."""
    import shutil
    from transformers import LlamaConfig, LlamaForCausalLM
    if not (SMOLLM2_DIR / "tokenizer.json").exists():
        pytest.skip(f"no SmolLM2 folder at {SMOLLM2_DIR}: build it with `.venv/bin/python -m tools.smollm2`")
    out = tmp_path_factory.mktemp("tiny_smollm2")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      initializer_range=0.5)  # large weights: clear argmax margins, so greedy is batch-independent
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM2_DIR / name, out)
    return out


NO_SYSTEM_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}"
                      "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def no_system_target(tmp_path_factory, tiny_smollm2):
    """tiny_smollm2 with a chat template that refuses the system role, as some models' templates do."""
    import shutil
    out = tmp_path_factory.mktemp("no_system") / "target"
    shutil.copytree(tiny_smollm2, out)
    (out / "chat_template.jinja").write_text(NO_SYSTEM_TEMPLATE)
    return out


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
