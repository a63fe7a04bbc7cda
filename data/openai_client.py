"""An OpenAI-compatible server as a generation backend (SGLang, vLLM, tools/serve_openai.py): data.regenerate and
data.synthesize send their requests through it. Standard library only.

    pool = Pool(["http://10.0.0.1:30000", "http://10.0.0.2:30000/v1"], served_model=None, concurrency=16)
    pool.probe(completions=True)               # before any row: names the model, checks chat (and raw completions)
    for tag, choice, error in pool.run(pending, request):   # pending: a deque the caller may append to
        ...                                    # request(tag) -> ("chat/completions" | "completions", body)

Errors are sorted in three kinds, never guessed from a message:
  Rejected (HTTP 4xx but 429, and 500): the request is wrong (a model name the server does not serve, a bad field,
                        an auth error), or the server failed on it (500: an exception while serving it, which the
                        same request meets again). Never retried. From the probe, or any 4xx but 400 during the
                        run: the run stops (exit code 2 in the tools). A 400 or 500 during the run is that
                        request's own (a prompt longer than the context, a prompt the server cannot handle): its row
                        fails at once; BAD_REQUESTS_STOP of them in a row with no success between stop the run too
                        (then they are not the rows' fault).
  transient:            connection refused / reset, timeouts, HTTP 429, 502, 503, 504 and other 5xx but 500 (the
                        server busy, starting or behind a proxy that lost it), a reply that is not the JSON asked
                        for. Retried on the same endpoint after RETRY_BACKOFF_S, doubling per try up to
                        RETRY_BACKOFF_MAX_S, each retry printed on one line.
  EndpointsDown:        a request that still fails after its tries leads to a health check of its endpoint
                        (GET /v1/models, with the same tries). If the endpoint answers, the request is at fault and
                        is handed back as failed (the tools record that row as failed). If it does not, the endpoint
                        is down: its requests in flight go back to the shared queue for the other endpoints, with
                        their tries reset, and it takes no new work. When every endpoint is down the run stops with
                        EndpointsDown, and none of the requests in flight is reported as failed.

Waits: the probe's requests wait PROBE_TIMEOUT_S a try (the run's, --timeout); a request of the run that has waited
SLOW_REQUEST_S is reported on one line naming its endpoint, again after as long again.

Several endpoints share one queue of work: each runs `concurrency` worker threads that take the next request from
it, so a faster server takes more. Threads are daemons: a run that stops does not wait for requests in flight.
"""
import hashlib
import http.client
import json
import os
import queue
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from typing import NamedTuple

RETRY_BACKOFF_S = 0.5       # sleep before the 2nd try of a request; doubles per try
RETRY_BACKOFF_MAX_S = 8.0   # ... up to this
BAD_REQUESTS_STOP = 16      # HTTP 400s / 500s in a row (no success between) that stop a run: not the rows' fault
ROW_STATUSES = (400, 500)   # refusals that are one request's own during a run: its row fails, the run goes on
PROBE_TIMEOUT_S = 60.0      # the probe's wait per try of its one-token requests (at most --timeout): a server that
                            # lists its model but never answers is named in minutes, not --timeout x --retries
SLOW_REQUEST_S = 60.0       # a request waiting this long for its answer is reported, per endpoint, and again after
                            # as long again, while the run waits (up to --timeout)
PROBE_MESSAGES = [{"role": "user", "content": "Hi"}]   # the probe's one-token chat request
API_KEY_ENV = "OPENAI_API_KEY"   # sent as `Authorization: Bearer` when set (a server started with --api-key)
FIXES = {  # HTTP status -> what the user can change
    401: f"The server wants an API key: set {API_KEY_ENV}",
    403: f"The server refused the key: check {API_KEY_ENV}",
    404: "Check the model name (--served-model; GET /v1/models lists the served ones) and the endpoint URL",
    400: "The request was malformed or too long for the server's context: check --max-new-tokens and the prompts",
    500: "The server failed on this request (its log says why); the same request fails again, so it is not retried",
}


class Choice(NamedTuple):
    text: str
    finish_reason: str      # "stop" or "length"
    tokens: int | None      # generated tokens (usage.completion_tokens over the choices; None if not reported)


class Rejected(Exception):
    """The server refused a request (HTTP 4xx but 429) or failed on it (500); status None: the probe found no model
    to ask for. The request must change, retrying cannot help."""

    def __init__(self, url, status, message, fix=""):
        self.url, self.status, self.message = url, status, message
        said = f"{url} answered HTTP {status}" if status else url
        super().__init__(f"{said}: {message}" + (f". {fix}" if fix else ""))


