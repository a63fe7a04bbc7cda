"""data/synthesize.py and data/filters.py: the filters count each kind of bad row; synthesize resumes into exactly the
rows of one uninterrupted run, its decisions are those of data.filters on the same rows, and on SmolLM2 it writes
rows that data.prepare accepts. The mechanics run on a scripted engine (text drawn from (seed, key), no model) with
the Qwen3 tokenizer fixture, a few seconds each (tests/helpers/synth_cases.py; runs as processes, stopped and killed:
tests/jobs/test_synthesize_jobs.py); the SmolLM2 test runs model/engine.py on the real model (slow: about 25 s on the
CPU, `pytest -m slow tests/unit/test_synthesize.py`)."""
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from data import filters as F
from data import synthesize as syn
from data.chat import render
from synth_cases import WORDS, ScriptedEngine, by_id, cached_tokenizer, read_jsonl, scripted  # noqa: F401 (a fixture)

SMOLLM2_DIR = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "smollm2-135m-instruct"


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------------------------------------------------------
# filters on hand-made rows

def row(*turns, finish=None, user_finish=None):
    r = {"messages": [user(t) if i % 2 == 0 else assistant(t) for i, t in enumerate(turns)],
         "finish_reasons": finish or ["stop"] * (len(turns) // 2)}
    if user_finish:
        r["user_finish_reasons"] = user_finish
    return r


LOOP = "I am a being of the mind, and I am a being of the mind. " * 6
HELDOUT = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences " \
          "and must-see attractions."


def hand_made_rows():
    """(row, expected reason or None) in order; the duplicates refer to the first good row."""
    good = "How do I sort a list of tuples by the second element in Python without writing a loop myself?"
    return [
        (row(good, "Use sorted with a key."), None),
        (row("What is the tallest mountain on Earth and how was its height measured?", "Everest, by survey.",
             finish=["length"]), None),
        (row("   ", "An answer."), "empty_user"),
        (row("Tell me about the history of", "It began...", user_finish=["length"]), "truncated_user"),
        (row(LOOP, "Fine."), "repetition"),
        (row("Give me three tips for sleeping better at night when I am stressed.", LOOP), "repetition"),
        (row("Line\n" + "print('the same line over and over')\n" * 5, "ok"), "repetition"),
        # an emoji loop (as SmolLM2 wrote one): no word repeats, no line repeats; it compresses to ~7%
        (row("My webcam isn't detected.", "Ladadad! \U0001f32a\U0001f31f" + "\U0001f30d" * 120), "repetition"),
        (row(HELDOUT.upper().replace(" ", "  "), "Aloha!"), "heldout_copy"),
        (row(HELDOUT.replace("recent trip", "recent family trip"), "Aloha!"), "heldout_near"),
        (row("  " + good.lower() + " ", "Other answer."), "duplicate"),
        (row(good.replace("myself?", "myself at all?"), "Other answer."), "near_duplicate"),
        (row("Name a fruit that is yellow and long, which monkeys are said to like.", ""), "empty_answer"),
        (row("Name a fruit that is red and round.", "An apple.", "And a green one?", " "), "empty_answer"),
        (row("Name a vegetable that is orange and crunchy, loved by rabbits.", "A carrot.", "Why is it orange?",
             "Beta-carotene.", finish=["stop", "length"]), None),
    ]


def test_filters_count_each_kind_of_bad_row():
    rows = hand_made_rows()
    assert HELDOUT in F.heldout_prompts([F.HELDOUT_DEFAULT])  # the held-out rows copy a real eval prompt
    filters = F.Filters(F.heldout_prompts([F.HELDOUT_DEFAULT]))
    stats = F.empty_stats()
    got = []
    for r, _ in rows:
        reason = filters.check(r)
        F.count(stats, r, reason)
        got.append(reason)
    assert got == [want for _, want in rows]
    expected = {r: sum(w == r for _, w in rows) for r in F.REASONS}
    assert stats == {"kept": 3, "length_capped": 2, "rejected": expected}
    assert all(expected.values())  # every reason is exercised


def test_filters_command_and_heldout_file(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r, _ in hand_made_rows()))
    extra = tmp_path / "more_eval.jsonl"  # a --heldout file turns the first good row into a held-out copy
    extra.write_text(json.dumps({"messages": [hand_made_rows()[0][0]["messages"][0]]}) + "\n")
    stats = F.main([str(inp), "--out", str(tmp_path / "out.jsonl"), "--heldout", str(extra)])
    # the good row and its exact copy are held-out copies now, its near copy a held-out near copy
    assert stats["rejected"]["heldout_copy"] == 3 and stats["rejected"]["heldout_near"] == 2
    assert stats["rejected"]["duplicate"] == stats["rejected"]["near_duplicate"] == 0 and stats["kept"] == 2
    assert json.loads((tmp_path / "out.jsonl.stats.json").read_text()) == stats
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 2
    assert "kept 2 of 15" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n[1]\n')
    with pytest.raises(SystemExit, match="bad.jsonl:2"):
        F.main([str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o2.jsonl")])


def test_near_duplicate_index_matches_brute_force_jaccard():
    """The LSH index against exact Jaccard on the same shingles: pairs well above the threshold are found, pairs
    well below are not (LSH is approximate near the threshold itself)."""
    rng = random.Random(0)
    base = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(40)]
    variants = []
    for b in base:
        w = b.split()
        k = rng.choice([1, 12])  # 1 word changed: Jaccard ~0.9; 12 words: ~0.3
        for i in rng.sample(range(30), k):
            w[i] = rng.choice(WORDS) + "x"
        variants.append(" ".join(w))
    filters = F.Filters()
    for b in base:
        filters.admit({"messages": [user(b)]})
    for b, v in zip(base, variants):
        sa, sb = set(F.shingles(b)), set(F.shingles(v))
        jaccard = len(sa & sb) / len(sa | sb)
        found = filters.opener_reason({"messages": [user(v)]}) == "near_duplicate"
        if jaccard >= 0.9:
            assert found, (jaccard, v)
        elif jaccard <= 0.5:
            assert not found, (jaccard, v)


# ---------------------------------------------------------------------------------------------------------------
# synthesize's mechanics on a scripted engine

def synth(model, out, num, *extra):
    return syn.main(["--model", str(model), "--num", str(num), "--out", str(out), "--prompt-tokens", "24",
                     "--max-new-tokens", "16", "--batch-size", "4", *map(str, extra)])


def test_resume_equals_one_run(tmp_path, qwen3_dir, scripted):
    """N=20 stopped, then N=40: the 20 rows stay, 20 are added, and both files equal one N=40 run's (rows and
    rejections, by id), also when the kept file lost its last newline and the rejected file ends in a torn line."""
    mix = ["--mix", "data/default/train_prompts.jsonl", "--mix-ratio", "0.1"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first = synth(qwen3_dir, a, 20, *mix)
    assert first["kept"] == 20 and first["rejected"]["duplicate"] + first["rejected"]["near_duplicate"] > 0
    kept20 = by_id(a)
    a.write_bytes(a.read_bytes().rstrip(b"\n"))  # a complete last row without its newline: not torn
    rej = syn.rejected_path(a)
    rej.write_bytes(rej.read_bytes() + b'{"id": "self/99", "messa')  # a torn write
    second = synth(qwen3_dir, a, 40, *mix)
    assert second["runs"][-1]["rows"] == 20
    one = synth(qwen3_dir, b, 40, *mix)
    assert by_id(a) == by_id(b) and by_id(syn.rejected_path(a)) == by_id(syn.rejected_path(b))
    assert {k: v for k, v in by_id(a).items() if k in kept20} == kept20
    assert {k: second[k] for k in ("kept", "length_capped", "rejected", "candidates", "streams")} == \
           {k: one[k] for k in ("kept", "length_capped", "rejected", "candidates", "streams")}
    rows = by_id(b).values()
    mixed = [r for r in rows if r["source"] != "self"]
    assert len(mixed) == 4 and all(r["source"] == "mix:data/default/train_prompts.jsonl" and r["prompt_id"]
                                   for r in mixed)
    texts = [F.normalize(r["messages"][0]["content"]) for r in rows if r["source"] == "self"]
    assert len(set(texts)) == len(texts) == 36
    assert all(r["finish_reasons"] and r["messages"][-1]["role"] == "assistant" for r in rows)
    assert synth(qwen3_dir, b, 40, *mix)["runs"] == one["runs"]  # complete: nothing to do, nothing written


def test_sigterm_records_the_run_and_a_rerun_goes_on(tmp_path, qwen3_dir, scripted, monkeypatch):
    """A SIGTERM part-way (as `timeout` sends): the rows written stay, the run is recorded as stopped with its rows
    and tokens, and rerunning the same command ends with the files of one uninterrupted run."""
    import os
    import signal
    run, results = ScriptedEngine.run, []

    def run_then_term(self, pending, **kw):
        for out in run(self, pending, **kw):
            results.append(out)
            if len(results) == 30:
                os.kill(os.getpid(), signal.SIGTERM)
            yield out
    monkeypatch.setattr(ScriptedEngine, "run", run_then_term)
    out, one = tmp_path / "s.jsonl", tmp_path / "one.jsonl"
    with pytest.raises(syn.Incomplete) as stop:   # exit status 1: `synthesize && prepare` stops here
        synth(qwen3_dir, out, 40)
    assert stop.value.code != 0 and "stopped by SIGTERM. Run the same command again" in str(stop.value)
    assert f"-m data.synthesize --model {qwen3_dir} --num 40 --out {out} " in str(stop.value)
    stats = stop.value.summary
    last = stats["runs"][-1]
    assert last["stopped"] == "SIGTERM" and 0 < last["rows"] < 40 and last["generated_tokens"] > 0
    assert len(read_jsonl(out)) == last["rows"] == stats["kept"]
    assert signal.getsignal(signal.SIGTERM) is not syn._on_sigterm  # the handler is the caller's again
    monkeypatch.setattr(ScriptedEngine, "run", run)
    again = synth(qwen3_dir, out, 40)
    assert again["kept"] == 40 and "stopped" not in again["runs"][-1]
    synth(qwen3_dir, one, 40)
    assert by_id(out) == by_id(one) and by_id(syn.rejected_path(out)) == by_id(syn.rejected_path(one))


def test_rows_do_not_depend_on_the_window(tmp_path, qwen3_dir, scripted):
    """--batch-size sets how many candidates are in flight (and so the completion order): the rows and rejections
    written are the same for 1 and 7 slots."""
    files = []
    for slots in (1, 7):
        out = tmp_path / f"w{slots}.jsonl"
        syn.main(["--model", str(qwen3_dir), "--num", "25", "--out", str(out), "--prompt-tokens", "24",
                  "--max-new-tokens", "16", "--batch-size", str(slots), "--mix", "data/default/train_prompts.jsonl",
                  "--mix-ratio", "0.2"])
        files.append((by_id(out), by_id(syn.rejected_path(out))))
    assert files[0] == files[1] and len(files[0][0]) == 25 and files[0][1]


def test_decisions_are_those_of_the_filters_command(tmp_path, qwen3_dir, scripted):
    """Two turns: every candidate, kept or rejected, gets the same verdict from data.filters on the written rows in
    index order; the follow-up turn was written from the conversation plus the template's user-turn opening."""
    out = tmp_path / "s.jsonl"
    synth(qwen3_dir, out, 12, "--turns", 2, "--system", "Be brief.")
    rows = sorted(read_jsonl(out) + read_jsonl(syn.rejected_path(out)), key=lambda r: syn.stream_of(r)[1])
    filters = F.Filters(F.heldout_prompts(F.HELDOUT_DEFAULTS))
    assert [filters.check(r) for r in rows] == [r.get("rejected") for r in rows]
    kept = read_jsonl(out)
    assert all([m["role"] for m in r["messages"]] == ["system", "user", "assistant", "user", "assistant"] and
               r["user_finish_reasons"] == ["stop", "stop"] for r in kept)
    tok = cached_tokenizer(str(qwen3_dir))
    conv = kept[0]["messages"][:3]
    follow_up = syn.encode(tok, render(tok, conv + [user(syn.SENTINEL)]).split(syn.SENTINEL)[0])
    assert follow_up in scripted.engines[0].prompts
    assert tok.decode(follow_up).endswith("<|im_start|>user\n")


def write_openers(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_openers_start_the_user_turns(tmp_path, qwen3_dir, scripted):
    """--openers: each self row's user turn is its drawn opener's text continued by the model (the write request
    ends with that text), the draw follows the weights and depends on (seed, index) alone (rows equal for 1 and 7
    slots), the rows keep their opener, and changing the file refuses a resume."""
    ops = write_openers(tmp_path / "openers.jsonl", [{"name": "free", "text": "", "weight": 1},
                                                     {"name": "py", "text": "Write a Python function that",
                                                      "weight": 2}])
    files = []
    for slots in (1, 7):
        out = tmp_path / f"o{slots}.jsonl"
        syn.main(["--model", str(qwen3_dir), "--num", "30", "--out", str(out), "--prompt-tokens", "24",
                  "--max-new-tokens", "16", "--batch-size", str(slots), "--openers", str(ops)])
        files.append((by_id(out), by_id(syn.rejected_path(out))))
    assert files[0] == files[1]
    rows = list(files[0][0].values()) + list(files[0][1].values())
    steered = [r for r in rows if r.get("opener")]
    assert steered and len(steered) < len(rows)
    assert all(r["opener"] == "Write a Python function that" for r in steered)
    assert all(r["messages"][0]["content"].startswith("Write a Python function that") and
               len(r["messages"][0]["content"]) > len(r["opener"]) for r in steered)
    tok = cached_tokenizer(str(qwen3_dir))
    writes = [tok.decode(p) for p in scripted.engines[0].prompts if tok.decode(p).endswith("that")]
    # (>=: candidates in flight past the last row needed are generated, not written)
    assert len(writes) >= len(steered) and all(w.endswith("<|im_start|>user\nWrite a Python function that")
                                               for w in writes)
    write_openers(ops, [{"text": "Explain"}])
    with pytest.raises(SystemExit, match="openers: was"):
        syn.main(["--model", str(qwen3_dir), "--num", "30", "--out", str(tmp_path / "o1.jsonl"), "--prompt-tokens",
                  "24", "--max-new-tokens", "16", "--openers", str(ops)])


def test_opener_draw_weights_and_bad_files(tmp_path):
    ops = [syn.Opener("a", "A ", 1.0), syn.Opener("b", "B ", 3.0)]
    draws = [syn.draw_opener(ops, 0, i).text for i in range(4000)]
    assert abs(draws.count("B ") / 4000 - 0.75) < 0.03                           # the weights, within 4 SEs
    assert draws == [syn.draw_opener(ops, 0, i).text for i in range(4000)]  # (seed, index) alone
    assert draws != [syn.draw_opener(ops, 1, i).text for i in range(4000)]  # the seed matters
    assert syn.draw_opener([], 0, 5) is None
    # a user turn that is only its opener (the model ended the turn at once) is empty
    filters = F.Filters()
    assert filters.opener_reason({"opener": "Explain", "messages": [user("Explain")]}) == "empty_user"
    assert filters.opener_reason({"opener": "Explain", "messages": [user("Explain gravity to a child.")]}) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok "}\n{"text": "x", "weight": 0}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:2 is not an opener"):
        syn.read_openers(bad)
    for cap in ("0", '"8"', "true", "2.5"):
        bad.write_text('{"text": "ok "}\n{"text": "x", "prompt_tokens": %s}\n' % cap)
        with pytest.raises(SystemExit, match="bad.jsonl:2 is not an opener.*prompt_tokens"):
            syn.read_openers(bad)
    bad.write_text("\n")
    with pytest.raises(SystemExit, match="holds no opener"):
        syn.read_openers(bad)


def test_an_openers_own_prompt_cap(tmp_path, qwen3_dir, scripted):
    """An opener's "prompt_tokens" caps the user turn the model writes after it; the others keep --prompt-tokens,
    the answers --max-new-tokens."""
    ops = write_openers(tmp_path / "openers.jsonl", [{"name": "free", "text": "", "weight": 1},
                                                     {"name": "py", "text": "Write a Python function that",
                                                      "weight": 1, "prompt_tokens": 40}])
    assert syn.read_openers(ops)[1] == syn.Opener("py", "Write a Python function that", 1.0, 40)
    syn.main(["--model", str(qwen3_dir), "--num", "20", "--out", str(tmp_path / "o.jsonl"), "--prompt-tokens", "6",
              "--max-new-tokens", "16", "--batch-size", "4", "--openers", str(ops)])
    tok = cached_tokenizer(str(qwen3_dir))
    caps = {}
    for p, n in zip(scripted.engines[0].prompts, scripted.engines[0].max_new):
        text = tok.decode(p)
        kind = "py" if text.endswith("user\nWrite a Python function that") else \
            "free" if text.endswith("<|im_start|>user\n") else "answer"
        caps.setdefault(kind, set()).add(n)
    assert caps == {"py": {40}, "free": {6}, "answer": {16}}


def test_shipped_openers_file_parses():
    ops = syn.read_openers(Path("data/default/openers.jsonl"))
    assert len({o.name for o in ops}) == len(ops) and any(o.text == "" for o in ops)


def test_systems_give_each_conversation_its_own(tmp_path, qwen3_dir, scripted):
    """--systems: each candidate (self and mix) draws a system prompt by weight from (seed, stream, index) alone
    (rows equal for 1 and 7 slots); the row keeps the system message and its name, the user turn is written after
    that system turn, "" keeps the template's default (Qwen3's: none), the openers drawn are those of a run without
    --systems, a changed file refuses a resume, and --system with --systems is a usage error."""
    ops = write_openers(tmp_path / "openers.jsonl", [{"name": "free", "text": "", "weight": 1},
                                                     {"name": "py", "text": "Write a Python function that"}])
    acme = "You are the support desk of Acme Widgets."
    sys_file = write_openers(tmp_path / "systems.jsonl", [{"name": "default", "text": "", "weight": 1},
                                                          {"name": "acme", "text": acme, "weight": 2}])
    mix = ["--mix", "data/default/train_prompts.jsonl", "--mix-ratio", "0.2"]
    files = []
    for slots in (1, 7):
        out = tmp_path / f"s{slots}.jsonl"
        syn.main(["--model", str(qwen3_dir), "--num", "30", "--out", str(out), "--prompt-tokens", "24",
                  "--max-new-tokens", "16", "--batch-size", str(slots), "--openers", str(ops),
                  "--systems", str(sys_file), *mix])
        files.append((by_id(out), by_id(syn.rejected_path(out))))
    assert files[0] == files[1]
    rows = list(files[0][0].values()) + list(files[0][1].values())
    names = {r["id"]: r["system_name"] for r in rows}
    assert set(names.values()) == {"default", "acme"}
    assert {r["id"].split("/")[0] for r in rows if r["system_name"] == "acme"} == {"self", "mix"}
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        if r["system_name"] == "acme":
            assert r["messages"][0] == {"role": "system", "content": acme} and roles.count("system") == 1
        else:
            assert "system" not in roles
    tok = cached_tokenizer(str(qwen3_dir))
    writes = [tok.decode(p) for p in scripted.engines[0].prompts if tok.decode(p).endswith("<|im_start|>user\n")]
    assert any(acme + "<|im_end|>\n<|im_start|>user\n" in w for w in writes)
    assert any("<|im_start|>system" not in w for w in writes)
    # the opener draw has its own hash: a run without --systems draws the same openers
    syn.main(["--model", str(qwen3_dir), "--num", "30", "--out", str(tmp_path / "plain.jsonl"), "--prompt-tokens",
              "24", "--max-new-tokens", "16", "--openers", str(ops), *mix])
    plain = {**by_id(tmp_path / "plain.jsonl"), **by_id(syn.rejected_path(tmp_path / "plain.jsonl"))}
    shared = set(plain) & set(names)
    assert len(shared) >= 20 and all(plain[i].get("opener") == files[0][0].get(i, files[0][1].get(i)).get("opener")
                                     for i in shared)
    draws = [syn.draw_system(syn.read_systems(sys_file), 0, "self", i).name for i in range(3000)]
    assert abs(draws.count("acme") / 3000 - 2 / 3) < 0.035                     # the weights, within 4 SEs
    write_openers(sys_file, [{"text": "You are terse."}])
    with pytest.raises(SystemExit, match="systems: was"):
        syn.main(["--model", str(qwen3_dir), "--num", "30", "--out", str(tmp_path / "s1.jsonl"), "--prompt-tokens",
                  "24", "--max-new-tokens", "16", "--openers", str(ops), "--systems", str(sys_file), *mix])
    with pytest.raises(SystemExit) as e:
        syn.main(["--model", str(qwen3_dir), "--num", "3", "--out", str(tmp_path / "x.jsonl"), "--system", "Hi.",
                  "--systems", str(sys_file)])
    assert e.value.code == 2


def test_systems_file_errors_and_the_shipped_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    for line in ('{"name": "x"}', '{"text": 3}', '{"text": "ok", "weight": -1}', '["a list"]', "not json"):
        bad.write_text('{"text": "fine"}\n' + line + "\n")
        with pytest.raises(SystemExit, match="bad.jsonl:2 is not a system prompt"):
            syn.read_systems(bad)
    bad.write_text("\n\n")
    with pytest.raises(SystemExit, match="holds no system prompt"):
        syn.read_systems(bad)
    shipped = syn.read_systems(Path("data/default/systems.jsonl"))
    assert len({s.name for s in shipped}) == len(shipped) >= 25 and any(s.text == "" for s in shipped)
    # the broad evaluation set's system prompts are not among those the shipped file trains on
    broad = [json.loads(line) for line in Path("data/default/eval_broad.jsonl").read_text().splitlines()]
    held = {m["content"].strip() for r in broad for m in r["messages"] if m["role"] == "system"}
    assert held and not held & {s.text for s in shipped}


def test_attempts_cap_and_changed_settings(tmp_path, qwen3_dir, scripted, capsys):
    scripted.never_stop = True  # every user turn runs into --prompt-tokens
    out = tmp_path / "t.jsonl"
    with pytest.raises(syn.Incomplete) as short:
        synth(qwen3_dir, out, 5)
    stats = short.value.summary
    assert stats["kept"] == 0 and stats["rejected"]["truncated_user"] == 5 * syn.ATTEMPTS_PER_ROW
    assert "stopped short at 0 of 5 rows after 15 candidates" in str(short.value)
    assert f"--batch-size 4 --attempts-per-row {2 * syn.ATTEMPTS_PER_ROW}" in str(short.value)
    with pytest.raises(SystemExit, match="seed: was 0, now 1"):
        synth(qwen3_dir, out, 5, "--seed", 1)
    with pytest.raises(SystemExit):
        synth(qwen3_dir, out, 5, "--mix-ratio", 0.1)
    assert "--mix and --mix-ratio go together" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2: the real model

@pytest.mark.slow  # 20-30 s on 2 shared cores: two chunks of SmolLM2 decoding through the engine on the CPU
def test_smollm2_rows_prepare_accepts(tmp_path):
    if not (SMOLLM2_DIR / "model.safetensors").exists():
        pytest.skip(f"no SmolLM2 folder at {SMOLLM2_DIR}: build it with `.venv/bin/python -m tools.smollm2`")
    from data.prepare import prepare
    out = tmp_path / "smol.jsonl"
    stats = syn.main(["--model", str(SMOLLM2_DIR), "--num", "6", "--out", str(out), "--prompt-tokens", "40",
                      "--max-new-tokens", "8", "--temperature", "0.6", "--device", "cpu", "--attempts-per-row", "5",
                      "--batch-size", "16"])
    rows = read_jsonl(out)
    assert len(rows) == stats["kept"] == 6 and len({r["id"] for r in rows}) == 6
    assert len({F.normalize(r["messages"][0]["content"]) for r in rows}) == 6
    assert stats["length_capped"] == sum("length" in r["finish_reasons"] for r in rows)
    prepared = prepare([out], SMOLLM2_DIR, tmp_path / "prepared", max_len=512, num_proc=1)
    assert prepared["samples"] == 6 and prepared["skipped"] == {}


def test_self_eval_prompts_tool(tmp_path, qwen3_dir, scripted):
    """tools/self_eval_prompts: N user turns in the eval file format, categorised by opener; never overwrites."""
    from tools import self_eval_prompts
    ops = write_openers(tmp_path / "openers.jsonl", [{"name": "free", "text": "", "weight": 1},
                                                     {"name": "ex", "text": "Explain", "weight": 1}])
    out = tmp_path / "eval_self.jsonl"
    rows = self_eval_prompts.main(["--model", str(qwen3_dir), "--num", "12", "--openers", str(ops), "--out", str(out),
                                   "--prompt-tokens", "24"])
    assert read_jsonl(out) == rows and len(rows) == 12 and len({r["id"] for r in rows}) == 12
    assert {r["category"] for r in rows} == {"self/free", "self/ex"}
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in rows)
    assert all(r["messages"][0]["content"].startswith("Explain") for r in rows if r["category"] == "self/ex")
    with pytest.raises(SystemExit, match="exists"):
        self_eval_prompts.main(["--model", str(qwen3_dir), "--out", str(out)])


# ---------------------------------------------------------------------------------------------------------------
# what a new user gets wrong: the output is kept, the message names the fix

def test_an_out_of_other_json_is_refused_and_left_as_it_is(tmp_path, qwen3_dir, scripted):
    """A one-line JSON file (what json.dump writes: a prompt file given as --out by mistake) is not a torn last
    line: it is refused, byte for byte as it was. A torn last line of real rows is still cut."""
    for obj in ([{"id": "p1", "messages": [user("hi")]}], {"id": "chatterbot/x/1", "messages": [user("hi")]}):
        out = tmp_path / "prompts.json"
        out.write_text(json.dumps(obj))
        before = out.read_bytes()
        with pytest.raises(SystemExit, match=r"prompts.json:1 is JSON but not a row that synthesize writes.*another "
                                             r"output path"):
            synth(qwen3_dir, out, 4)
        assert out.read_bytes() == before and not syn.stats_path(out).exists()


def test_a_one_line_text_file_as_out_is_refused_and_a_torn_first_row_is_cut(tmp_path, qwen3_dir, scripted):
    """A file whose only line is not JSON is someone's file: refused, left as it is. The same torn line where the
    stats file says synthesize wrote it (killed during its first row) is cut and the rows made again."""
    out = tmp_path / "notes.txt"
    out.write_text("remember to buy milk")
    with pytest.raises(SystemExit, match=r"notes.txt is not an output of synthesize.*give another output path"):
        synth(qwen3_dir, out, 4)
    assert out.read_text() == "remember to buy milk" and not syn.stats_path(out).exists()
    out = tmp_path / "s.jsonl"
    synth(qwen3_dir, out, 4)
    rows = out.read_bytes()
    out.write_bytes(rows[: len(rows.splitlines()[0]) // 2])
    syn.rejected_path(out).write_text("")
    assert synth(qwen3_dir, out, 4)["kept"] == 4 and out.read_bytes() == rows


def test_synthesize_and_regenerate_refuse_each_others_outputs(tmp_path, qwen3_dir, scripted):
    """Each tool recognises the other's output by the files beside it (synthesize's stats and rejected files,
    regenerate's stats and errors files) and refuses it before any request, leaving it as it is: appended rows
    of the other kind would leave a file its maker can no longer resume."""
    from data import regenerate as regen
    out = tmp_path / "s.jsonl"
    synth(qwen3_dir, out, 4)
    before = out.read_bytes()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p", "messages": [user("q")]}) + "\n")
    with pytest.raises(SystemExit, match=r"s.jsonl is an output of data.synthesize .*give another output path"):
        regen.main(["--input", str(prompts), "--output", str(out), "--endpoint", "http://127.0.0.1:9"])
    assert out.read_bytes() == before
    syn.stats_path(out).unlink()   # the rejected file alone says it too
    with pytest.raises(SystemExit, match=r"is an output of data.synthesize \(.*rejected.jsonl says so\)"):
        regen.main(["--input", str(prompts), "--output", str(out), "--endpoint", "http://127.0.0.1:9"])
    regen_out = tmp_path / "r.jsonl"
    regen_out.write_text(json.dumps({"id": "self/0", "messages": [user("q"), assistant("a")],
                                     "finish_reasons": ["stop"]}) + "\n")
    Path(f"{regen_out}.errors.jsonl").write_text("")
    for stats in (None, {"tool": "regenerate", "config": {}}):
        if stats:
            syn.stats_path(regen_out).write_text(json.dumps(stats))
        with pytest.raises(SystemExit, match=r"r.jsonl is an output of data.regenerate"):
            synth(qwen3_dir, regen_out, 4)
    assert len(read_jsonl(regen_out)) == 1 and not syn.rejected_path(regen_out).exists()


def test_a_second_run_on_one_out_is_refused_naming_the_holder(tmp_path, qwen3_dir, scripted, monkeypatch, capsys):
    """Two runs on one --out at once would write every row twice: the second is refused with the first's pid, host
    and start time, and changes nothing; the first ends with --num distinct rows. A lock file naming a run that is
    gone (killed) is taken over with a message."""
    import socket
    out = tmp_path / "s.jsonl"
    run, raced, refusals = ScriptedEngine.run, [], []

    def run_and_race(self, pending, **kw):
        for i, result in enumerate(run(self, pending, **kw)):
            if i == 5 and not raced:   # once: a second run that got in would race here itself
                raced.append(i)
                before = out.read_bytes()
                with pytest.raises(SystemExit) as second:
                    synth(qwen3_dir, out, 40)
                refusals.append(str(second.value))
                assert out.read_bytes() == before
            yield result
    monkeypatch.setattr(ScriptedEngine, "run", run_and_race)
    synth(qwen3_dir, out, 40)
    assert len(refusals) == 1 and "is being written by another run" in refusals[0], refusals
    assert f"pid {os.getpid()} on host {socket.gethostname()}, started" in refusals[0]
    assert len(by_id(out)) == 40 and syn.resume.lock_path(out).read_text() == ""  # released at the end
    monkeypatch.setattr(ScriptedEngine, "run", run)
    dead = tmp_path / "d.jsonl"
    syn.resume.lock_path(dead).write_text("synthesize pid 4000000 on host gone, started yesterday\n")
    synth(qwen3_dir, dead, 5)
    assert "names a run that is gone (synthesize pid 4000000" in capsys.readouterr().err
    assert len(by_id(dead)) == 5


def test_a_run_by_a_symbolic_link_to_a_held_out_is_refused(tmp_path, qwen3_dir, scripted):
    """The lock is the file's, not the path's: a second run that reaches a held --out through a symbolic link is
    refused and changes nothing; a later run by the link resumes the file's rows, with its stats file."""
    out, link = tmp_path / "s.jsonl", tmp_path / "link.jsonl"
    link.symlink_to(out)
    synth(qwen3_dir, out, 4)
    before = out.read_bytes()
    with syn.resume.locked(out, "synthesize"):
        with pytest.raises(SystemExit, match="is being written by another run"):
            synth(qwen3_dir, link, 8)
    assert out.read_bytes() == before
    assert synth(qwen3_dir, link, 8)["kept"] == 8 and out.read_bytes().startswith(before)
    assert not Path(f"{link}.stats.json").exists() and len(by_id(out)) == 8


@pytest.fixture
def model_dir(tmp_path, qwen3_dir):
    """The tokenizer with a config.json and a (tiny, fake) model.safetensors: a model folder as far as synthesize
    reads one before the engine (replaced by the scripted one) loads it."""
    from safetensors.torch import save_file
    import torch
    d = tmp_path / "model"
    shutil.copytree(qwen3_dir, d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 512}))
    save_file({"w": torch.zeros(64)}, d / "model.safetensors")
    return d


def test_other_weights_behind_the_same_config_refuse_a_resume(tmp_path, model_dir, scripted, capsys):
    """The weights' fingerprint (safetensors header and first MiB, as the trainer's) is part of the settings: other
    weights of the same shapes behind the same config.json refuse a resume. A stats file written before the
    fingerprint existed resumes with a note, and records it."""
    from safetensors.torch import save_file
    import torch
    out = tmp_path / "s.jsonl"
    first = synth(model_dir, out, 6)
    assert first["config"]["model_weights"] == syn.resume.weights_fingerprint(model_dir)
    stats = json.loads(syn.stats_path(out).read_text())
    del stats["config"]["model_weights"]          # as an older data.synthesize wrote it
    syn.stats_path(out).write_text(json.dumps(stats))
    again = synth(model_dir, out, 8)
    assert "predates the weights' fingerprint" in capsys.readouterr().err and again["kept"] == 8
    assert json.loads(syn.stats_path(out).read_text())["config"]["model_weights"] == first["config"]["model_weights"]
    save_file({"w": torch.ones(64)}, model_dir / "model.safetensors")   # same header, other weights
    rows = out.read_bytes()
    with pytest.raises(SystemExit, match="model_weights: was .* written by another model"):
        synth(model_dir, out, 10)
    assert out.read_bytes() == rows


def test_a_changed_mix_ratio_on_resume_makes_exactly_num(tmp_path, qwen3_dir, scripted, capsys):
    """20 rows at --mix-ratio 0.5 (10 mix), then --num 40 at 0.1 (4 of 40 would be mix): the 10 mix rows stay and
    the self stream makes 30, so --out holds 40 rows, not 46."""
    mix = ["--mix", "data/default/train_prompts.jsonl"]
    out = tmp_path / "m.jsonl"
    synth(qwen3_dir, out, 20, *mix, "--mix-ratio", 0.5)
    stats = synth(qwen3_dir, out, 40, *mix, "--mix-ratio", 0.1)
    rows = by_id(out)
    assert len(rows) == stats["kept"] == 40
    assert sum(r["source"] != "self" for r in rows.values()) == 10
    assert "this run makes only what adds up to --num 40 (self 30, mix 10)" in capsys.readouterr().err


def test_out_in_a_new_folder_and_bad_paths(tmp_path, qwen3_dir, model_dir, scripted):
    """The README's recipe on a fresh clone: --out data/synth/x.jsonl in folders that do not exist yet. A folder as
    --out, a non-UTF-8 openers file and an opener cap past the model's positions get messages, not tracebacks."""
    out = tmp_path / "data" / "synth" / "x.jsonl"
    assert synth(qwen3_dir, out, 3)["kept"] == 3 and len(by_id(out)) == 3
    with pytest.raises(SystemExit) as folder:
        synth(qwen3_dir, tmp_path / "data", 3)
    assert folder.value.code == 2
    ops = tmp_path / "ops.jsonl"
    ops.write_bytes(b'{"text": "Explain \xff"}\n')
    with pytest.raises(SystemExit, match="ops.jsonl is not UTF-8 text"):
        synth(qwen3_dir, tmp_path / "o.jsonl", 3, "--openers", ops)
    write_openers(ops, [{"name": "huge", "text": "Write", "prompt_tokens": 10 ** 9}])
    with pytest.raises(SystemExit, match=r"opener 'huge'.*prompt_tokens.*max_position_embeddings 512"):
        synth(model_dir, tmp_path / "o.jsonl", 3, "--openers", ops)
    with pytest.raises(SystemExit, match="--max-new-tokens 4,000.*max_position_embeddings 512"):
        syn.main(["--model", str(model_dir), "--num", "3", "--out", str(tmp_path / "o.jsonl"),
                  "--max-new-tokens", "4000"])


def test_rows_written_twice_are_refused_not_counted(tmp_path, qwen3_dir, scripted):
    """A file two runs wrote at once (before the lock) holds ids twice: a resume names them instead of counting the
    copies as rows."""
    out = tmp_path / "s.jsonl"
    synth(qwen3_dir, out, 6)
    out.write_bytes(out.read_bytes() + out.read_bytes().splitlines(keepends=True)[2])
    before = out.read_bytes()
    with pytest.raises(SystemExit, match="hold 1 id\\(s\\) more than once .*Keep the first row of each id"):
        synth(qwen3_dir, out, 10)
    assert out.read_bytes() == before


def test_a_template_without_a_system_role_refuses_system_prompts(no_system_target):
    tok = syn.load_tokenizer(str(no_system_target))
    with pytest.raises(SystemExit, match=r"refuses a system turn \(TemplateError: System role not supported\); drop "
                                         r"--system / --systems"):
        syn.check_system_role(tok, ["", "You are terse."])
    assert syn.check_system_role(tok, ["", ""]) is None     # the template's default only: nothing asked of it
