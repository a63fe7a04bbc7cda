"""The project's drafter against z-lab's reference DFlashDraftModel without the reference's code: its output on a
fixed tiny drafter was recorded once (tools/zlab_golden.py, tests/fixtures/zlab_golden/). The fixture's export is
loaded with model.export.load_drafter, exported again and reloaded (the current export path), and both the packed
training forward and the cached serving step must give z-lab's last hidden states for every block."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.drafter import DrafterCache
from model.export import export_drafter, load_drafter

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "zlab_golden"


@pytest.fixture(scope="module")
def golden():
    return load_file(str(FIXTURE / "io.safetensors"))


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    again = export_drafter(load_drafter(FIXTURE / "drafter"), tmp_path_factory.mktemp("zlab") / "drafter",
                           dtype=torch.float32)
    return load_drafter(again).eval()


def test_fixture_is_the_recorded_config(drafter, golden):
    meta = json.loads((FIXTURE / "meta.json").read_text())
    cfg = drafter.config
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.rope_theta) == (meta["num_layers"], meta["block_size"],
                                                                       meta["target"]["rope_theta"])
    N, B, H = golden["want"].shape
    assert (N, B, H) == (len(meta["anchors"]), cfg.block_size, cfg.hidden_size) and golden["want"].abs().max() > 0.1


def test_training_forward_matches_zlab_golden(drafter, golden):
    g, B = golden, drafter.config.block_size
    anchors = g["anchor_idx"]
    positions = (g["pos"][anchors][:, None] + torch.arange(B)).flatten()                # [N*B]
    attn = drafter.attn_spec(anchors, g["doc"][anchors], g["doc"])
    with torch.no_grad():
        got = drafter(g["feats"], g["pos"], g["noise"].flatten(0, 1), positions, attn)   # [N*B, H]
    torch.testing.assert_close(got.view_as(g["want"]), g["want"], atol=1e-5, rtol=1e-5)


def test_serving_step_matches_zlab_golden(drafter, golden):
    g, B = golden, drafter.config.block_size
    doc, pos = g["doc"], g["pos"]
    for n, a in enumerate(g["anchor_idx"].tolist()):
        ctx = (doc == doc[a]) & (torch.arange(len(doc)) < a)   # the document's tokens before the anchor
        with torch.no_grad():
            cache = DrafterCache(drafter)
            if ctx.any():
                cache.append(g["feats"][ctx], pos[ctx])
            got = drafter.step(cache, g["noise"][n], pos[a] + torch.arange(B))          # [B, H]
        torch.testing.assert_close(got, g["want"][n], atol=1e-5, rtol=1e-5, msg=lambda m: f"block {n}: {m}")
