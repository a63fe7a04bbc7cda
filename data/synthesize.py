"""The target writes the prompts too: conversations from nothing but its chat template (the "Magpie" technique).

    python -m data.synthesize --model PATH --num N --out FILE.jsonl [--seed S] [--turns 1|2]
        [--system TEXT | --systems data/default/systems.jsonl]
        [--mix data/default/train_prompts.jsonl --mix-ratio 0.02] [--openers data/default/openers.jsonl]
        [--max-new-tokens 384] [--prompt-tokens 128]
        [--temperature 0.6] [--prompt-temperature 1.0] [--batch-size 256] [--attention sdpa|matmul]
        [--compile-sampler] [--device auto] [--dtype auto]
    python -m data.synthesize --endpoint URL [URL ...] --tokenizer DIR --num N --out FILE.jsonl [--served-model NAME]
        [--concurrency 16] [--retries 3] [--timeout 600] [the settings above but the engine's]

An instruction-tuned model given only its template's opening of a user turn (`<|im_start|>user\\n` after the default
system turn; found by rendering a sentinel user message and taking the text before it) writes a plausible user
message, up to its end-of-turn token or --prompt-tokens (then the message is cut: the row is rejected). The target
then answers it, as data.regenerate would. --turns 2 continues the trick: the model writes a follow-up user turn
after its own answer, then answers that. --system TEXT replaces the template's default system turn (and is kept in
the rows, so training sees the context the answers were written in). --systems FILE gives each conversation its own:
a JSONL of {"name", "text", "weight"} rows (data/default/systems.jsonl: personas, support desks, tutors, format
rules, as apps that serve a model set them), candidate <stream>/<i> drawing one by weight from a hash of --seed,
the stream and i (its own hash: the opener drawn is the same with or without --systems); "" keeps the template's
default. The model writes the user turn after that system turn, so a support desk's users ask about its product;
the row keeps the system message and the drawn row's name under "system_name".

--openers FILE steers what the self-written prompts are about: a JSONL of {"name", "text", "weight"} rows. Candidate
self/<i> draws one row (by weight, from a hash of --seed and i alone) and its user turn starts with that text, which
the model continues (e.g. "Complete the following Python function.\\n\\n```python\\ndef" makes it write a function stub
to complete; no trailing space: the model's next token carries its own); an empty text leaves the model free. An
instruction-tuned model of a few hundred million parameters, left free, writes chat questions and rarely code, while
a drafter is judged on code too. The row keeps the text under "opener"; a user turn that is only the opener (the
model ended the turn at once) is empty_user. A row may set its own "prompt_tokens", the cap on the model's
continuation of that opener (default --prompt-tokens): a prompt that carries code needs more room than a question.

Two streams of rows, each numbered from 0 by its candidates: `self/<i>` (self-written) and, with --mix, `mix/<j>`:
draw j answers the prompt perm[j % M] of the M prompts of the mix file (perm: a shuffle seeded by --seed; the
prompt's own id is kept as `prompt_id`, its first --turns user turns are answered). round(N * mix_ratio) of the N
rows come from the mix stream, the rest from the self stream. The mix file's repeats are kept (the shipped sets
repeat questions on purpose), so mix rows skip the duplicate checks; every other filter applies (data/filters.py).

Output rows are what data.prepare reads: {"id", "source": "self"|"mix:<file>", "messages", "finish_reasons" (one
per answer: "stop" or "length"), "user_finish_reasons" (self-written user turns, always "stop" when kept)}.
Rejected candidates go to OUT.rejected.jsonl with their reason; counts by reason to OUT.stats.json.

Seeded and resumable: a candidate's sampling keys depend only on (--seed, stream, index, turn), and a candidate is
judged only against those before it, so rows are the same however a run is cut into pieces. A run stopped part-way
and restarted (with the same or a larger --num) reads back OUT and OUT.rejected.jsonl, rebuilds the filter state
from them in index order, and goes on from the next index of each stream.

Candidates stream through one engine run (model.engine.Engine.run): a conversation's next turn joins the running
batch as soon as its previous one is done, so the batch stays full to the end instead of draining at every stage.
At most WINDOW_PER_SLOT * --batch-size candidates are in flight; a row is written (flushed; fsynced within a
second) once every lower index of its stream is, so a stop loses at most the candidates in flight; a SIGTERM or
Ctrl-C still records the run (rows, tokens, wall time) in OUT.stats.json and prints the final line. A self-written
opener is judged for duplicates only once every lower index's opener was, so the verdicts are those of one pass in
index order. A torn last line (it does not parse) after rows of this tool is dropped; a complete last line that only
lacks its newline is kept; a file of other JSON given as --out (a prompt file), one whose only line is not JSON, or
an output of data.regenerate is refused and left as it is. The settings that shape the
rows (--seed, --turns, --system(s), temperatures, token caps, the model's config.json and weights (their headers and
first MiB), mix, openers and held-out files) are recorded in OUT.stats.json and must match when resuming; --num,
--mix-ratio, --batch-size, --attention, --compile-sampler, --device and --dtype may change (a bf16 run samples
slightly different rows than an fp32 one, and a compiled sampler's float logs may round differently from eager).
A stream that already holds more rows than a changed --mix-ratio gives it keeps them, and the other stream makes
only what adds up to --num.

One run at a time writes an --out: the run holds OUT.lock (flock, released however the run ends; its text names
the holder), and a second run on the same --out is refused with the holder's pid, host and start time.

A stream that has tried ATTEMPTS_PER_ROW (--attempts-per-row) candidates per row it must supply stops there, short,
with the reasons printed: more attempts would not help a model whose prompts the filters keep rejecting.

Through servers (--endpoint, data/openai_client.py; SGLang, vLLM, tools/serve_openai.py): the same candidates,
filters, ordered writer, stats and resume; only the generations go elsewhere (ServerEngine). A self-written user
turn is a raw /v1/completions request of the rendered template opening (and opener) with add_special_tokens false
and the stop ids as `stop_token_ids`; an answer is a /v1/chat/completions request of the row's messages. The
template opening is rendered locally, so the served model's tokenizer and chat template must be here: --tokenizer
DIR (tokenizer.json, tokenizer_config.json, the template), or --model DIR (its weights are then fingerprinted
as the rows' model, but nothing is loaded). The probe, before any row, reads the model name from /v1/models (or
checks --served-model), its context (max_model_len, which must hold the conversation's max_len), sends a one-token
chat and a one-token completion, and warns when the server renders a chat to another token count than the local
template. OUT.stats.json records the served model names in place of the weights; a resume must see the same, and
local and server runs do not mix in one --out. A sampled request carries the API's `seed` from --seed and the
candidate's key (stream, index, turn): a server that honours seeds repeats a candidate on resume, so the rows are
those of an uninterrupted run (tools/serve_openai.py, one request at a time, does). vLLM and SGLang honour the seed
but are not batch-invariant: the same request batched with others may sample other text, so the rows after a cut
may differ from an uninterrupted run's; the rows written stay and no id is written twice either way. --concurrency
requests per endpoint are in flight (the window is WINDOW_PER_SLOT of them per request slot). A request that fails
after --retries tries while its server answers (or a 400 for that one request) rejects its candidate as
server_error, with the error in the rejected row; HTTP 4xx from the probe or for every request stops the run with
exit status 2; servers that all stop answering stop it with exit status 1, and the rerun goes on from there.

Exit status: 0 when --out holds --num rows; 1 when it holds fewer (a SIGTERM or Ctrl-C, a stream stopped short, the
servers gone), with the command that goes on from there; 2 for a bad argument or a request the server refuses.
"""
import argparse
import hashlib
import json
import math
import os
import random
import shlex
import signal
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from data import filters as F
from data import openai_client as oc
from data import resume
from data import weighted
from data.chat import end_of_turn, render, template_hash
from data.regenerate import read_prompts, row_id
from model.engine import Request
from model.hub import resolve_model_path

