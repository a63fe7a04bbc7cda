"""trainer/evaluate.py and its CLI eval_dflash.py: the verify/accept/commit loop against plain greedy decoding, oracle
and wrong proposers, DDTree, the drafter's context KV cache, the context limit, several drafters sharing one
reference, the CLI on SmolLM2 (--workers' processes: tests/jobs/test_eval_jobs.py); per-category and macro tau
against a slow reference, prompt rows checked before the target loads, multi-turn rows with answer placeholders;
tools.tau_diff."""
import gzip
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import SMOLLM2_DIR
import eval_dflash
from data.prompts import PromptTooLong, encode_prompt, load_prompts, prompt_messages, refused_by_template
from eval_cases import B, prompts, untimed
from eval_dflash import main
from model.decode import build_tree, eos_ids, greedy_decode, speculative_decode
from model.drafter import DrafterCache
from model.export import export_drafter, load_drafter
from trainer import evaluate as measure
from trainer.evaluate import evaluate, evaluate_drafters


@pytest.fixture(scope="module")
def target(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                local_files_only=True).eval()


class Oracle:
    """Proposes the target's own greedy continuation, found by running the target B-1 times without a cache.
    wrong_slot(start) -> slot (1..B-1) whose token is replaced by the next vocabulary id, or None;
    rank2=True keeps the right token there as the second choice (a tree can still find it)."""
    layer_ids = None

    def __init__(self, model, wrong_slot=lambda start: None, rank2=False):
        self.model, self.wrong_slot, self.rank2 = model, wrong_slot, rank2

    def reset(self, prompt_ids, features):
        pass

    def commit(self, features, positions):
        pass

    @torch.no_grad()
    def propose(self, tokens, start, block_size):
        seq, V = list(tokens), self.model.config.vocab_size
        logits = torch.zeros(block_size - 1, V)
        for k in range(1, block_size):
            t = int(self.model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(t)
            if k == self.wrong_slot(start):
                logits[k - 1, (t + 1) % V] = 5.0
                logits[k - 1, t] = 4.0 if self.rank2 else 0.0
            else:
                logits[k - 1, t] = 5.0
        return logits


def run(target, proposer, max_new, **kw):
    return evaluate(target, None, proposer, prompts(), block_size=B, max_new_tokens=max_new, log=None, **kw)


def test_oracle_gives_tau_block_size(target):
    res = run(target, Oracle(target), 1 + 3 * B)
    assert res["lossless"] and res["tau"] == B
    assert all(r["steps"] == [B, B, B] for r in res["per_prompt"])
    assert res["accept_hist"] == {B: 9} and set(res["tau_by_category"]) == {"a", "b", "b/x", "b/y"}
    res = run(target, Oracle(target), 1 + 3 * B + 2)          # the last step is capped by max_new_tokens
    assert res["lossless"] and all(r["steps"] == [B, B, B, 2] for r in res["per_prompt"])
    assert res["tau"] == pytest.approx((3 * B + 2) / 4)


def test_wrong_drafter_gives_tau_one(target):
    res = run(target, Oracle(target, wrong_slot=lambda s: 1), 20)
    assert res["lossless"] and res["tau"] == 1.0
    assert all(r["steps"] == [1] * 19 for r in res["per_prompt"])


def test_stops_at_eos(target):
    ids = prompts()[1]["input_ids"]
    want = greedy_decode(target, ids, 30, eos=set())
    eos = {want[9]}
    cut = want[: want.index(want[9]) + 1]
    assert greedy_decode(target, ids, 30, eos) == cut
    got = speculative_decode(target, ids, Oracle(target), B, 30, eos)
    assert got["tokens"] == cut and sum(got["steps"]) == len(cut) - 1


def test_random_drafter_lossless_after_export(target, build_drafter, tiny_qwen3_dir, tmp_path):
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B)
    d = load_drafter(export_drafter(d, tmp_path / "drafter"))
    res = evaluate(target, None, d, prompts(), max_new_tokens=24, tree_budget=12, tree_top_k=4, log=None)
    assert res["config"]["block_size"] == B and res["prompts"] == 3
    assert res["lossless"], res["mismatches"]
    assert 1.0 <= res["tau"] <= B and 1.0 <= res["tree_tau"] <= B


