"""Chat formats -> the target's chat template -> (input_ids, loss_mask).

normalize_messages(row) turns one input row (OpenAI `messages` or ShareGPT `conversations`) into a clean
[{role, content}] list or raises RowError(reason) with a short stable reason code that data.prepare counts.

tokenize_chat(tokenizer, messages, max_len, enable_thinking) renders the conversation ONCE with the tokenizer's own
chat template and builds the assistant mask itself (most templates have no {% generation %} markers, so
`return_assistant_tokens_mask` is not an option). Assistant turn i is located in the rendered text by characters:
  start = end of the common prefix of render(messages[:i], add_generation_prompt=True) and the full render, so the
          assistant header (and Qwen3's empty think block in non-thinking mode) stays unsupervised: it is prompt.
  end   = just past the template's end-of-turn string (`<|im_end|>`, `<|eot_id|>`, found by probing the template)
          after the turn's content: the target generates it, so the drafter must predict it.
Tokens whose first character falls in [start, end) are supervised (offset mapping of the one tokenization). When
the generation prompt is not a prefix of the render (Qwen3 with thinking off writes `<think>\n\n</think>\n\n`
that earlier turns lack), the common prefix can end inside the turn's first token (`<t` of `<tool_call>`): the
token holding that first differing character is generated text, so it is supervised too.
Working on characters of one render, rather than on token prefixes of incremental renders, also handles templates
that are not prefix-stable: Qwen3 drops the think block of earlier assistant turns once a later user turn follows.
"""
import hashlib
import json

SUPPORTED_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {  # lower-cased input role -> role; anything else is RowError("unknown_role")
    "system": "system", "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
    "function_call": "assistant",  # ShareGPT tool-call turn: its JSON value becomes `tool_calls`
}
PROBE = "Zq7 probe reply"  # content used once per template to discover its end-of-turn string
MAX_CHARS_PER_TOKEN = 32  # truncate mode cuts absurdly long rows to max_len * this many characters before rendering


class RowError(ValueError):
    """A row that cannot become a training sample. `reason` is a short stable code, `detail` a short message."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------------------------
# input formats

def decode_line(line: bytes) -> str:
    """One line of a JSONL file as text; RowError("bad_encoding") when it is not UTF-8 (a row read with replacement
    characters would train on U+FFFD)."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowError("bad_encoding", str(e)[:80])


def read_turns(row) -> list[dict]:
    """One input row (a dict or its JSON text) -> its turns as [{role, content}], the one reading of a conversation
    that data.prepare, data.regenerate and data.filters share: OpenAI {"messages": [{role, content}]} or ShareGPT
    {"conversations": [{from, value}]}, roles mapped by ROLE_ALIASES whatever their case. Each turn is judged only
    by its own form: empty turns are kept (normalize_messages judges the conversation). Raises RowError:
    malformed_json, missing_messages, malformed_message, unknown_role, non_string_content, bad_tool_call."""
    if isinstance(row, (str, bytes)):
        try:
            row = json.loads(row)
        except (ValueError, UnicodeDecodeError) as e:
            raise RowError("malformed_json", str(e)[:80])
    if not isinstance(row, dict):
        raise RowError("malformed_json", f"row is a {type(row).__name__}, not an object")
    turns = row.get("messages")
    if turns is None:
        turns = row.get("conversations")
    if turns is None:
        raise RowError("missing_messages", f"keys: {sorted(row)[:6]}")
    if not isinstance(turns, list):
        raise RowError("missing_messages", "messages is not a list")
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            raise RowError("malformed_message", f"turn is a {type(t).__name__}")
        # Parquet and datasets give every turn every column of the file: a ShareGPT turn may carry role: null
        raw_role = t.get("role") if t.get("role") is not None else t.get("from")
        role = ROLE_ALIASES.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise RowError("unknown_role", repr(raw_role)[:40])
        content = t.get("content") if t.get("content") is not None else t.get("value")
        tool_calls = t.get("tool_calls") if role == "assistant" else None
        if raw_role.lower() == "function_call":
            tool_calls, content = [_parse_tool_call(content)], ""
        if content is None and tool_calls:
            content = ""
        if not isinstance(content, str):
            raise RowError("non_string_content", f"{role} content is a {type(content).__name__}")
        msg = {"role": role, "content": content}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        reasoning = t.get("reasoning_content") if role == "assistant" else None
        if isinstance(reasoning, str) and reasoning.strip():  # Qwen3-style templates render it as the think block
            msg["reasoning_content"] = reasoning
        if role == "tool" and t.get("tool_call_id") is not None:
            msg["tool_call_id"] = t["tool_call_id"]
        messages.append(msg)
    return messages