ATTEMPTS_PER_ROW = 3     # candidates a stream may try per row it must supply (cumulative over resumed runs)
WINDOW_PER_SLOT = 3      # candidates in flight = this * --batch-size: enough queued requests for every refill, and
                         # a stop loses at most these
TURN_OVERHEAD = 16       # tokens a template adds around one turn (role header, end-of-turn): headroom in max_len
SENTINEL = "Zq7 user sentinel"  # content of the probe user turn whose opening the model continues
STREAMS = ("self", "mix")
SERVER_ERROR = "server_error"   # rejection reason of a candidate whose server request failed (--endpoint only)


# --- the template ---------------------------------------------------------------------------------------------------

def user_opening(tok, history: list[dict]) -> str:
    """The rendered text of `history` followed by the opening of a new user turn (the template's default system
    turn first when `history` has none): what the model continues to write a user message."""
    text = render(tok, history + [{"role": "user", "content": SENTINEL}])
    if SENTINEL not in text:
        raise SystemExit("synthesize: the chat template does not render user content; cannot open a user turn")
    return text[:text.index(SENTINEL)]


def stop_ids(tok, model) -> list[int]:
    """Tokens that end a turn: the template's end-of-turn after a user and after an assistant message (when each is
    one token) and the eos ids of the tokenizer and the model's generation config."""
    ids = set()
    user = render(tok, [{"role": "user", "content": SENTINEL}])
    for text in (user[user.index(SENTINEL) + len(SENTINEL):].strip(), end_of_turn(tok)):
        enc = tok.encode(text, add_special_tokens=False) if text else []
        if len(enc) == 1:
            ids.add(enc[0])
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in (eos if isinstance(eos, list) else [eos]) + [tok.eos_token_id]:
        if e is not None:
            ids.add(int(e))
    if not ids:
        raise SystemExit("synthesize: found no end-of-turn or eos token to stop generation at")
    return sorted(ids)


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]  # the rendered template carries its own specials