class Transient(Exception):
    """A failure that may pass: no connection, a timeout, HTTP 5xx / 429, a reply that is not the JSON asked for."""


class EndpointsDown(Exception):
    """Every endpoint is down (its health check failed after the tries)."""


# --- one HTTP request -----------------------------------------------------------------------------------------------

def base_url(url: str) -> str:
    """'http://host:port', '.../v1' or '.../v1/' -> 'http://host:port/v1'; 'host:port' (no scheme, as vLLM and
    SGLang print their address) is taken as http://host:port. ValueError for another scheme or no host."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")) or not urllib.parse.urlsplit(url).hostname:
        raise ValueError(f"endpoint {url!r} is not an http(s) URL of a server: give e.g. http://127.0.0.1:30000")
    return url if url.endswith("/v1") else url + "/v1"


def check_args(ap, args):
    """The tools' --endpoint and --timeout, checked before anything runs: ap.error (exit status 2) naming the fix."""
    for url in args.endpoint:
        try:
            base_url(url)
        except ValueError as e:
            ap.error(f"--endpoint: {e}")
    if not 0 < args.timeout < float("inf"):
        ap.error(f"--timeout {args.timeout:g} must be more than 0: the seconds to wait for one answer (e.g. 600)")


def server_message(body: bytes) -> str:
    """The error text of an OpenAI-style error body ({"error": {"message"}} or vLLM's {"message"}), else the body."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg)[:500]
    except ValueError:
        pass
    return body.decode("utf-8", "replace").strip()[:500] or "(no message)"


def request_json(url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    """GET (body None) or POST JSON -> the decoded reply. Rejected for HTTP 4xx but 429, and 500; Transient
    otherwise."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        msg = server_message(e.read() or b"")
        if 400 <= e.code < 500 and e.code != 429 or e.code == 500:
            raise Rejected(url, e.code, msg, FIXES.get(e.code, "")) from None
        raise Transient(f"{url}: HTTP {e.code}: {msg}") from None
    except urllib.error.URLError as e:   # connection refused, unknown host; a timeout while connecting
        raise Transient(f"{url}: {e.reason}") from None
    except (OSError, http.client.HTTPException) as e:   # reset, timeout while reading, a torn reply
        raise Transient(f"{url}: {type(e).__name__}: {e}") from None
    try:
        obj = json.loads(raw)
        assert isinstance(obj, dict)
    except (ValueError, AssertionError):
        raise Transient(f"{url}: the reply is not a JSON object: {raw[:200]!r}") from None
    return obj


def backoff_s(attempt: int) -> float:
    """Sleep before try attempt + 2 (attempt 0 -> the 2nd try)."""
    return min(RETRY_BACKOFF_S * 2 ** attempt, RETRY_BACKOFF_MAX_S)


def with_retries(fn, tries: int, what: str, log=None, retry_on=(Transient,)):
    """fn() with up to `tries` tries on `retry_on` errors, sleeping backoff_s between and printing each retry on one
    line; anything else (Rejected) and the last try's error propagate."""
    for attempt in range(tries):
        try:
            return fn()
        except retry_on as e:
            if attempt == tries - 1:
                raise
            wait = backoff_s(attempt)
            print(f"{what}: {e}; retry {attempt + 2}/{tries} in {wait:g} s", file=log or sys.stderr,
                  flush=True)
            time.sleep(wait)