def test_chain_tree_equals_block_verification(target):
    # wrong at a slot that moves with the position: accepted lengths 0..B-1 all occur
    oracle = Oracle(target, wrong_slot=lambda s: 1 + s % B)
    res = run(target, oracle, 30, tree_budget=B - 1, tree_top_k=1)
    assert res["lossless"], res["mismatches"]
    assert len(res["accept_hist"]) > 2
    for r in res["per_prompt"]:
        assert r["tree_steps"] == r["steps"] and r["tree_tau"] == r["tau"]


def test_tree_finds_second_choices_and_stays_lossless(target):
    oracle = Oracle(target, wrong_slot=lambda s: 1 + s % (B - 1), rank2=True)
    res = run(target, oracle, 1 + 4 * B, tree_budget=20, tree_top_k=2)
    assert res["lossless"], res["mismatches"]
    assert res["tau"] < B and res["tree_tau"] == B            # the right token is always in the tree


def test_build_tree_best_first():
    logp = torch.tensor([[0.0, -1.0, -3.0], [-0.5, -2.0, -9.0], [-0.1, -0.2, -9.0]])   # [D=3, V=3]
    tokens, parents, depths = build_tree(logp, budget=5, top_k=2)
    # path scores: 0, -0.5, -0.6, -0.7, -1.0 are the five best; parents come before their children
    assert list(zip(tokens, parents, depths)) == [(0, 0, 1), (0, 1, 2), (0, 2, 3), (1, 2, 3), (1, 0, 1)]
    tokens, parents, depths = build_tree(logp, budget=3, top_k=1)
    assert (tokens, parents, depths) == ([0, 0, 0], [0, 1, 2], [1, 2, 3])


def test_prompt_over_context_limit(target):
    rows = prompts() + [{"id": "huge", "input_ids": [1] * 500}]     # tiny target: max_position_embeddings 512
    with pytest.raises(PromptTooLong, match="'huge' has 500 tokens"):
        evaluate(target, None, Oracle(target), rows, block_size=B, max_new_tokens=16, log=None)
    res = evaluate(target, None, Oracle(target), rows, block_size=B, max_new_tokens=16, on_too_long="skip", log=None)
    assert res["skipped"] == ["huge"] and res["prompts"] == 3