def sample_key(stream: str, index: int, turn: int) -> int:
    """The engine's noise key of one generation: with the engine's seed, the sample depends on nothing else."""
    digest = hashlib.blake2b(f"{stream}/{index}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits: room for the engine's own arithmetic on it


Opener = weighted.Weighted     # an --openers or --systems row


def draw_opener(openers, seed: int, index: int) -> Opener | None:
    """The opener of candidate self/<index>: drawn by weight from a hash of (seed, index) alone, so a resumed or
    re-windowed run draws the same. None without --openers."""
    return weighted.draw(openers, f"opener/{seed}/{index}")


def draw_system(systems, seed: int, stream: str, index: int) -> Opener | None:
    """The system prompt of candidate <stream>/<index> (--systems): drawn like an opener, from its own hash of
    (seed, stream, index), so it does not change which opener a candidate draws. None without --systems."""
    return weighted.draw(systems, f"system/{seed}/{stream}/{index}")


NO_OPENER = Opener("", "", 1.0)     # a self row without --openers: the model writes the whole turn, --prompt-tokens


def read_openers(path: Path) -> list[Opener]:
    """--openers FILE -> [Opener] ("" text: the model writes freely); SystemExit naming the line of a bad row."""
    return weighted.read(path, "synthesize", "--openers", "an opener",
                         '{"name": "code", "text": "Write a Python function that", "weight": 10}', caps=True)


def read_systems(path: Path) -> list[Opener]:
    """--systems FILE -> [Opener] ("" text: the template's default system turn); SystemExit naming the line of a
    bad row."""
    return weighted.read(path, "synthesize", "--systems", "a system prompt",
                         '{"name": "support", "text": "You are a support agent for Acme.", "weight": 2}', strip=True)


# --- files ----------------------------------------------------------------------------------------------------------

def read_back(path: Path, owned: bool = False) -> list[dict]:
    """Rows already written (data.resume.read_back: a torn last line is cut, nothing else is changed; a file of
    other JSON, e.g. a prompt file given as --out, is refused). owned: the stats file says synthesize made it."""
    return resume.read_back(path, "synthesize", stream_of, owned)


def stream_of(row: dict) -> tuple[str, int]:
    """A written row's (stream, index); ValueError (or KeyError, TypeError) for anything that is not one."""
    stream, index = row["id"].split("/")
    if stream not in STREAMS or not isinstance(row["messages"], list):
        raise ValueError(f"id {row['id']!r} is not self/<i> or mix/<j>")
    return stream, int(index)


class Sink:
    """Appends kept and rejected rows. Each write is flushed (a killed process loses nothing written); fsync runs
    at most every FSYNC_S seconds and at the end (a machine crash loses at most that), since an fsync per row stalls
    the loop that keeps the engine fed."""
    FSYNC_S = 1.0

    def __init__(self, out: Path):
        out.parent.mkdir(parents=True, exist_ok=True)
        self.kept = open(out, "a", encoding="utf-8")
        self.rejected = open(rejected_path(out), "a", encoding="utf-8")
        self.synced = time.time()

    def write(self, row: dict, reason):
        f = self.rejected if reason else self.kept
        f.write(json.dumps({**row, "rejected": reason} if reason else row, ensure_ascii=False) + "\n")
        f.flush()
        if time.time() - self.synced > self.FSYNC_S:
            self.sync()

    def sync(self):
        for f in (self.kept, self.rejected):
            f.flush()
            os.fsync(f.fileno())
        self.synced = time.time()

    def close(self):
        self.sync()
        self.kept.close()
        self.rejected.close()


def rejected_path(out: Path) -> Path:
    return Path(str(out) + ".rejected.jsonl")  # beside OUT, as data.regenerate's OUT.errors.jsonl


stats_path = resume.stats_path


def write_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


file_hash = resume.file_hash


# --- one candidate --------------------------------------------------------------------------------------------------

@dataclass
class Item:
    """A candidate row in flight. steps: what it still needs, in order: "write" (the model writes a user turn),
    "answer", or ("ask", text): a given user turn (mix rows)."""
    stream: str
    index: int
    row: dict
    steps: list
    turn: int = 0                 # generations done: the key of the next one
    reason: str | None = None     # set when rejected
    opener: Opener = NO_OPENER    # the start of the first self-written user turn and its cap (--openers)
    prompt: str = ""              # the text of a "write" request in flight (a server is sent text, not ids)

    def key(self) -> int:
        return sample_key(self.stream, self.index, self.turn)


class Synth:
    """Candidates -> engine requests, one turn at a time, with the filters between the turns."""

    def __init__(self, engine, tok, stops, filters, args, mix_prompts, openers=(), systems=()):
        self.engine, self.tok, self.stops, self.filters, self.args = engine, tok, stops, filters, args
        self.mix_prompts = mix_prompts  # [(prompt id, [user texts])], in the seeded shuffled order
        self.openers = list(openers)    # [Opener] (--openers)
        self.systems = list(systems)    # [Opener] (--systems): system prompts drawn per candidate
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.tokens, self.t0, self.last_post = 0, time.time(), 0.0
        self.pending = deque()          # the engine's queue: requests whose tag is their Item
        self.waiting = {}               # self items whose opener is written, by index, until their turn to be judged
        self.judge_next = 0             # the self index whose opener is judged next
        self.finished = []              # items done (kept or rejected) since the driver last looked
        self.written = 0                # kept rows written by this run

    def new_item(self, stream: str, index: int) -> Item:
        row = {"id": f"{stream}/{index}", "source": "self" if stream == "self" else f"mix:{self.args.mix}",
               "messages": list(self.system), "finish_reasons": []}
        sp = draw_system(self.systems, self.args.seed, stream, index)
        if sp:
            row["system_name"] = sp.name
            if sp.text:
                row["messages"] = [{"role": "system", "content": sp.text}]
        if stream == "self":
            row["user_finish_reasons"] = []
            o = draw_opener(self.openers, self.args.seed, index) or NO_OPENER
            if o.text:
                row["opener"] = o.text
            return Item(stream, index, row, ["write", "answer"] * self.args.turns, opener=o)
        pid, users = self.mix_prompts[index % len(self.mix_prompts)]
        row["prompt_id"] = pid
        return Item(stream, index, row, [s for u in users[:self.args.turns] for s in (("ask", u), "answer")])

    def advance(self, it: Item, front=True):
        """Given user turns join (and are judged); then the item's next generation is queued, or it is finished."""
        while not it.reason and it.steps and isinstance(it.steps[0], tuple):
            it.row["messages"].append({"role": "user", "content": it.steps.pop(0)[1]})
            it.reason = self.judge(it)
        if it.reason or not it.steps:
            self.finished.append(it)
            return
        a = self.args
        if it.steps[0] == "write":
            first = not F.user_turns(it.row)
            cap = (first and it.opener.prompt_tokens) or a.prompt_tokens           # the opener's, first turn only
            it.prompt = user_opening(self.tok, it.row["messages"]) + it.opener.text * first
            req = Request(encode(self.tok, it.prompt), cap, a.prompt_temperature, it.key(), it)
        else:
            req = Request(encode(self.tok, render(self.tok, it.row["messages"], add_generation_prompt=True)),
                          a.max_new_tokens, a.temperature, it.key(), it)
        # started conversations go first: they finish sooner and free the reorder buffers
        self.pending.appendleft(req) if front else self.pending.append(req)

    def judge(self, it: Item):
        """-> the rejection reason of the user turn just added (not the self stream's first: see took())."""
        if len(F.user_turns(it.row)) == 1:
            return self.filters.opener_reason(it.row, dedup=False)  # mix rows: the shipped sets repeat on purpose
        return self.filters.rest_reason(it.row)

    def took(self, it: Item, out, why):
        """One generation of `it` is back: add it to the row, judge it, queue what comes next. out: the engine's
        token ids, a server's oc.Choice, or the error that failed the request after its tries (ServerEngine)."""
        if isinstance(out, Exception):
            self.failed(it, out)
            return
        if isinstance(out, oc.Choice):
            text, n = out.text, (out.tokens if out.tokens is not None
                                 else len(encode(self.tok, out.text)) + (why == "stop"))
        else:
            text, n = self.tok.decode(out, skip_special_tokens=True), len(out) + (why == "stop")
        self.tokens += n  # the stop token was generated too
        it.turn += 1
        # the first self-written user turn continues its opener's text (no strip between the two)
        text = (it.opener.text + text if it.steps[0] == "write" and not F.user_turns(it.row) else text).strip()
        if it.steps.pop(0) == "answer":
            it.row["messages"].append({"role": "assistant", "content": text})
            it.row["finish_reasons"].append(why)
            it.reason = self.filters.rest_reason(it.row)
            self.advance(it)
            return
        it.row["messages"].append({"role": "user", "content": text})
        it.row["user_finish_reasons"].append(why)
        if len(F.user_turns(it.row)) > 1:
            it.reason = self.filters.rest_reason(it.row)
            self.advance(it)
            return
        # a first self-written opener: judged against every lower index's, in index order, whatever the timing
        self.waiting[it.index] = it
        self.judge_waiting()

    def judge_waiting(self):
        while self.judge_next in self.waiting:
            nxt = self.waiting.pop(self.judge_next)
            self.judge_next += 1
            if not nxt.reason:   # (a candidate whose opener the server failed to write is judged already)
                nxt.reason = self.filters.opener_reason(nxt.row)
                if not nxt.reason:
                    self.filters.admit(nxt.row)
            self.advance(nxt)

    def failed(self, it: Item, error):
        """A server request of `it` failed after its tries (or was refused for itself): the candidate is rejected
        as server_error, with the error in the row; a first opener still waits for its turn in the index order."""
        it.reason, it.row["error"] = SERVER_ERROR, str(error)[:300]
        if it.stream == "self" and it.steps[0] == "write" and not F.user_turns(it.row):
            self.waiting[it.index] = it
            self.judge_waiting()
        else:
            self.finished.append(it)

    def post(self, bar):
        if time.time() - self.last_post > 2.0:
            self.last_post = time.time()
            bar.set_postfix_str(f"{self.tokens / (time.time() - self.t0):,.0f} gen tok/s", refresh=False)


# --- the run --------------------------------------------------------------------------------------------------------

def load_engine(args, max_len):
    """-> (engine, model); the model is only read for its generation config (tests replace this)."""
    from model.engine import Engine, load_model
    model, _ = load_model(args.model, device=args.device, dtype=args.dtype)  # the tokenizer is load_tokenizer's
    try:
        return Engine(model, max_batch=args.batch_size, max_len=max_len, seed=args.seed,
                      attention=args.attention, compile_sampler=args.compile_sampler), model
    except ValueError as e:  # a model the engine does not run
        raise SystemExit(f"synthesize: {e}")


class ServerEngine:
    """model.engine.Engine's run() over OpenAI-compatible servers (data.openai_client.Pool). A self-written user turn
    is a raw completion (/v1/completions) of the text the local engine gets as ids (the template's rendered opening
    of a user turn, as Magpie sends it; `add_special_tokens` false: the text holds the template's own), stopped at
    the same stop ids (vLLM's and SGLang's `stop_token_ids`, besides the server's eos); an answer is a chat
    completion (/v1/chat/completions) of the row's messages, which the server renders with its own template. A
    sampled request carries the API's `seed`, from --seed and the request's key: the same candidate asks with the
    same seed in every run."""

    def __init__(self, pool: oc.Pool, seed: int):
        self.pool, self.seed = pool, seed

    def run(self, pending: deque, *, stop_ids, sampled=None):
        def request(req: Request):
            seed = oc.api_seed(self.seed, req.key) if req.temperature > 0 else None
            if req.tag.steps[0] == "answer":
                return oc.chat_request(list(req.tag.row["messages"]), req.max_new, temperature=req.temperature,
                                       seed=seed)
            return oc.completion_request(req.tag.prompt, req.max_new, temperature=req.temperature, seed=seed,
                                         add_special_tokens=False, stop_token_ids=list(stop_ids))
        for req, choices, error in self.pool.run(pending, request):
            yield req, error or choices[0], None if error else choices[0].finish_reason


def connect(args, tok) -> oc.Pool:
    """--endpoint: the servers, probed (model name, context length, a chat and a raw completion) before any row.
    SystemExit (status 2 for a refused probe) naming what to fix. A template the server renders to another token
    count than --tokenizer's is reported: its answers would follow a conversation other than the rows hold."""
    pool = oc.connect("synthesize", args, completions=True)
    local = len(encode(tok, render(tok, oc.PROBE_MESSAGES, add_generation_prompt=True)))
    for e in pool.endpoints:
        if e.prompt_tokens is not None and e.prompt_tokens != local:
            print(f"synthesize: warning: {e.url} renders a one-message chat to {e.prompt_tokens} tokens, the "
                  f"tokenizer of {args.tokenizer or args.model} to {local}: check that it is the served model's "
                  f"tokenizer and chat template", file=sys.stderr)
    return pool


def load_tokenizer(path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise SystemExit(f"synthesize: cannot load the tokenizer of --model {path}: {e}")


def read_mix(args) -> list[tuple[str, list[str]]]:
    prompts, skipped, dupes = read_prompts(args.mix, "all")
    if not prompts:
        raise SystemExit(f"synthesize: no usable prompts in --mix {args.mix} (skipped: {dict(skipped)})")
    rows = [(row_id(row), [m["content"] for m in asks]) for row, _, asks in prompts]
    random.Random(args.seed).shuffle(rows)
    return rows


def run_config(args, tok, pool=None) -> dict:
    """The settings that shape the rows: a resumed run must have the same. With --endpoint, the served model names
    stand in for the weights, which a server does not show (those of --model when it is given too)."""
    folder = Path(args.model or args.tokenizer)
    cfg_file = folder / "config.json"
    return {"model_config": file_hash(cfg_file) if cfg_file.exists() else None,
            "model_weights": resume.weights_fingerprint(args.model) if args.model else None,
            **({"served_model": sorted({e.model for e in pool.endpoints})} if pool else {}),
            "chat_template": template_hash(tok),
            "seed": args.seed, "turns": args.turns, "system": args.system or None,
            "max_new_tokens": args.max_new_tokens, "prompt_tokens": args.prompt_tokens,
            "temperature": args.temperature, "prompt_temperature": args.prompt_temperature,
            "mix": file_hash(args.mix) if args.mix else None,
            "openers": file_hash(args.openers) if args.openers else None,
            **({"systems": file_hash(args.systems)} if args.systems else {}),
            "heldout": [file_hash(p) for p in [*F.HELDOUT_DEFAULTS, *args.heldout]],
            "filters": {k: getattr(F, k) for k in ("REPEAT_NGRAM", "MAX_REPEATED_NGRAM_SHARE", "MIN_LINE_CHARS",
                                                   "MAX_SAME_LINE", "MIN_ZLIB_BYTES", "MIN_ZLIB_RATIO",
                                                   "SHINGLE_WORDS", "NUM_PERM", "NEAR_DUP_JACCARD",
                                                   "HELDOUT_JACCARD")}}


def check_resume(path: Path, config: dict, have_rows: bool) -> dict:
    """-> the stats file's earlier content ({} when no row was written yet); SystemExit when rows exist and the
    settings that made them differ from this run's. A stats file from before the weights were fingerprinted (no
    "model_weights") takes this run's, with a note: its config.json hash still has to match."""
    if not have_rows:
        return {}
    out = Path(str(path).removesuffix(".stats.json"))
    old = resume.read_settings(out, "synthesize")
    if old is None:
        raise SystemExit(f"synthesize: rows exist but {path} (which records how they were made) is missing; "
                         f"restore it, or write to a new --out")
    was = old["config"]
    if "model_weights" not in was:
        print(f"synthesize: note: {path} predates the weights' fingerprint; the rows are taken as made by the "
              f"weights of --model (its config.json must still match), whose fingerprint is recorded from now on",
              file=sys.stderr)
        was["model_weights"] = config["model_weights"]
    resume.check_settings("synthesize", out, was, config)
    return old


def targets(args, kept: dict | None = None) -> dict:
    """Rows each stream supplies: round(N * mix_ratio) from the mix stream, the rest self-written. kept: rows
    already written per stream; where a stream already holds more than its share (an earlier run had a larger
    --mix-ratio), the other stream supplies only what makes N in all: rows are never removed, and never more
    than N are made."""
    n_mix = round(args.num * args.mix_ratio) if args.mix else 0
    share = {"self": args.num - n_mix, "mix": n_mix}
    kept = kept or dict.fromkeys(STREAMS, 0)
    over = {s: max(0, kept[s] - share[s]) for s in STREAMS}   # rows a stream holds past its share
    return {s: max(0, share[s] + over[s] - over[other]) for s, other in (("self", "mix"), ("mix", "self"))}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local HF model folder of the target (with --endpoint: read for its tokenizer)")
    ap.add_argument("--endpoint", nargs="+", metavar="URL", help="OpenAI-compatible servers of the target (SGLang, "
                    "vLLM) instead of the local engine, e.g. http://127.0.0.1:30000")
    ap.add_argument("--tokenizer", help="with --endpoint and no --model: a folder with the served model's tokenizer "
                                        "and chat template (the user turn's opening is rendered here)")
    ap.add_argument("--served-model", help="with --endpoint: the model name to ask for (default: the one the "
                                           "server lists at /v1/models)")
    ap.add_argument("--concurrency", type=int, default=16, help="with --endpoint: requests in flight per endpoint")
    ap.add_argument("--retries", type=int, default=3, help="with --endpoint: tries per request (transient errors)")
    ap.add_argument("--timeout", type=float, default=600.0, help="with --endpoint: seconds per request")
    ap.add_argument("--num", type=int, required=True, help="rows wanted in --out (kept rows; resumed runs count)")
    ap.add_argument("--out", type=Path, required=True, help="JSONL to append to (resumed if it exists)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=int, choices=[1, 2], default=1, help="user turns per conversation")
    ap.add_argument("--system", default="", help="system turn (default: the template's own)")
    ap.add_argument("--systems", type=Path, help="JSONL of {name, text, weight}: system prompts drawn by weight, one "
                                                 "per conversation (\"\" = the template's own; "
                                                 "data/default/systems.jsonl)")
    ap.add_argument("--mix", type=Path, help="prompt file (data.prepare formats) whose prompts make up --mix-ratio")
    ap.add_argument("--mix-ratio", type=float, default=0.0, help="share of the rows answered from --mix, 0..1")
    ap.add_argument("--openers", type=Path, help="JSONL of {name, text, weight}: the text a self-written user turn "
                                                 "starts with, drawn by weight (data/default/openers.jsonl)")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="answer cap, tokens")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="cap on a self-written user turn, tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="answers (0 = greedy)")
    ap.add_argument("--prompt-temperature", type=float, default=1.0, help="self-written user turns")
    ap.add_argument("--batch-size", type=int, default=256, help="engine slots (sequences decoded together)")
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "matmul"],
                    help="the engine's decode attention (bench.generate_bench --attention sdpa,matmul compares them)")
    ap.add_argument("--compile-sampler", action="store_true",
                    help="torch.compile the decode step's sampler (bench.generate_bench --sampler eager,compiled)")
    ap.add_argument("--heldout", type=Path, action="append", default=[],
                    help=f"more evaluation prompts to keep out (always: "
                         f"{', '.join(p.name for p in F.HELDOUT_DEFAULTS)})")
    ap.add_argument("--attempts-per-row", type=float, default=ATTEMPTS_PER_ROW,
                    help="candidates a stream may try per row it supplies before it stops short")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args(argv)
    for name, ok in (("--num", args.num >= 1), ("--max-new-tokens", args.max_new_tokens >= 1),
                     ("--prompt-tokens", args.prompt_tokens >= 1), ("--batch-size", args.batch_size >= 1),
                     ("--attempts-per-row", args.attempts_per_row >= 1)):
        if not ok:
            ap.error(f"{name} must be at least 1")
    if not 0.0 <= args.mix_ratio <= 1.0:
        ap.error(f"--mix-ratio must be within 0..1, not {args.mix_ratio}")
    if bool(args.mix) != (args.mix_ratio > 0):
        ap.error("--mix and --mix-ratio go together: give both (e.g. --mix data/default/train_prompts.jsonl "
                 "--mix-ratio 0.02) or neither")
    if args.endpoint:
        if not (args.tokenizer or args.model):
            ap.error("--endpoint needs the served model's tokenizer here (a server does not send it): give "
                     "--tokenizer DIR (its tokenizer.json, tokenizer_config.json, chat template) or --model DIR")
        if args.concurrency < 1 or args.retries < 1:
            ap.error("--concurrency and --retries must be at least 1")
        oc.check_args(ap, args)
        args.batch_size = args.concurrency * len(args.endpoint)  # the requests in flight: the window's unit
    elif not args.model:
        ap.error("give --model DIR (the local engine) or --endpoint URL (a server)")
    elif args.tokenizer:
        ap.error("--tokenizer goes with --endpoint; the local engine uses --model's tokenizer")
    for name in ("--model", "--tokenizer"):   # a folder, or a Hub id in the local Hugging Face cache
        if getattr(args, name[2:]):
            try:
                setattr(args, name[2:], str(resolve_model_path(getattr(args, name[2:]))))
            except FileNotFoundError as e:
                ap.error(f"{name}: {e}")
    args.out = resume.real_path(args.out)   # its side files beside the file itself, whatever path leads to it
    if args.out.is_dir():
        ap.error(f"--out {args.out} is a folder: give the path of a JSONL file, e.g. {args.out / 'rows.jsonl'}")
    if args.system and args.systems:
        ap.error("--system and --systems exclude each other: one system prompt for every row, or a file to draw from")
    for name, path in [("--mix", args.mix)] * bool(args.mix) + [("--openers", args.openers)] * bool(args.openers) + \
            [("--systems", args.systems)] * bool(args.systems) + [("--heldout", p) for p in args.heldout]:
        if not path.is_file():
            ap.error(f"{name} {path}: no such file")
    return args