def normalize_messages(row) -> list[dict]:
    """OpenAI {"messages": [{role, content}]} or ShareGPT {"conversations": [{from, value}]} -> [{role, content}].

    `row` may be a dict or a JSON string; its turns are read by read_turns. Empty system messages are dropped;
    assistant `tool_calls` pass through (then its content may be empty). The result has at least one assistant turn
    and ends on one. A row's `finish_reasons` (data.regenerate) marks turns cut at max_new_tokens
    (`"unfinished": True`): their end-of-turn token is not supervised.
    """
    if isinstance(row, (str, bytes)):
        try:
            row = json.loads(row)
        except (ValueError, UnicodeDecodeError) as e:
            raise RowError("malformed_json", str(e)[:80])
    turns = read_turns(row)
    if not turns:
        raise RowError("missing_messages", "messages is empty")
    messages = []
    for m in turns:
        if not m["content"].strip() and not m.get("tool_calls"):
            if m["role"] == "system":
                continue
            raise RowError("empty_content", f"empty {m['role']} turn")
        messages.append(m)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no_assistant_turn")
    reasons = row.get("finish_reasons")  # data.regenerate: one per generated turn, the last assistant turns
    if isinstance(reasons, list) and reasons:
        answers = [m for m in messages if m["role"] == "assistant"][-len(reasons):]
        for m, r in zip(answers[::-1], reasons[::-1]):
            if r == "length":  # cut by max_new_tokens: the end-of-turn the template adds was never generated
                m["unfinished"] = True
    if messages[-1]["role"] != "assistant":
        raise RowError("ends_on_user", f"last turn is {messages[-1]['role']}")
    return messages


def _parse_tool_call(value) -> dict:
    try:
        call = json.loads(value) if isinstance(value, str) else value
        return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
    except (ValueError, TypeError, KeyError) as e:
        raise RowError("bad_tool_call", str(e)[:60])


# ---------------------------------------------------------------------------------------------------------------
# template -> tokens + assistant mask

def render(tokenizer, messages, enable_thinking=None, add_generation_prompt=False) -> str:
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


_EOT_CACHE = {}


def end_of_turn(tokenizer, enable_thinking=None) -> str:
    """The string the template writes right after an assistant's content (`<|im_end|>` for ChatML), found by
    rendering a probe conversation once per template; falls back to the eos token when the template writes nothing
    there. Also checks, once, that the template can write a generation prompt (the mask's start depends on it)."""
    key = (str(tokenizer.chat_template), tokenizer.eos_token, enable_thinking)
    if key not in _EOT_CACHE:
        user = [{"role": "user", "content": "Hi"}]
        if render(tokenizer, user, enable_thinking, True) == render(tokenizer, user, enable_thinking):
            raise ValueError("chat template ignores add_generation_prompt; cannot tell the assistant header apart")
        text = render(tokenizer, user + [{"role": "assistant", "content": PROBE}], enable_thinking)
        if PROBE not in text:
            raise ValueError("chat template does not render the assistant content; cannot build a loss mask")
        eot = text[text.rindex(PROBE) + len(PROBE):].strip()
        _EOT_CACHE[key] = eot or (tokenizer.eos_token or "")
    return _EOT_CACHE[key]