@pytest.mark.parametrize("sliding", [0, 1])
def test_drafter_cache_equals_full_recompute(build_drafter, tiny_qwen3_dir, sliding):
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B, sliding_window_layers=sliding,
                      sliding_window=5 if sliding else None)
    cfg, T = d.config, 11
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(T + 3, cfg.num_taps * cfg.hidden_size, generator=g)
    emb = torch.randn(B, cfg.hidden_size, generator=g)
    pos, bpos = torch.arange(T + 3), torch.arange(T, T + B)
    with torch.no_grad():
        cache = DrafterCache(d)
        cache.append(feats[:7], pos[:7])
        cache.append(feats[7:], pos[7:])              # 3 rows too many (a rejected draft) ...
        cache.crop(T)                                 # ... rolled back
        got = d.step(cache, emb, bpos)
        attn = d.attn_spec(torch.tensor([T]), torch.tensor([0]), torch.zeros(T, dtype=torch.long))
        want = d(feats[:T], pos[:T], emb, bpos, attn)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_first_user_turn_only():
    row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                        {"role": "user", "content": "q2"}]}
    assert [m["content"] for m in prompt_messages(row)] == ["s", "q1"]
    assert prompt_messages({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]


@pytest.mark.skipif(not SMOLLM2_DIR.exists(), reason=f"no SmolLM2 folder at {SMOLLM2_DIR}")
def test_cli_smollm2(tmp_path, capsys):
    from transformers import AutoConfig
    from model.drafter import Drafter, DrafterConfig
    torch.manual_seed(0)
    d = Drafter(DrafterConfig.from_target(AutoConfig.from_pretrained(SMOLLM2_DIR), 1, B, mask_token_id=16))
    export_drafter(d, tmp_path / "drafter")
    rows = [{"id": "mt", "category": "mtbench/x", "messages": [{"role": "user", "content": "Name a colour."},
                                                               {"role": "user", "content": "Another one."}]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "res.json"
    main(["--target", str(SMOLLM2_DIR), "--drafter", str(tmp_path / "drafter"), "--prompts",
          str(tmp_path / "p.jsonl"), "--max-new-tokens", "6", "--tree-budget", "6", "--out", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"tau=\d+\.\d\d lossless=yes prompts=1", last), last
    res = json.loads(out.read_text())
    assert res["lossless"] and res["prompts"] == 1 and "ddtree" in res["tokens_per_s"]
    assert res["per_prompt"][0]["prompt_tokens"] > 10


def test_proposals_equal_training_forward(target, build_drafter, tiny_qwen3_dir):
    """Every proposal of the cached decode loop equals the training-time forward: features of all tokens before the
    block from a fresh no-cache target run (model.target.Target: layer hooks, no hidden_states offset to get wrong),
    one block [token at start, MASK...] at positions start.., the training mask."""
    from model.decode import DrafterProposer
    from model.target import Target
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B)
    tgt = Target(tiny_qwen3_dir, dtype=torch.float32, layer_ids=d.config.target_layer_ids)
    seen = []

    class Recording(DrafterProposer):
        def propose(self, tokens, start, block_size):
            logits = super().propose(tokens, start, block_size)
            seen.append((list(tokens), start, logits))
            return logits

    ids = prompts()[1]["input_ids"]
    for budget in (0, 6):                                          # block and tree verification commit differently
        seen.clear()
        speculative_decode(target, ids, Recording(d, target), B, 20, set(), tree_budget=budget, tree_top_k=3)
        assert len(seen) > 3
        for tokens, start, logits in seen:
            with torch.no_grad():
                feats = tgt.features(torch.tensor([tokens[:start]]))[0]                       # [start, K*H]
                block = torch.tensor([tokens[start]] + [d.config.mask_token_id] * (B - 1))
                attn = d.attn_spec(torch.tensor([start]), torch.tensor([0]), torch.zeros(start, dtype=torch.long))
                h = d(feats, torch.arange(start), tgt.embed_tokens(block), torch.arange(start, start + B), attn)
                want = target.lm_head(h[1:])
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


def test_several_drafters_equal_each_alone(target, build_drafter, tiny_qwen3_dir, monkeypatch):
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B)
    drafters = [d, Oracle(target, wrong_slot=lambda s: 1 + s % B)]     # tau ~1 and tau > 1: a mix-up shows
    kw = dict(block_size=B, max_new_tokens=16, tree_budget=6, tree_top_k=3, log=None)
    alone = [evaluate(target, None, x, prompts(), **kw) for x in drafters]
    calls = []
    monkeypatch.setattr(measure, "greedy_decode", lambda *a: calls.append(1) or greedy_decode(*a))
    both = evaluate_drafters(target, None, drafters, prompts(), **kw)
    assert len(calls) == 1 + 3                                           # warm-up + one reference per prompt
    assert both[0]["tau"] < both[1]["tau"]
    for one, res in zip(alone, both):
        assert [untimed(r) for r in res["per_prompt"]] == [untimed(r) for r in one["per_prompt"]]
        for key in ("tau", "tree_tau", "lossless", "tau_by_category", "accept_hist", "tree_accept_hist", "config"):
            assert res[key] == one[key], key
        assert res["lossless"], res["mismatches"]


def test_teacher_forced_streak_equals_the_decode_path(target, build_drafter, tiny_qwen3_dir):
    """teacher_forced_streak (training forward over the whole sequence) equals the streak the cached decode path
    gets at every anchor. The completion is built from the drafter's own slot-1 choice, so every anchor's slot 1
    is right by construction: the value must be >= 1, and any off-by-one between the paths breaks that."""
    from model.decode import DrafterProposer, target_forward, teacher_forced_streak
    from transformers import DynamicCache
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B).eval()
    prop = DrafterProposer(d, target)
    prompt = prompts()[1]["input_ids"]

    def proposals(tokens):                                   # decode path, anchor = tokens[-1]
        p = len(tokens) - 1
        with torch.no_grad():
            _, feats = target_forward(target, torch.tensor(tokens[:p]), torch.arange(p), DynamicCache(),
                                      prop.layer_ids)
            prop.reset(tokens[:p], feats)
            return prop.propose(tokens, p, B).argmax(-1).tolist()      # slots 1..B-1
    seq = list(prompt) + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    for _ in range(12):
        seq.append(proposals(seq)[0])
    streaks = []
    for p in range(len(prompt), len(seq) - 1):
        got, n = proposals(seq[:p + 1]), 0
        while n < B - 1 and p + 1 + n < len(seq) and got[n] == seq[p + 1 + n]:
            n += 1
        streaks.append(n)
    assert min(streaks) >= 1
    tf = teacher_forced_streak(target, prop, prompt, seq[len(prompt):], B)
    assert tf == pytest.approx(sum(streaks) / len(streaks), abs=1e-9), (tf, streaks)


def test_train_streak_tool(tmp_path, capsys):
    """tools.train_streak scores dataset rows with teacher_forced_streak: a value in [0, B-1] for every kept row."""
    import runs
    from model.drafter import Drafter, DrafterConfig
    from transformers import AutoConfig
    from tools.train_streak import main as train_streak
    tgt, data = runs.make_target(tmp_path / "t"), runs.make_dataset(tmp_path / "d", n=6)
    hf = AutoConfig.from_pretrained(tgt, local_files_only=True)
    torch.manual_seed(0)
    export_drafter(Drafter(DrafterConfig.from_target(hf, 1, B, mask_token_id=runs.MASK_ID)), tmp_path / "drafter")
    train_streak(["--target", str(tgt), "--drafter", str(tmp_path / "drafter"), "--data", str(data), "--rows", "6"])
    m = re.search(r"teacher-forced streak on (\d+) rows .*: ([0-9.]+)$", capsys.readouterr().out.strip())
    assert m and int(m.group(1)) == 6 and 0.0 <= float(m.group(2)) <= B - 1, m


def test_cli_checks_its_input_before_loading_the_target(tmp_path, monkeypatch, build_drafter, tiny_qwen3_dir):
    loaded = []
    monkeypatch.setattr(eval_dflash, "run_here", lambda a, prompts, *_, **__: loaded.append(a) or [])
    ckpt = tmp_path / "step_000010"
    export_drafter(build_drafter(tiny_qwen3_dir, num_layers=1, block_size=B), ckpt / "drafter")
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n")

    def cli(*extra, drafter=ckpt / "drafter", prompts=good):
        argv = ["--target", str(tiny_qwen3_dir), "--drafter", str(drafter), "--prompts", str(prompts), *extra]
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert not loaded, "the target was loaded before the bad input was refused"
        return str(e.value)

    assert "empty.jsonl has no prompt rows" in cli(prompts=tmp_path / "empty.jsonl")
    assert "nope.jsonl" in cli(prompts=tmp_path / "nope.jsonl")
    assert "--max-new-tokens 0: must be at least 1" in cli("--max-new-tokens", "0")
    assert "--max-new-tokens -4: must be at least 1" in cli("--max-new-tokens", "-4")
    assert re.search(r"--drafter \S+ has no config.json: .*checkpoints/step_NNNNNN/drafter", cli(drafter=tmp_path))
    cfg = json.loads((ckpt / "drafter" / "config.json").read_text())
    wrong = tmp_path / "wrong"
    export_drafter(build_drafter(tiny_qwen3_dir, num_layers=1, block_size=B), wrong)
    (wrong / "config.json").write_text(json.dumps(cfg | {"dflash_config": cfg["dflash_config"] |
                                                         {"mask_token_id": 500}}))
    assert "mask_token_id 500 is not a row of the target's embedding (vocab_size 128)" in cli(drafter=wrong)
    main(["--target", str(tiny_qwen3_dir), "--drafter", str(ckpt), "--prompts", str(good)])  # a checkpoint folder
    assert loaded[0].drafter == [ckpt / "drafter"]


def test_tau_diff_tool(tmp_path, capsys):
    """tools.tau_diff: the paired difference is the mean of the per-prompt differences, its SE theirs; prompts
    only one drafter has are left out; a file with one drafter is refused by name."""
    from tools import tau_diff

    def drafter(name, taus):
        return {"drafter": name, "tau": sum(taus.values()) / len(taus),
                "per_prompt": [{"id": k, "tau": v} for k, v in taus.items()]}

    base = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 1.5}
    other = {"a": 1.1, "b": 2.3, "c": 3.0, "e": 9.0}      # "d" and "e" are not shared
    tb, to, diff, se, n = tau_diff.paired_diff(tau_diff.per_prompt_tau(drafter("x", base)),
                                               tau_diff.per_prompt_tau(drafter("y", other)))
    d = [0.1, 0.3, 0.0]
    mean = sum(d) / 3
    assert n == 3 and diff == pytest.approx(mean) and tb == pytest.approx(2.0) and to == pytest.approx(6.4 / 3)
    assert se == pytest.approx((sum((x - mean) ** 2 for x in d) / 2 / 3) ** 0.5)
    f = tmp_path / "walk.json"
    f.write_text(json.dumps({"drafters": [drafter("runs/base", base), drafter("runs/fp8", other)]}))
    assert tau_diff.main([str(f), "--base", "base"]) == 0
    out = capsys.readouterr().out
    assert f"minus base {mean:+.4f} +- {se:.4f}" in out and "over 3 prompts" in out
    gz = tmp_path / "walk.json.gz"                        # the results the repo keeps are gzipped
    gz.write_bytes(gzip.compress(f.read_bytes()))
    assert tau_diff.main([str(gz), "--base", "base"]) == 0
    assert f"minus base {mean:+.4f} +- {se:.4f}" in capsys.readouterr().out
    one = tmp_path / "one.json"
    one.write_text(json.dumps(drafter("runs/base", base)))
    with pytest.raises(SystemExit, match="holds 1 drafter"):
        tau_diff.main([str(one)])
    with pytest.raises(SystemExit, match="no drafter path contains 'nope'"):
        tau_diff.main([str(f), "--base", "nope"])