class Incomplete(SystemExit):
    """Raised at the end of a run that left fewer than --num rows in --out (a stop, or a stream that ran out of
    attempts): the exit status is 1, so `synthesize && prepare` does not prepare a partial set. `summary` is what
    main would have returned."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


def main(argv=None) -> dict:
    """-> this run's summary (for tests): the stats written to OUT.stats.json. Incomplete (exit status 1) when --out
    holds fewer than --num rows at the end, with the command that goes on from there."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    with resume.locked(args.out, "synthesize"):   # one run per --out: two would write every row twice
        resume.check_owner(args.out, "synthesize")
        return run(args, argv)


def run(args, argv) -> dict:
    t_start = time.time()
    tok = load_tokenizer(args.tokenizer or args.model)
    pool = connect(args, tok) if args.endpoint else None   # the probe, before anything is written
    config = run_config(args, tok, pool)
    written = read_written(args.out)
    old = check_resume(stats_path(args.out), config, any(written.values()))

    filters = F.Filters(F.heldout_prompts([*F.HELDOUT_DEFAULTS, *args.heldout]))
    openers = read_openers(args.openers) if args.openers else []
    systems = read_systems(args.systems) if args.systems else []
    check_system_role(tok, [args.system] + [sp.text for sp in systems])
    stats = rebuild_stats(written, filters, pool)
    want = targets(args, {s: stats[s]["kept"] for s in STREAMS})
    if want != targets(args):
        print(f"synthesize: note: {args.out} holds self {stats['self']['kept']:,}, mix {stats['mix']['kept']:,} rows, "
              f"one stream more than --mix-ratio {args.mix_ratio:g} gives it (an earlier run had another): this run "
              f"makes only what adds up to --num {args.num:,} (self {want['self']:,}, mix {want['mix']:,})",
              file=sys.stderr)
    nxt = {s: stream_of(rows[-1])[1] + 1 if rows else 0 for s, rows in written.items()}
    kept0 = sum(st["kept"] for st in stats.values())
    mix_prompts = read_mix(args) if want["mix"] else []
    max_len = check_max_len(args, tok, openers, mix_prompts, systems)
    if pool and pool.max_len and max_len > pool.max_len:
        raise SystemExit(f"synthesize: a conversation may need {max_len:,} tokens, more than the server's context "
                         f"({pool.max_len:,}, max_model_len at /v1/models): lower --max-new-tokens or --prompt-tokens, "
                         f"or serve a longer context")
    print(f"synthesize: {kept0:,} rows already in {args.out} (self {stats['self']['kept']:,}, mix "
          f"{stats['mix']['kept']:,}), want {args.num:,} (self {want['self']:,}, mix {want['mix']:,}); "
          f"max_len {max_len:,} tokens; up to {WINDOW_PER_SLOT * args.batch_size:,} candidates in flight")

    runs = old.get("runs", [])

    def record():
        write_json(stats_path(args.out), summarize(config, stats, nxt, runs))
    record()  # the settings are on disk before the first row is
    todo = {s: max(0, want[s] - stats[s]["kept"]) for s in STREAMS}
    if not sum(todo.values()):
        print(f"synthesize: nothing to do ({kept0:,} rows >= {args.num:,})")
        return summarize(config, stats, nxt, runs)
    engine, model = load_engine(args, max_len) if not pool else (ServerEngine(pool, args.seed), None)
    synth = Synth(engine, tok, stop_ids(tok, model), filters, args, mix_prompts, openers, systems)
    stopped, refused = generate(synth, stats, want, nxt, args, kept0, record)
    wall = time.time() - synth.t0
    runs.append(run_record(args, synth, engine, pool, wall, stopped))
    record()
    print_run(args, synth, stats, want, wall, t_start)
    summary = summarize(config, stats, nxt, runs)
    if refused:
        oc.exit_rejected("synthesize", refused)
    short = short_message(args, argv, stats, want, nxt, stopped)
    if short:
        raise Incomplete(short, summary)
    return summary


