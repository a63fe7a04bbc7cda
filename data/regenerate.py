"""Have the target write the assistant turns itself, so the drafter learns the target's distribution.

    python -m data.regenerate --input prompts.jsonl --output regen.jsonl --model PATH          # local (model.engine)
        [--systems data/default/systems.jsonl]
    python -m data.regenerate --input prompts.jsonl --output regen.jsonl --endpoint http://127.0.0.1:30000 \
        [http://10.0.0.2:30000 ...] [--served-model NAME] --concurrency 32                    # SGLang / vLLM servers

Input: what data.prepare reads (.jsonl / .json / .parquet, .gz too, or a `datasets` folder), rows in the OpenAI
`messages` or ShareGPT `conversations` format, parsed by data.chat.normalize_messages, so regeneration accepts and
rejects exactly what training does; a rejected row is skipped and counted by its RowError reason. The final
assistant turns of a row are what gets regenerated and are not read (prompt-only rows are fine). With `--turns all`
(default) every original assistant turn is dropped and the target answers each user turn in order; `--turns last`
keeps the conversation up to its last user (or tool) turn and regenerates only the final answer. Output rows: the
input row with `messages` replaced and `finish_reasons` added (one per generated turn: "stop" or "length").
`--systems data/default/systems.jsonl` gives each row without a system message of its own one drawn by weight (from
--seed and the row id alone, as data.synthesize --systems draws), so the answers are written, and trained on, under
the variety of system prompts served traffic comes with; the output row keeps it.

Local generation runs model.engine (continuous batching, CUDA graphs; `--batch-size` slots, 0 = as many as fit in
free GPU memory, `--max-len` tokens each); `--engine hf` runs transformers `generate` instead, the slow reference.
Both write the same greedy rows. Sampled rows (`--temperature` > 0) from the engine depend only on `--seed`, the
row id and the turn, so a resumed run samples what an uninterrupted one would have.

Server generation (data/openai_client.py) sends one /v1/chat/completions request per turn, --concurrency per
endpoint, the rows shared by all the endpoints given. Before any row each server is probed: the model name (the
one /v1/models lists, or --served-model, which must be among them), and a one-token chat request. A refused
request (HTTP 4xx: a wrong model name, a template error) stops the run with exit status 2 and what to fix; it is
never retried. Connection errors, timeouts, HTTP 429 and 5xx but 500 are retried (--retries tries, backoff
doubling from 0.5 s to 8 s); a request that still fails while its server answers fails its row (into the errors
file below), a 400 (a prompt longer than the context) or 500 (the server failed on it) for one request at once.
A server that stops answering is dropped and its requests go to the others; with none left the run stops (exit
status 1) and the rows in flight are not recorded as failed. A sampled request carries the API's `seed` from --seed,
the row id and the turn: a server that honours it answers a resumed row as an uninterrupted run would (vLLM and
SGLang only up to batch invariance).

Resumable: finished rows are appended (flushed) as they complete; a rerun skips the ids already in the output and
drops a torn last line of its own rows (that prompt is redone); an --output whose lines are not this tool's rows (a
prompt file given by mistake, a text file), that holds an id twice, that is the --input, or that data.synthesize
wrote, is refused and left as it is. OUTPUT.stats.json records the settings that shape the rows (the model:
--model's config.json and weights fingerprint, or the served model name; --turns, --max-new-tokens,
--temperature, --thinking, --seed, --systems) before the first row: a resume with others is refused, as
data.synthesize refuses it. One run at a time writes an --output (OUTPUT.lock, as data.synthesize). A prompt that
still fails after `--retries` tries goes to OUTPUT.errors.jsonl and is attempted again on the next run; it never
stops the job. Ctrl-C or SIGTERM ends the run with exit status 1, the rows written kept, the rows in flight not
recorded as failed, and prints the command that goes on.
"""
import argparse
import hashlib
import json
import os
import shlex
import signal
import sys
import time
from collections import Counter, deque
from pathlib import Path

from data import openai_client as oc
from data import resume
from data import weighted
from data.chat import ROLE_ALIASES, RowError, has_reasoning, normalize_messages
from data.prepare import read_rows
from model.hub import resolve_model_path