def template_hash(tokenizer) -> str:
    """sha256 of the chat template text: stored in stats.json so a train/serve template mismatch is detectable."""
    tpl = tokenizer.chat_template
    return hashlib.sha256(json.dumps(tpl, sort_keys=True).encode()).hexdigest()


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first differing character: the prefixes can be long
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assistant_spans(tokenizer, messages, enable_thinking=None) -> tuple[str, list[tuple[int, int, bool]]]:
    """Render `messages` -> (text, [(start, end, diverged)] character span of each assistant turn's generated part;
    diverged: the generation prompt was not a prefix of the text, `start` is where they first differ)."""
    try:
        text = render(tokenizer, messages, enable_thinking)
    except Exception as e:  # jinja raise_exception (roles must alternate, no system role, ...)
        raise RowError("template_error", str(e)[:80])
    for m in messages:  # templates may silently drop roles they do not know (Qwen3 ignores anything but 4 roles)
        if m["role"] != "assistant" and m["content"].strip() and m["content"].strip() not in text:
            raise RowError("unsupported_role" if m["role"] == "tool" else "dropped_by_template", m["role"])
    first = next(i for i, m in enumerate(messages) if m["role"] != "system")
    if messages[first]["role"] == "assistant":
        # nothing prompts it, and the template would put its default system prompt and the assistant header in a
        # prompt we cannot render (no user turn before it): they would be supervised as if the target wrote them
        raise RowError("assistant_first", "the first non-system turn is the assistant's")
    eot = end_of_turn(tokenizer, enable_thinking)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            prompt = render(tokenizer, messages[:i], enable_thinking, add_generation_prompt=True)
        except Exception as e:
            raise RowError("template_error", f"prompt of turn {i}: {e}"[:80])
        common = _common_prefix_len(prompt, text)
        start = max(common, cursor)
        tail = m["content"].strip()[-64:]
        pos = text.find(tail, start) if tail else -1
        after = pos + len(tail) if pos >= 0 else start
        stop = text.find(eot, after) if eot else -1
        end = stop + len(eot) if stop >= 0 else (after if pos >= 0 else len(text))
        if m.get("tool_calls") and not text[start:stop if stop >= 0 else end].strip():
            # only a tool call, and the template writes nothing for it (SmolLM2's has no tool_calls): the turn would
            # train its end token after an empty answer
            raise RowError("tool_call_not_rendered", f"assistant turn {i} is a tool call the template drops")
        if m.get("unfinished") and stop >= 0:
            end = stop  # supervise the text, not the end-of-turn the template appended
        spans.append((start, end, common < len(prompt)))
        cursor = end
    return text, spans


def tokenize_chat(tokenizer, messages, max_len, enable_thinking=None, overlong="truncate"):
    """-> (input_ids list[int], loss_mask list[int]) of `messages` under the tokenizer's chat template.

    overlong: "truncate" cuts at max_len tokens; "drop" raises RowError("too_long"). Raises
    RowError("no_supervised_tokens") when fewer than two consecutive tokens are supervised (no valid anchor).
    """
    cut = False
    if overlong == "truncate":
        messages, cut = _cut_chars(messages, max_len * MAX_CHARS_PER_TOKEN)
    if enable_thinking is False and any(m["role"] == "assistant" and has_reasoning(m) for m in messages):
        raise RowError("thinking_mismatch", "reasoning in an assistant turn with thinking off")
    text, spans = assistant_spans(tokenizer, messages, enable_thinking)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask, s = [0] * len(ids), 0
    for t, (a, b) in enumerate(offsets):
        while s < len(spans) and a >= spans[s][1]:
            s += 1
        if s < len(spans):
            start, _, diverged = spans[s]
            mask[t] = int(start <= a or (diverged and a < start < b))
    if len(ids) > max_len:
        if overlong == "drop":
            raise RowError("too_long", f"{len(ids)} > {max_len} tokens")
        ids, mask = ids[:max_len], mask[:max_len]
    elif cut:  # the character cut landed inside max_len tokens: the template's end-of-turn would be fake
        raise RowError("too_long", f"over {max_len * MAX_CHARS_PER_TOKEN} characters")
    if not any(mask[t] and mask[t + 1] for t in range(len(mask) - 1)):
        raise RowError("no_supervised_tokens", f"{sum(mask)} supervised of {len(ids)}")
    return ids, mask


def has_reasoning(m) -> bool:
    """Non-empty <think>...</think> (or a `reasoning_content` field): the target would not write it with thinking off."""
    if (m.get("reasoning_content") or "").strip():
        return True
    c = m["content"]
    return "</think>" in c and c.split("</think>")[0].split("<think>")[-1].strip() != ""


def _cut_chars(messages, budget):
    """Keep a character budget of content (an over-long row is truncated anyway; this bounds the work on it)."""
    if sum(len(m["content"]) for m in messages) <= budget:
        return messages, False
    out = []
    for m in messages:
        if budget <= 0:
            break
        out.append(dict(m, content=m["content"][:budget]))
        budget -= len(m["content"])
    return out, True
