"""The trainer end to end on CPU: gloo transport, DDP drafters, resume, refusals. Each run is a real torchrun job
with a tiny target (tests/helpers/runs.py)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runs import (MASK_ID, REPO, base_args, env, losses, make_dataset, make_target, metrics, ok, padded, run,
                  stop_at_step_3_then_resume, free_port)


def packed_target_features(target_dir, lengths, input_ids):
    """The features of a packed micro-batch computed directly by the target (no transport)."""
    from model.target import Target
    from model.drafter import default_layer_ids
    t = Target(target_dir, "cpu", torch.float32, default_layer_ids(4, 1))
    ids, attn = padded(lengths, input_ids)
    return t.features(ids, attn)[attn.bool()]


@pytest.mark.job
@pytest.mark.parametrize("nproc,targets", [(3, 1), (3, 2)])
def test_drafters_receive_the_targets_features(assets, tmp_path, nproc, targets):
    target, data = assets
    out = tmp_path / "out"
    ok(run(nproc, base_args(target, data, out, TARGET_RANKS=targets, MAX_STEPS=4, DUMP_BATCHES=100)))
    dumps = sorted((out / "dump").glob("g*.pt"))
    drafters = nproc - targets
    assert [int(p.stem[1:]) for p in dumps] == list(range(4 * drafters)), "every micro-batch exactly once, in order"
    for p in dumps:
        got = torch.load(p)
        # the plan: drafter (g % per_step) % D consumes g; here GRAD_ACCUM=1 so per_step = D
        assert got["rank"] == targets + got["g"] % drafters
        want = packed_target_features(target, got["lengths"], got["input_ids"])
        torch.testing.assert_close(got["features"], want, rtol=0, atol=0)


@pytest.mark.job
def test_ddp_drafters_identical_and_loss_falls(assets, tmp_path):
    target, data = assets
    out = tmp_path / "out"
    r = ok(run(3, base_args(target, data, out, EPOCHS=12, LR=1e-2)))
    rows = metrics(out)
    assert rows and all(r["ddp_weight_spread"] == 0.0 for r in rows)
    # each role's capacity is measured from its busy time and turned into a split recommendation, once
    assert r.stdout.count("throughput per GPU (measured while busy)") == 1, r.stdout
    rec = [x for x in rows if "recommended_split" in x]
    assert len(rec) == 1 and sum(rec[0]["recommended_split"]) == 3
    assert rec[0]["target_capacity_tok_s"] > 0 and rec[0]["drafter_capacity_tok_s"] > 0
    # the copy task is learnable, but the tiny tied lm_head caps how sharp logits get: judge by acc and a clear fall
    head, tail = rows[:3], rows[-5:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
    assert mean(tail, "loss") < 0.85 * mean(head, "loss"), [round(r["loss"], 3) for r in rows]
    assert mean(tail, "acc") > mean(head, "acc") + 0.15, [round(r["acc"], 3) for r in rows]
    # the serving export of the final step loads back
    from model.export import load_drafter
    final = sorted((out / "checkpoints").glob("step_*"))[-1]
    d = load_drafter(final / "drafter")
    assert d.config.mask_token_id == MASK_ID
    assert json.loads((out / "run.json").read_text())["config"]["MAX_ANCHORS"] == 32


@pytest.mark.job
def test_sigterm_then_resume_matches_uninterrupted(assets, tmp_path):
    target, data = assets
    args = dict(EPOCHS=3, LR=5e-3)
    ok(run(3, base_args(target, data, tmp_path / "ref", **args)))
    out = tmp_path / "cut"
    code, log = stop_at_step_3_then_resume(3, base_args(target, data, out, **args), out, losses(tmp_path / "ref"))
    # torchrun itself reports the signal it got (non-zero); the workers save and leave cleanly
    assert code is not None and "stopped at step" in log and "resume with RESUME=auto" in log, log
    assert "ABORT" not in log and "thread:" not in log, log


@pytest.mark.job
def test_resume_with_another_split_continues_at_the_same_micro_batch(assets, tmp_path):
    target, data = assets
    out = tmp_path / "out"
    ok(run(3, base_args(target, data, out, TARGET_RANKS=1, MAX_STEPS=2, EPOCHS=2)))   # 2 steps x 2 = 4 micro-batches
    # MAX_STEPS back to 0: the schedule is re-planned to 2 epochs, continuing at micro-batch 4 with one drafter
    r = ok(run(3, base_args(target, data, out, TARGET_RANKS=2, MAX_STEPS=0, EPOCHS=2, DUMP_BATCHES=100)))
    assert "RESUMING from step 2" in r.stdout and "checkpoint split [1, 2] -> now 2 targets : 1" in r.stdout
    seen = sorted(int(p.stem[1:]) for p in (out / "dump").glob("g*.pt"))
    assert seen and seen[0] == 4, f"resumed run must start at micro-batch 4, got {seen[:3]}"


@pytest.mark.job
@pytest.mark.parametrize("compile_target", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_one_process_trains_like_one_target_and_one_drafter(assets, tmp_path, compile_target):
    """The single-process mode (target forward and prepare on a feeder thread; with COMPILE_TARGET the forward on
    the main thread, a micro-batch ahead) and a 1 + 1 job see the same micro-batches and take the same steps; with
    COMPILE_TARGET both compile the target's layers with inductor (~1 min on 2 CPU cores: slow)."""
    target, data = assets
    args = dict(EPOCHS=2, LR=5e-3, LOG_EVERY=1, COMPILE_TARGET=compile_target)
    ok(run(2, base_args(target, data, tmp_path / "pair", **args), timeout=600))
    r = ok(run(1, base_args(target, data, tmp_path / "solo", **args), timeout=600))
    assert ("the target forward runs on the main thread" in r.stdout) == compile_target
    pair, solo = losses(tmp_path / "pair"), losses(tmp_path / "solo")
    assert len(pair) >= 4 and sorted(solo) == sorted(pair)
    for s in pair:   # the ranks split the CPU threads differently: reductions may round differently
        assert solo[s] == pytest.approx(pair[s], rel=1e-5), f"step {s}: {solo[s]} != {pair[s]}"
    rows = metrics(tmp_path / "solo")                                    # the feeder's queues in the status line
    assert all(len(r["q_hs"]) == 1 and 0 <= r["q_hs"][0] <= 8 and len(r["q_pre"]) == 1 for r in rows)
    assert any(r["q_hs"][0] > 0 or r["q_pre"][0] > 0 for r in rows), rows