def api_seed(seed: int, key: int) -> int:
    """The API's `seed` of a request from the run's seed and the request's own key: 31 bits (what every server
    takes), the same in every run."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest(), "little") % 2 ** 31


def exit_rejected(tool: str, err: Rejected):
    """Print what the server refused and what to fix, then exit with status 2 (rows already written stay)."""
    print(f"{tool}: stopped: {err}\n{tool}: nothing written is lost: fix this and run the same command again to go "
          f"on", file=sys.stderr, flush=True)
    raise SystemExit(2)


def connect(tool: str, args, completions=False, thinking=None) -> "Pool":
    """The tools' --endpoint, --served-model, --concurrency, --timeout and --retries -> a Pool, probed before any
    row. A refused probe (a wrong --served-model, a model without a chat template) exits with status 2 and the fix;
    a server that does not answer is SystemExit naming it."""
    pool = Pool(args.endpoint, args.served_model, args.concurrency, args.timeout, args.retries)
    try:
        pool.probe(completions, thinking)
    except Rejected as e:
        exit_rejected(tool, e)
    except EndpointsDown as e:
        raise SystemExit(f"{tool}: {e}")
    return pool


def choices_of(reply: dict, url: str, chat: bool) -> list[Choice]:
    """The choices of a completion reply. A chat message's reasoning (`reasoning_content` from SGLang and vLLM,
    `reasoning` from newer vLLM, both from a server that runs a reasoning parser) is put back in front of the answer
    as `<think>\\nREASONING\\n</think>\\n\\nANSWER`, the text the model generated: Qwen3-style templates render it as
    the think block (and drop it from earlier turns), and data.chat.has_reasoning sees it."""
    try:
        raw = reply["choices"]
        assert isinstance(raw, list) and raw
    except (KeyError, AssertionError):
        raise Transient(f"{url}: the reply has no choices: {str(reply)[:200]}") from None
    out = []
    for c in raw:
        if chat:
            msg = c.get("message") or {}
            text = msg.get("content")
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            if isinstance(reasoning, str) and reasoning.strip():   # content is null when cut mid-thought
                text = f"<think>\n{reasoning.strip()}\n</think>\n\n{(text or '').strip()}"
        else:
            text = c.get("text")
        if not isinstance(text, str):
            raise Transient(f"{url}: the reply holds no text: {str(c)[:200]}")
        out.append(Choice(text, "length" if c.get("finish_reason") == "length" else "stop", None))
    used = (reply.get("usage") or {}).get("completion_tokens")
    if isinstance(used, int) and len(out) == 1:
        out[0] = out[0]._replace(tokens=used)
    return out


def chat_request(messages, max_tokens, temperature=0.0, seed=None, thinking=None, **extra) -> tuple[str, dict]:
    """-> (path, body) of a chat completion. thinking: chat_template_kwargs.enable_thinking (None: not sent)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, **extra}
    if seed is not None:
        body["seed"] = seed
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    return "chat/completions", body


