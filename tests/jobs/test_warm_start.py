"""INIT_FROM: a run starts from an exported drafter (fp32 or bf16 export) with its exact weights, is a fresh run,
loses to a checkpoint to resume, and refuses an export of another shape before any model loads."""
import json
import shutil

import pytest
import torch

import runs
from runs import MASK_ID, base_args, make_dataset, make_target, metrics, ok
from model.export import export_drafter


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm_assets")
    return make_target(root / "target"), make_dataset(root / "data", n=16)


def export(target_dir, out, layers=1, block_size=4, seed=123, dtype=torch.float32):
    """A drafter for target_dir with weights unlike the trainer's own seed-0 init, exported to out."""
    from transformers import AutoConfig
    from model.drafter import Drafter, DrafterConfig
    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(target_dir, local_files_only=True), layers, block_size,
                                    mask_token_id=MASK_ID)
    torch.manual_seed(seed)
    d = Drafter(cfg)
    export_drafter(d, out, dtype=dtype)
    return d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_init_from_gives_the_exported_weights_and_logits(assets, tmp_path, dtype, monkeypatch):
    from trainer import settings
    from model.drafter import Drafter
    target, _ = assets
    src = export(target, tmp_path / "drafter", dtype=dtype)
    torch.manual_seed(0)
    run_drafter = Drafter(src.config)                             # what the trainer builds before loading
    assert settings.load_init_from(tmp_path / "drafter", run_drafter) == str(dtype).replace("torch.", "")
    for (name, got), want in zip(run_drafter.state_dict().items(), src.state_dict().values()):
        assert got.dtype == torch.float32, name
        assert torch.equal(got, want.to(dtype).float()), name     # fp32: bitwise; bf16: its values, widened exactly
    g = torch.Generator().manual_seed(0)
    c = src.config
    feats, emb = torch.randn(9, c.num_taps * c.hidden_size, generator=g), torch.randn(4, c.hidden_size, generator=g)
    attn = src.attn_spec(torch.tensor([9]), torch.tensor([0]), torch.zeros(9, dtype=torch.long))
    with torch.no_grad():
        ref = src.to(dtype).float()
        assert torch.equal(run_drafter(feats, torch.arange(9), emb, torch.arange(9, 13), attn),
                           ref(feats, torch.arange(9), emb, torch.arange(9, 13), attn))


@pytest.mark.job
def test_run_from_init_from_starts_with_the_exported_drafter(assets, tmp_path, monkeypatch):
    """A real one-process run with INIT_FROM: its step-1 loss (computed before the first update) equals the loss of
    the exported drafter on the same micro-batch, and not that of the trainer's own random init. Then, with a
    checkpoint in OUT_DIR, resuming wins over INIT_FROM."""
    from data.loader import Data
    from model.drafter import Drafter
    from model.objective import weighted_ce
    from model.target import load_frozen_io
    from trainer.pipe import Packet
    from trainer.micro_batch import make_prepare
    from trainer.settings import Settings
    target, data = assets
    src = export(target, tmp_path / "drafter")
    out = tmp_path / "out"
    r = ok(runs.run(1, base_args(target, data, out, INIT_FROM=tmp_path / "drafter", MAX_STEPS=1, DUMP_BATCHES=1)))
    assert "INIT_FROM: drafter weights from" in r.stdout and "float32 export" in r.stdout, r.stdout
    assert "step=1/1 " in r.stdout and "RESUMING" not in r.stdout
    got = metrics(out)[0]["loss"]

    # micro-batch 0 through the trainer's own batching, prepare and loss, with the run's settings
    config = json.loads((out / "run.json").read_text())["config"]
    dump = torch.load(out / "dump" / "g000000.pt")                 # the features the run's drafter got
    ids, mask, attn, lengths = Data(str(data), runs.VOCAB, config["TOKEN_BUDGET"], config["MAX_BATCH_SIZE"],
                                    config["SEED"]).batch(0)
    assert torch.equal(ids[attn.bool()], dump["input_ids"])
    item = make_prepare(src.config, "cpu", False, Settings(**config))(Packet(0, lengths, dump["input_ids"],
                                                                            mask[attn.bool()], dump["features"]))
    embed, head_w, _ = load_frozen_io(target, "cpu", torch.float32)

    def loss_of(drafter):
        with torch.no_grad():
            h = drafter(item.features, item.ctx_pos, embed(item.block_ids), item.block_pos, item.attn)
            p = weighted_ce(h, head_w, item.labels, item.weights, 4096, rows=item.rows)
        return float(p.loss_sum / p.weight_sum)
    want = loss_of(src)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    torch.manual_seed(0)
    assert abs(loss_of(Drafter(src.config)) - want) > 1e-3, "the export must differ from the trainer's own init"

    r = ok(runs.run(1, base_args(target, data, out, INIT_FROM=tmp_path / "drafter", MAX_STEPS=2)))
    assert "RESUMING from step 1" in r.stdout and "is ignored: a checkpoint to resume wins" in r.stdout, r.stdout
    assert "INIT_FROM: drafter weights from" not in r.stdout


@pytest.mark.job
def test_init_from_of_another_shape_is_refused_before_any_model_loads(assets, tmp_path):
    """An export for another target and drafter shape: one error naming each setting with both values, before
    any model loads: the target's weights here are garbage, so loading them would fail differently."""
    target, data = assets
    broken = tmp_path / "target"
    shutil.copytree(target, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    other = make_target(tmp_path / "other", hidden=16, layers=6)
    export(other, tmp_path / "drafter", layers=2, block_size=8)
    r = runs.run(1, base_args(broken, data, tmp_path / "out", INIT_FROM=tmp_path / "drafter"))
    assert r.returncode != 0
    err = r.stderr
    assert f"INIT_FROM={tmp_path / 'drafter'} does not fit this run's drafter" in err, err
    assert "NUM_DRAFT_LAYERS: this run has 1 (num_hidden_layers), the drafter in INIT_FROM 2: pass " \
           "--NUM_DRAFT_LAYERS=2" in err, err
    assert "BLOCK_SIZE: this run has 4 (block_size), the drafter in INIT_FROM 8: pass --BLOCK_SIZE=8" in err, err
    assert "TARGET_LAYER_IDS: this run has 2 (target_layer_ids), the drafter in INIT_FROM 1,3: pass " \
           "--TARGET_LAYER_IDS=1,3" in err, err
    assert f"the target (TARGET={broken}) has hidden_size=32, num_attention_heads=4, " in err, err
    assert "; the drafter in INIT_FROM was made for hidden_size=16, num_attention_heads=2, " in err, err
    assert "num_target_layers=6: it was trained for another target" in err and "Traceback" not in err, err
    assert "load data" not in r.stdout and "load target" not in r.stdout, r.stdout
