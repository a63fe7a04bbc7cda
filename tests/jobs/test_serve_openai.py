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
