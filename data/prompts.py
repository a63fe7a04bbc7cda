"""Evaluation prompts: reading a prompts file (rows of `messages`, `prompt` or `input_ids`, with optional `id` and
`category`), checking every row before any model loads, dealing a limit over the categories (`spread`), and encoding
a row exactly as training rendered it (`encode_prompt`). eval_dflash.py's docstring gives the rules; the trainer's
in-training evaluation and the tools read prompts through here too."""
import json
from collections import Counter, defaultdict
from pathlib import Path

from data.chat import render


class PromptTooLong(ValueError):
    pass


THINKING = {"auto": None, "on": True, "off": False}   # --thinking -> enable_thinking


def load_prompts(path, limit=None, categories=None) -> list[dict]:
    """The rows of a prompts JSONL, each checked (check_row) so that a bad row fails here, before any model loads.
    categories: select_categories' spec ("chat,explain" keeps those, "-system" leaves that one out), applied first;
    limit: that many rows, dealt round-robin over the categories in file order (each category's first rows), so a
    limited run still covers every category; the kept rows stay in file order."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            problem = check_row(row)
            if problem:
                raise ValueError(f"{path}:{n}: {problem}")
            row.setdefault("id", f"{Path(path).name}:{n}")
            rows.append(row)
    seen = Counter(r["id"] for r in rows)
    if dup := sorted(str(i) for i, c in seen.items() if c > 1):
        raise ValueError(f"{path}: ids must be unique (results are paired by id); repeated: {', '.join(dup[:10])}")
    if categories is not None:
        rows = select_categories(rows, categories, path)
    return spread(rows, limit) if limit else rows


def select_categories(rows, spec: str, where="prompts") -> list[dict]:
    """The rows of the categories `spec` names: a comma list, "a,b" keeps only those, "-a,-b" keeps all but those
    (a row without `category` is "all"); ValueError naming the file's categories for a spec that names none, a name
    the file does not have, or one that leaves no row."""
    names = [c.strip() for c in spec.split(",") if c.strip()]
    drop = {c[1:] for c in names if c.startswith("-")}
    keep = {c for c in names if not c.startswith("-")}
    have = list(dict.fromkeys(r.get("category", "all") for r in rows))
    if not names or "" in drop:
        raise ValueError(f"--categories {spec!r} names no category: give names to keep (a,b) or to leave out (-a,-b); "
                         f"{where} has {', '.join(have) or 'no rows'}")
    if keep and drop:
        raise ValueError(f"--categories {spec!r}: either names to keep or names to leave out (-name), not both")
    if unknown := sorted((keep | drop) - set(have)):
        raise ValueError(f"--categories: {where} has no category {', '.join(map(repr, unknown))}; it has "
                         f"{', '.join(have)}")
    kept = [r for r in rows if (r.get("category", "all") in keep if keep else r.get("category", "all") not in drop)]
    if rows and not kept:
        raise ValueError(f"--categories {spec!r} leaves no prompt of {where}: it has {', '.join(have)}")
    return kept


def refused_by_template(tokenizer, rows, enable_thinking=None) -> list[tuple[dict, str]]:
    """(row, the template's message) for each messages row the chat template will not render (e.g. a template
    without a system role: "System role not supported"); an answer placeholder is rendered as a stand-in answer."""
    out = []
    for row in rows:
        if "input_ids" in row:
            continue
        msgs = [m if m.get("content") is not None else {"role": m["role"], "content": "..."}
                for m in prompt_messages(row)]
        try:
            render(tokenizer, msgs, enable_thinking, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja's raise_exception, or any other template failure
            out.append((row, f"{type(e).__name__}: {e}"))
    return out


def template_refusal_message(refused, prompts) -> str:
    """One error for refused_by_template's list: how many of `prompts`, which categories, the first message, and
    the fix: the categories every prompt of which is refused can be left out with --categories."""
    cats = Counter(r.get("category", "all") for r, _ in refused)
    sizes = Counter(r.get("category", "all") for r in prompts)
    whole = [c for c in cats if cats[c] == sizes[c]]
    row, why = refused[0]
    fix = (f"leave them out with --categories={','.join('-' + c for c in whole)}, or give the template the role it "
           f"lacks" if len(whole) == len(cats) else "fix those rows, or give the template the role it lacks")
    return (f"the target's chat template refuses {len(refused)} of {len(prompts)} prompts (by category: "
            f"{', '.join(f'{c} {n} of {sizes[c]}' for c, n in cats.items())}; e.g. {row['id']!r}: {why}): {fix}")


def check_row(row) -> str | None:
    """What is wrong with one prompt row, or None: `messages` (a list of {role, content} with a user turn; an
    assistant turn with content null is a placeholder for the target's answer, between user turns), `prompt` (a
    string) or `input_ids` (a list of ints); optional `id` (string or int) and `category` (string)."""
    if not isinstance(row, dict):
        return f"a prompt row is a JSON object, not {type(row).__name__}"
    if "input_ids" in row:
        ids = row["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            return "`input_ids` must be a non-empty list of token ids (non-negative ints)"
    elif "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            return "`prompt` must be a non-empty string"
    elif "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in msgs):
            return "`messages` must be a list of {\"role\": ..., \"content\": ...} objects"
        roles = [m["role"] for m in msgs]
        if "user" not in roles:
            return f"`messages` has no user turn (roles {roles})"
        for i, m in enumerate(msgs):
            if m.get("content") is None and m["role"] == "assistant":
                if "user" not in roles[:i] or "user" not in roles[i + 1:]:
                    return (f"message {i} is an answer placeholder (assistant, content null): it needs a user turn "
                            f"before it and one after it")
            elif not isinstance(m.get("content"), str):
                return f"message {i} ({m['role']}) has no string `content`"
    else:
        return f"a prompt row needs `messages`, `prompt` or `input_ids`; has {sorted(row)}"
    if not isinstance(row.get("category", ""), str):
        return f"`category` must be a string, not {row['category']!r}"
    if not isinstance(row.get("id", ""), (str, int)) or isinstance(row.get("id"), bool):
        return f"`id` must be a string or an int, not {row['id']!r}"
    return None


def spread(rows, limit) -> list[dict]:
    """`limit` rows dealt round-robin over the categories (first appearance order), each category's first rows
    first; returned in file order."""
    by_cat = defaultdict(list)
    for i, r in enumerate(rows):
        by_cat[r.get("category", "all")].append(i)
    queues, keep = list(by_cat.values()), []
    while len(keep) < min(limit, len(rows)):
        for q in queues:
            if q and len(keep) < limit:
                keep.append(q.pop(0))
    return [rows[i] for i in sorted(keep)]


def has_placeholders(row) -> bool:
    return any(m["role"] == "assistant" and m.get("content") is None for m in row.get("messages") or [])


def prompt_messages(row) -> list[dict]:
    """The conversation to answer. A row with answer placeholders: all its messages (the placeholders are filled
    by encode_prompt). Otherwise the system messages before the first user turn, plus that turn: MT-Bench's
    second question in eval_prompts.jsonl refers to an answer the row does not have."""
    if "prompt" in row:
        return [{"role": "user", "content": row["prompt"]}]
    msgs = row["messages"]
    if has_placeholders(row):
        return [dict(m) for m in msgs]
    first = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
    if first is None:
        raise ValueError(f"prompt {row.get('id')!r} has no user turn")
    return [m for m in msgs[:first] if m["role"] == "system"] + [msgs[first]]


def encode_prompt(tokenizer, row, enable_thinking=None, answer=None) -> list[int]:
    """A row's prompt ids, templated as in training. answer: prompt ids -> the target's answer ids (eos dropped),
    needed by rows with placeholders: each is filled, in order, with the answer to the conversation before it."""
    if "input_ids" in row:
        return [int(t) for t in row["input_ids"]]
    assert tokenizer is not None, "prompt rows with messages/prompt need a tokenizer"

    def ids(msgs):
        text = render(tokenizer, msgs, enable_thinking, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    msgs = prompt_messages(row)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and m.get("content") is None:
            if answer is None:
                raise ValueError(f"prompt {row.get('id')!r} has an answer placeholder: encoding it needs the target")
            text = tokenizer.decode(answer(ids(msgs[:i])), skip_special_tokens=True)
            msgs[i] = {"role": "assistant", "content": text}
    return ids(msgs)
