"""A small OpenAI-compatible server on transformers, to rehearse the server path (data/regenerate.py --endpoint,
data/synthesize.py) without SGLang or vLLM, and for the CPU tests that talk HTTP to a real process:

    python -m tools.serve_openai --model DIR [--port 8000] [--host 127.0.0.1] [--served-model NAME] [--device cpu]

DIR: a local HF folder or a Hub id already in the local cache (model.hub.resolve_model_path). NAME defaults to
--model as given, as vLLM and SGLang name a model by the path they were given. --port 0 picks a free port. It prints
`serving NAME on http://HOST:PORT` once it accepts requests, and stops on SIGTERM or Ctrl-C.

Endpoints: GET /v1/models; POST /v1/completions (a raw text prompt) and /v1/chat/completions (messages rendered with
the tokenizer's chat template; chat_template_kwargs such as enable_thinking passed to it), with n, seed, max_tokens,
stop, temperature (0 = greedy, transformers' own greedy generate) and top_p. A seed makes a sampled request repeatable.
Errors as vLLM gives them: 404 for an unknown model name or path, 400 for a malformed request (an empty prompt, text
that is not valid Unicode), in OpenAI's {"error": {...}} shape. One request generates at a time (a lock): a rehearsal
server, not a fast one. No streaming. A request whose client has disconnected is dropped, with one line in the log:
while it waits for the lock, and while it generates (checked at every token); a client gone by the reply is one line
too. A bad --port or --device, or a port in use, stops it (exit 2) before the model loads.
"""
import argparse
import json
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from model.engine import default_stop_ids, load_model
from model.hub import resolve_model_path


class BadRequest(Exception):
    """-> HTTP `status` with an OpenAI-style error body."""

    def __init__(self, message, status=400, kind="BadRequestError", param=None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


class ClientGone(Exception):
    """The client disconnected before its answer was ready: the request is dropped."""


def error_body(e: BadRequest) -> dict:
    return {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.status}}


# ---------------------------------------------------------------------------
# Request checks: the fields this server honours, each of the type OpenAI's API gives it

def _field(body, name, kinds, default, check=None, what=""):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise BadRequest(f"`{name}` must be {what or ' or '.join(k.__name__ for k in kinds)}, got {v!r}", param=name)
    if check and not check(v):
        raise BadRequest(f"`{name}` must be {what}, got {v!r}", param=name)
    return v


