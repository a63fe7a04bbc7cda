"""data.filters as a command: it reads a conversation as data.prepare does (role aliases, ShareGPT, bad UTF-8), and
its outputs never destroy its input or the previous run's pair (OUT and its stats are renamed into place)."""
import json
import os
import re

import pytest

from data import filters as F
from data.chat import RowError, normalize_messages

QUESTION = "How do I sort a list of tuples by the second element in Python without writing a loop myself?"


def lines(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def test_roles_are_read_as_prepare_reads_them(tmp_path):
    """`User` / `Assistant`, ShareGPT `human` / `gpt` (under `conversations` or as `from`/`value` in `messages`)
    are conversations data.prepare trains on: data.filters keeps them. A line that is not UTF-8, which data.prepare
    skips as bad_encoding, is rejected with that reason, not kept with replacement characters."""
    rows = [
        {"messages": [{"role": "User", "content": QUESTION}, {"role": "Assistant", "content": "Use sorted()."}]},
        {"conversations": [{"from": "human", "value": "What is the tallest mountain on Earth, and who measured it?"},
                           {"from": "gpt", "value": "Everest."}]},
        {"messages": [{"from": "human", "value": "Name a fruit that is yellow and long, which monkeys like."},
                      {"from": "gpt", "value": "A banana."}]},
    ]
    for r in rows:
        assert normalize_messages(r)  # data.prepare's reading accepts each
    bad = json.dumps({"messages": [{"role": "user", "content": "caf\udce9 ol\udce9"},
                                   {"role": "assistant", "content": "Yes."}]}, ensure_ascii=False)
    bad = bad.encode("utf-8", "surrogateescape")  # \xe9 bytes: Latin-1, not UTF-8
    unknown = {"messages": [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "upon"}]}
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(lines(*rows, bad, unknown))
    stats = F.main([str(inp), "--out", str(tmp_path / "out.jsonl")])
    assert stats["kept"] == 3, stats
    assert stats["rejected"]["bad_encoding"] == 1 and stats["rejected"]["unknown_role"] == 1
    kept = (tmp_path / "out.jsonl").read_text(encoding="utf-8")
    assert "\ufffd" not in kept and [json.loads(x) for x in kept.splitlines()] == rows
    with pytest.raises(RowError, match="unknown_role"):
        normalize_messages(unknown)


def test_outputs_that_are_the_input_are_refused(tmp_path, capsys):
    """--out hard-linked to the input, --stats naming the input or --out: refused with exit status 2 before
    anything is written; the input is unchanged."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(lines({"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "x"}]}))
    before = inp.read_bytes()
    os.link(inp, tmp_path / "link.jsonl")
    for argv, says in (
            (["--out", str(tmp_path / "link.jsonl")], "is the input"),
            (["--out", str(tmp_path / "o.jsonl"), "--stats", str(inp)], "--stats .* is the input"),
            (["--out", str(tmp_path / "o.jsonl"), "--stats", str(tmp_path / "o.jsonl")], "are the same file"),
            (["--out", str(tmp_path)], "is a folder")):
        with pytest.raises(SystemExit) as e:
            F.main([str(inp), *argv])
        assert e.value.code == 2
        assert re.search(says, capsys.readouterr().err), says
        assert inp.read_bytes() == before and not (tmp_path / "o.jsonl").exists()


def test_a_failed_run_leaves_the_previous_outputs(tmp_path):
    """A run that stops on a bad line leaves the previous run's OUT and stats as they were, and no temporary file."""
    good = {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Use sorted()."}]}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(lines(good))
    F.main([str(inp), "--out", str(out)])
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    other = {"messages": [{"role": "user", "content": "Name a fruit that is red and round, and grows on trees."},
                          {"role": "assistant", "content": "An apple."}]}
    inp.write_bytes(lines(other, b"[1]"))
    with pytest.raises(SystemExit, match="in.jsonl:2"):
        F.main([str(inp), "--out", str(out)])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p != inp} == \
           {k: v for k, v in files.items() if k != "in.jsonl"}


def test_heldout_prompts_read_the_broad_sets_multi_turn_rows():
    """The broad set's multi-turn rows hold an answer placeholder (content null, filled at evaluation time) between
    their two user turns: both user turns are held out, and the placeholder is no malformed row."""
    rows = [json.loads(line) for line in F.HELDOUT_BROAD.read_text().splitlines()]
    multi = [r for r in rows if r["category"] == "multiturn"]
    assert multi and all(m["content"] is None for r in multi for m in r["messages"] if m["role"] == "assistant")
    held = set(F.heldout_prompts([F.HELDOUT_BROAD]))
    assert all(m["content"] in held for r in rows for m in r["messages"] if m["role"] == "user")
