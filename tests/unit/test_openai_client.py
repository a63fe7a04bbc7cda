"""data/openai_client.py without a model: URL handling, error sorting, backoff, the probe's choice of the model, and
the pool's retries and failover, against small in-process HTTP stubs (tests/helpers/stub_server.py; the end-to-end
runs through the project's real server are tests/jobs/test_endpoint.py, data.regenerate stopped as a process is
tests/jobs/test_regenerate_jobs.py)."""
import json
import re
import socket
import threading
from collections import Counter, deque
from pathlib import Path

import pytest

from data import openai_client as oc
from server import dead_url
from stub_server import stubs  # noqa: F401 (a fixture)
from synth_cases import WORDS


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(oc, "RETRY_BACKOFF_S", 0.01)
    monkeypatch.setattr(oc, "RETRY_BACKOFF_MAX_S", 0.02)


def test_base_url_and_backoff():
    assert oc.base_url("http://h:1") == oc.base_url("http://h:1/") == oc.base_url("http://h:1/v1/") == "http://h:1/v1"
    assert oc.base_url("h:1") == oc.base_url(" h:1/v1 ") == "http://h:1/v1"   # vLLM users type host:port
    for bad in ("ftp://h:1", "http:///v1", ":8000"):
        with pytest.raises(ValueError, match="http"):
            oc.base_url(bad)
    waits = [oc.backoff_s(a) for a in range(10)]
    assert waits[:2] == [oc.RETRY_BACKOFF_S, 2 * oc.RETRY_BACKOFF_S] and max(waits) == oc.RETRY_BACKOFF_MAX_S
    assert waits == sorted(waits)


def test_endpoint_without_scheme_works_and_bad_server_flags_are_usage_errors(stubs, tmp_path, qwen3_dir, capsys):
    """`--endpoint 127.0.0.1:PORT` is taken as http://; an endpoint of another scheme and a --timeout that is not
    above 0 are usage errors (exit status 2) naming the fix, in both tools, before anything is written."""
    from data import regenerate as regen
    from data import synthesize as syn
    s = stubs()
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"id": "p", "messages": [{"role": "user", "content": "q"}]}) + "\n")
    regen.main(["--input", str(prompts), "--output", str(out), "--endpoint", s.url.removeprefix("http://")])
    assert json.loads(out.read_text())["messages"][-1]["content"] == "q@s"
    for extra, said in ((["--endpoint", "ftp://h:1"], "--endpoint: endpoint 'ftp://h:1' is not an http"),
                        (["--endpoint", s.url, "--timeout", "-1"], "--timeout -1 must be more than 0"),
                        (["--endpoint", s.url, "--timeout", "0"], "--timeout 0 must be more than 0")):
        for main, flags in ((regen.main, ["--input", str(prompts), "--output", str(tmp_path / "o.jsonl")]),
                            (syn.main, ["--tokenizer", str(qwen3_dir), "--num", "2", "--out",
                                        str(tmp_path / "o.jsonl")])):
            with pytest.raises(SystemExit) as e:
                main(flags + extra)
            assert e.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_error_kinds(stubs):
    s = stubs()
    for code, kind in ((400, oc.Rejected), (404, oc.Rejected), (422, oc.Rejected), (429, oc.Transient),
                       (500, oc.Rejected), (502, oc.Transient), (503, oc.Transient)):
        s.status["x"] = code
        with pytest.raises(kind, match=f"{code}.*status {code} for x"):
            oc.request_json(s.url + "/v1/completions", {"model": "tgt", "prompt": "x", "max_tokens": 1})
    with pytest.raises(oc.Transient, match="refused"):
        oc.request_json(dead_url() + "/v1/models")
    # vLLM's error body for an unknown model name: the message is read from its top level
    with pytest.raises(oc.Rejected, match="The model `nope` does not exist"):
        oc.request_json(s.url + "/v1/completions", {"model": "nope", "prompt": "x"})


def test_api_key_and_the_fix_for_a_401(stubs, monkeypatch):
    s = stubs()
    oc.request_json(s.url + "/v1/models")
    monkeypatch.setenv(oc.API_KEY_ENV, "sk-test")
    oc.request_json(s.url + "/v1/models")
    assert s.auth == [None, "Bearer sk-test"]
    s.status["models"] = 401
    with pytest.raises(oc.Rejected, match=f"401: no models here. The server wants an API key: set {oc.API_KEY_ENV}"):
        oc.request_json(s.url + "/v1/models")


def test_with_retries_retries_transient_only(capsys):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise oc.Transient("reset")
        return "ok"
    assert oc.with_retries(flaky, 3, "x") == "ok" and len(calls) == 3
    assert capsys.readouterr().err.count("retry") == 2
    calls.clear()

    def rejected():
        calls.append(1)
        raise oc.Rejected("u", 404, "gone")
    with pytest.raises(oc.Rejected):
        oc.with_retries(rejected, 5, "x")
    assert len(calls) == 1  # a 4xx is never retried


