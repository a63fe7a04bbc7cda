"""DFlash2 through the rest of the tree: the registry, the optimizer's chunks, every decode loop lossless with the
selector's walk (and the walk's tau equal to the decode loop's), DDTree refused, INIT_FROM of a DFlash export, the
memory plan. In-process, tiny targets, CPU (the fast loop's CUDA graphs: tests/gpu/test_dflash2_cuda.py)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.evaluate import evaluate_drafters
from model import drafters
from model.decode import DrafterProposer, greedy_decode, speculative_decode
from model.dflash2 import DFlash2Config, DFlash2Drafter, dflash2_keys
from model.drafter import Drafter
from model.export import export_drafter
from model.fastdecode import FastDecoder
from dflash2_cases import B, build_dflash2, randomize_dflash2, walkers  # noqa: F401 (fixtures)
from trainer.optim import make_optimizer
from trainer.settings import Settings


def test_the_registry_names_each_arch_once():
    assert drafters.ARCHS["dflash"].drafter is Drafter and drafters.ARCHS["dflash2"].drafter is DFlash2Drafter
    assert drafters.ARCHS["dflash2"].loss is drafters.dflash2_train_loss


def test_param_chunks_cover_a_dflash2_drafter_and_the_selector_is_its_own_unit(walkers):
    d2 = walkers[0]
    make_optimizer(d2, 1e-3, 0.0)                     # asserts every parameter is in exactly one chunk
    chunks = d2.param_chunks()
    assert len(chunks) == d2.config.num_hidden_layers + 3
    assert {id(p) for p in chunks[-1]} == {id(p) for p in d2.candidate_selector.parameters()}
    assert d2.shard_units()[-1] is d2.candidate_selector
    opt = make_optimizer(d2, 1e-3, 0.1)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    kept = {id(p) for p in d2.no_decay_params()}
    assert kept and not kept & decayed
    assert id(d2.candidate_selector.hidden_projection.weight) in decayed
    assert id(d2.layers[0].mlp_conv.kernel_projection.weight) in decayed


def test_the_walk_is_not_the_argmax(small_vocab, walkers):
    """The drafters under test propose by their selector: some draft differs from the unary argmax."""
    path, model, rows = small_vocab
    differ = 0
    for d2 in walkers:
        prop = DrafterProposer(d2, model)
        for row in rows:
            got = speculative_decode(model, row["input_ids"], prop, B, 12, set())
            assert got["tokens"] == greedy_decode(model, row["input_ids"], 12, set())
            ids = row["input_ids"] + got["tokens"][:1]
            prop.reset(row["input_ids"], _features(model, row["input_ids"], d2))
            differ += int((prop.draft(ids[:-1] + ids[-1:], len(row["input_ids"]), B)
                           != prop.propose(ids, len(row["input_ids"]), B).argmax(-1)).any())
    assert differ


def _features(model, ids, d):
    from transformers import DynamicCache
    from model.decode import target_forward
    t = torch.tensor(ids)
    return target_forward(model, t, torch.arange(len(t)), DynamicCache(), d.config.target_layer_ids)[1]


def test_decode_is_lossless_and_the_walk_equals_it(small_vocab, walkers):
    path, model, rows = small_vocab
    kw = dict(block_size=B, max_new_tokens=30, log=None)
    decode = evaluate_drafters(model, None, walkers, rows, **kw)
    walk = evaluate_drafters(model, None, walkers, rows, method="walk", **kw)
    hist = {}
    for dec, wk in zip(decode, walk):
        assert dec["lossless"], dec["mismatches"]
        for a, b in zip(dec["per_prompt"], wk["per_prompt"]):
            assert b["tokens"] == a["tokens"] and b["steps"] == a["steps"] and b["tau"] == a["tau"], a["id"]
            assert b["tf_streak"] == pytest.approx(a["tf_streak"], abs=1e-9)
        assert wk["tau"] == dec["tau"]
        hist |= dec["accept_hist"]
    assert len(hist) >= 2, f"too few accepted drafts to test the walk: {hist}"


def test_the_fast_loop_equals_the_decode_loop(small_vocab, walkers):
    path, model, rows = small_vocab
    prompts = [r["input_ids"] for r in rows]
    fast = FastDecoder(model, max(map(len, prompts)) + 30 + B - 1, cuda_graphs=False)
    for d2 in walkers:
        prop, state = DrafterProposer(d2, model), fast.drafter(d2, B)
        for p in prompts:
            want = speculative_decode(model, p, prop, B, 30, set())
            assert fast.speculative(p, state, 30, set()) == want
            assert want["tokens"] == greedy_decode(model, p, 30, set())


def test_ddtree_refuses_a_dflash2_drafter(small_vocab, walkers):
    path, model, rows = small_vocab
    with pytest.raises(ValueError, match="DFlash2"):
        evaluate_drafters(model, None, walkers[:1], rows, block_size=B, max_new_tokens=8, tree_budget=4, log=None)


def test_init_from_a_dflash_export_drafts_as_it(tiny_qwen3_dir, build_drafter, tmp_path):
    """settings.load_init_from of a DFlash export into a DFlash2 run: the backbone's weights, the new parameters at
    their init, and the same outputs as the DFlash drafter."""
    from test_drafter import packed_batch, run
    from trainer.settings import load_init_from
    dflash = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B, seed=3)
    export_drafter(dflash, tmp_path / "d", dtype=torch.float32)
    d2 = DFlash2Drafter(DFlash2Config.from_drafter(dflash.config, selector_rank=8, selector_top_k=4))
    randomize_dflash2(d2)                                       # load_init_from must put the new ones back at init
    assert "DFlash" in load_init_from(tmp_path / "d", d2)
    fresh = DFlash2Drafter(d2.config)
    for k, v in d2.state_dict().items():
        if k not in dflash2_keys(d2):
            assert torch.equal(v, dflash.state_dict()[k]), k
        elif "_conv." in k:                                         # the identity convolutions
            assert torch.equal(v, fresh.state_dict()[k]), k
    assert not d2.candidate_selector.successor_codebook.any()
    batch = packed_batch(dflash)
    assert torch.equal(run(d2, batch), run(dflash, batch))


def test_a_resume_with_another_arch_is_refused(tiny_qwen3_dir):
    from trainer import phases

    class Stop(Exception):
        pass

    def fail(_, msg):
        raise Stop(msg)
    meta = {"config": {"DRAFTER_ARCH": "dflash"}, "drafter": {}, "target": None}
    orig = phases.fail, phases.ckpt.read_meta
    phases.fail, phases.ckpt.read_meta = fail, lambda p: meta
    try:
        with pytest.raises(Stop, match="DRAFTER_ARCH: the checkpoint trained a dflash drafter, this run dflash2"):
            phases.resume(Settings(DRAFTER_ARCH="dflash2"), type("D", (), {"is_master": False})(), None, "ck", None,
                         DFlash2Config.from_drafter(_cfg(tiny_qwen3_dir)), {})
    finally:
        phases.fail, phases.ckpt.read_meta = orig


def _cfg(target_dir):
    from transformers import AutoConfig
    from model.drafter import DrafterConfig
    hf = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return DrafterConfig.from_target(hf, 2, B, mask_token_id=hf.vocab_size - 1)


def test_drafter_fp8_leaves_dflash2s_small_linears_alone(walkers):
    from model.fp8 import drafter_linears
    names = drafter_linears(walkers[0])
    assert names and not [n for n in names if "_conv." in n or n.startswith("candidate_selector.")]
    assert {n.rsplit(".", 1)[-1] for n in names} >= {"q_proj", "o_proj", "down_proj"}


def test_cli_reads_a_dflash2_export_and_its_methods_agree(small_vocab, walkers, tmp_path, capsys):
    """eval_dflash.py takes a DFlash2 export (by its config's architectures): --method decode lossless, --method walk
    and --method fast with decode's tau; --tree-budget refused naming DFlash2."""
    import json
    from eval_dflash import main
    from model.export import export_dflash2
    path, model, rows = small_vocab
    export_dflash2(walkers[0], tmp_path / "d", dtype=torch.float32)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--target", str(path), "--drafter", str(tmp_path / "d"), "--prompts", str(tmp_path / "p.jsonl"),
            "--device", "cpu", "--max-new-tokens", "24"]
    decode = main(args)
    assert decode["lossless"] and decode["prompts"] == len(rows)
    for method in ("walk", "fast"):
        res = main(args + ["--method", method])
        assert res["tau"] == decode["tau"] and res["accept_hist"] == decode["accept_hist"], method
    with pytest.raises(SystemExit, match="a DFlash2 drafter proposes by its selector's walk; drop --tree-budget"):
        main(args + ["--tree-budget", "4"])