# ---------------------------------------------------------------------------
# Per category and macro; prompt rows; multi-turn rows

def test_category_stats_and_macro_equal_a_slow_reference():
    """category_stats on a hand-made result equals the textbook formulas written out slowly: per category the mean
    and sd / sqrt(n) (statistics.stdev), the macro the plain mean of the category means with SE
    sqrt(sum se_c^2) / C; prompts without a tau are left out of their category."""
    import statistics
    taus = {"chat": [1.0, 1.5, 2.5], "code": [3.0, 4.0, 3.5, 5.5], "howto": [2.0, None, 2.2]}
    rows = [{"id": f"{c}{i}", "category": c, "tau": t} for c, ts in taus.items() for i, t in enumerate(ts)]
    cats, macro = measure.category_stats(rows, "tau")
    slow = {}
    for c, ts in taus.items():
        ts = [t for t in ts if t is not None]
        slow[c] = {"prompts": len(ts), "mean": statistics.fmean(ts), "se": statistics.stdev(ts) / len(ts) ** 0.5}
    assert cats.keys() == slow.keys()
    for c in slow:
        assert cats[c] == pytest.approx(slow[c]), c
    assert macro["categories"] == 3
    assert macro["mean"] == pytest.approx((slow["chat"]["mean"] + slow["code"]["mean"] + slow["howto"]["mean"]) / 3)
    assert macro["se"] == pytest.approx((slow["chat"]["se"] ** 2 + slow["code"]["se"] ** 2
                                         + slow["howto"]["se"] ** 2) ** 0.5 / 3)
    # the macro weighs categories, not prompts: code's 4 prompts count as much as howto's 2
    assert macro["mean"] != pytest.approx(statistics.fmean(t for ts in taus.values() for t in ts if t is not None))
    one = measure.category_stats([{"category": "a", "tau": 2.0}, {"category": "b", "tau": 1.0},
                                      {"category": "b", "tau": 3.0}])[1]
    assert one["mean"] == 2.0 and one["se"] is None          # a one-prompt category has no SE, nor has the macro