def test_reasoning_is_put_back_in_front():
    reply = {"choices": [{"message": {"content": " Paris.", "reasoning_content": "\nCapital.\n"},
                          "finish_reason": "stop"}], "usage": {"completion_tokens": 9}}
    assert oc.choices_of(reply, "u", chat=True) == [oc.Choice("<think>\nCapital.\n</think>\n\nParis.", "stop", 9)]
    cut = {"choices": [{"message": {"content": None, "reasoning": "Hmm"}, "finish_reason": "length"}]}
    assert oc.choices_of(cut, "u", chat=True) == [oc.Choice("<think>\nHmm\n</think>\n\n", "length", None)]
    with pytest.raises(oc.Transient, match="no text"):
        oc.choices_of({"choices": [{"message": {"content": None}}]}, "u", chat=True)


def test_probe_chooses_the_model(stubs):
    one = stubs()
    e = oc.Endpoint(one.url + "/v1")
    e.probe()
    assert (e.model, e.max_len, e.prompt_tokens) == ("tgt", 256, 5)
    with pytest.raises(oc.Rejected, match=r"does not serve a model named 'default'; it serves \['tgt'\]"):
        oc.Endpoint(one.url).probe("default")
    two = stubs(models=[{"id": "a"}, {"id": "b"}])
    with pytest.raises(oc.Rejected, match=r"serves 2 models \(\['a', 'b'\]\).*--served-model"):
        oc.Endpoint(two.url).probe()
    e = oc.Endpoint(two.url)
    e.probe("b", completions=True)
    assert e.model == "b" and e.max_len is None
    one.status["Hi"] = 400  # the chat probe refused (e.g. no chat template): the message says what was probed
    with pytest.raises(oc.Rejected, match="status 400 for Hi.*one-token chat request.*chat template"):
        oc.Endpoint(one.url).probe()


def test_endpoints_serving_different_models_are_refused_unless_one_is_named(stubs, tmp_path):
    """Two servers of two models would mix two models' answers in one output: the probe refuses (regenerate exits
    with status 2 before any row); --served-model picks a name both serve."""
    from data import regenerate as regen
    a, b = stubs("a", models=[{"id": "small"}]), stubs("b", models=[{"id": "big"}, {"id": "small"}])
    c = stubs("c", models=[{"id": "big"}])
    with pytest.raises(oc.Rejected, match=r"it serves 'big', .* serves 'small': one run's rows must come from one "
                                          r"model.*--served-model"):
        oc.Pool([a.url, c.url]).probe()
    pool = oc.Pool([a.url, b.url], served_model="small")
    pool.probe()
    assert [e.model for e in pool.endpoints] == ["small", "small"]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"id": "p", "messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(SystemExit) as e:
        regen.main(["--input", str(prompts), "--output", str(out), "--endpoint", a.url, c.url])
    assert e.value.code == 2 and not out.exists()


def test_chat_and_complete_of_one_endpoint(stubs):
    s = stubs()
    e = oc.Endpoint(s.url)
    e.probe()
    assert e.chat([{"role": "user", "content": "q"}], 4, temperature=0.5, seed=7) == oc.Choice("q@s", "stop", 3)
    assert s.seen[-1] == ("/v1/chat/completions", {"model": "tgt", "messages": [{"role": "user", "content": "q"}],
                                                   "max_tokens": 4, "temperature": 0.5, "seed": 7})
    assert e.complete("p", 4, n=2) == [oc.Choice("p@s", "stop", None)] * 2   # usage is per request, not per choice
    assert oc.api_seed(1, 2) == oc.api_seed(1, 2) != oc.api_seed(2, 2) and 0 <= oc.api_seed(1, 2) < 2 ** 31


def test_probe_of_a_dead_server_names_it(capsys):
    url = dead_url()
    pool = oc.Pool([url], tries=2)
    with pytest.raises(oc.EndpointsDown, match=f"{url}/v1 does not answer after 2 tries.*Start the server"):
        pool.probe()
    assert capsys.readouterr().err.count("retry 2/2") == 1


