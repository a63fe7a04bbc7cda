"""INIT_FROM pointed at a target (or any HF model folder) instead of an exported drafter: a message that says what
the folder is and what INIT_FROM takes, not a KeyError from the config reader."""
import pytest
from transformers import AutoConfig

import train_dflash as td
from model.drafter import DrafterConfig


def test_init_from_a_target_folder_says_it_is_not_a_drafter(tiny_qwen3_dir, monkeypatch, capsys):
    dcfg = DrafterConfig.from_target(AutoConfig.from_pretrained(tiny_qwen3_dir, local_files_only=True), 1, 4,
                                     mask_token_id=127)
    monkeypatch.setattr(td, "INIT_FROM", str(tiny_qwen3_dir))
    with pytest.raises(SystemExit, match=r"is not an exported drafter .*a target or other HF model folder\?\). "
                                         r"INIT_FROM takes a drafter this trainer exported"):
        td.check_init_from(dcfg)
