"""data/default/eval_broad.jsonl: the shipped file is data.broad_eval's output, its categories are full, its rows
load in eval_dflash.py, and it is held out of training data (data/filters.py) and absent from the shipped training
prompts."""
import json

import pytest

from data import broad_eval
from data import filters as F
from data.sources import write_jsonl
from data.prompts import load_prompts, prompt_messages

MIN_PER_CATEGORY = 25


@pytest.fixture(scope="module")
def rows():
    return broad_eval.build()


def test_shipped_file_is_the_builders_output(rows, tmp_path):
    write_jsonl(rows, tmp_path / "eval_broad.jsonl")
    assert broad_eval.OUT.read_bytes() == (tmp_path / "eval_broad.jsonl").read_bytes(), \
        "data/default/eval_broad.jsonl is stale: rebuild it with `python -m data.broad_eval`"


def test_categories_sources_and_rows(rows):
    counts = {c: sum(r["category"] == c for r in rows) for c in broad_eval.CATEGORIES}
    assert set(r["category"] for r in rows) == set(broad_eval.CATEGORIES)
    assert all(n >= MIN_PER_CATEGORY for n in counts.values()), counts
    loaded = load_prompts(broad_eval.OUT)             # every row checks, ids unique
    assert [r["id"] for r in loaded] == [r["id"] for r in rows]
    source = broad_eval.read_jsonl(broad_eval.SOURCE)
    code = [r["id"] for r in rows if r["category"] == "code_complete"]
    assert code == [f"code_complete/HumanEval/{k}" for k in range(0, 164, broad_eval.HUMANEVAL_EVERY)]
    mt = {r["id"]: r for r in source if r["id"].startswith("mtbench/")}
    multi = [r for r in rows if r["category"] == "multiturn"]
    assert len(multi) == len(mt) == 40 and all(int(i.split("/")[1]) % 2 for i in mt)
    for r in multi:
        u1, placeholder, u2 = r["messages"]
        assert placeholder == {"role": "assistant", "content": None}
        assert [u1, u2] == mt[r["id"].removeprefix("multiturn/")]["messages"]
        assert prompt_messages(r) == r["messages"]     # the evaluator fills the placeholder


def test_system_rows(rows):
    """The system category: an app's system prompt, then one user request; no two share either."""
    system = [r for r in rows if r["category"] == "system"]
    assert len(system) == len(broad_eval.SYSTEM) >= MIN_PER_CATEGORY
    assert all([m["role"] for m in r["messages"]] == ["system", "user"] for r in system)
    for k in (0, 1):
        assert len({r["messages"][k]["content"] for r in system}) == len(system)
    assert all(prompt_messages(r) == r["messages"] for r in system)


def test_hand_written_prompts_are_not_near_duplicates_of_each_other(rows):
    filters = F.Filters()
    firsts = [r for r in rows if r["category"] in [*broad_eval.HAND_WRITTEN, "system"]]
    assert len(firsts) == sum(map(len, broad_eval.HAND_WRITTEN.values())) + len(broad_eval.SYSTEM)
    reasons = [(r["id"], filters.check(r)) for r in firsts]            # each admitted, then the next checked
    assert [(i, why) for i, why in reasons if why] == []


def test_no_broad_prompt_survives_the_filters_in_a_training_file(rows, tmp_path):
    """Every user turn of the set, as it is and as a near copy (a word dropped from a long one, case and spacing
    changed), written into a training file: data.filters (its default held-out list) keeps none of them."""
    assert F.HELDOUT_BROAD in F.HELDOUT_DEFAULTS
    turns = [t for r in rows for t in F.prompt_turns(r) if t.strip()]
    near = [" ".join(t.upper().split()[:-1]) for t in turns if len(t.split()) >= 20]
    train = tmp_path / "train.jsonl"
    write_jsonl([{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "Sure."}]}
                 for t in turns + near], train)
    stats = F.main([str(train), "--out", str(tmp_path / "kept.jsonl")])
    assert stats["kept"] == 0 and stats["rejected"]["heldout_copy"] + stats["rejected"]["heldout_near"] == \
        len(turns) + len(near), stats
    assert len(near) > 50


def test_shipped_training_prompts_hold_no_broad_prompt(rows):
    """data/default/train_prompts.jsonl and smollm2_regen.jsonl (the shipped prepared set's source): no user turn
    is a copy or near copy of a broad evaluation prompt."""
    filters = F.Filters(F.heldout_prompts([F.HELDOUT_BROAD]))
    for name in ("train_prompts.jsonl", "smollm2_regen.jsonl"):
        lines = (broad_eval.DEFAULT / name).read_text(encoding="utf-8").splitlines()
        hits = [(row["id"], t[:60]) for row in map(json.loads, lines) for t in F.user_turns(row)
                if filters.opener_reason({"messages": [{"role": "user", "content": t}]}, dedup=False)
                in ("heldout_copy", "heldout_near")]
        assert len(lines) > 2000 and hits == [], (name, hits)