@pytest.mark.job
def test_resume_scratch_refuses_existing_checkpoints(assets, tmp_path):
    target, data = assets
    out = tmp_path / "out"
    ok(run(1, base_args(target, data, out, MAX_STEPS=2)))
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    r = run(1, base_args(target, data, out, MAX_STEPS=2, RESUME="scratch"))
    assert r.returncode != 0
    assert "RESUME=scratch" in r.stderr + r.stdout and "nothing was overwritten" in r.stderr + r.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


@pytest.mark.job
def test_changed_dataset_is_detected(assets, tmp_path):
    target, data = assets
    out = tmp_path / "out"
    ok(run(1, base_args(target, data, out, MAX_STEPS=2, EPOCHS=2)))
    other = make_dataset(tmp_path / "other", n=40, seed=1)
    r = run(1, base_args(target, other, out, MAX_STEPS=4, EPOCHS=2))
    assert r.returncode != 0 and "dataset changed" in r.stderr + r.stdout and "ALLOW_DATA_CHANGE" in r.stderr + r.stdout
    r = ok(run(1, base_args(target, other, out, MAX_STEPS=4, EPOCHS=2, ALLOW_DATA_CHANGE=True)))
    assert "re-planned" in r.stdout and "RESUMING from step 2" in r.stdout