def test_a_resume_names_a_changed_dflash2_setting(tiny_qwen3_dir):
    from trainer.checkpoint import resume_mismatches
    cfg = DFlash2Config.from_drafter(_cfg(tiny_qwen3_dir), selector_rank=8)
    old = DFlash2Config.from_drafter(_cfg(tiny_qwen3_dir), selector_rank=16)
    errs = resume_mismatches({"drafter": old.__dict__}, cfg, {})
    assert errs == ["SELECTOR_RANK: the checkpoint has selector_rank=16, this run 8"]


def test_a_meta_build_warm_started_materialises_the_new_params(tiny_qwen3_dir, build_drafter):
    """DFlash2 built on the meta device + warm_start(assign=True) from a DFlash state: every parameter real, the
    backbone the state's tensors, the convolutions the identity, and the DFlash drafter's outputs."""
    from model.dflash2 import warm_start
    from test_drafter import packed_batch, run
    dflash = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B, seed=4)
    with torch.device("meta"):
        d2 = DFlash2Drafter(DFlash2Config.from_drafter(dflash.config, selector_rank=8, selector_top_k=4))
    warm_start(d2, {k: v.clone() for k, v in dflash.state_dict().items()}, assign=True)
    assert not any(p.is_meta for p in d2.parameters()) and not any(b.is_meta for b in d2.buffers())
    assert not d2.candidate_selector.successor_codebook.any()
    batch = packed_batch(dflash)
    assert torch.equal(run(d2, batch), run(dflash, batch))