def read_written(out: Path) -> dict:
    """-> {stream: [row]}: the rows --out and its rejected file already hold, per stream, in index order. Exits when
    an id is there twice."""
    written = {s: [] for s in STREAMS}  # rows of both files, per stream, in index order
    owned = (resume.owner(out) or ("",))[0] == "synthesize"
    back = read_back(out, owned) + read_back(rejected_path(out), owned)
    twice = [i for i, n in Counter(r["id"] for r in back).items() if n > 1]
    if twice:   # two runs wrote at once (before OUT.lock): counting the copies as rows would overshoot --num
        raise SystemExit(f"synthesize: {out} and its rejected file hold {len(twice):,} id(s) more than once (e.g. "
                         f"{twice[0]}): two runs wrote them at once. Keep the first row of each id in both files, "
                         f"then run again")
    for row in back:
        written[stream_of(row)[0]].append(row)
    for rows in written.values():
        rows.sort(key=lambda r: stream_of(r)[1])
    return written


def rebuild_stats(written: dict, filters, pool) -> dict:
    """-> {stream: stats} of the rows already written; `filters` admits their self-written prompts again, as the
    runs that wrote them did."""
    stats = {s: F.empty_stats() for s in STREAMS}
    for st in stats.values() if pool else ():
        st["rejected"][SERVER_ERROR] = 0
    for s, rows in written.items():  # the filter state, rebuilt as it was built: in index order
        for row in rows:
            reason = row.get("rejected")
            if s == "self" and not filters.opener_reason(row):
                filters.admit(row)
            F.count(stats[s], row, reason)
    return stats


