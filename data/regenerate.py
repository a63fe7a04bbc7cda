"""Have the target write the assistant turns itself, so the drafter learns the target's distribution.

    python -m data.regenerate --input prompts.jsonl --output regen.jsonl --model PATH          # local transformers
    python -m data.regenerate --input prompts.jsonl --output regen.jsonl --endpoint http://127.0.0.1:30000 \
        --served-model NAME --concurrency 32                                                  # SGLang / vLLM server

Input rows hold `messages` (OpenAI) or `conversations` (ShareGPT). With `--turns all` (default) every original
assistant turn is dropped and the target answers each user turn in order; `--turns last` keeps the conversation
up to its last user turn and regenerates only the final answer. Output rows: the input row with `messages`
replaced and `finish_reasons` added (one per generated turn: "stop" or "length").

Resumable: finished rows are appended (flushed) as they complete; a rerun skips the ids already in the output and
drops a torn last line. A prompt that still fails after `--retries` tries goes to OUTPUT.errors.jsonl and is
attempted again on the next run; it never stops the job.
"""
import argparse
import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROLE_ALIASES = {"user": "user", "human": "user", "system": "system",
                "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant"}


# --- rows -----------------------------------------------------------------------------------------------------------

def row_id(row: dict) -> str:
    if row.get("id") is not None:
        return str(row["id"])
    conv = row.get("messages", row.get("conversations"))
    return "sha1:" + hashlib.sha1(json.dumps(conv, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def prompt_turns(row: dict, turns: str) -> tuple[list[dict], list[str]]:
    """-> (history kept verbatim, user turns still to answer). Raises ValueError on a row with nothing to answer."""
    conv = row.get("messages", row.get("conversations"))
    if not isinstance(conv, list) or not conv:
        raise ValueError("no messages/conversations list")
    msgs = []
    for m in conv:
        if not isinstance(m, dict):
            raise ValueError("message is not an object")
        role = ROLE_ALIASES.get(str(m.get("role", m.get("from", ""))).lower())
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            raise ValueError(f"bad message {str(m)[:80]!r}")
        msgs.append({"role": role, "content": content})
    while msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    if not msgs or msgs[-1]["role"] != "user":
        raise ValueError("no user turn to answer")
    if turns == "last":
        return msgs[:-1], [msgs[-1]["content"]]
    history = [m for m in msgs if m["role"] == "system"][:1]
    return history, [m["content"] for m in msgs if m["role"] == "user"]


def read_done(output: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off so appends stay valid JSONL."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    good_end, done = 0, set()
    for line in data.splitlines(keepends=True):
        try:
            done.add(row_id(json.loads(line)))
        except (json.JSONDecodeError, UnicodeDecodeError):
            break
        if not line.endswith(b"\n"):
            break
        good_end += len(line)
    if good_end != len(data):
        print(f"regenerate: dropping a torn last line of {output} ({len(data) - good_end} bytes)", file=sys.stderr)
        with open(output, "r+b") as f:
            f.truncate(good_end)
    return done


class Sink:
    """Appends finished rows and errors; flush + fsync per write so an interrupted run loses nothing finished."""

    def __init__(self, output: Path):
        output.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(output, "a", encoding="utf-8")
        self.err = open(str(output) + ".errors.jsonl", "a", encoding="utf-8")

    def _write(self, f, obj):
        f.write(json.dumps(obj, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def done(self, row, messages, finish_reasons):
        self._write(self.out, {**{k: v for k, v in row.items() if k not in ("conversations",)},
                               "id": row_id(row), "messages": messages, "finish_reasons": finish_reasons})

    def failed(self, row, error):
        self._write(self.err, {"id": row_id(row), "error": str(error)[:500], "time": time.time()})


# --- backends -------------------------------------------------------------------------------------------------------

class LocalBackend:
    """transformers `generate` in left-padded batches on the local device."""

    def __init__(self, path, device, dtype, max_new_tokens, temperature, thinking, seed):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch = torch
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dt = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=True).to(device).eval()
        self.device, self.max_new, self.temperature, self.thinking = device, max_new_tokens, temperature, thinking
        torch.manual_seed(seed)

    def encode(self, messages):
        kw = {} if self.thinking is None else {"enable_thinking": self.thinking}
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)

    def generate(self, batch: list[list[dict]]) -> list[tuple[str, str]]:
        torch = self.torch
        ids = [self.encode(m) for m in batch]
        ids = [x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x for x in ids]
        width = max(len(x) for x in ids)
        pad = self.tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids], device=self.device)
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
        sample = self.temperature > 0
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=self.max_new,
                                      do_sample=sample, temperature=self.temperature if sample else None,
                                      top_p=None, top_k=None, pad_token_id=pad)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        results = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos), None)
            text = self.tok.decode(row[:cut] if cut is not None else row, skip_special_tokens=True)
            results.append((text.strip(), "stop" if cut is not None else "length"))
        return results


class HttpBackend:
    """OpenAI-compatible /v1/chat/completions (SGLang, vLLM). One request per conversation turn."""

    def __init__(self, endpoint, model, max_new_tokens, temperature, thinking, timeout):
        self.url = endpoint.rstrip("/") + ("" if endpoint.rstrip("/").endswith("/v1") else "/v1") + "/chat/completions"
        self.model, self.max_new, self.temperature, self.thinking, self.timeout = (
            model, max_new_tokens, temperature, thinking, timeout)

    def one(self, messages) -> tuple[str, str]:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_new, "temperature": self.temperature}
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            choice = json.loads(r.read())["choices"][0]
        text = choice["message"]["content"]
        if not isinstance(text, str):
            raise ValueError(f"server returned no text: {str(choice)[:200]}")
        return text.strip(), "length" if choice.get("finish_reason") == "length" else "stop"