def completion_request(prompt, max_tokens, temperature=0.0, n=1, seed=None, stop=None, **extra) -> tuple[str, dict]:
    """-> (path, body) of a raw completion of `prompt` (a string), n choices, `stop` strings; extra fields as given
    (vLLM / SGLang: stop_token_ids; vLLM: add_special_tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "n": n, **extra}
    if seed is not None:
        body["seed"] = seed
    if stop:
        body["stop"] = stop
    return "completions", body


# --- one server -----------------------------------------------------------------------------------------------------

class Endpoint:
    """One server: its /v1 URL, the model name it is asked for, its context length (None when not reported)."""

    def __init__(self, url: str, timeout: float = 600.0, tries: int = 3):
        self.url, self.timeout, self.tries = base_url(url), timeout, tries
        self.model, self.max_len, self.prompt_tokens = None, None, None
        self.down = False

    def list_models(self) -> list[dict]:
        """GET /v1/models -> its `data` list ({"id", and "max_model_len" from vLLM})."""
        reply = request_json(self.url + "/models", timeout=min(self.timeout, 30.0))
        data = reply.get("data")
        if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
            raise Transient(f"{self.url}/models: not a model list: {str(reply)[:200]}")
        return data

    def post(self, path: str, body: dict, timeout: float | None = None) -> list[Choice]:
        """One try of POST /v1/<path> with the model filled in -> its choices."""
        url = f"{self.url}/{path}"
        return choices_of(request_json(url, {"model": self.model, **body}, timeout or self.timeout), url,
                          path.startswith("chat"))

    def chat(self, messages, max_tokens, **kw) -> Choice:
        """/v1/chat/completions, one try (chat_request's keywords)."""
        return self.post(*chat_request(messages, max_tokens, **kw))[0]

    def complete(self, prompt, max_tokens, **kw) -> list[Choice]:
        """/v1/completions, one try (completion_request's keywords): n choices."""
        return self.post(*completion_request(prompt, max_tokens, **kw))

    def probe(self, served_model=None, completions=False, thinking=None):
        """Before any row: the model name (the one served, or `served_model`, which must be among them), its
        context length, a one-token chat request (and a raw completion with `completions`). Rejected with what to
        fix; Transient after the tries when the server does not answer."""
        models = with_retries(self.list_models, self.tries, "openai_client: probe")
        names = [m["id"] for m in models]
        if served_model is None:
            if len(names) != 1:
                raise Rejected(f"{self.url}/models", None, f"the server serves {len(names)} models ({names})",
                               "Choose one with --served-model NAME")
            served_model = names[0]
        elif served_model not in names:
            raise Rejected(f"{self.url}/models", None, f"it does not serve a model named {served_model!r}; it serves "
                           f"{names}", "Give one of these as --served-model, or leave --served-model out when the "
                           "server serves one model")
        self.model = served_model
        info = next(m for m in models if m["id"] == served_model)
        self.max_len = info.get("max_model_len") if isinstance(info.get("max_model_len"), int) else None
        wait = min(self.timeout, PROBE_TIMEOUT_S)
        try:
            url = f"{self.url}/chat/completions"
            body = {"model": self.model, **chat_request(PROBE_MESSAGES, 1, thinking=thinking)[1]}
            reply = with_retries(lambda: request_json(url, body, wait), self.tries, "openai_client: probe")
            self.prompt_tokens = (reply.get("usage") or {}).get("prompt_tokens")
            choices_of(reply, url, chat=True)
            if completions:
                url = f"{self.url}/completions"
                with_retries(lambda: self.post(*completion_request("Hi", 1), timeout=wait), self.tries,
                             "openai_client: probe")
        except Transient as e:
            raise EndpointsDown(f"{self.url} lists model {self.model!r} but did not answer a one-token request in "
                                f"{self.tries} tries of up to {wait:g} s ({e}): check the server's log (is it still "
                                f"loading, or stuck?), then run again") from None
        except Rejected as e:
            what = "a one-token chat request" if url.endswith("chat/completions") else \
                "a one-token raw completion"
            raise Rejected(e.url, e.status, f"{e.message} (the probe: {what} to model {self.model!r})",
                           "Check that the server runs this model with a chat template (vLLM: --chat-template) and "
                           "accepts /v1/completions") from None


# --- several servers ------------------------------------------------------------------------------------------------

class Pool:
    """Endpoints sharing one queue of requests (see the module docstring)."""

    def __init__(self, urls, served_model=None, concurrency=16, timeout=600.0, tries=3, log=None):
        if not urls:
            raise ValueError("no endpoint given")
        if concurrency < 1 or tries < 1:
            raise ValueError(f"concurrency ({concurrency}) and tries ({tries}) must be at least 1")
        self.endpoints = [Endpoint(u, timeout, tries) for u in urls]
        self.served_model, self.concurrency, self.tries, self.log = served_model, concurrency, tries, log
        self.lock = threading.Lock()

    def say(self, text):
        print(f"openai_client: {text}", file=self.log or sys.stderr, flush=True)

    @property
    def max_len(self):
        """The smallest context length the endpoints report (None when none does)."""
        lens = [e.max_len for e in self.endpoints if e.max_len]
        return min(lens) if lens else None

    def probe(self, completions=False, thinking=None):
        """Probe every endpoint (a listed endpoint that does not answer is an error: likely a wrong URL). Rejected
        when they serve different models: one output holds one model's answers."""
        for e in self.endpoints:
            try:
                e.probe(self.served_model, completions, thinking)
            except Transient as err:
                raise EndpointsDown(f"{e.url} does not answer after {self.tries} tries ({err}). Start the server, "
                                    f"or check the URL and port") from None
            self.say(f"{e.url}: model {e.model!r}" + (f", context {e.max_len:,} tokens" if e.max_len else ""))
            if e.model != self.endpoints[0].model:
                raise Rejected(e.url, None, f"it serves {e.model!r}, {self.endpoints[0].url} serves "
                               f"{self.endpoints[0].model!r}: one run's rows must come from one model",
                               "Give endpoints that serve one model, or --served-model NAME when each of them "
                               "serves a model of that name")

    def healthy(self, e: Endpoint) -> bool:
        try:
            with_retries(e.list_models, self.tries, "openai_client: health check", self.log)
            return True
        except (Transient, Rejected):
            return False

    def run(self, pending: deque, request):
        """Yields (tag, [Choice] or None, error or None) in completion order for the tags taken from the left of
        `pending`, which the caller may append to while iterating. request(tag) -> (path, body), made in the
        caller's thread when the tag is sent. error: the Rejected (HTTP 400, 500) or Transient that failed the request.
        Raises Rejected (a 4xx that is not a row's own) and EndpointsDown; then the requests in flight are not
        reported."""
        live = [e for e in self.endpoints if not e.down]
        if not live:
            raise EndpointsDown("no endpoint is up")
        work, results, stop = queue.Queue(), queue.Queue(), threading.Event()
        capacity = self.concurrency * len(live)
        waiting, reported = {}, {}   # worker thread -> (endpoint, when its request was sent); URL -> next report

        threads = [threading.Thread(target=self._worker, args=(e, work, results, stop, waiting), daemon=True,
                                    name=f"openai-{e.url}-{i}")
                   for e in live for i in range(self.concurrency)]
        for t in threads:
            t.start()
        inflight, bad_in_row = 0, 0
        try:
            while True:
                while pending and inflight < capacity:
                    tag = pending.popleft()
                    path, body = request(tag)
                    work.put((tag, path, body, 0))
                    inflight += 1
                if not inflight:
                    return
                try:
                    kind, tag, choices, err = results.get(timeout=SLOW_REQUEST_S / 4)
                except queue.Empty:
                    self._report_slow(waiting, reported)
                    continue
                self._report_slow(waiting, reported)
                if kind == "down":
                    if all(e.down for e in self.endpoints):
                        raise EndpointsDown(f"every endpoint is down ({', '.join(e.url for e in self.endpoints)}); "
                                            f"the last error: {err}")
                    continue
                inflight -= 1
                if kind == "rejected":
                    if err.status not in ROW_STATUSES:
                        raise err
                    bad_in_row += 1
                    if bad_in_row >= BAD_REQUESTS_STOP:
                        raise Rejected(err.url, err.status, f"{err.message} ({bad_in_row} requests in a row)",
                                       "Every request is refused: check the settings the requests carry "
                                       "(--max-new-tokens against the context length, the model)")
                else:
                    bad_in_row = 0 if kind == "ok" else bad_in_row
                yield tag, choices, err
        finally:
            stop.set()
            for _ in threads:
                work.put(None)

    def _worker(self, e: Endpoint, work: queue.Queue, results: queue.Queue, stop: threading.Event, waiting: dict):
        """One of run's threads for endpoint `e`: takes (tag, path, body, attempt) from `work` until a None or `stop`,
        puts (kind, tag, choices, error) on `results`; retries a Transient with backoff, then hands the request to the
        other endpoints when `e` itself is down. `waiting` (thread -> (endpoint, when sent)) is what _report_slow
        reads."""
        while not stop.is_set():
            item = work.get()
            if item is None or stop.is_set():
                return
            if e.down:                  # found down by another of its workers: leave the work to the others
                work.put(item)
                return
            tag, path, body, attempt = item
            me = threading.get_ident()
            try:
                waiting[me] = (e, time.monotonic())   # _report_slow reads it
                try:
                    choices = e.post(path, body)
                finally:
                    del waiting[me]
                results.put(("ok", tag, choices, None))
                continue
            except Rejected as err:
                results.put(("rejected", tag, None, err))
                continue
            except Transient as err:
                if e.down:              # another request found it down meanwhile: hand this one over
                    work.put((tag, path, body, 0))
                    return
                if attempt + 1 < self.tries:
                    wait = backoff_s(attempt)
                    self.say(f"{err}; retry {attempt + 2}/{self.tries} in {wait:g} s")   # err names the URL
                    time.sleep(wait)
                    work.put((tag, path, body, attempt + 1))
                    continue
                if self.healthy(e):     # the server answers: the request itself fails
                    results.put(("failed", tag, None, err))
                    continue
                with self.lock:
                    e.down = True
                    left = [x.url for x in self.endpoints if not x.down]
                self.say(f"{e.url} is down ({err}); " + (f"its requests go to {', '.join(left)}" if left else
                                                         "no endpoint is left"))
                work.put((tag, path, body, 0))
                results.put(("down", None, None, err))
                return

    def _report_slow(self, waiting: dict, reported: dict):
        """A line per endpoint whose oldest request has waited SLOW_REQUEST_S, again after as long again: a
        server that takes requests but never answers is seen while the run waits."""
        now = time.monotonic()
        slow = {}
        for e, sent in list(waiting.values()):
            if now - sent >= SLOW_REQUEST_S:
                n, oldest = slow.get(e, (0, now))
                slow[e] = (n + 1, min(oldest, sent))
        for e, (n, oldest) in slow.items():
            if now >= reported.get(e.url, 0.0):
                reported[e.url] = now + SLOW_REQUEST_S
                self.say(f"{e.url}: {n} request(s) waiting for an answer, the oldest for {now - oldest:.0f} s "
                         f"(--timeout {e.timeout:g} s)")