def generate(synth, stats, want, nxt, args, kept0, record) -> tuple:
    """generate_rows under a progress bar, the sink and a SIGTERM handler, all closed again however it ends.
    -> (stopped, refused): what stopped the run early (None when it finished) and the oc.Rejected that did, if one
    did."""
    from tqdm import tqdm
    bar = tqdm(total=args.num, initial=min(kept0, args.num), desc="synthesize", unit="conv", smoothing=0.1)
    sink = Sink(args.out)
    stopped = refused = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # a stop (timeout, kill) still records this run
    try:
        generate_rows(synth, stats, want, nxt, args, sink, bar, record)
    except (Stopped, KeyboardInterrupt) as e:
        stopped = str(e) or "SIGINT"
    except oc.EndpointsDown as e:   # the candidates in flight are redone by the next run
        stopped = f"the servers going down ({e})"
    except oc.Rejected as e:        # not a candidate's own: every request would be refused
        stopped, refused = f"a refused request (HTTP {e.status})", e
    finally:
        signal.signal(signal.SIGTERM, previous)
        sink.close()
        bar.close()
    return stopped, refused


def run_record(args, synth, engine, pool, wall, stopped) -> dict:
    """-> this run's entry in OUT.stats.json's "runs": rows, tokens, speed and the settings that set the speed."""
    n_written = synth.written
    es = getattr(engine, "stats", {})  # busy: tokens per slot-step the engine ran (1.0: every slot, every step)
    busy = round(es["generated"] / (es["decode_steps"] * engine.S), 3) if es.get("decode_steps") else None
    return {"num": args.num, "rows": n_written, "generated_tokens": synth.tokens, "engine_busy": busy,
            "wall_s": round(wall, 1), "conv_per_s": round(n_written / wall, 2),
            "gen_tok_per_s": round(synth.tokens / wall, 1), "batch_size": args.batch_size,
            **({"endpoints": [e.url for e in pool.endpoints], "concurrency": args.concurrency} if pool else
               {"attention": args.attention, "compile_sampler": args.compile_sampler, "device": args.device,
                "dtype": args.dtype}),
            **({"stopped": stopped} if stopped else {})}


