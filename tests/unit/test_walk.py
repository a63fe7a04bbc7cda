"""The walk (eval_dflash --method walk): the decode loop's tau and per-step commits from batched greedy references
and one teacher-forced forward per prompt, checked against the decode loop itself; and the speed figure's device
and dtype fields."""
import json
import re

import pytest
import torch

from conftest import SMOLLM2_DIR
from eval_dflash import main
from trainer.evaluate import evaluate, evaluate_drafters, report_lines
from model.decode import (DrafterProposer, drafts_at_every_anchor, greedy_decode, greedy_references, speculative_decode,
                          target_forward, walk_steps, walk_tree_steps)
from model.export import export_drafter

B = 4


def test_walk_steps_by_hand():
    y = [10, 11, 12, 13, 14, 15, 16, 17]          # the completion; drafts[i] are proposed with y[i] as the anchor
    drafts = [[11, 12, 13],                       # anchor y[0]: all 3 right -> commits 4 (to y[4])
              [0, 0, 0], [0, 0, 0], [0, 0, 0],
              [15, 0, 0],                         # anchor y[4]: 1 right -> commits 2 (to y[6])
              [0, 0, 0],
              [0, 0, 0]]                          # anchor y[6]: 0 right -> commits the bonus y[7]
    assert walk_steps(drafts, y, 4) == [4, 2, 1]
    # the end of the completion (eos or max_new_tokens) cuts the last step, whatever the drafts say past it
    assert walk_steps([[11, 12, 13], [0] * 3, [0] * 3, [0] * 3, [15, 16, 99], [0] * 3], y[:6], 4) == [4, 1]
    assert walk_steps([[11, 12, 13], [0] * 3, [0] * 3, [0] * 3, [15, 16, 17]], y[:6], 4) == [4, 1]
    assert walk_steps([[11, 12, 0], [0] * 3, [13, 14, 15]], y[:4], 4) == [3]
    assert walk_steps([], y[:1], 4) == []          # done after the prefill token
    # DDTree: y[1..3] is slot 1's second choice (path score -1.2), then slot 2's and 3's first; 6 nodes reach depth
    # 2 of it (scores -0.1 -0.2 -0.3 -1.0 -1.1 -1.1), 9 all of it (+ the three paths scoring -1.2)
    lp = [[[-0.1, -1.0]] * 3] * 7
    ids = [[[99, 11], [12, 98], [13, 97]]] + [[[0, 1]] * 3] * 6
    assert walk_tree_steps(lp, ids, y, budget=6) == [3, 1, 1, 1, 1]
    assert walk_tree_steps(lp, ids, y, budget=9) == [4, 1, 1, 1]


def test_greedy_references_equal_greedy_decode(small_vocab, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 127, (n,), generator=g).tolist() for n in (4, 17, 9, 30)]
    free = [greedy_decode(model, p, 12, set()) for p in prompts]
    eos = {free[1][5], free[3][2]}                # stops two of them early, inside a batch
    want = [greedy_decode(model, p, 12, eos) for p in prompts]
    assert len(want[1]) < 12 and len(want[3]) < 12
    assert greedy_references(model, prompts, 12, eos, batch_size=3) == want


@pytest.mark.parametrize("sliding", [0, 1])
def test_walk_equals_the_decode_loop(small_vocab, build_drafter, sliding):
    """Per prompt, the walk's steps, tau, DDTree steps and teacher-forced streak == the decode loop's, exactly, and
    every proposal the decode loop made == the walk's drafts at that anchor."""
    path, model, rows = small_vocab
    drafters = [build_drafter(path, num_layers=2, block_size=B, seed=s, sliding_window_layers=sliding,
                              sliding_window=6 if sliding else None).eval() for s in (0, 1)]
    kw = dict(block_size=B, max_new_tokens=30, tree_budget=5, tree_top_k=2, log=None)
    decode = evaluate_drafters(model, None, drafters, rows, **kw)
    walk = evaluate_drafters(model, None, drafters, rows, method="walk", **kw)
    hist = {}
    for dec, wk in zip(decode, walk):
        assert dec["lossless"], dec["mismatches"]
        assert wk["lossless"] is None and wk["reference_mismatches"] == []
        for a, b in zip(dec["per_prompt"], wk["per_prompt"]):
            assert b["tokens"] == a["tokens"]
            assert b["steps"] == a["steps"] and b["tau"] == a["tau"], a["id"]
            assert b["tree_steps"] == a["tree_steps"] and b["tree_tau"] == a["tree_tau"], a["id"]
            assert b["tf_streak"] == pytest.approx(a["tf_streak"], abs=1e-9)
        for key in ("tau", "tree_tau", "accept_hist", "tree_accept_hist", "tau_by_category"):
            assert wk[key] == dec[key], key
        hist |= dec["accept_hist"]
    assert len(hist) >= 3, f"too few accepted drafts to test the walk: {hist}"

    seen = []

    class Recording(DrafterProposer):
        def propose(self, tokens, start, block_size):
            logits = super().propose(tokens, start, block_size)
            seen.append((start, logits.argmax(-1).tolist()))
            return logits
    d = drafters[0]
    for row in rows:
        seen.clear()
        P = len(row["input_ids"])
        got = speculative_decode(model, row["input_ids"], Recording(d, model), B, 30, set())
        seq = torch.tensor(row["input_ids"] + got["tokens"])
        from transformers import DynamicCache
        _, feats = target_forward(model, seq, torch.arange(len(seq)), DynamicCache(), d.config.target_layer_ids)
        drafts = drafts_at_every_anchor(DrafterProposer(d, model), feats, seq, P, B).tolist()
        assert [drafts[start - P] for start, _ in seen] == [p for _, p in seen]