def test_summary_and_report_give_categories_and_macro(target):
    res = run(target, Oracle(target, wrong_slot=lambda start: 2), 12)
    cats, macro = measure.category_stats(res["per_prompt"], "tau")
    assert res["tau_categories"] == cats and set(cats) == {"a", "b/x", "b/y"}
    assert res["tau_macro"] == macro["mean"] and res["tau_macro_se"] == macro["se"]
    assert res["tau_se"] == measure.mean_se([r["tau"] for r in res["per_prompt"]])[2]
    lines = measure.report_lines(res)
    assert any(re.fullmatch(rf"b/x\s+1\s+{res['tau_categories']['b/x']['mean']:.2f}\s+-", ln) for ln in lines), lines
    assert any(ln.startswith("macro (3 categories)") for ln in lines), lines
    assert lines[-2].startswith(f"macro tau {res['tau_macro']:.2f} +- -")
    assert re.fullmatch(r"tau=\d+\.\d\d lossless=yes prompts=3", lines[-1])


def test_limit_spreads_over_categories(tmp_path):
    rows = [{"id": f"{c}{i}", "category": c, "prompt": "x"} for c in "abc" for i in range(4)]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["id"] for r in load_prompts(f, limit=5)] == ["a0", "a1", "b0", "b1", "c0"]
    assert len(load_prompts(f, limit=50)) == 12