def print_run(args, synth, stats, want, wall, t_start):
    """The run's closing lines: each stream's filter stats, then what was written and how fast."""
    n_written = synth.written
    for s in STREAMS:
        if want[s] or stats[s]["kept"]:
            print(f"synthesize: {s}: {F.format_stats(stats[s])}")
    print(f"synthesize: wrote {n_written:,} rows to {args.out} in {wall:,.1f} s: {n_written / wall:,.2f} conv/s, "
          f"{synth.tokens / wall:,.0f} generated tok/s ({synth.tokens:,} tokens, rejected and unwritten candidates "
          f"too; {time.time() - t_start:,.1f} s with loading)")


def short_message(args, argv, stats, want, nxt, stopped) -> str | None:
    """-> None when every stream has its rows, else what is missing and the exact command that goes on."""
    kept = sum(stats[s]["kept"] for s in STREAMS)
    if all(stats[s]["kept"] >= want[s] for s in STREAMS):
        return None
    python = f"{shlex.quote(sys.executable)} -m data.synthesize"
    command = f"{python} {shlex.join(argv)}"
    head = f"synthesize: {args.out} holds {kept:,} of --num {args.num:,} rows"
    if stopped:
        return f"{head}: stopped by {stopped}. Run the same command again to go on from here:\n  {command}"
    lines = [head + ":"]
    for s in STREAMS:
        if stats[s]["kept"] < want[s]:
            lines.append(f"  the {s} stream stopped short at {stats[s]['kept']:,} of {want[s]:,} rows after "
                         f"{nxt[s]:,} candidates ({args.attempts_per_row:g} per row); its rejections: "
                         f"{F.format_stats(stats[s])}")
    again = [a for a in argv if not a.startswith("--attempts-per-row=")]
    if "--attempts-per-row" in again:
        i = again.index("--attempts-per-row")
        del again[i:i + 2]
    again += ["--attempts-per-row", f"{2 * args.attempts_per_row:g}"]   # as many candidates again as so far
    lines.append(f"More attempts go on from here (attempts count over every run on this --out):\n  {python} "
                 f"{shlex.join(again)}\nor, for a model whose prompts the filters keep rejecting, "
                 f"start a new --out with a higher --prompt-temperature or --prompt-tokens (settings that shape "
                 f"the rows cannot change on resume)")
    return "\n".join(lines)


