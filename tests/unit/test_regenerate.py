"""data/regenerate.py: input parsing shared with training, resume without duplicates, torn-line repair, retries and
the errors file, through a fake OpenAI-compatible server on loopback and through local `generate` on a tiny random
Llama with the SmolLM2 tokenizer. CPU, a few seconds."""
import hashlib
import json
import shutil
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import SMOLLM2_DIR
from data import openai_client as oc
from data import regenerate as regen
from data.chat import RowError, normalize_messages

QWEN3_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_tokenizer"


def write_jsonl(path: Path, rows) -> Path:
    """rows: dicts (dumped) or raw bytes lines (written as they are)."""
    with open(path, "wb") as f:
        for r in rows:
            f.write((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    """The real Qwen3 tokenizer and chat template from the fixture (tokenizer.json stored xz-compressed)."""
    import lzma
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("qwen3_tokenizer")
    (d / "tokenizer.json").write_bytes(lzma.open(QWEN3_FIXTURE / "tokenizer.json.xz").read())
    shutil.copy(QWEN3_FIXTURE / "tokenizer_config.json", d)
    return AutoTokenizer.from_pretrained(d)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(oc, "RETRY_BACKOFF_S", 0.0)


# ---------------------------------------------------------------------------------------------------------------
# parsing: the same formats and reasons as training

SYSTEM = {"role": "system", "content": "Be terse."}
CHAT = [SYSTEM, user("q1"), assistant("a1"), user("q2"), assistant("a2")]


def test_prompt_agrees_with_training():
    sharegpt = {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                   "value": m["content"]} for m in CHAT]}
    for row in ({"messages": CHAT}, sharegpt):
        history, asks = regen.prompt_turns(row, "last")
        assert history + asks == normalize_messages(row)[:-1]
        assert regen.prompt_turns(row, "all") == ([SYSTEM], [user("q1"), user("q2")])
    empty_answer = {"messages": [user("q"), assistant("")]}  # the answer slot of a prompt file: not read
    assert regen.prompt_turns(empty_answer, "all") == ([], [user("q")])
    tool = {"messages": [user("w?"), {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
            "function": {"name": "wx", "arguments": {}}}]}, {"role": "tool", "content": "sunny"}, assistant("old")]}
    history, asks = regen.prompt_turns(tool, "last")
    assert [m["role"] for m in history] == ["user", "assistant"] and asks == [{"role": "tool", "content": "sunny"}]


@pytest.mark.parametrize("row, reason", [
    ("[1, 2]", "malformed_json"),
    ({"text": "hi"}, "missing_messages"),
    ({"messages": []}, "missing_messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
    ({"messages": [user(" ")]}, "empty_content"),
    ({"messages": [user(["x"])]}, "non_string_content"),
    ({"messages": [assistant("a")]}, "no_user_turn"),
    ({"messages": [SYSTEM]}, "no_user_turn"),
    ({"messages": [user("w?"), {"role": "tool", "content": "sunny"}]}, "tool_turns"),  # turns=all only
])
def test_prompt_row_errors(row, reason):
    with pytest.raises(RowError) as e:
        regen.prompt_turns(json.loads(row) if isinstance(row, str) else row, "all")
    assert e.value.reason == reason


def test_unreadable_rows_skipped_and_missing_input(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "ok", "messages": [user("hi")]},
        b'{"id": "torn", "messages": [',
        b"",
        b'{"id": "latin1", "messages": [{"role": "user", "content": "caf\xe9"}]}',
        {"id": "role", "messages": [{"role": "wizard", "content": "x"}]},
        {"id": "ok", "messages": [user("again")]},
    ])
    prompts, skipped, dupes = regen.read_prompts(inp, "all")
    assert [regen.row_id(p[0]) for p in prompts] == ["ok"]
    assert skipped == {"malformed_json": 1, "bad_encoding": 1, "unknown_role": 1} and dupes == 1
    assert f"{inp}:2" in capsys.readouterr().err  # the file:line of a skipped row is shown
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SystemExit, match="nope.jsonl"):
        regen.main(["--input", str(missing), "--output", str(tmp_path / "o.jsonl"), "--endpoint", "http://127.0.0.1:9"])


