"""Weighted text rows, drawn by a hash: the openers (data.synthesize --openers) and system prompts (data.synthesize /
data.regenerate --systems) that steer generated data.

A file is JSONL of {"name", "text", "weight"} (weight > 0, default 1; "" text: nothing steered, e.g. the template's
own system turn); an opener row may also set "prompt_tokens" (an integer >= 1). A draw depends on its key string
alone (built by the caller from --seed, the stream and the row's index or id), so a resumed or re-windowed run draws
the same rows.
"""
import hashlib
import json
import math
from pathlib import Path
from typing import NamedTuple


class Weighted(NamedTuple):
    name: str
    text: str
    weight: float
    prompt_tokens: int | None = None  # openers: the cap on the model's continuation of it (None: --prompt-tokens)


def draw(rows, key: str) -> Weighted | None:
    """One of `rows`, drawn by weight from a hash of `key` alone; None when there are none."""
    if not rows:
        return None
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "little") >> 11) / 2 ** 53 * sum(o.weight for o in rows)   # uniform in [0, total)
    for o in rows:
        u -= o.weight
        if u < 0:
            return o
    return rows[-1]


def read(path: Path, tool: str, flag: str, what: str, example: str, caps: bool = False,
         strip: bool = False) -> list[Weighted]:
    """A weighted file -> [Weighted]; SystemExit naming the tool, `flag`, the file and the line of a bad row. caps:
    rows may set "prompt_tokens"; strip: texts are stripped of surrounding whitespace (an opener's trailing space or
    newline is meant)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"{tool}: {flag} {path} is not UTF-8 text ({e}); save it as UTF-8 JSONL")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            body, weight, cap = row["text"], float(row.get("weight", 1.0)), row.get("prompt_tokens") if caps else None
            assert isinstance(body, str) and weight > 0 and math.isfinite(weight)
            assert cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1)
        except (ValueError, KeyError, TypeError, AssertionError, AttributeError):
            raise SystemExit(f"{tool}: {path}:{n} is not {what}: want a JSON object with a \"text\" string, an optional "
                             f"\"weight\" > 0" + (" and an optional \"prompt_tokens\" integer >= 1" if caps else "")
                             + f", e.g. {example}")
        out.append(Weighted(str(row.get("name", n)), body.strip() if strip else body, weight, cap))
    if not out:
        raise SystemExit(f"{tool}: {flag} {path} holds no {what.split(' ', 1)[1]}")
    return out