def test_speed_is_reported_with_device_and_dtype(small_vocab, build_drafter):
    path, model, rows = small_vocab
    d = build_drafter(path, num_layers=1, block_size=B)
    res = evaluate(model, None, d, rows, block_size=B, max_new_tokens=12, tree_budget=4, tree_top_k=2, log=None)
    on = res["measured_on"]
    assert on == {"device": "cpu", "device_name": f"cpu ({torch.get_num_threads()} threads)", "dtype": "float32",
                  "drafter_dtype": "float32", "method": "decode"}
    assert {k: res["config"][k] for k in on} == on
    tps = res["tokens_per_s"]
    assert set(tps) == {"greedy", "dflash", "ddtree"} and all(v > 0 for v in tps.values())
    assert res["speedup"] == tps["dflash"] / tps["greedy"] and res["tree_speedup"] == tps["ddtree"] / tps["greedy"]
    for m in ("greedy", "dflash", "ddtree"):   # tokens / seconds summed over the prompts, per mode
        toks = sum(r["gen_tokens"][m] for r in res["per_prompt"])
        assert tps[m] == pytest.approx(toks / sum(r["seconds"][m] for r in res["per_prompt"]), rel=1e-12)
    line = next(l for l in report_lines(res) if l.startswith("tok/s"))
    assert line.startswith(f"tok/s on {on['device_name']} (cpu, target float32, drafter float32, HF decode loop): "
                           f"greedy {tps['greedy']:.1f} | dflash {tps['dflash']:.1f} (speedup {res['speedup']:.2f}x) | "
                           f"ddtree {tps['ddtree']:.1f} (speedup {res['tree_speedup']:.2f}x"), line


def test_cli_walk(small_vocab, build_drafter, tmp_path, capsys):
    path, _, rows = small_vocab
    export_drafter(build_drafter(path, num_layers=2, block_size=B), tmp_path / "d")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--target", str(path), "--drafter", str(tmp_path / "d"), "--prompts", str(tmp_path / "p.jsonl"),
            "--device", "cpu", "--max-new-tokens", "20"]
    dec = main(args)
    capsys.readouterr()
    wk = main(args + ["--method", "walk", "--out", str(tmp_path / "w.json")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"tau={wk['tau']:.2f} lossless=unchecked prompts=3"
    assert any(l.startswith("walk: tau of the decode loop from 3 greedy references") for l in lines), lines
    assert json.loads((tmp_path / "w.json").read_text())["config"]["method"] == "walk"
    assert wk["tau"] == dec["tau"] and wk["accept_hist"] == dec["accept_hist"] and "tokens_per_s" not in wk


@pytest.mark.skipif(not SMOLLM2_DIR.exists(), reason=f"no SmolLM2 folder at {SMOLLM2_DIR}")
def test_walk_equals_decode_on_smollm2(tmp_path):
    """SmolLM2 (fp32) with a random drafter on two chat prompts: the walk's steps == the decode loop's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from model.drafter import Drafter, DrafterConfig
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR, local_files_only=True)
    torch.manual_seed(0)
    d = Drafter(DrafterConfig.from_target(AutoConfig.from_pretrained(SMOLLM2_DIR), 1, B, mask_token_id=16)).eval()
    rows = [{"id": "a", "prompt": "Name three colours."}, {"id": "b", "prompt": "def add(a, b):"}]
    kw = dict(block_size=B, max_new_tokens=12, log=None)
    dec = evaluate(model, tok, d, rows, **kw)
    wk = evaluate(model, tok, d, rows, method="walk", **kw)
    assert dec["lossless"] and wk["reference_mismatches"] == []
    assert [r["steps"] for r in wk["per_prompt"]] == [r["steps"] for r in dec["per_prompt"]]
    assert [r["tokens"] for r in wk["per_prompt"]] == [r["tokens"] for r in dec["per_prompt"]]
    assert re.fullmatch(r"cpu \(\d+ threads\)", dec["measured_on"]["device_name"])