def test_an_output_that_is_not_regenerate_output_is_refused(tmp_path):
    """--output naming a prompt file (one line of JSON, as json.dump writes it, or prompt rows) or the --input
    itself (a hard link too): refused before any request, the file byte for byte as it was."""
    inp = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [user("alpha")]}])
    server = ["--endpoint", "http://127.0.0.1:9"]  # never reached
    for obj in ([{"id": "a", "messages": [user("alpha")]}], {"id": "a", "messages": [user("alpha")]}):
        out = tmp_path / "prompts.json"
        out.write_text(json.dumps(obj))
        with pytest.raises(SystemExit, match="prompts.json:1 is JSON but not a row that regenerate writes"):
            regen.main(["--input", str(inp), "--output", str(out), *server])
        assert out.read_text() == json.dumps(obj)
    before = inp.read_bytes()
    (tmp_path / "link.jsonl").hardlink_to(inp)
    for out in (inp, tmp_path / "link.jsonl", tmp_path):   # the input, a hard link to it, a folder
        with pytest.raises(SystemExit) as e:
            regen.main(["--input", str(inp), "--output", str(out), *server])
        assert e.value.code == 2 and inp.read_bytes() == before


def test_a_one_line_text_file_as_output_is_refused_not_cut(tmp_path):
    """A file whose only line is not JSON (no final newline) is someone's file, not a torn row: refused, byte for
    byte as it was, the message naming the file and the fix."""
    inp = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [user("alpha")]}])
    out = tmp_path / "notes.txt"
    out.write_text("remember to buy milk")
    with pytest.raises(SystemExit, match=r"notes.txt is not an output of regenerate.*give another output path"):
        regen.main(["--input", str(inp), "--output", str(out), "--endpoint", "http://127.0.0.1:9"])
    assert out.read_text() == "remember to buy milk"


@pytest.mark.parametrize("flag,value", [("--limit", "-1"), ("--retries", "0"), ("--batch-size", "-4"),
                                        ("--concurrency", "0")])