@pytest.mark.job
def test_two_nodes_on_loopback_train_and_resume_like_one(assets, tmp_path):
    target, data = assets
    args = dict(EPOCHS=2)
    for extra in (dict(MAX_STEPS=3), {}):   # the same two legs on one node: 3 steps, then resume to the end
        ok(run(2, base_args(target, data, tmp_path / "one", **args, **extra)))
    out = tmp_path / "two"
    port = free_port()

    def agents(extra_args):
        procs = []
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                   f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   "--rdzv-id=dflash-test", str(REPO / "train_dflash.py"), *base_args(target, data, out, **extra_args)]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outs = [p.communicate(timeout=240)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(outs)
        return "".join(outs)

    agents(dict(args, MAX_STEPS=3))
    assert max(losses(out)) == 3
    log = agents(args)
    assert "RESUMING from step 3" in log
    one, two = losses(tmp_path / "one"), losses(out)
    assert sorted(one) == sorted(two)
    for s in one:
        assert two[s] == pytest.approx(one[s], rel=1e-6, abs=1e-7)


@pytest.mark.job
def test_bogus_setting_and_dry_run(assets, tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "train_dflash.py"), "--BOGUS=1"], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unknown setting --BOGUS" in r.stderr
    r = subprocess.run([sys.executable, str(REPO / "train_dflash.py"), "--MAX_STEPS=abc"], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--MAX_STEPS='abc' is not a valid int" in r.stderr
    target, data = assets
    r = ok(run(1, base_args(target, data, tmp_path / "out", DRY_RUN=True)))
    assert "DRY_RUN" in r.stdout and "load target" not in r.stdout
    # base_args sets GAMMA, which only the exp weighting uses: the default dpace says so, exp does not
    assert "NOTE: GAMMA=4.0 is not used: LOSS_WEIGHTING=dpace" in r.stdout
    r = ok(run(1, base_args(target, data, tmp_path / "out", DRY_RUN=True, LOSS_WEIGHTING="exp")))
    assert "DRY_RUN" in r.stdout and "GAMMA=4.0 is not used" not in r.stdout


SMOL = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "smollm2-135m-instruct"


@pytest.mark.job
@pytest.mark.skipif(not (SMOL / "tokenizer.json").exists(), reason="needs the SmolLM2 folder (python -m tools.smollm2)")
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_eval_during_training_logs_tau(tmp_path, arch):
    """EVAL_EVERY: tau of the checkpointed drafter, measured on the master, in the status line and metrics.jsonl.
    A tiny random target with SmolLM2's tokenizer keeps it fast; the shipped dataset fits its vocabulary. A DFlash2
    drafter proposes with its selector's walk there, losslessly, and its export's card says DFlash2."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    tgt = tmp_path / "target"
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=4096, tie_word_embeddings=True)).save_pretrained(tgt)
    AutoTokenizer.from_pretrained(SMOL).save_pretrained(tgt)
    r = ok(run(1, base_args(tgt, REPO / "data" / "default" / "smollm2", tmp_path / "out", MASK_TOKEN_ID=-1,
                            TOKEN_BUDGET=1024, MAX_STEPS=4, SAVE_EVERY=2, EVAL_EVERY=1, EVAL_LIMIT=2,
                            EVAL_MAX_NEW_TOKENS=6, DRAFTER_ARCH=arch, SELECTOR_RANK=8, CONV_GROUP_SIZE=8)))
    evals = [m for m in metrics(tmp_path / "out") if "tau" in m]
    assert [m["step"] for m in evals] == [2, 4]
    assert all(m["lossless"] and 1.0 <= m["tau"] <= 4 for m in evals), evals
    assert all(0.0 <= m["tf_streak"] <= 3 for m in evals), evals          # B-1 = 3 slots at most
    assert "held-out streak=" in r.stdout
    assert "eval step 4: tau=" in r.stdout and " tau=" in r.stdout.split("eval step 2")[1]
    # each evaluated checkpoint is measured before it is written: its export's model card carries that tau
    for m in evals:
        export = tmp_path / "out" / "checkpoints" / f"step_{m['step']:06d}" / "drafter"
        card = (export / "README.md").read_text()
        assert f"# {'DFlash2' if arch == 'dflash2' else 'DFlash'} drafter for" in card, card
        assert "on 2 prompts of `eval_broad.jsonl`" in card and "| **macro**" in card, card
        # its hashes are what a user can compare: data.prepare's stats.json, sha256sum of the export's config.json
        stats = json.loads((REPO / "data" / "default" / "smollm2" / "stats.json").read_text())
        assert f"| data content_hash | `{stats['content_hash']}`" in card, card
        assert f"| config.json sha256 | `{hashlib.sha256((export / 'config.json').read_bytes()).hexdigest()}`" in card
        assert sorted(m["tau_categories"]) == ["chat", "explain"], m["tau_categories"]   # dealt over the categories


def test_drafter_ranks_load_only_embedding_and_head(tiny_qwen3_dir, tiny_llama_dir):
    """Drafter ranks read the two frozen tensors from the safetensors files, tied (Llama tiny) or not (Qwen3 tiny)."""
    from transformers import AutoModelForCausalLM
    from model.target import load_frozen_io
    for path in (tiny_qwen3_dir, tiny_llama_dir):
        m = AutoModelForCausalLM.from_pretrained(path)
        embed, head, _ = load_frozen_io(path, "cpu", torch.float32)
        torch.testing.assert_close(embed.weight, m.get_input_embeddings().weight, rtol=0, atol=0)
        torch.testing.assert_close(head, m.get_output_embeddings().weight, rtol=0, atol=0)
        assert not embed.weight.requires_grad and not head.requires_grad


@pytest.mark.job
def test_dpace_run_logs_both_losses(assets, tmp_path):
    """LOSS_WEIGHTING=dpace trains; the status line's loss stays the exp-decay CE (one scale for both weightings)
    and the D-PACE objective is logged beside it."""
    target, data = assets
    out = tmp_path / "out"
    r = ok(run(1, base_args(target, data, out, LOSS_WEIGHTING="dpace", DPACE_ALPHA=0.3, MAX_STEPS=2)))
    rows = metrics(out)
    assert len(rows) == 2 and all(x["objective"] != x["loss"] for x in rows)
    assert all(f"loss={x['loss']:.3f} dpace={x['objective']:.3f} acc=" in r.stdout for x in rows), r.stdout
    r = ok(run(1, base_args(target, data, tmp_path / "exp", LOSS_WEIGHTING="exp", MAX_STEPS=1)))
    row = metrics(tmp_path / "exp")[0]
    assert row["objective"] == row["loss"] and " dpace=" not in r.stdout
    assert row["loss"] == pytest.approx(rows[0]["loss"], rel=1e-6)   # step 1: same weights, same yardstick


@pytest.mark.job
def test_resume_refuses_changed_drafter_settings_and_another_target(assets, tmp_path):
    """Before any model loads: another BLOCK_SIZE (it continued silently), NUM_DRAFT_LAYERS (a raw load_state_dict
    error) or a different target of the same sizes (it continued silently) is refused, naming the setting and both
    values."""
    from trainer import checkpoint as ckpt
    from model.drafter import DrafterConfig
    target, data = assets
    out = tmp_path / "out"
    ok(run(1, base_args(target, data, out, MAX_STEPS=2)))
    other = make_target(tmp_path / "other", seed=1)                     # same config, other weights
    r = run(1, base_args(other, data, out, MAX_STEPS=4, BLOCK_SIZE=8))
    assert r.returncode != 0, r.stdout[-2000:]
    assert "BLOCK_SIZE: the checkpoint has block_size=4, this run 8" in r.stderr, r.stderr[-2000:]
    assert f"TARGET: the checkpoint was trained on {target.resolve()} (config " in r.stderr and \
        f"this run's {other.resolve()} has other weights" in r.stderr, r.stderr[-2000:]
    assert "load target" not in r.stdout and "Traceback" not in r.stderr, r.stderr[-2000:]

    meta = ckpt.read_meta(ckpt.latest_complete(out / "checkpoints"))
    cfg = DrafterConfig(**meta["drafter"])
    fp = ckpt.target_fingerprint(target)
    assert ckpt.resume_mismatches(meta, cfg, fp) == []
    deeper = DrafterConfig(**{**meta["drafter"], "num_hidden_layers": 2, "layer_types": []})
    assert ckpt.resume_mismatches(meta, deeper, fp) == [
        "NUM_DRAFT_LAYERS: the checkpoint has num_hidden_layers=1, this run 2",
        "SLIDING_WINDOW_LAYERS: the checkpoint has layer_types=['full_attention'], this run "
        "['full_attention', 'full_attention']"]
    moved = tmp_path / "moved"   # a copy elsewhere (the module's shared target stays where the later tests find it)
    shutil.copytree(target, moved)                                       # a moved folder is the same target
    assert ckpt.resume_mismatches(meta, cfg, ckpt.target_fingerprint(moved)) == []


def qwen3_tokenizer_dir(tmp_path):
    """The real Qwen3 tokenizer in a folder (tests/fixtures stores tokenizer.json xz-compressed)."""
    import lzma
    import shutil
    d = tmp_path / "qwen3_tokenizer"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(lzma.open(QWEN3_TOKENIZER / "tokenizer.json.xz").read())
    shutil.copy(QWEN3_TOKENIZER / "tokenizer_config.json", d)
    return d


QWEN3_TOKENIZER = REPO / "tests" / "fixtures" / "qwen3_tokenizer"


@pytest.mark.job
def test_data_of_another_tokenizer_or_template_is_refused(tmp_path):
    """stats.json's tokenizer and chat template hashes against TARGET's: a dataset tokenized for another target trained
    to the end without a word before."""
    from transformers import AutoTokenizer
    from data.chat import template_hash
    from data.prepare import tokenizer_hash
    from data.loader import tokenizer_mismatches
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(tmp_path))
    same = {"tokenizer": "/m/qwen3", "tokenizer_hash": tokenizer_hash(tok), "chat_template_hash": template_hash(tok)}
    assert tokenizer_mismatches(same, tok, "DATA", "TARGET") == []
    other = AutoTokenizer.from_pretrained(tmp_path / "qwen3_tokenizer")
    other.add_tokens(["<new_token>"])
    errs = tokenizer_mismatches({**same, "tokenizer_hash": tokenizer_hash(other)}, tok, "DATA", "TARGET")
    assert len(errs) == 1 and "was tokenized with the tokenizer of /m/qwen3" in errs[0], errs
    errs = tokenizer_mismatches({**same, "chat_template_hash": "0" * 64}, tok, "DATA", "TARGET")
    assert len(errs) == 1 and "rendered with the chat template of /m/qwen3 (hash 000000000000)" in errs[0], errs

    # end to end: refused before any model loads
    target = make_target(tmp_path / "target")
    tok.save_pretrained(target)
    data = make_dataset(tmp_path / "data")
    (data / "stats.json").write_text(json.dumps({**same, "tokenizer_hash": tokenizer_hash(other)}))
    r = run(1, base_args(target, data, tmp_path / "out"))
    assert r.returncode != 0 and f"TARGET={target} has another one ({tokenizer_hash(tok)[:12]})" in r.stderr, \
        r.stdout[-2000:] + r.stderr[-2000:]
    assert "load data" not in r.stdout and "Traceback" not in r.stderr


# --- trackers (TENSORBOARD, WANDB_PROJECT) --------------------------------------------------------------------------

def test_a_missing_tracker_package_is_an_error_naming_its_install(monkeypatch):
    import builtins
    from trainer import status
    real = builtins.__import__

    def no_trackers(name, *a, **kw):
        if name in ("wandb", "torch.utils.tensorboard"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_trackers)
    errs = status.check_trackers(True, "myproj")
    assert len(errs) == 2 and "pip install tensorboard" in errs[0] and "pip install wandb" in errs[1], errs
    assert status.check_trackers(False, "") == []


FAKE_WANDB = '''
import json, os
util = type("util", (), {"generate_id": staticmethod(lambda: "fresh1")})
class Run:
    def log(self, nums, step): pass
def init(**kw):
    with open(os.path.join(kw["dir"], "fake_wandb_inits.jsonl"), "a") as f:
        f.write(json.dumps({"id": kw["id"], "resume": kw["resume"], "project": kw["project"]}) + "\\n")
    return Run()
'''


def test_wandb_run_id_is_kept_in_out_dir_and_reused_on_resume(tmp_path, monkeypatch):
    from trainer import status
    (tmp_path / "pkgs").mkdir()
    (tmp_path / "pkgs" / "wandb.py").write_text(FAKE_WANDB)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    from trainer.settings import Settings
    config = Settings(TENSORBOARD=False, WANDB_PROJECT="p")
    status.Metrics(out, config)
    assert (out / status.WANDB_ID_FILE).read_text().strip() == "fresh1"
    (out / status.WANDB_ID_FILE).write_text("kept7\n")     # a resume reads the id the first run wrote
    status.Metrics(out, config)
    inits = [json.loads(l) for l in (out / "fake_wandb_inits.jsonl").read_text().splitlines()]
    assert inits == [{"id": "fresh1", "resume": "allow", "project": "p"}, {"id": "kept7", "resume": "allow",
                                                                            "project": "p"}]


@pytest.mark.job
def test_a_missing_wandb_stops_the_job_before_any_model_loads(assets, tmp_path, monkeypatch):
    import runs
    target, data = assets
    (tmp_path / "pkgs").mkdir()
    (tmp_path / "pkgs" / "wandb.py").write_text("raise ImportError('No module named wandb (fake)')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pkgs"))
    r = runs.run(1, runs.base_args(target, data, tmp_path / "out", WANDB_PROJECT="p", MAX_STEPS=1))
    assert r.returncode != 0 and "pip install wandb" in r.stderr, r.stderr[-2000:]
    assert "load target" not in r.stdout and "load data" not in r.stdout, r.stdout[-2000:]
