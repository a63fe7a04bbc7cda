"""tools/serve_openai.py as a real process on 127.0.0.1, over HTTP: /v1/models, the chat and completions shapes,
greedy output equal to transformers' own greedy generate, seeds, n, stop strings, max_tokens and finish_reason,
chat_template_kwargs, 404 for an unknown model, 400 for malformed requests, a clean stop on SIGTERM."""
import pytest
import torch

from server import get, post, serving, tiny_chat_model

pytestmark = pytest.mark.job
NAME = "tiny-chat"
EOS = [151645, 151643]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def url(model_dir):
    with serving(model_dir, "--served-model", NAME) as u:
        yield u


@pytest.fixture(scope="module")
def local(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def reference(local, text, max_new_tokens, special_tokens):
    """transformers' greedy generate on `text` -> (prompt ids, generated ids up to the first eos, eos reached)."""
    model, tok = local
    ids = tok(text, add_special_tokens=special_tokens, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=EOS, pad_token_id=EOS[1])[0, ids.shape[1]:].tolist()
    end = next((i for i, t in enumerate(out) if t in EOS), None)
    return ids[0].tolist(), out[:end] if end is not None else out, end is not None


def chat(url, **kw):
    return post(url, "/v1/chat/completions", {"model": NAME, "messages": CHAT, **kw})


def test_models_lists_the_served_name(url):
    status, body = get(url, "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [(NAME, "model", 512)]


def test_chat_greedy_equals_transformers_generate(url, local):
    tok = local[1]
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    p_ids, want, eos = reference(local, prompt, 12, special_tokens=False)
    status, body = chat(url, max_tokens=12, temperature=0)
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["model"] == NAME and body["id"].startswith("chatcmpl-")
    [c] = body["choices"]
    assert c["index"] == 0 and c["message"]["role"] == "assistant"
    assert c["message"]["content"] == tok.decode(want, skip_special_tokens=True)
    assert c["finish_reason"] == ("stop" if eos else "length")
    assert body["usage"] == {"prompt_tokens": len(p_ids), "completion_tokens": len(want) + eos,
                             "total_tokens": len(p_ids) + len(want) + eos}


def test_completions_greedy_n_and_max_tokens(url, local):
    tok = local[1]
    p_ids, want, eos = reference(local, "The river", 7, special_tokens=True)
    assert not eos, "pick a prompt whose 7 greedy tokens hold no eos"
    status, body = post(url, "/v1/completions", {"model": NAME, "prompt": "The river", "max_tokens": 7,
                                                 "temperature": 0.0, "n": 3})
    assert status == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert {c["text"] for c in body["choices"]} == {tok.decode(want, skip_special_tokens=True)}
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    assert body["usage"]["prompt_tokens"] == len(p_ids) and body["usage"]["completion_tokens"] == 3 * 7
    # a list of prompts: n choices each, indexed in order
    status, body = post(url, "/v1/completions", {"model": NAME, "prompt": ["The river", "A lake"], "max_tokens": 2,
                                                 "temperature": 0, "n": 2})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == body["choices"][1]["text"] == tok.decode(want[:2], skip_special_tokens=True)


def test_seed_makes_sampling_repeatable(url):
    def sample(seed, n=1):
        status, body = chat(url, max_tokens=6, temperature=1.0, top_p=0.9, seed=seed, n=n)
        assert status == 200, body
        return [c["message"]["content"] for c in body["choices"]]
    a, b, c = sample(7), sample(7), sample(8)
    assert a == b and a != c
    three = sample(7, n=3)
    assert three == sample(7, n=3) and len(set(three)) > 1     # n samples are drawn apart, yet repeatable


def test_stop_string_cuts_the_text(url, local):
    tok = local[1]
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    _, want, _ = reference(local, prompt, 24, special_tokens=False)
    full = tok.decode(want, skip_special_tokens=True)
    # a stop string: one generated token's text that occurs first after some text, with whole characters only
    stop = next(s for s in (tok.decode([t]) for t in want[3:]) if s.strip() and "\ufffd" not in s and full.find(s) > 0)
    status, body = chat(url, max_tokens=24, temperature=0, stop=[stop, "never-generated-xyz"])
    assert status == 200, body
    [c] = body["choices"]
    assert c["message"]["content"] == full[: full.find(stop)] and c["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 24


def test_chat_template_kwargs_reach_the_template(url, local):
    tok = local[1]
    counts = {}
    for thinking in (True, False):
        status, body = chat(url, max_tokens=1, temperature=0, chat_template_kwargs={"enable_thinking": thinking})
        assert status == 200, body
        counts[thinking] = body["usage"]["prompt_tokens"]
        want = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert counts[thinking] == len(tok(want, add_special_tokens=False)["input_ids"])
    assert counts[False] > counts[True]                       # the empty <think></think> block


def test_unknown_model_is_404(url):
    status, body = chat(url, model="Qwen/Qwen3-8B", max_tokens=1)
    assert status == 404 and body["error"]["type"] == "NotFoundError" and body["error"]["code"] == 404
    assert "Qwen/Qwen3-8B" in body["error"]["message"]
    status, body = post(url, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1})
    assert status == 404 and "nope" in body["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", b"[1, 2]", None),
    ("/v1/chat/completions", {"model": NAME}, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": "8"}, "max_tokens"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": 100000}, "max_tokens"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "stop": [3]}, "stop"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "stream": True}, "stream"),
    ("/v1/completions", {"model": NAME, "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_p": 0}, "top_p"),
])
def test_malformed_request_is_400(url, path, body, param):
    status, got = post(url, path, body)
    assert status == 400 and got["error"]["type"] == "BadRequestError" and got["error"]["param"] == param, got