def test_categories_keep_or_leave_out(tmp_path):
    rows = [{"id": f"{c}{i}", "category": c, "prompt": "x"} for c in "abc" for i in range(4)] + [{"prompt": "y"}]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = lambda **kw: [r["id"] for r in load_prompts(f, **kw)]          # noqa: E731
    assert ids(categories="b") == ["b0", "b1", "b2", "b3"]
    assert ids(categories="a, all") == ["a0", "a1", "a2", "a3", "p.jsonl:13"]
    assert ids(categories="-a,-b,-all") == ["c0", "c1", "c2", "c3"]
    assert ids(categories="-c", limit=3) == ["a0", "b0", "p.jsonl:13"]     # selected first, then dealt
    with pytest.raises(ValueError, match="has no category 'd'; it has a, b, c, all"):
        ids(categories="a,d")
    with pytest.raises(ValueError, match="not both"):
        ids(categories="a,-b")
    for empty in (",", "", " , ", "-"):   # an empty filter is a mistake, not "every prompt"
        with pytest.raises(ValueError, match=f"--categories {empty!r} names no category.*has a, b, c, all"):
            ids(categories=empty)
    with pytest.raises(ValueError, match=r"--categories '-a,-b,-c,-all' leaves no prompt of .*p.jsonl: it has a, b, c"):
        ids(categories="-a,-b,-c,-all")


def test_prompts_the_template_refuses_fail_before_the_target_loads(tmp_path, monkeypatch, build_drafter,
                                                                    no_system_target, capsys):
    """A target whose chat template has no system role, on the broad set: the run stops before any model loads,
    naming the category and --categories=-system; with it, the rest runs."""
    from transformers import AutoTokenizer
    broad = Path("data/default/eval_broad.jsonl")
    tok = AutoTokenizer.from_pretrained(no_system_target)
    refused = refused_by_template(tok, load_prompts(broad))
    assert {r["category"] for r, _ in refused} == {"system"} and len(refused) == 30
    assert all("System role not supported" in why for _, why in refused)
    ran = []
    monkeypatch.setattr(eval_dflash, "run_here", lambda a, prompts, *_, **__: ran.append(prompts) or [])
    export_drafter(build_drafter(no_system_target, num_layers=1, block_size=B), tmp_path / "d")
    argv = ["--target", str(no_system_target), "--drafter", str(tmp_path / "d"), "--prompts", str(broad)]
    with pytest.raises(SystemExit) as e:
        eval_dflash.main(argv)
    assert "refuses 30 of 313 prompts (by category: system 30 of 30; e.g. 'system/00': TemplateError: System role " \
           "not supported): leave them out with --categories=-system" in str(e.value)
    assert ran == []
    monkeypatch.setattr(eval_dflash, "write_json", lambda *a: None)
    monkeypatch.setattr(eval_dflash, "report_lines", lambda res: [])
    eval_dflash.main(argv + ["--categories=-system"])
    assert len(ran[0]) == 283 and "system" not in {r["category"] for r in ran[0]}


@pytest.mark.parametrize("row, problem", [
    ({"messages": "hi"}, "`messages` must be a list"),
    ({"messages": [{"role": "system", "content": "s"}]}, "`messages` has no user turn"),
    ({"messages": [{"role": "user", "content": 5}]}, "message 0 (user) has no string `content`"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
     "message 1 is an answer placeholder"),
    ({"prompt": "q", "category": 3}, "`category` must be a string"),
    ({"input_ids": [1, "2"]}, "`input_ids` must be a non-empty list"),
    ({"prompt": ""}, "`prompt` must be a non-empty string"),
    ([1, 2], "a prompt row is a JSON object"),
])
def test_bad_prompt_rows_fail_before_the_target_loads(row, problem, tmp_path, monkeypatch, build_drafter,
                                                       tiny_qwen3_dir):
    """Rows that used to pass load_prompts and fail in encode_prompt, after the target had loaded."""
    loaded = []
    monkeypatch.setattr(eval_dflash, "run_here", lambda a, prompts, *_, **__: loaded.append(a) or [])
    export_drafter(build_drafter(tiny_qwen3_dir, num_layers=1, block_size=B), tmp_path / "d")
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "d"), "--prompts", str(f)])
    assert not loaded and f"p.jsonl:2: {problem}" in str(e.value), str(e.value)