def sampling(body) -> dict:
    """The generation settings of a request body (both endpoints)."""
    if body.get("stream"):
        raise BadRequest("streaming is not supported by this server: send stream=false", param="stream")
    stop = _field(body, "stop", (str, list), [], what="a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"`stop` must be a string or a list of non-empty strings, got {stop!r}", param="stop")
    return {
        "n": _field(body, "n", (int,), 1, lambda v: v >= 1, "an integer >= 1"),
        "seed": _field(body, "seed", (int,), None, what="an integer"),
        "max_tokens": _field(body, "max_tokens", (int,), None, lambda v: v >= 1, "an integer >= 1"),
        "temperature": float(_field(body, "temperature", (int, float), 1.0, lambda v: v >= 0, "a number >= 0")),
        "top_p": float(_field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        "stop": stop,
    }


def chat_messages(body) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs):
        raise BadRequest("`messages` must be a non-empty list of {\"role\": str, \"content\": str}", param="messages")
    return msgs


def check_unicode(body) -> None:
    """JSON's \\uXXXX escapes can spell a lone UTF-16 surrogate, which no tokenizer can encode: a 400, not a 500."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"the request holds text that is not valid Unicode ({e.reason}: "
                         f"{e.object[e.start:e.end]!a}); send UTF-8 text") from None


def completion_prompts(body) -> list[str]:
    p = body.get("prompt")
    prompts = [p] if isinstance(p, str) else p
    if not isinstance(prompts, list) or not prompts or not all(isinstance(x, str) for x in prompts):
        raise BadRequest("`prompt` must be a string or a non-empty list of strings", param="prompt")
    return prompts


# ---------------------------------------------------------------------------
# Generation

class StopOnText(StoppingCriteria):
    """Ends a sequence once its generated text holds one of the stop strings (OpenAI's `stop`)."""

    def __init__(self, tok, stops, prompt_len):
        self.tok, self.stops, self.prompt_len = tok, stops, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        texts = self.tok.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


class StopWhenGone(StoppingCriteria):
    """Ends generation once the request's client has disconnected (`gone`, checked at every token)."""

    def __init__(self, gone):
        self.gone = gone

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.gone(), dtype=torch.bool, device=input_ids.device)


def socket_closed(sock) -> bool:
    """Has the peer closed `sock`? Readable with nothing to read (EOF) or reset. A client waiting for its answer
    sends nothing, so its socket is not readable; a pipelined next request is data, not EOF."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):   # reset, or already closed here
        return True


class Generator:
    """The model, its tokenizer and the lock that serialises generation."""

    def __init__(self, path, device, dtype):
        self.model, self.tok = load_model(path, device, dtype)
        self.stop_ids = default_stop_ids(self.model, self.tok)
        self.max_model_len = self.model.config.get_text_config().max_position_embeddings
        self.lock = threading.Lock()

    def render(self, messages, template_kwargs) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template: use /v1/completions")
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                **template_kwargs)
        except Exception as e:   # a template's raise_exception (bad roles, ...) is the request's fault
            raise BadRequest(f"the chat template rejected these messages: {e}", param="messages") from None

    def generate(self, text, s, special_tokens, gone=lambda: False) -> tuple[int, list[tuple[str, str, int]]]:
        """A prompt's text and sampling settings -> (prompt tokens, n x (text, finish_reason, completion tokens)).
        special_tokens: let the tokenizer add its BOS (vLLM does for a raw prompt, not for a rendered template).
        All of it under the lock: a fast tokenizer used from two threads at once can fail ("Already borrowed").
        gone(): has the client disconnected? Checked once the lock is ours and at every token: ClientGone."""
        with self.lock, torch.no_grad():
            if gone():
                raise ClientGone("before generating")
            out = self._generate(text, s, special_tokens, gone)
            if gone():
                raise ClientGone("while generating")
            return out

    def _generate(self, text, s, special_tokens, gone):
        ids = self.tok(text, add_special_tokens=special_tokens, return_tensors="pt")["input_ids"].to(self.model.device)
        P = ids.shape[1]
        if P == 0:   # vLLM's words: there is no token to continue from
            raise BadRequest("The decoder prompt cannot be empty", param="prompt")
        room = self.max_model_len - P
        max_new = s["max_tokens"] if s["max_tokens"] is not None else room
        if max_new > room or room < 1:
            raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {P + max_new} tokens ({P} in the messages, {max_new} in the completion). "
                             f"Please reduce the length of the messages or completion.", param="max_tokens")
        greedy = s["temperature"] == 0
        gen = GenerationConfig(max_new_tokens=max_new, do_sample=not greedy,
                               num_return_sequences=1 if greedy else s["n"],   # n greedy answers are one
                               temperature=None if greedy else s["temperature"], top_p=None if greedy else s["top_p"],
                               top_k=None if greedy else 0, eos_token_id=self.stop_ids, pad_token_id=self.stop_ids[0])
        criteria = StoppingCriteriaList([StopWhenGone(gone)] + ([StopOnText(self.tok, s["stop"], P)] if s["stop"]
                                                                else []))
        if s["seed"] is not None:
            torch.manual_seed(s["seed"])          # under the lock: the global RNG is this request's alone
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                                  stopping_criteria=criteria)[:, P:].tolist()
        return P, [self.finish(row, s["stop"]) for row in out] * (s["n"] if greedy else 1)

    def finish(self, row, stops) -> tuple[str, str, int]:
        """Generated ids (padded with the first stop id after the end) -> (text, finish_reason, tokens generated)."""
        end = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
        text = self.tok.decode(row[:end], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:            # the stop string itself is not returned; what follows `end` is padding
            return text[: min(hits)], "stop", len(row) if end is None else end
        return text, "stop" if end is not None else "length", len(row) if end is None else end + 1


# ---------------------------------------------------------------------------
# HTTP

def make_handler(gen: Generator, name: str):
    def check_model(body):
        model = body.get("model", name)                           # vLLM: no model = the one served
        if model != name:
            raise BadRequest(f"The model `{model}` does not exist.", status=404, kind="NotFoundError", param="model")

    def completions(body, gone):
        check_model(body)
        s, prompts = sampling(body), completion_prompts(body)
        choices, used = [], 0
        for text in prompts:
            p, outs = gen.generate(text, s, special_tokens=True, gone=gone)
            used += p
            choices += [{"index": len(choices) + i, "text": t, "logprobs": None, "finish_reason": why, "_tokens": k}
                        for i, (t, why, k) in enumerate(outs)]
        return "cmpl", "text_completion", choices, used

    def chat(body, gone):
        check_model(body)
        s, msgs = sampling(body), chat_messages(body)
        kwargs = _field(body, "chat_template_kwargs", (dict,), {}, what="an object")
        p, outs = gen.generate(gen.render(msgs, kwargs), s, special_tokens=False, gone=gone)
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": why, "_tokens": k} for i, (t, why, k) in enumerate(outs)]
        return "chatcmpl", "chat.completion", choices, p

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):   # one line per request is noise in a test log
            pass

        def client_left(self, when):
            print(f"serve_openai: client {self.client_address[0]}:{self.client_address[1]} went away {when}; "
                  f"{self.command} {self.path} dropped", file=sys.stderr, flush=True)
            self.close_connection = True

        def reply(self, status, obj):
            data = json.dumps(obj).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):   # the client left: one line, not a traceback
                self.client_left("before its reply")

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self.reply(200, {"object": "list", "data": [
                    {"id": name, "object": "model", "created": int(START), "owned_by": "serve_openai",
                     "root": name, "max_model_len": gen.max_model_len}]})
            elif self.path.rstrip("/") == "/health":
                self.reply(200, {})
            else:
                self.reply(404, error_body(BadRequest(f"no route {self.path}", 404, "NotFoundError")))

        def do_POST(self):
            routes = {"/v1/completions": completions, "/v1/chat/completions": chat}
            try:
                route = routes.get(self.path.rstrip("/"))
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if route is None:
                    raise BadRequest(f"no route {self.path}", 404, "NotFoundError")
                try:
                    body = json.loads(raw)
                except ValueError as e:
                    raise BadRequest(f"the body is not JSON: {e}") from None
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                check_unicode(body)
                prefix, kind, choices, prompt_tokens = route(body, lambda: socket_closed(self.connection))
            except BadRequest as e:
                return self.reply(e.status, error_body(e))
            except ClientGone as e:
                return self.client_left(str(e))
            except Exception as e:   # a bug here: say so to the client and in this server's log, keep serving
                traceback.print_exc()
                return self.reply(500, error_body(BadRequest(f"{type(e).__name__}: {e}", 500, "InternalServerError")))
            completion_tokens = sum(c.pop("_tokens") for c in choices)      # counted per choice, not sent
            self.reply(200, {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                             "model": name, "choices": choices,
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens}})
    return Handler


START = time.time()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local HF folder, or a Hub id in the local cache")
    ap.add_argument("--served-model", default=None, help="the name clients pass as `model`; default: --model as given")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    ap.add_argument("--port", type=int, default=8000, help="0 = any free port (printed)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: bfloat16 on a GPU, float32 on the CPU")
    args = ap.parse_args(argv)
    try:
        path = resolve_model_path(args.model)
    except FileNotFoundError as e:
        raise SystemExit(f"serve_openai: {e}")
    # what can be wrong with the flags or this machine, found before the model loads (usage errors: exit 2)
    if not 0 <= args.port <= 65535:
        ap.error(f"--port {args.port} is not a TCP port: give 1-65535, or 0 for any free one")
    if args.device != "auto":
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            ap.error(f"--device {args.device!r}: {e}")
        if device.type == "cuda" and not torch.cuda.is_available():
            ap.error(f"--device {args.device}: torch sees no CUDA device (a CPU build of torch, or no GPU visible): "
                     f"use --device cpu")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            ap.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    try:   # listen first: a port in use is said now, not after the model loaded; clients queue until serving
        httpd = ThreadingHTTPServer((args.host, args.port), BaseHTTPRequestHandler)
    except OSError as e:
        ap.error(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}): stop what holds the port or pick "
                 f"another --port (0 = any free one)")
    httpd.daemon_threads = True
    name = args.served_model or args.model
    gen = Generator(path, args.device, args.dtype)
    httpd.RequestHandlerClass = make_handler(gen, name)
    # SIGTERM: leave serve_forever from another thread (shutdown() waits for the loop it stops)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start())
    host, port = httpd.server_address[:2]
    print(f"serving {name} on http://{host}:{port}", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        gen.lock.acquire()   # and never released: a handler thread still inside torch at exit aborts the process
    print("serve_openai: stopped", flush=True)


if __name__ == "__main__":
    main()