def test_default_name_is_the_model_argument(model_dir):
    """vLLM and SGLang serve a model under the path they were given; so does this server (and stops on SIGTERM)."""
    with serving(model_dir) as u:
        status, body = get(u, "/v1/models")
        assert status == 200 and body["data"][0]["id"] == str(model_dir)
        status, body = post(u, "/v1/completions", {"model": str(model_dir), "prompt": "A", "max_tokens": 1,
                                                   "temperature": 0})
        assert status == 200 and body["model"] == str(model_dir)


def test_regenerate_reads_its_answers(url, local, tmp_path):
    """data/regenerate.py --endpoint against this server: the greedy answer of transformers' generate comes back."""
    import json
    from data import regenerate
    tok = local[1]
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "regen.jsonl"
    inp.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Name three rivers."}]}) + "\n")
    regenerate.main(["--input", str(inp), "--output", str(out), "--endpoint", url, "--served-model", NAME,
                     "--max-new-tokens", "10", "--temperature", "0", "--thinking", "off", "--retries", "1"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three rivers."}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)
    _, want, eos = reference(local, prompt, 10, special_tokens=False)
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["messages"][-1] == {"role": "assistant", "content": tok.decode(want, skip_special_tokens=True).strip()}
    assert row["finish_reasons"] == ["stop" if eos else "length"]


# ---------------------------------------------------------------------------
# Start-up checks, requests no tokenizer can take, clients that leave

def start(model, *args, stderr):
    """serve_openai as a process (stdout piped, stderr to the open file `stderr`) -> (process, base URL or None if
    it exited before serving)."""
    import subprocess
    import sys
    from server import ROOT
    proc = subprocess.Popen([sys.executable, "-m", "tools.serve_openai", "--model", str(model), "--host", "127.0.0.1",
                             *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    for line in proc.stdout:
        if line.startswith("serving "):
            return proc, line.rsplit(" on ", 1)[1].strip()
    proc.wait(timeout=60)
    return proc, None


def test_bad_port_busy_port_or_missing_cuda_stop_before_the_model_loads(tmp_path):
    """Exit 2 with the flag and the fix, before loading: the folder given has no model, so a check that came after
    loading would say that instead."""
    import socket
    no_model = tmp_path / "no-model"
    no_model.mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = [(["--port", "99999"], "--port 99999 is not a TCP port: give 1-65535, or 0 for any free one"),
                 (["--port", str(port)], f"cannot listen on 127.0.0.1:{port} (Address already in use)")]
        if not torch.cuda.is_available():
            cases.append((["--port", "0", "--device", "cuda"], "--device cuda: torch sees no CUDA device"))
        for args, message in cases:
            with open(tmp_path / "err", "w+") as err:
                proc, url = start(no_model, *args, stderr=err)
                err.seek(0)
                text = err.read()
            assert url is None and proc.returncode == 2, (args, text)
            assert message in text and "config.json" not in text and "Traceback" not in text, (args, text)


def test_empty_prompt_and_lone_surrogate_are_400(url):
    """vLLM answers these with a 400; they used to reach the tokenizer or generate and come back as a 500."""
    for path, body, param in [
            ("/v1/completions", {"model": NAME, "prompt": "", "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"model": NAME, "prompt": ["A", ""], "max_tokens": 1}, "prompt"),
            ("/v1/completions", b'{"model": "tiny-chat", "prompt": "x\\ud800", "max_tokens": 1}', None),
            ("/v1/chat/completions", b'{"model": "tiny-chat", "max_tokens": 1, "messages": '
                                     b'[{"role": "user", "content": "\\udc00"}]}', None)]:
        status, got = post(url, path, body)
        assert status == 400 and got["error"]["type"] == "BadRequestError" and got["error"]["param"] == param, got
        assert ("cannot be empty" if param else "not valid Unicode") in got["error"]["message"], got
    status, _ = post(url, "/v1/completions", {"model": NAME, "prompt": "A", "max_tokens": 1})
    assert status == 200


def test_a_client_gone_before_its_reply_is_one_log_line(capsys):
    """The reply to a client that closed its connection: one line in the server's log, no BrokenPipeError."""
    from types import SimpleNamespace
    from tools import serve_openai

    class Closed:
        def write(self, data):
            raise BrokenPipeError(32, "Broken pipe")
    handler = serve_openai.make_handler(SimpleNamespace(max_model_len=512), NAME)
    h = handler.__new__(handler)
    h.wfile, h.request_version, h.requestline, h.command, h.path = Closed(), "HTTP/1.1", "", "POST", "/v1/completions"
    h.client_address = ("127.0.0.1", 5555)
    h.reply(200, {"choices": []})
    err = capsys.readouterr().err
    assert err == "serve_openai: client 127.0.0.1:5555 went away before its reply; POST /v1/completions dropped\n"
    assert h.close_connection


def test_requests_of_clients_that_left_are_dropped(model_dir, tmp_path):
    """Clients that send a long request and disconnect: each request is dropped (waiting for the lock, or at the
    next token), one log line each, and the next client is served."""
    import json
    import signal
    import socket
    with open(tmp_path / "err", "w+") as err:
        proc, url = start(model_dir, "--port", "0", "--served-model", NAME, stderr=err)
        try:
            assert url, "the server did not start"
            host, port = url.removeprefix("http://").split(":")
            body = json.dumps({"model": NAME, "prompt": "A", "max_tokens": 400, "temperature": 0}).encode()
            request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n").encode() + body
            for _ in range(3):
                with socket.create_connection((host, int(port))) as s:
                    s.sendall(request)
            status, got = post(url, "/v1/completions", {"model": NAME, "prompt": "A", "max_tokens": 2})
            assert status == 200 and len(got["choices"]) == 1
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        err.seek(0)
        log = err.read()
    dropped = [ln for ln in log.splitlines() if "went away" in ln and "POST /v1/completions dropped" in ln]
    assert len(dropped) == 3 and all(" generating;" in ln for ln in dropped), log
    assert "Traceback" not in log and "BrokenPipeError" not in log, log