NUM_EXAMPLES = 5          # skipped input rows printed with their file:line
RETRYABLE = (OSError, ValueError, KeyError, IndexError)   # errors of a local batch that get --retries tries
PLACEHOLDER = {"role": "assistant", "content": "(regenerated)"}  # lent to normalize_messages, see prompt_turns
ENGINE_CHUNK = 32         # fast engine: conversations per engine call, in slots (bounds the prompts held; each call
                          # ends with its slots draining, ~1/ENGINE_CHUNK of the time)
HF_BATCH = 32             # --engine hf: conversations per generate call when --batch-size is 0


# --- rows -----------------------------------------------------------------------------------------------------------

def conversation(row: dict):
    """The row's raw turn list, picked as data.chat.normalize_messages picks it."""
    return row["messages"] if row.get("messages") is not None else row.get("conversations")


def row_id(row: dict) -> str:
    if row.get("id") is not None:
        return str(row["id"])
    conv = conversation(row)
    return "sha1:" + hashlib.sha1(json.dumps(conv, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _is_answer(turn) -> bool:
    role = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
    return isinstance(role, str) and ROLE_ALIASES.get(role.lower()) == "assistant"


def prompt_turns(row, turns: str) -> tuple[list[dict], list[dict]]:
    """-> (history sent as is, turns that each get one generated answer, in order). Raises RowError.

    turns="last": the history is everything before the last user/tool turn. turns="all": the history is the first
    system message and every user turn is answered afresh; a conversation with tool turns cannot be (its tool
    results answer the original assistant's calls), so it is RowError("tool_turns")."""
    conv = conversation(row) if isinstance(row, dict) else None
    if not isinstance(conv, list) or not conv:
        normalize_messages(row)  # always raises here, with training's reason: malformed_json, missing_messages
    raw = list(conv)
    while raw and _is_answer(raw[-1]):  # the answers to regenerate: not read, so an empty one is fine
        raw.pop()
    if not raw:
        raise RowError("no_user_turn", "only assistant turns")
    # normalize_messages wants a conversation that ends on an answer: lend it one, then take it back
    msgs = normalize_messages({"messages": raw + [PLACEHOLDER]})[:-1]
    if not msgs or msgs[-1]["role"] not in ("user", "tool"):
        raise RowError("no_user_turn", f"last turn is {msgs[-1]['role'] if msgs else 'an empty system turn'}")
    if turns == "last":
        return msgs[:-1], msgs[-1:]
    if any(m["role"] == "tool" for m in msgs):
        raise RowError("tool_turns", "tool results answer the original calls: use --turns last")
    return [m for m in msgs if m["role"] == "system"][:1], [m for m in msgs if m["role"] == "user"]


def with_system(history: list[dict], systems, seed: int, rid: str) -> list[dict]:
    """history with a system prompt drawn by weight from `systems` (--systems; from a hash of --seed and the row id
    alone) when it has none of its own; "" (the template's default) or no --systems leaves it as it is."""
    if any(m["role"] == "system" for m in history):
        return history
    sp = weighted.draw(systems, f"system/{seed}/{rid}")
    return [{"role": "system", "content": sp.text}] + history if sp and sp.text else history


def read_prompts(path: Path, turns: str, limit: int = 0, systems=(), seed: int = 0):
    """-> (list of (row, history, asks), Counter of skipped reasons, duplicate ids). SystemExit when `path` cannot
    be read at all; a bad row is skipped, counted, and the first few are printed with their file:line. systems:
    --systems' rows (with_system)."""
    prompts, skipped, ids, dupes = [], Counter(), set(), 0
    for n, (src, text, err, detail) in enumerate(read_rows(path), 1):
        if limit and n > limit:
            break
        try:
            if err:
                raise RowError(err, detail)
            row = json.loads(text)
            history, asks = prompt_turns(row, turns)
        except ValueError as e:  # RowError, or json's error for a line that is not JSON
            skipped[getattr(e, "reason", "malformed_json")] += 1
            if skipped.total() <= NUM_EXAMPLES:
                print(f"regenerate: skipping {src}: {e}", file=sys.stderr)
            continue
        rid = row_id(row)
        if rid in ids:
            dupes += 1
            continue
        ids.add(rid)
        prompts.append((row, with_system(history, systems, seed, rid), asks))
    return prompts, skipped, dupes


def output_row(row) -> None:
    """Raises (KeyError, TypeError, ValueError) unless `row` is a row this tool writes (Sink.done)."""
    if not (isinstance(row["id"], str) and isinstance(row["messages"], list)
            and isinstance(row["finish_reasons"], list)):
        raise ValueError("want an \"id\", a \"messages\" list and a \"finish_reasons\" list")


def read_done(output: Path) -> set[str]:
    """Ids already written (data.resume.read_back: a torn last line is cut off and its prompt redone, nothing else
    is changed; a file of other JSON, e.g. a prompt file given as --output, is refused). An id written twice (two
    runs at once, before the lock) is refused, as data.synthesize refuses it: skipping the copies would leave a
    file that trains on those rows twice, and which of two different answers to keep is the user's call."""
    owned = (resume.owner(output) or ("",))[0] == "regenerate"
    ids = Counter(row["id"] for row in resume.read_back(output, "regenerate", output_row, owned))
    twice = [i for i, n in ids.items() if n > 1]
    if twice:
        raise SystemExit(f"regenerate: {output} holds {len(twice):,} id(s) more than once (e.g. {twice[0]!r}): two "
                         f"runs wrote it at once. It was left as it is: keep the first row of each id, then run "
                         f"again")
    return set(ids)


def run_config(args, pool=None) -> dict:
    """The settings that shape the rows, recorded in OUTPUT.stats.json before the first row; a resumed run must
    have the same (as data.synthesize's). The model: --model's config.json and weights fingerprint, or the name
    the servers serve (a server does not show its weights)."""
    cfg = Path(args.model) / "config.json" if args.model else None
    return {"model_config": resume.file_hash(cfg) if cfg and cfg.exists() else None,
            "model_weights": resume.weights_fingerprint(args.model) if args.model else None,
            "served_model": pool.endpoints[0].model if pool else None,
            "turns": args.turns, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "thinking": args.thinking, "seed": args.seed,
            "systems": resume.file_hash(args.systems) if args.systems else None}


def check_resume(output: Path, config: dict, have_rows: bool):
    """SystemExit when rows exist and OUTPUT.stats.json says other settings (or another model) made them; then
    this run's settings are recorded. Rows from before the settings were recorded are taken as this run's, with a
    note."""
    old = resume.read_settings(output, "regenerate")
    if have_rows and old is None:
        print(f"regenerate: note: {output} has no {resume.stats_path(output).name} (written before the settings "
              f"were recorded): its rows are taken as made by this run's model and settings, recorded from now on",
              file=sys.stderr)
    elif have_rows:
        resume.check_settings("regenerate", output, old["config"], config)
    tmp = Path(str(resume.stats_path(output)) + ".tmp")
    tmp.write_text(json.dumps({"tool": "regenerate", "config": config}, indent=2) + "\n")
    os.replace(tmp, resume.stats_path(output))


class Sink:
    """Appends finished rows and errors; flush + fsync per write so an interrupted run loses nothing finished."""

    def __init__(self, output: Path):
        output.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(output, "a", encoding="utf-8")
        self.err = open(str(output) + ".errors.jsonl", "a", encoding="utf-8")
        self.n_done = self.n_failed = 0

    def _write(self, f, obj):
        f.write(json.dumps(obj, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def done(self, row, messages, finish_reasons):
        self.n_done += 1
        self._write(self.out, {**{k: v for k, v in row.items() if k != "conversations"},
                               "id": row_id(row), "messages": messages, "finish_reasons": finish_reasons})

    def failed(self, row, error):
        self.n_failed += 1
        self._write(self.err, {"id": row_id(row), "error": str(error)[:500], "time": time.time()})

    def close(self):
        self.out.close()
        self.err.close()


# --- backends -------------------------------------------------------------------------------------------------------

class LocalBackend:
    """A local HF model (model.engine.load_model: bf16 on CUDA, fp32 on CPU). engine "fast": model.engine's
    continuous batching, through `stream`; engine "hf": transformers `generate` in left-padded batches, through
    `generate` (the slow reference). Both stop at model.engine.default_stop_ids."""

    def __init__(self, path, device, dtype, max_new_tokens, temperature, thinking, seed, engine="fast", slots=0,
                 max_len=4096):
        import torch
        from model.engine import Engine, auto_slots, check_family, default_stop_ids, load_model
        self.torch = torch
        self.model, self.tok = load_model(path, device, dtype)
        self.device, self.max_new, self.temperature, self.thinking = (
            self.model.device, max_new_tokens, temperature, thinking)
        self.stop_ids = default_stop_ids(self.model, self.tok)
        self.engine = None
        if engine == "fast":
            try:   # the family first: auto_slots reads config fields other families lack
                check_family(self.model.config.get_text_config())
                self.engine = Engine(self.model, max_batch=slots or auto_slots(self.model, max_len),
                                     max_len=max_len, seed=seed)
            except ValueError as e:  # a model the engine does not run
                raise SystemExit(f"regenerate: {e}")
        self.hf_tokens = 0
        torch.manual_seed(seed)

    @property
    def generated_tokens(self) -> int:
        return self.engine.stats["generated"] if self.engine else self.hf_tokens

    def encode(self, messages) -> list[int]:
        kw = {} if self.thinking is None else {"enable_thinking": self.thinking}
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def check(self, ids) -> list[int]:
        """-> ids; ValueError (naming --max-len) for a prompt the engine cannot fit."""
        self.engine.check_prompt(len(ids), self.max_new)
        return ids

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def stream(self, prompts: list[list[int]], keys: list[int]):
        """-> (index, text, finish reason) per prompt, in completion order (model.engine.Engine.generate)."""
        for i, ids, why in self.engine.generate(prompts, max_new_tokens=self.max_new, temperature=self.temperature,
                                                stop_ids=self.stop_ids, keys=keys):
            yield i, self.decode(ids), why

    def generate(self, batch: list[list[dict]]) -> list[tuple[str, str]]:
        torch = self.torch
        ids = [self.encode(m) for m in batch]
        width = max(len(x) for x in ids)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.stop_ids[0]
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=self.device)
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
        sample = self.temperature > 0
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=self.max_new,
                                      do_sample=sample, temperature=self.temperature if sample else None,
                                      top_p=None, top_k=None, pad_token_id=pad, eos_token_id=self.stop_ids)
        results = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
            self.hf_tokens += len(row) if cut is None else cut + 1
            results.append((self.decode(row[:cut] if cut is not None else row), "stop" if cut is not None else "length"))
        return results


# --- driver ---------------------------------------------------------------------------------------------------------

def run_local(backend, todo, sink, batch_size, retries, progress):
    """Batches of conversations advance turn by turn together; rows sorted by first prompt length pad less. A batch
    that still fails after its retries is redone one row at a time, so a bad row (a template error) fails alone."""
    todo = sorted(todo, key=lambda t: len(json.dumps(t[1] + t[2][:1])))
    for s in range(0, len(todo), batch_size):
        chunk = todo[s:s + batch_size]
        convs = [list(history) for _, history, _ in chunk]
        reasons = [[] for _ in chunk]
        try:
            for k in range(max(len(asks) for _, _, asks in chunk)):
                live = [i for i, (_, _, asks) in enumerate(chunk) if k < len(asks)]
                for i in live:
                    convs[i].append(chunk[i][2][k])
                answers = oc.with_retries(lambda: backend.generate([convs[i] for i in live]), retries,
                                          "regenerate: batch", retry_on=RETRYABLE)
                for i, (text, why) in zip(live, answers):
                    convs[i].append({"role": "assistant", "content": text})
                    reasons[i].append(why)
        except Exception as e:  # noqa: BLE001 - recorded per prompt, the run goes on
            if len(chunk) > 1:
                print(f"regenerate: a batch of {len(chunk)} failed ({e}); redoing it row by row", file=sys.stderr)
                run_local(backend, chunk, sink, 1, retries, progress)
            else:
                sink.failed(chunk[0][0], e)
                progress(1)
            continue
        for (row, _, _), conv, why in zip(chunk, convs, reasons):
            sink.done(row, conv, why)
        progress(len(chunk))


def sample_key(rid: str, turn: int) -> int:
    """The engine's noise key of a row's turn: a row samples the same answer whatever shares its batch, and on resume."""
    return int(hashlib.sha1(f"{rid}/{turn}".encode()).hexdigest()[:15], 16)


def run_engine(backend, todo, sink, chunk, progress):
    """Continuous batching (model.engine), `chunk` conversations at a time: every row's turn k, then turn k+1 (a
    turn's prompt needs the previous answer, and one engine call per turn keeps the engine's API a plain list).
    Rows are written as their last turn completes. A row whose template fails or whose prompt does not fit --max-len
    fails alone, before the engine runs; the engine is deterministic, so nothing is retried."""
    for start in range(0, len(todo), chunk):
        rows = todo[start:start + chunk]
        convs = [list(history) for _, history, _ in rows]
        reasons = [[] for _ in rows]
        alive = list(range(len(rows)))
        for k in range(max(len(asks) for _, _, asks in rows)):
            turn, prompts = [], []
            for i in alive:
                if k >= len(rows[i][2]):
                    continue
                convs[i].append(rows[i][2][k])
                try:
                    prompts.append(backend.check(backend.encode(convs[i])))
                except Exception as e:  # noqa: BLE001 - recorded per prompt, the run goes on
                    sink.failed(rows[i][0], e)
                    progress(1)
                    continue
                turn.append(i)
            keys = [sample_key(row_id(rows[i][0]), k) for i in turn]
            for j, text, why in backend.stream(prompts, keys):
                i = turn[j]
                convs[i].append({"role": "assistant", "content": text})
                reasons[i].append(why)
                if k == len(rows[i][2]) - 1:
                    sink.done(rows[i][0], convs[i], reasons[i])
                    progress(1)
            alive = turn


def run_http(pool, todo, sink, args, thinking, progress) -> int:
    """Every row's turns through the servers (data.openai_client.Pool), one request per turn, the next turn of a
    conversation queued ahead of new rows; a row is written when its last turn is back, or recorded as failed when
    a request of it fails (after its tries, or refused for itself: HTTP 400). A sampled request carries the API's
    seed from --seed, the row id and the turn. -> rows with an answer that holds no reasoning (counted with
    --thinking on only: the server's reasoning parser may be off, or the model does not think)."""
    convs = [list(history) + asks[:1] for _, history, asks in todo]
    reasons, reasoned = [[] for _ in todo], [True] * len(todo)

    def request(tag):
        i, k = tag
        seed = oc.api_seed(args.seed, sample_key(row_id(todo[i][0]), k)) if args.temperature > 0 else None
        return oc.chat_request(list(convs[i]), args.max_new_tokens, temperature=args.temperature, seed=seed,
                               thinking=thinking)

    no_reasoning, pending = 0, deque((i, 0) for i in range(len(todo)))
    for (i, k), choices, error in pool.run(pending, request):
        row, _, asks = todo[i]
        if error:
            sink.failed(row, error)
            progress(1)
            continue
        text = choices[0].text.strip()
        convs[i].append({"role": "assistant", "content": text})
        reasons[i].append(choices[0].finish_reason)
        reasoned[i] &= has_reasoning({"content": text})
        if k + 1 < len(asks):
            convs[i].append(asks[k + 1])
            pending.appendleft((i, k + 1))   # a started conversation first: it is written sooner
            continue
        sink.done(row, convs[i], reasons[i])
        no_reasoning += thinking is True and not reasoned[i]
        progress(1)
    return no_reasoning


class Stopped(Exception):
    """SIGTERM, raised in the main thread: the rows written stay, the run ends as a Ctrl-C does."""


def _on_sigterm(signum, frame):
    raise Stopped("SIGTERM")


def stopped(args, why: str, written: int) -> SystemExit:
    """The exit (status 1) of a run stopped by Ctrl-C or SIGTERM: what was kept and the command that goes on."""
    command = f"{shlex.quote(sys.executable)} -m data.regenerate {shlex.join(args.argv)}"
    return SystemExit(f"regenerate: stopped by {why}: {written:,} rows written to {args.output} by this run stay, "
                      f"and the rows in flight were not recorded as failed. Run the same command again to go on:\n"
                      f"  {command}")


def main(argv=None) -> dict:
    """-> counts of this run (for tests): done before, to do, skipped {reason: n}, duplicates, failed. SystemExit
    (status 1) with the command that goes on when stopped by Ctrl-C or SIGTERM."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", type=Path, required=True, help="conversations or prompts (.jsonl/.json/.parquet/folder)")
    ap.add_argument("--output", type=Path, required=True, help="JSONL to append to (resumed if it exists)")
    ap.add_argument("--model", help="local HF model folder (no server)")
    ap.add_argument("--endpoint", nargs="+", metavar="URL", help="OpenAI-compatible servers (SGLang, vLLM), e.g. "
                    "http://127.0.0.1:30000; several share the rows")
    ap.add_argument("--served-model", help="model name to ask the server for (default: the one it lists at "
                                           "/v1/models)")
    ap.add_argument("--turns", choices=["all", "last"], default="all")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--thinking", choices=["on", "off", "auto"], default="auto", help="enable_thinking for templates that have it")
    ap.add_argument("--engine", choices=["fast", "hf"], default="fast",
                    help="local backend: model.engine's continuous batching, or transformers generate (slow reference)")
    ap.add_argument("--batch-size", type=int, default=0, help="local backend: engine slots (0 = as many as fit in "
                    f"free GPU memory), or for --engine hf conversations per generate call (0 = {HF_BATCH})")
    ap.add_argument("--max-len", type=int, default=4096, help="fast engine: prompt + answer tokens per slot; a longer "
                    "prompt is recorded as failed")
    ap.add_argument("--concurrency", type=int, default=16, help="HTTP backend: requests in flight per endpoint")
    ap.add_argument("--retries", type=int, default=3, help="tries per request (HTTP: transient errors only) before "
                                                          "its prompt is recorded as failed")
    ap.add_argument("--timeout", type=float, default=600.0, help="HTTP timeout per request, seconds")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    ap.add_argument("--systems", type=Path, help="JSONL of {name, text, weight}: a system prompt drawn by weight for "
                                                 "each row without one of its own (data/default/systems.jsonl)")
    args = ap.parse_args(argv)
    args.argv = argv
    if bool(args.model) == bool(args.endpoint):
        ap.error("give exactly one of --model (local generate) or --endpoint (server)")
    if args.endpoint:
        oc.check_args(ap, args)
    for name, ok, want in (("--limit", args.limit >= 0, "0 (all) or more"),
                           ("--retries", args.retries >= 1, "at least 1"),
                           ("--batch-size", args.batch_size >= 0, "0 (automatic) or more"),
                           ("--concurrency", args.concurrency >= 1, "at least 1"),
                           ("--max-new-tokens", args.max_new_tokens >= 1, "at least 1"),
                           ("--max-len", args.max_len >= 2, "at least 2")):
        if not ok:
            ap.error(f"{name} {getattr(args, name[2:].replace('-', '_'))} must be {want}")
    if args.model:   # a folder, or a Hub id in the local Hugging Face cache
        try:
            args.model = str(resolve_model_path(args.model))
        except FileNotFoundError as e:
            ap.error(f"--model: {e}")
    if args.systems and not args.systems.is_file():
        ap.error(f"--systems {args.systems}: no such file")
    args.output = resume.real_path(args.output)   # its side files beside the file itself, whatever path leads to it
    if args.output.is_dir():
        ap.error(f"--output {args.output} is a folder: give the path of a JSONL file, e.g. "
                 f"{args.output / 'regen.jsonl'}")
    if args.output.exists() and args.input.exists() and os.path.samefile(args.output, args.input):
        ap.error(f"--output {args.output} is the --input file: the rows would be taken as already done and the "
                 f"prompts appended to; give another --output")
    with resume.locked(args.output, "regenerate"):   # one run per --output: two would write every row twice
        resume.check_owner(args.output, "regenerate")
        previous = signal.signal(signal.SIGTERM, _on_sigterm)   # a stop (timeout, kill) ends as Ctrl-C does
        try:
            return run(args)
        except (KeyboardInterrupt, Stopped) as e:   # before any row (loading, the probe): nothing to keep
            raise stopped(args, str(e) or "Ctrl-C", 0) from None
        finally:
            signal.signal(signal.SIGTERM, previous)


def run(args) -> dict:
    thinking = {"on": True, "off": False, "auto": None}[args.thinking]
    systems = []
    if args.systems:
        systems = weighted.read(args.systems, "regenerate", "--systems", "a system prompt", '{"name": "support", '
                                '"text": "You are a support agent for Acme.", "weight": 2}', strip=True)
    prompts, skipped, dupes = read_prompts(args.input, args.turns, args.limit, systems, args.seed)
    done = read_done(args.output)
    todo = [p for p in prompts if row_id(p[0]) not in done]
    why = ", ".join(f"{r} {n:,}" for r, n in skipped.most_common())
    print(f"regenerate: {len(prompts) - len(todo):,} already done, {len(todo):,} to do, "
          f"{skipped.total():,} unreadable rows skipped{f' ({why})' if why else ''}, {dupes:,} duplicate ids")
    counts = {"done_before": len(prompts) - len(todo), "todo": len(todo), "skipped": dict(skipped),
              "duplicates": dupes, "failed": 0, "no_reasoning": 0}
    if not todo:
        return counts
    from tqdm import tqdm
    pool = oc.connect("regenerate", args, thinking=thinking) if args.endpoint else None
    args.output.parent.mkdir(parents=True, exist_ok=True)
    check_resume(args.output, run_config(args, pool), bool(done))   # before any model loads and any row is written
    if args.model:
        backend = LocalBackend(args.model, args.device, args.dtype, args.max_new_tokens, args.temperature,
                               thinking, args.seed, args.engine, args.batch_size, args.max_len)
    else:
        backend = pool
    sink = Sink(args.output)
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv")
    t0 = time.perf_counter()

    def progress(n):  # tqdm shows conv/s; the local backends also count generated tokens
        bar.update(n)
        if hasattr(backend, "generated_tokens"):
            bar.set_postfix_str(f"{backend.generated_tokens / (time.perf_counter() - t0):,.0f} tok/s", refresh=False)

    try:
        if args.model and args.engine == "fast":
            run_engine(backend, todo, sink, ENGINE_CHUNK * backend.engine.S, progress)
        elif args.model:
            run_local(backend, todo, sink, args.batch_size or HF_BATCH, args.retries, progress)
        else:
            counts["no_reasoning"] = run_http(backend, todo, sink, args, thinking, progress)
    except oc.Rejected as e:   # not a row's own: every request would be refused
        oc.exit_rejected("regenerate", e)
    except oc.EndpointsDown as e:
        raise SystemExit(f"regenerate: stopped: {e}\nregenerate: the rows written stay and the rows in flight were "
                         f"not recorded as failed: start the server(s) and run the same command again to go on")
    except (KeyboardInterrupt, Stopped) as e:
        bar.close()
        raise stopped(args, str(e) or "Ctrl-C", sink.n_done) from None
    finally:
        bar.close()
        sink.close()
    wall = time.perf_counter() - t0
    counts["failed"] = sink.n_failed
    if counts["no_reasoning"]:
        print(f"regenerate: warning: {counts['no_reasoning']:,} rows got an answer without reasoning although "
              f"--thinking on (no reasoning_content or <think> block): check that the server runs a reasoning "
              f"parser and that the model thinks", file=sys.stderr)
    tokens = f", {backend.generated_tokens:,} tokens ({backend.generated_tokens / wall:,.0f} tok/s)" \
        if hasattr(backend, "generated_tokens") else ""
    print(f"regenerate: {len(todo) - sink.n_failed:,} conversations in {wall:.1f} s "
          f"({(len(todo) - sink.n_failed) / wall:.2f} conv/s){tokens}; wrote {args.output}"
          + (f"; {counts['failed']:,} failed, see {args.output}.errors.jsonl" if counts["failed"] else ""))
    return counts


if __name__ == "__main__":
    main()