def check_system_role(tok, texts):
    """SystemExit when a system turn is asked for (--system, --systems) and the chat template will not render one
    (e.g. "System role not supported"): before any model loads, not as a traceback at the first row."""
    text = next((t for t in texts if t), None)
    if text is None:
        return
    try:
        user_opening(tok, [{"role": "system", "content": text}])
    except Exception as e:  # noqa: BLE001 - jinja's raise_exception, or any other template failure
        raise SystemExit(f"synthesize: the chat template refuses a system turn ({type(e).__name__}: {e}); drop "
                         f"--system / --systems, or give the template a system role")


def check_max_len(args, tok, openers, mix_prompts, systems=()) -> int:
    """-> the engine's tokens per slot: the template and, per turn, the longest user turn and the answer cap.
    SystemExit when that passes the model's max_position_embeddings (a huge "prompt_tokens" in the openers file
    would otherwise ask the engine for a KV cache of that length)."""
    longest_mix = max((len(encode(tok, u)) for _, users in mix_prompts for u in users[:args.turns]), default=0)
    # the longest first user turn an opener can make: its text and its cap (a later turn: --prompt-tokens)
    longest_opener = max(openers, default=None,
                         key=lambda o: len(encode(tok, o.text)) + (o.prompt_tokens or args.prompt_tokens))
    opener_len = (len(encode(tok, longest_opener.text)) + (longest_opener.prompt_tokens or args.prompt_tokens)
                  if longest_opener else args.prompt_tokens)
    template = max(len(encode(tok, user_opening(tok, [{"role": "system", "content": text}] if text else [])))
                   for text in [args.system] + [sp.text for sp in systems])   # the longest system turn
    user_len = max(opener_len, args.prompt_tokens, longest_mix)
    max_len = template + args.turns * (user_len + args.max_new_tokens + 2 * TURN_OVERHEAD)
    limit = max_positions(Path(args.model or args.tokenizer))
    if limit and max_len > limit:
        which = (f"the opener {longest_opener.name!r} of --openers {args.openers} (\"prompt_tokens\" "
                 f"{longest_opener.prompt_tokens:,})" if longest_opener and longest_opener.prompt_tokens
                 and user_len == opener_len else f"--prompt-tokens {args.prompt_tokens:,}"
                 if user_len == args.prompt_tokens else f"a --mix prompt of {longest_mix:,} tokens")
        raise SystemExit(f"synthesize: a conversation may need {max_len:,} tokens ({args.turns} turn(s) of a user turn "
                         f"up to {user_len:,} tokens, from {which}, and --max-new-tokens {args.max_new_tokens:,}), "
                         f"more than --model's max_position_embeddings {limit:,}: lower them to fit")
    return max_len


def max_positions(model: Path) -> int | None:
    """The model's max_position_embeddings from its config.json (a multimodal config's text_config); None if absent."""
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg if isinstance(cfg, dict) else {}
    n = cfg.get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


def summarize(config, stats, nxt, runs) -> dict:
    """What OUT.stats.json holds: counts over every run that wrote to OUT (they are recounted from the files)."""
    total = F.empty_stats()
    for st in stats.values():
        total["kept"] += st["kept"]
        total["length_capped"] += st["length_capped"]
        for r, n in st["rejected"].items():
            total["rejected"][r] = total["rejected"].get(r, 0) + n   # server_error: --endpoint runs only
    return {"tool": "synthesize", "config": config, **total, "candidates": dict(nxt), "streams": stats, "runs": runs}


class Stopped(Exception):
    """SIGTERM, raised in the main thread: the rows written so far stay, the run is recorded."""


def _on_sigterm(signum, frame):
    raise Stopped("SIGTERM")


def generate_rows(synth, stats, want, nxt, args, sink, bar, record):
    """One engine run, topped up with new candidates as rows come back, until each stream has its rows or its
    attempts; rows are written in index order per stream, counted in synth.written."""
    issued, last_record = dict(nxt), time.time()
    done = {s: {} for s in STREAMS}  # finished items by index, until every lower index is written
    synth.judge_next = nxt["self"]
    window = WINDOW_PER_SLOT * args.batch_size

    def wanted(s):
        """Candidates stream s should have in flight: what its rows still missing need at its keep rate so far."""
        need = want[s] - stats[s]["kept"]
        if need <= 0:
            return 0
        tried = stats[s]["kept"] + sum(stats[s]["rejected"].values())
        rate = (stats[s]["kept"] + 1) / (tried + 2)  # kept per candidate so far (Laplace's rule: 1/2 before any)
        cap = math.ceil(args.attempts_per_row * want[s])
        return min(math.ceil(need / rate * 1.1), cap - nxt[s])

    def top_up():
        while sum(issued[s] - nxt[s] for s in STREAMS) < window:
            short = [s for s in STREAMS if issued[s] - nxt[s] < wanted(s)]
            if not short:
                return
            s = min(short, key=lambda s: (issued[s] - nxt[s]) / wanted(s))  # the stream furthest behind its share
            synth.advance(synth.new_item(s, issued[s]), front=False)
            issued[s] += 1

    def write_finished():
        for it in synth.finished:
            done[it.stream][it.index] = it
        synth.finished.clear()
        for s in STREAMS:
            while nxt[s] in done[s] and stats[s]["kept"] < want[s]:
                it = done[s].pop(nxt[s])
                sink.write(it.row, it.reason)
                F.count(stats[s], it.row, it.reason)
                nxt[s] += 1
                if not it.reason:
                    synth.written += 1
                    bar.update(1)
            if stats[s]["kept"] >= want[s]:
                done[s].clear()  # past the stream's last row: not written, so a larger --num regenerates it the same

    top_up()
    write_finished()  # mix candidates can be rejected before any generation
    sampled = args.temperature > 0 or args.prompt_temperature > 0
    for req, ids, why in synth.engine.run(synth.pending, stop_ids=synth.stops, sampled=sampled):
        synth.took(req.tag, ids, why)
        write_finished()   # first, so top_up sees the kept counts it tops up against
        top_up()
        write_finished()   # new mix candidates rejected at once
        synth.post(bar)
        if time.time() - last_record > 10.0:
            record()
            last_record = time.time()
    record()


if __name__ == "__main__":
    main()