def test_a_server_that_lists_its_model_but_never_answers_is_named_soon(stubs, monkeypatch, tmp_path, capsys):
    """The probe waits PROBE_TIMEOUT_S per try, not --timeout: a server that lists its model but does not answer is
    named with the fix in seconds. A request of the run that waits SLOW_REQUEST_S is reported on stderr with its
    endpoint and the seconds waited, while the run goes on waiting for it."""
    import time
    from data import regenerate as regen
    monkeypatch.setattr(oc, "PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(oc, "SLOW_REQUEST_S", 0.4)
    s = stubs()
    s.answer = lambda prompt, body: time.sleep(1.2) or f"a:{prompt}"
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"id": "p", "messages": [{"role": "user", "content": "q"}]}) + "\n")
    t0 = time.time()
    with pytest.raises(SystemExit, match=r"lists model 'tgt' but did not answer a one-token request in 2 tries of "
                                         r"up to 0.3 s .*check the server's log"):
        regen.main(["--input", str(prompts), "--output", str(out), "--endpoint", s.url, "--retries", "2"])
    assert time.time() - t0 < 5 and not out.exists()
    s.answer = lambda prompt, body: (time.sleep(1.2) if prompt == "q" else None) or f"a:{prompt}"
    capsys.readouterr()
    regen.main(["--input", str(prompts), "--output", str(out), "--endpoint", s.url, "--timeout", "30"])
    assert json.loads(out.read_text())["messages"][-1]["content"] == "a:q"
    assert re.search(re.escape(s.url) + r"/v1: 1 request\(s\) waiting for an answer, the oldest for \d+ s "
                     r"\(--timeout 30 s\)", capsys.readouterr().err)


def chat_of(tag):
    return oc.chat_request([{"role": "user", "content": tag}], 4)


def drain(pool, tags):
    return {tag: (choices, err) for tag, choices, err in pool.run(deque(tags), chat_of)}


def test_pool_spreads_work_and_fails_a_row_only_when_the_server_answers(stubs):
    a, b = stubs("a"), stubs("b")
    a.status["bad"] = b.status["bad"] = 503    # a request that fails on every server that is up
    a.status["long"] = b.status["long"] = 400  # a request refused for itself (too long): no retry
    a.status["odd"] = b.status["odd"] = 500    # the server fails on this prompt: it would again, no retry
    pool = oc.Pool([a.url, b.url], concurrency=2, tries=2)
    pool.probe()
    got = drain(pool, [f"q{i}" for i in range(20)] + ["bad", "long", "odd"])
    texts = {t: c[0].text for t, (c, err) in got.items() if c}
    assert {t: x.split("@")[0] for t, x in texts.items()} == {f"q{i}": f"q{i}" for i in range(20)}
    assert {x.split("@")[1] for x in texts.values()} == {"a", "b"}  # both servers took work
    assert isinstance(got["bad"][1], oc.Transient) and isinstance(got["long"][1], oc.Rejected)
    assert isinstance(got["odd"][1], oc.Rejected) and got["odd"][1].status == 500
    tries = Counter(body["messages"][-1]["content"] for p, body in a.seen + b.seen)
    assert tries["long"] == tries["odd"] == 1 and tries["bad"] >= 2


def test_pool_moves_work_off_a_dead_server_and_stops_when_all_are(stubs, capsys):
    a, b = stubs("a"), stubs("b")
    pool = oc.Pool([a.url, b.url], concurrency=2, tries=2)
    pool.probe()
    a.stop()  # a dies after the probe: its requests are retried on b, none is reported failed
    got = drain(pool, [f"q{i}" for i in range(12)])
    assert all(err is None and c[0].text == f"{t}@b" for t, (c, err) in got.items()) and len(got) == 12
    assert f"{a.url}/v1 is down" in capsys.readouterr().err
    b.stop()
    pool = oc.Pool([b.url], concurrency=2, tries=2)
    pool.endpoints[0].model = "tgt"
    seen = []
    with pytest.raises(oc.EndpointsDown, match="every endpoint is down"):
        for tag, choices, err in pool.run(deque(["x", "y"]), chat_of):
            seen.append(tag)
    assert seen == []  # nothing reported failed: the rows in flight are redone by the next run


def test_pool_stops_on_a_rejection_that_is_not_a_rows(stubs):
    a = stubs()
    pool = oc.Pool([a.url], concurrency=2, tries=3)
    pool.probe()
    a.models = [{"id": "other"}]  # the server now serves another model: 404 for every request
    with pytest.raises(oc.Rejected, match="404.*does not exist"):
        drain(pool, ["q1", "q2", "q3"])
    pool.endpoints[0].model = "other"
    a.status.update({f"q{i}": 400 for i in range(40)})
    with pytest.raises(oc.Rejected, match=f"{oc.BAD_REQUESTS_STOP} requests in a row"):
        drain(pool, [f"q{i}" for i in range(40)])


# ---------------------------------------------------------------------------------------------------------------
# data.synthesize's server path against a stub: a candidate whose request fails is rejected, in index order