# --- driver ---------------------------------------------------------------------------------------------------------

def with_retries(fn, retries, what):
    for attempt in range(retries):
        try:
            return fn()
        except (urllib.error.URLError, OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            if attempt == retries - 1:
                raise
            print(f"regenerate: {what} failed ({e}); retry {attempt + 2}/{retries}", file=sys.stderr)
            time.sleep(min(2 ** attempt * 0.5, 8))


def run_local(backend, todo, sink, batch_size, retries, progress):
    """Batches of conversations advance turn by turn together; rows sorted by prompt length pad less."""
    todo = sorted(todo, key=lambda t: len(json.dumps(t[1])))
    for s in range(0, len(todo), batch_size):
        chunk = todo[s:s + batch_size]
        convs = [list(h) for _, h, _ in chunk]
        reasons = [[] for _ in chunk]
        try:
            for k in range(max(len(u) for _, _, u in chunk)):
                live = [i for i, (_, _, users) in enumerate(chunk) if k < len(users)]
                for i in live:
                    convs[i].append({"role": "user", "content": chunk[i][2][k]})
                answers = with_retries(lambda: backend.generate([convs[i] for i in live]), retries, "batch")
                for i, (text, why) in zip(live, answers):
                    convs[i].append({"role": "assistant", "content": text})
                    reasons[i].append(why)
        except Exception as e:  # noqa: BLE001 - recorded per prompt, the run goes on
            for row, _, _ in chunk:
                sink.failed(row, e)
            progress(len(chunk))
            continue
        for (row, _, _), conv, why in zip(chunk, convs, reasons):
            sink.done(row, conv, why)
        progress(len(chunk))


def run_http(backend, todo, sink, concurrency, retries, progress):
    def one(item):
        row, history, users = item
        conv, reasons = list(history), []
        try:
            for u in users:
                conv.append({"role": "user", "content": u})
                text, why = with_retries(lambda: backend.one(conv), retries, row_id(row))
                conv.append({"role": "assistant", "content": text})
                reasons.append(why)
        except Exception as e:  # noqa: BLE001
            return row, None, e
        return row, conv, reasons

    with ThreadPoolExecutor(concurrency) as pool:
        for row, conv, info in pool.map(one, todo):
            if conv is None:
                sink.failed(row, info)
            else:
                sink.done(row, conv, info)
            progress(1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", type=Path, required=True, help="JSONL of conversations or prompts")
    ap.add_argument("--output", type=Path, required=True, help="JSONL to append to (resumed if it exists)")
    ap.add_argument("--model", help="local HF model folder (no server)")
    ap.add_argument("--endpoint", help="OpenAI-compatible server, e.g. http://127.0.0.1:30000")
    ap.add_argument("--served-model", default="default", help="model name the server expects")
    ap.add_argument("--turns", choices=["all", "last"], default="all")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--thinking", choices=["on", "off", "auto"], default="auto", help="enable_thinking for templates that have it")
    ap.add_argument("--batch-size", type=int, default=32, help="local backend: conversations per generate call")
    ap.add_argument("--concurrency", type=int, default=16, help="HTTP backend: requests in flight")
    ap.add_argument("--retries", type=int, default=3, help="tries per prompt before it is recorded as failed")
    ap.add_argument("--timeout", type=float, default=600.0, help="HTTP timeout per request, seconds")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    args = ap.parse_args(argv)
    if bool(args.model) == bool(args.endpoint):
        ap.error("give exactly one of --model (local generate) or --endpoint (server)")
    thinking = {"on": True, "off": False, "auto": None}[args.thinking]

    done = read_done(args.output)
    todo, bad, seen = [], 0, set(done)
    try:
        lines = args.input.read_bytes().splitlines()
    except OSError as e:
        raise SystemExit(f"cannot read prompts file {args.input}: {e}")
    for n, line in enumerate(lines[: args.limit or None], 1):
        try:
            row = json.loads(line)
            history, users = prompt_turns(row, args.turns)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            bad += 1
            if bad <= 5:
                print(f"regenerate: skipping {args.input}:{n}: {e}", file=sys.stderr)
            continue
        rid = row_id(row)
        if rid not in seen:
            seen.add(rid)
            todo.append((row, history, users))
    print(f"regenerate: {len(done):,} already done, {len(todo):,} to do, {bad:,} unreadable rows skipped")
    if not todo:
        return
    from tqdm import tqdm
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv")
    sink = Sink(args.output)
    if args.model:
        backend = LocalBackend(args.model, args.device, args.dtype, args.max_new_tokens, args.temperature,
                               thinking, args.seed)
        run_local(backend, todo, sink, args.batch_size, args.retries, bar.update)
    else:
        backend = HttpBackend(args.endpoint, args.served_model, args.max_new_tokens, args.temperature, thinking,
                              args.timeout)
        run_http(backend, todo, sink, args.concurrency, args.retries, bar.update)
    bar.close()
    print(f"regenerate: wrote {args.output}")


if __name__ == "__main__":
    main()