def test_bad_counts_are_refused(tmp_path, capsys, flag, value):
    """A negative --limit processed nothing and exited 0; --retries 0 never tried; a negative --batch-size: each is
    a usage error (exit status 2) naming the flag."""
    inp = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [user("alpha")]}])
    with pytest.raises(SystemExit) as e:
        regen.main(["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--endpoint", "http://127.0.0.1:9",
                    flag, value])
    assert e.value.code == 2 and f"{flag} {value} must be" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_hub_id_model_absent_from_the_cache_names_the_cache(tmp_path, capsys, monkeypatch):
    """--model org/name is looked up in the local Hugging Face cache only; absent, a usage error naming the cache
    folder and how to fill it, before anything is written (data.synthesize reads --model / --tokenizer alike)."""
    from data import synthesize
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    inp = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [user("alpha")]}])
    for main, args in ((regen.main, ["--input", str(inp), "--output", str(tmp_path / "o.jsonl")]),
                       (synthesize.main, ["--num", "2", "--out", str(tmp_path / "s.jsonl")])):
        with pytest.raises(SystemExit) as e:
            main([*args, "--model", "Qwen/Qwen3-8B"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"not in the Hugging Face cache {tmp_path / 'hub'}" in err, err
        assert "hf download Qwen/Qwen3-8B" in err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "s.jsonl").exists()


# ---------------------------------------------------------------------------------------------------------------
# HTTP backend against a fake OpenAI-compatible server

def answer(text: str) -> str:
    return "re:" + hashlib.sha1(text.encode()).hexdigest()[:8]


class FakeServer:
    """/v1/models listing one model, "tgt"; /v1/chat/completions answering `answer(last user content)`. Requests are
    counted per conversation (its first user turn), the probe's apart (`probes`); `fail_once` prompts get one HTTP
    503 first, `fail_always` prompts only 503s (transient errors); "long" prompts end with finish_reason "length";
    `reasoning` maps a last user content to (field, text) sent beside the answer, as a server with a reasoning
    parser does."""

    def __init__(self):
        self.requests, self.bodies, self.probes = Counter(), [], []
        self.fail_once, self.fail_always = {"flaky"}, {"broken"}
        self.reasoning = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.reply({"object": "list", "data": [{"id": "tgt"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                users = [m["content"] for m in body["messages"] if m["role"] == "user"]
                if body["messages"] == oc.PROBE_MESSAGES:
                    server.probes.append(body)
                    return self.reply({"choices": [{"message": {"content": "Hi"}, "finish_reason": "length"}]})
                with server.lock:
                    server.bodies.append(body)
                    server.requests[users[0]] += 1
                    fail = users[0] in server.fail_always or (users[0] in server.fail_once
                                                              and server.requests[users[0]] == 1)
                if self.path != "/v1/chat/completions" or fail:
                    self.send_error(503 if fail else 404)
                    return
                message = {"role": "assistant", "content": " " + answer(users[-1]) + "\n"}
                if users[-1] in server.reasoning:
                    field, text = server.reasoning[users[-1]]
                    message[field] = text
                self.reply({"choices": [{"message": message,
                                         "finish_reason": "length" if "long" in users[-1] else "stop"}]})

            def reply(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


NOID = {"messages": [user("noid")]}
PROMPTS = [
    {"id": "a", "category": "x", "messages": [user("alpha")]},
    {"id": "b", "messages": CHAT},                                             # multi-turn with a system prompt
    {"id": "c", "conversations": [{"from": "human", "value": "gamma"}, {"from": "gpt", "value": "old"}]},
    {"id": "flaky", "messages": [user("flaky")]},                              # 503 on its first request
    {"id": "broken", "messages": [user("broken")]},                            # always 503
    {"id": "long", "messages": [user("long")]},                                # finish_reason "length"
    NOID,                                                                      # id from the content hash
    b'{"id": "bad", "messages": [',                                            # unreadable: skipped, counted
    {"id": "a", "messages": [user("alpha again")]},                            # duplicate id: answered once
]
NOID_ID = regen.row_id(NOID)


def run(inp, out, server, *extra, retries=2):
    return regen.main(["--input", str(inp), "--output", str(out), "--endpoint", server.url, "--concurrency", "4",
                       "--retries", str(retries), *extra])


def by_id(out: Path) -> dict:
    rows = read_jsonl(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"duplicate ids in {out}: {ids}"
    return {r["id"]: r for r in rows}


def test_http_resume_retry_errors_torn_line(tmp_path, server):
    inp, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS), tmp_path / "regen.jsonl"
    errors = Path(str(out) + ".errors.jsonl")
    counts = run(inp, out, server)
    assert counts == {"done_before": 0, "todo": 7, "skipped": {"malformed_json": 1}, "duplicates": 1, "failed": 1,
                      "no_reasoning": 0}
    rows = by_id(out)
    assert set(rows) == {"a", "b", "c", "flaky", "long", NOID_ID}
    assert rows["a"]["messages"] == [user("alpha"), assistant(answer("alpha"))] and rows["a"]["category"] == "x"
    assert rows["b"]["messages"] == [SYSTEM, user("q1"), assistant(answer("q1")), user("q2"), assistant(answer("q2"))]
    assert rows["b"]["finish_reasons"] == ["stop", "stop"] and rows["long"]["finish_reasons"] == ["length"]
    assert rows["c"]["messages"] == [user("gamma"), assistant(answer("gamma"))] and "conversations" not in rows["c"]
    assert [e["id"] for e in read_jsonl(errors)] == ["broken"]
    assert server.requests == {"alpha": 1, "q1": 2, "gamma": 1, "flaky": 2, "broken": 2, "long": 1, "noid": 1}
    assert not any("chat_template_kwargs" in b for b in server.bodies)  # --thinking auto sends nothing

    # rerun: the done prompts cost no request, the failed one is tried again (and now succeeds)
    before = Counter(server.requests)
    server.fail_always.clear()
    counts = run(inp, out, server)
    assert counts["done_before"] == 6 and counts["todo"] == 1 and counts["failed"] == 0
    assert server.requests - before == {"broken": 1}
    assert set(by_id(out)) == {"a", "b", "c", "flaky", "long", "broken", NOID_ID}

    # torn last line: row "c" killed mid-write -> the fragment is cut off and "c" is redone, once
    lines = out.read_bytes().splitlines(keepends=True)
    torn = next(line for line in lines if json.loads(line)["id"] == "c")
    out.write_bytes(b"".join(line for line in lines if line != torn) + torn[: len(torn) // 2])
    before = Counter(server.requests)
    counts = run(inp, out, server)
    assert counts["todo"] == 1 and server.requests - before == {"gamma": 1}
    assert set(by_id(out)) == {"a", "b", "c", "flaky", "long", "broken", NOID_ID}
    assert run(inp, out, server)["todo"] == 0  # and nothing left to do

    # a bad line that is not the last one is not cut (the rows after it would go too): a clear stop instead
    good = out.read_bytes()
    out.write_bytes(b'{"id": "x", "mess\n' + good)
    with pytest.raises(SystemExit, match="regen.jsonl:1 "):
        run(inp, out, server)
    assert out.read_bytes() == b'{"id": "x", "mess\n' + good


def test_a_torn_first_row_of_its_own_run_is_cut(tmp_path, server):
    """A run killed while writing its very first row leaves one torn line: the errors file beside it says the output
    is regenerate's, so the line is cut and the row redone."""
    inp, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2]), tmp_path / "regen.jsonl"
    run(inp, out, server)
    first = out.read_bytes().splitlines()[0]
    out.write_bytes(first[: len(first) // 2])
    counts = run(inp, out, server)
    assert counts["done_before"] == 0 and counts["todo"] == 2 and set(by_id(out)) == {"a", "b"}


def test_two_paths_to_one_output_share_its_lock_and_duplicate_ids_are_refused(tmp_path, server):
    """A run that reaches a held --output through a symbolic link is refused (the lock is the file's, not the
    path's), and so are settings that differ from those of a run by another path; an output that holds an id twice
    (two runs wrote at once) is refused on resume, left as it is."""
    from data import resume
    inp, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2]), tmp_path / "regen.jsonl"
    (tmp_path / "link.jsonl").symlink_to(out)
    with resume.locked(out, "regenerate"):
        with pytest.raises(SystemExit, match="is being written by another run"):
            run(inp, tmp_path / "link.jsonl", server)
    assert not out.exists()
    run(inp, tmp_path / "link.jsonl", server)
    write_jsonl(inp, PROMPTS[:3])
    with pytest.raises(SystemExit, match="max_new_tokens: was 512, now 16"):   # its settings are the file's too
        run(inp, out, server, "--max-new-tokens", "16")
    write_jsonl(inp, PROMPTS[:2])
    rows = out.read_bytes()
    first = rows.splitlines(keepends=True)[0]   # 'a' or 'b': the rows are written in the order answers arrive
    out.write_bytes(rows + first)
    dup = json.loads(first)["id"]
    with pytest.raises(SystemExit, match=rf"holds 1 id\(s\) more than once \(e.g. '{dup}'\).*keep the first row"):
        run(inp, out, server)
    assert out.read_bytes() == rows + rows.splitlines(keepends=True)[0]


def test_complete_last_row_without_newline_is_kept(tmp_path, server):
    inp, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:3]), tmp_path / "regen.jsonl"
    run(inp, out, server)
    out.write_bytes(out.read_bytes().rstrip(b"\n"))  # e.g. saved by an editor: every row complete, no final newline
    before = Counter(server.requests)
    assert run(inp, out, server)["todo"] == 0 and server.requests == before
    assert set(by_id(out)) == {"a", "b", "c"}
    server.requests.clear()
    write_jsonl(inp, PROMPTS[:4])  # a new prompt appended after the repaired row is a row of its own
    assert run(inp, out, server)["todo"] == 1 and set(by_id(out)) == {"a", "b", "c", "flaky"}


def test_http_keeps_reasoning(tmp_path, server, qwen3_tokenizer):
    from data.chat import render, tokenize_chat
    rows = [{"id": "rc", "messages": [user("why")]}, {"id": "r", "messages": [user("how")]},
            {"id": "none", "messages": [user("what")]}, {"id": "multi", "messages": [user("q1"), user("q2")]}]
    server.reasoning = {"why": ("reasoning_content", "\nBecause.\n"), "how": ("reasoning", "Like so."),
                        "q1": ("reasoning_content", "first")}  # "multi" thinks on its first turn only
    inp, out = write_jsonl(tmp_path / "prompts.jsonl", rows), tmp_path / "regen.jsonl"
    counts = run(inp, out, server, "--thinking", "on")
    assert counts["no_reasoning"] == 2 and counts["failed"] == 0  # "none" and "multi"
    got = by_id(out)
    assert got["rc"]["messages"][-1] == assistant(f"<think>\nBecause.\n</think>\n\n{answer('why')}")
    assert got["r"]["messages"][-1] == assistant(f"<think>\nLike so.\n</think>\n\n{answer('how')}")
    assert got["none"]["messages"][-1] == assistant(answer("what"))
    # Qwen3's template renders the stored row exactly as the server's message with its reasoning_content field
    served = [user("why"), {"role": "assistant", "content": answer("why"), "reasoning_content": "Because."}]
    assert render(qwen3_tokenizer, got["rc"]["messages"], True) == render(qwen3_tokenizer, served, True)
    ids, mask = tokenize_chat(qwen3_tokenizer, got["rc"]["messages"], 4096, enable_thinking=True)
    assert qwen3_tokenizer.decode([t for t, m in zip(ids, mask) if m]).startswith("<think>\nBecause.\n</think>")
    assert run(inp, tmp_path / "auto.jsonl", server)["no_reasoning"] == 0  # counted only with --thinking on


def test_http_turns_last(tmp_path, server):
    inp, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:3]), tmp_path / "regen.jsonl"
    run(inp, out, server, "--turns", "last")
    rows = by_id(out)
    assert rows["b"]["messages"] == CHAT[:-1] + [assistant(answer("q2"))]  # the history is kept verbatim
    assert rows["b"]["finish_reasons"] == ["stop"]
    assert rows["c"]["messages"] == [user("gamma"), assistant(answer("gamma"))]
    assert server.requests == {"alpha": 1, "q1": 1, "gamma": 1}  # one request per conversation


def test_http_systems_give_rows_without_one_a_system_prompt(tmp_path, server):
    """--systems: a row without a system message gets one drawn by weight from (seed, row id) alone, sent to the
    server and kept in the output; "" leaves the template's default; a row with its own keeps it; a bad file stops
    the run before any request."""
    acme = "You are the support desk of Acme Widgets."
    systems = write_jsonl(tmp_path / "systems.jsonl", [{"name": "default", "text": "", "weight": 1},
                                                        {"name": "acme", "text": acme, "weight": 2}])
    rows = [{"id": f"q{i}", "messages": [user(f"question {i}")]} for i in range(40)] + [PROMPTS[1]]
    inp = write_jsonl(tmp_path / "prompts.jsonl", rows)
    run(inp, tmp_path / "a.jsonl", server, "--systems", str(systems))
    out = by_id(tmp_path / "a.jsonl")
    got = {i: r["messages"][0]["content"] if r["messages"][0]["role"] == "system" else "" for i, r in out.items()}
    assert got["b"] == SYSTEM["content"]                                        # its own, not replaced
    drawn = [got[f"q{i}"] for i in range(40)]
    assert set(drawn) == {"", acme} and 18 <= drawn.count(acme) <= 36           # weight 2 of 3: ~27 of 40
    for i in range(40):
        assert out[f"q{i}"]["messages"][-2:] == [user(f"question {i}"), assistant(answer(f"question {i}"))]
    sent = {b["messages"][-1]["content"]: b["messages"][0] for b in server.bodies}
    assert all((sent[f"question {i}"] == {"role": "system", "content": acme}) == (drawn[i] == acme)
               for i in range(40))
    run(inp, tmp_path / "again.jsonl", server, "--systems", str(systems))      # the draw: (seed, id) alone
    assert by_id(tmp_path / "again.jsonl") == out
    run(inp, tmp_path / "seed1.jsonl", server, "--systems", str(systems), "--seed", "1")
    assert by_id(tmp_path / "seed1.jsonl") != out
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"text": "x", "weight": 0}])
    n = len(server.bodies)
    with pytest.raises(SystemExit, match="regenerate: .*bad.jsonl:2 is not a system prompt"):
        run(inp, tmp_path / "b.jsonl", server, "--systems", str(bad))
    assert len(server.bodies) == n