def test_synthesize_server_errors_reject_candidates_and_resume(stubs, qwen3_dir, tmp_path):
    """The stub writes random words seeded by the request's seed and fails (HTTP 500, every try) the user turn of
    self/2 and the answer of self/4: both are rejected as server_error (self/2's wait for its turn in the opener
    order does not stall the run), the others kept; a run cut at 5 rows and resumed to 9 writes the files of one
    run to 9."""
    from data import synthesize as syn
    import random as rnd
    fail = {oc.api_seed(7, syn.sample_key("self", 2, 0)), oc.api_seed(7, syn.sample_key("self", 4, 1))}

    def answer(prompt, body):
        if body.get("seed") in fail:
            return 500
        r = rnd.Random(body.get("seed"))   # (the probe's requests carry none)
        return " ".join(r.choice(WORDS) for _ in range(9)) + ("?" if "prompt" in body else ".")
    s = stubs(models=[{"id": "tgt", "max_model_len": 4096}])
    s.answer = answer

    def run(out, num):
        return syn.main(["--endpoint", s.url, "--tokenizer", qwen3_dir, "--num", num, "--out", out, "--seed", 7,
                         "--temperature", 0.5, "--retries", 2, "--concurrency", 2])
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first = run(a, 5)
    rejected = {r["id"]: r for r in map(json.loads, syn.rejected_path(a).read_text().splitlines())}
    assert {k: r["rejected"] for k, r in rejected.items()} == {"self/2": "server_error", "self/4": "server_error"}
    assert "HTTP 500" in rejected["self/2"]["error"] and rejected["self/2"]["messages"] == []
    assert [m["role"] for m in rejected["self/4"]["messages"]] == ["user"]
    assert first["kept"] == 5 and first["rejected"]["server_error"] == 2
    run(a, 9)
    one = run(b, 9)
    assert a.read_text().splitlines() == b.read_text().splitlines() and one["kept"] == 9
    assert [json.loads(x)["id"] for x in syn.rejected_path(a).read_text().splitlines()] == ["self/2", "self/4"]


def test_regenerate_stops_when_its_server_goes_away_and_a_rerun_finishes(stubs, tmp_path):
    """The only server goes away after a few answers: the run stops (exit status 1) naming it, the rows written stay,
    the rows in flight are not recorded as failed; a rerun against a server finishes every row once."""
    from data import regenerate as regen
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                               for i in range(12)))
    out = tmp_path / "out.jsonl"
    s, served = stubs(), []

    def answer(prompt, body):
        served.append(prompt)
        if len(served) == 6:   # the probe's request and 4 rows answered: then the server is gone
            threading.Thread(target=s.stop).start()
            return 503
        return f"a:{prompt}"
    s.answer = answer

    def run(url):
        return regen.main(["--input", str(prompts), "--output", str(out), "--endpoint", url, "--concurrency", "1",
                           "--retries", "2"])
    with pytest.raises(SystemExit, match="(?s)every endpoint is down.*not recorded as failed"):
        run(s.url)
    done = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert done == ["p0", "p1", "p2", "p3"] and not Path(f"{out}.errors.jsonl").read_text()
    assert run(stubs().url)["done_before"] == 4
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 12 and {r["id"] for r in rows} == {f"p{i}" for i in range(12)}
    assert rows[4]["messages"][-1]["content"] == "q4@s"


def test_regenerate_refuses_to_resume_rows_of_another_model_or_settings(stubs, tmp_path, capsys):
    """OUTPUT.stats.json records what made the rows: a resume with another served model, another answer cap or
    another temperature is refused naming the setting, the output left as it is; the same settings go on. An
    output from before the settings were recorded is resumed with a note, and its settings recorded."""
    from data import regenerate as regen
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"

    def write_prompts(n):
        prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]})
                                   + "\n" for i in range(n)))
    s = stubs()

    def run(*extra):
        return regen.main(["--input", str(prompts), "--output", str(out), "--endpoint", s.url,
                           "--max-new-tokens", "16", *extra])
    write_prompts(2)
    run()
    assert json.loads(regen.resume.stats_path(out).read_text())["config"]["served_model"] == "tgt"
    write_prompts(3)
    rows = out.read_bytes()
    for extra, said in ((["--max-new-tokens", "32"], "max_new_tokens: was 16, now 32"),
                        (["--temperature", "0.7"], "temperature: was 0.0, now 0.7")):
        with pytest.raises(SystemExit, match=f"cannot resume .*{said}.*a new output"):
            run(*extra)
    s.models = [{"id": "other"}]
    with pytest.raises(SystemExit, match="served_model: was 'tgt', now 'other'.*written by another model"):
        run()
    assert out.read_bytes() == rows
    s.models = [{"id": "tgt"}]
    assert run()["todo"] == 1
    regen.resume.stats_path(out).unlink()   # as data.regenerate wrote outputs before it recorded settings
    write_prompts(4)
    assert run()["todo"] == 1 and "taken as made by this run's model" in capsys.readouterr().err
    assert json.loads(regen.resume.stats_path(out).read_text())["config"]["max_new_tokens"] == 16
