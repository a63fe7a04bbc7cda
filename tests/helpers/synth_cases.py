"""data/synthesize.py's scripted engine, for tests/unit/test_synthesize.py (in-process runs),
tests/jobs/test_synthesize_jobs.py (runs as processes, stopped and killed) and tests/unit/test_openai_client.py
(WORDS): `ScriptedEngine` (the model.engine API, text drawn from (seed, key) alone), the fixture `scripted` (it replaces
synthesize's engine and caches the tokenizer), and reading a run's JSONL rows."""
import functools
import hashlib
import json
import random
from pathlib import Path

import pytest

from data import synthesize as syn

WORDS = ("apple river code stone light cloud music paper glass table window garden number letter planet engine "
         "forest bridge market silver winter summer ocean castle doctor pencil rocket tunnel violin zebra").split()
BANK = ["explain how a rocket engine works in simple words for a child who loves planets and stars and the moon "
        "at night please", "write a short poem about the ocean in winter when the light is silver and the wind"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_id(path):
    rows = read_jsonl(path)
    assert len({r["id"] for r in rows}) == len(rows), "duplicate ids"
    return {r["id"]: r for r in rows}


class ScriptedEngine:
    """The model.engine API with text drawn from (seed, key) alone: prompts are recorded, not read. Some draws end at
    the stop token, some run past max_new_tokens, some copy a BANK sentence (duplicates) or loop (repetition)."""

    def __init__(self, tok, seed, stop_after=True):
        self.tok, self.seed, self.stop_after, self.prompts, self.max_new = tok, seed, stop_after, [], []

    def run(self, pending, *, stop_ids, sampled=None):
        assert stop_ids
        while pending:
            batch = [pending.popleft() for _ in range(min(len(pending), 3))]
            random.Random(len(self.prompts)).shuffle(batch)  # completion order is the engine's business
            for r in batch:
                self.prompts.append(r.prompt)
                self.max_new.append(r.max_new)
                yield r, *self.draw(r.key, r.max_new)        # the consumer appends follow-ups meanwhile

    def draw(self, key, max_new_tokens):
        rng = random.Random(hashlib.sha256(f"{self.seed}/{key}".encode()).digest())
        kind = rng.random()
        if kind < 0.2:
            text = rng.choice(BANK)
        elif kind < 0.3:
            text = rng.choice(BANK).replace("please", "now")  # a near duplicate
        elif kind < 0.35:
            text = "again and again " * 20
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) + "?"
        ids = self.tok.encode(text, add_special_tokens=False)
        ends = self.stop_after and rng.random() < 0.85
        return (ids, "stop") if ends and len(ids) <= max_new_tokens else (ids[:max_new_tokens], "length")


LOAD_TOKENIZER = syn.load_tokenizer


@functools.cache
def cached_tokenizer(path):
    """Each run loads the tokenizer; the tests load it once (0.9 s for Qwen3's)."""
    return LOAD_TOKENIZER(path)


@pytest.fixture
def scripted(monkeypatch):
    """Replaces the engine; -> an object with the engines made (one per run) and a `never_stop` switch."""
    class Made:
        engines, never_stop = [], False

    def load_engine(args, max_len):
        Made.engines.append(ScriptedEngine(syn.load_tokenizer(args.model), args.seed, stop_after=not Made.never_stop))
        return Made.engines[-1], None
    monkeypatch.setattr(syn, "load_engine", load_engine)
    monkeypatch.setattr(syn, "load_tokenizer", cached_tokenizer)
    return Made