@pytest.mark.parametrize("thinking, sent", [("on", {"enable_thinking": True}), ("off", {"enable_thinking": False}),
                                            ("auto", None)])
def test_http_thinking_switch(tmp_path, server, thinking, sent):
    inp, out = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:1]), tmp_path / "regen.jsonl"
    server.url += "/v1"  # an endpoint given with its /v1 works too
    run(inp, out, server, "--thinking", thinking, "--served-model", "tgt", "--max-new-tokens", "7")
    (body,) = server.bodies
    assert body.get("chat_template_kwargs") == sent
    assert [p.get("chat_template_kwargs") for p in server.probes] == [sent]  # one probe, with the same template
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("tgt", 7, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# local backend

class FakeLocal:
    """generate() answers each conversation with its turn count; a batch holding "boom" raises (a template error)."""

    def __init__(self):
        self.batches = []

    def generate(self, batch):
        self.batches.append(len(batch))
        if any(m["content"] == "boom" for conv in batch for m in conv):
            raise RuntimeError("template error")
        return [(f"turn{len(conv) // 2}", "stop") for conv in batch]


def test_local_batch_failure_fails_one_row(tmp_path):
    prompts = [({"id": i}, [], [user(q) for q in qs]) for i, qs in enumerate([["x"], ["boom"], ["y", "z"], ["w"]])]
    sink = regen.Sink(tmp_path / "o.jsonl")
    regen.run_local(FakeLocal(), prompts, sink, batch_size=4, retries=2, progress=lambda n: None)
    sink.close()
    rows = by_id(tmp_path / "o.jsonl")
    assert set(rows) == {"0", "2", "3"} and sink.n_failed == 1
    assert rows["2"]["messages"] == [user("y"), assistant("turn0"), user("z"), assistant("turn1")]


def test_local_resume_matches_fresh_run(tmp_path, tiny_smollm2):
    inp = write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": "p0", "messages": [user("What is AI?")]},
        {"id": "p1", "messages": CHAT},
        {"id": "p2", "conversations": [{"from": "human", "value": "Tell me a joke about cats, please."}]},
        {"id": "p3", "messages": [user("Hi")]},
        {"id": "p4", "messages": [user("Name three colors."), assistant("old"), user("And two more?")]},
    ])

    def local(out, *extra):
        return regen.main(["--input", str(inp), "--output", str(out), "--model", str(tiny_smollm2), "--device", "cpu",
                           "--max-new-tokens", "4", "--batch-size", "2", *extra])

    fresh, resumed = tmp_path / "fresh.jsonl", tmp_path / "resumed.jsonl"
    local(fresh)
    assert local(resumed, "--limit", "3")["todo"] == 3  # "interrupted" after 3 prompts
    counts = local(resumed)
    assert counts["done_before"] == 3 and counts["todo"] == 2
    fresh_rows, resumed_rows = by_id(fresh), by_id(resumed)
    assert set(resumed_rows) == {f"p{i}" for i in range(5)}
    assert resumed_rows == fresh_rows  # greedy: the same answers whatever the batches were
    p1 = resumed_rows["p1"]["messages"]
    assert [m["role"] for m in p1] == ["system", "user", "assistant", "user", "assistant"]
    assert [p1[1]["content"], p1[3]["content"]] == ["q1", "q2"] and len(resumed_rows["p1"]["finish_reasons"]) == 2
    assert all(r in ("stop", "length") for row in resumed_rows.values() for r in row["finish_reasons"])