def test_duplicate_prompt_ids_are_refused(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "prompt": "x"}) + "\n" for i in ("a", "b", "a")))
    with pytest.raises(ValueError, match="ids must be unique .*repeated: a"):
        load_prompts(f)


@pytest.mark.skipif(not SMOLLM2_DIR.exists(), reason=f"no SmolLM2 folder at {SMOLLM2_DIR}")
def test_multiturn_row_measures_the_second_answer(tiny_smollm2, build_drafter):
    """A row [user1, placeholder, user2]: the prompt is the conversation with the target's plain greedy answer to
    user1 in the placeholder, and tau is measured on the answer to user2 (the first answer is not decoded again)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data.chat import render
    tok = AutoTokenizer.from_pretrained(tiny_smollm2)
    model = AutoModelForCausalLM.from_pretrained(tiny_smollm2, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = eos_ids(model, tok)
    u1, u2 = {"role": "user", "content": "Name a colour."}, {"role": "user", "content": "And another one?"}
    row = {"id": "m", "category": "multiturn", "messages": [u1, {"role": "assistant", "content": None}, u2]}

    def encode(msgs):
        return tok(render(tok, msgs, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    first = greedy_decode(model, encode([u1]), measure.EARLIER_ANSWER_TOKENS, eos)
    answer = tok.decode([t for t in first if t not in eos], skip_special_tokens=True)
    want = encode([u1, {"role": "assistant", "content": answer}, u2])
    with pytest.raises(ValueError, match="answer placeholder: encoding it needs the target"):
        encode_prompt(tok, row)
    assert len(answer) > 0 and encode_prompt(tok, row, answer=lambda ids: [
        t for t in greedy_decode(model, ids, measure.EARLIER_ANSWER_TOKENS, eos) if t not in eos]) == want
    drafter = build_drafter(tiny_smollm2, num_layers=1, block_size=B)
    res = evaluate(model, tok, drafter, [row], max_new_tokens=8, log=None)
    r = res["per_prompt"][0]
    assert res["lossless"] and r["prompt_tokens"] == len(want)
    assert r["tokens"] == greedy_decode(model, want, 8, eos)


# ---------------------------------------------------------------------------
# tools.tau_diff: per category, macro, and its input checks

def _drafter(name, taus, cats=None):
    return {"drafter": name, "tau": sum(taus.values()) / len(taus),
            "per_prompt": [{"id": k, "tau": v, "category": (cats or {}).get(k, "all")} for k, v in taus.items()]}


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def test_tau_diff_compares_on_shared_ids_and_says_what_it_left_out(tmp_path, capsys):
    """Result files with different prompt sets: both sides' tau on the shared ids only (the base's tau used to be
    over all of its prompts), and the ids left out counted per side; two files are compared like one."""
    from tools import tau_diff
    base = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 9.0}
    other = {"a": 1.5, "b": 2.0, "c": 3.5, "e": 1.0, "f": 1.0}
    f1, f2 = _write(tmp_path / "a.json", _drafter("runs/base", base)), _write(tmp_path / "b.json", _drafter("x", other))
    assert tau_diff.main([f1, f2]) == 0
    out = capsys.readouterr().out
    assert f"tau {7 / 3:.4f} vs base {2.0:.4f} on the same prompts, minus base {1 / 3:+.4f}" in out, out
    assert "left out, not in both: 1 of the base's 4 prompts, 2 of this one's 5" in out, out
    _write(tmp_path / "c.json", _drafter("y", {"x": 1.0, "z": 2.0}))
    with pytest.raises(SystemExit, match="share no prompt id with a tau"):
        tau_diff.main([f1, str(tmp_path / "c.json")])


def test_tau_diff_per_category_and_macro_equal_a_slow_reference(tmp_path, capsys):
    import statistics
    from tools import tau_diff
    cats = {"a": "chat", "b": "chat", "c": "chat", "d": "code", "e": "code"}
    base = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 5.0}
    other = {"a": 1.5, "b": 2.1, "c": 3.9, "d": 4.0, "e": 5.4}
    per_cat, macro = tau_diff.category_diffs(*(tau_diff.per_prompt(_drafter(n, t, cats), n)
                                               for n, t in (("b", base), ("o", other))))
    slow = {}
    for c in ("chat", "code"):
        d = [other[i] - base[i] for i in base if cats[i] == c]
        slow[c] = (statistics.fmean(d), statistics.stdev(d) / len(d) ** 0.5)
    assert per_cat.keys() == slow.keys()
    for c, (mean, se) in slow.items():
        assert (per_cat[c]["mean"], per_cat[c]["se"]) == pytest.approx((mean, se)), c
    assert macro["mean"] == pytest.approx((slow["chat"][0] + slow["code"][0]) / 2)
    assert macro["se"] == pytest.approx((slow["chat"][1] ** 2 + slow["code"][1] ** 2) ** 0.5 / 2)
    f = _write(tmp_path / "r.json", {"drafters": [_drafter("base", base, cats), _drafter("new", other, cats)]})
    assert tau_diff.main([f]) == 0
    out = capsys.readouterr().out
    assert f"macro (2 categories, each weighted equally): minus base {macro['mean']:+.4f} +- {macro['se']:.4f}" in out
    chat = next(ln.split() for ln in out.splitlines() if ln.split()[:1] == ["chat"])
    assert chat == ["chat", "3", f"{slow['chat'][0]:+.4f}", f"{slow['chat'][1]:.4f}"], out


def test_tau_diff_refuses_bad_input_by_name(tmp_path):
    """Duplicate ids (they used to collapse silently), no JSON, missing per-prompt fields: a message, no traceback."""
    from tools import tau_diff
    good = _write(tmp_path / "good.json", _drafter("g", {"a": 1.0, "b": 2.0}))
    dup = _drafter("dup", {"a": 1.0, "b": 2.0})
    dup["per_prompt"].append({"id": "a", "tau": 3.0})
    cases = [
        (_write(tmp_path / "dup.json", dup), r"repeats prompt ids a: a paired difference needs each prompt once"),
        (str(tmp_path / "notjson.json"), "is not JSON"),
        (_write(tmp_path / "list.json", [1, 2]), "is not an eval_dflash.py --out result"),
        (_write(tmp_path / "noper.json", {"drafter": "n", "tau": 1.0}), r"has no `per_prompt` list"),
        (_write(tmp_path / "noid.json", {"per_prompt": [{"id": "a", "tau": 1.0}, {"tau": 2.0}]}),
         r"per_prompt\[1\] lacks `id` or `tau`"),
        (_write(tmp_path / "strtau.json", {"per_prompt": [{"id": "a", "tau": "2"}]}), "has tau '2', not a number"),
        (str(tmp_path / "missing.json"), "cannot read"),
    ]
    # values json reads but no tau or id can be: NaN, Infinity, true; a null category; an id that is a list
    not_a_tau = r"\) has tau {}, not a number: a tau is finite"
    for name, row, message in [
            ("nan", '{"id": "a", "tau": NaN}', r"nan.json \(nan\): per_prompt\[1\] \(id 'a'" + not_a_tau.format("nan")),
            ("inf", '{"id": "a", "tau": -Infinity}', r"per_prompt\[1\] \(id 'a'" + not_a_tau.format("-inf")),
            ("bool", '{"id": "a", "tau": true}', r"per_prompt\[1\] \(id 'a'" + not_a_tau.format("True")),
            ("nullcat", '{"id": "a", "tau": 2.0, "category": null}', r"per_prompt\[1\] \(id 'a'\) has category None"),
            ("listid", '{"id": ["a"], "tau": 2.0}', r"per_prompt\[1\] has id \['a'\]: a prompt id is a string"),
            ("boolid", '{"id": true, "tau": 2.0}', r"per_prompt\[1\] has id True"),
    ]:
        rows = f'[{{"id": "b", "tau": 1.0}}, {row}]'
        (tmp_path / f"{name}.json").write_text(f'{{"drafter": "{name}", "per_prompt": {rows}}}')
        cases.append((str(tmp_path / f"{name}.json"), message))
    (tmp_path / "notjson.json").write_text("{not json")
    for path, message in cases:
        with pytest.raises(SystemExit, match=message):
            tau_diff.main([good, path])
