"""Measure a DFlash drafter the way it is served (docs/ALGORITHM.md, section 5): tau, losslessness, speed, and DDTree.

    python eval_dflash.py --target ~/.cache/dflash/smollm2-135m-instruct --drafter runs/x/export \
        --prompts data/default/eval_prompts.jsonl --limit 40 --max-new-tokens 256 --tree-budget 32 --out tau.json
    python eval_dflash.py --target ... --drafter runs/x/checkpoints/step_*/drafter --prompts ... --workers 16

Greedy speculative decoding, batch 1, with a KV cache for the target (HF DynamicCache) and for the drafter's
context (model.drafter.DrafterCache):
  prefill the prompt with hidden states -> first token = target argmax; drafter context = the prompt's features
  loop: block [last token, MASK x (B-1)] at positions start..start+B-1 -> drafter argmax for slots 1..B-1 -> one
        target forward over the block -> accept the longest prefix with draft[k] == target argmax at k-1 -> commit
        it plus the target's bonus token -> crop the target cache to the committed tokens minus the bonus (whose KV
        the next forward makes) -> drafter context += the target's features of the accepted tokens.
Choices (documented here once):
  - tau of a prompt = mean over verify steps of the tokens that step committed (accepted + 1, cut at eos and at
    max_new_tokens); the first token comes from the prefill and is no step. Overall / per category: mean over
    prompts (docs/ALGORITHM.md, section 5), each with its SE (sd / sqrt(n)); the macro-average weighs every
    category equally: the mean of the category means, SE sqrt(sum of the categories' SE^2) / C (category_stats).
    The histogram counts committed tokens per step (1..B).
  - Prompt rows: `messages` (OpenAI), `prompt` (a string, sent as one user message) or pre-tokenized `input_ids`;
    optional `id` (unique), `category` (a string). Every row is checked when the file is read, before any model
    loads. Multi-turn rows keep the system messages before the first user turn and that turn only (MT-Bench's
    second question refers to an answer the row does not have), unless they hold answer placeholders
    ({"role": "assistant", "content": null}, data/default/eval_broad.jsonl's `multiturn`): each is filled with the
    target's plain greedy answer to the conversation before it (EARLIER_ANSWER_TOKENS at most, untimed, not
    counted, so fixed for a given target) and tau is measured on the answer to the last user turn. Templated
    exactly as in training (data.chat.render with add_generation_prompt=True, then tokenized without special
    tokens). --limit N keeps N rows dealt round-robin over the categories (spread), so every category is measured.
  - --drafter-dtype: the drafter may run in another dtype than the target (bf16 proposals, an fp32 target): the
    target verifies every token, so the output stays the target's greedy output.
  - A prompt with prompt_len + max_new_tokens + B - 1 > max_position_embeddings (the last block drafts up to B-1
    positions past the last token) raises PromptTooLong naming it, before any decoding; on_too_long="skip"
    (CLI --skip-long) drops it with a warning instead.
  - Losslessness: the reference is plain greedy decoding with the same KV-cache forward, one token at a time (not
    model.generate); any difference is reported with its first position. On GPU in bf16 a block forward and a
    one-token forward round differently, so a rare near-tie can flip: that shows up here as a mismatch, honestly.
  - --method fast (model.fastdecode): the same loop and acceptance rule on static KV caches (target and drafter
    context), each step kind one CUDA graph, the host reading back one small tensor per step: its cost is the GPU
    work, not HF's per-token Python. Its greedy baseline runs the same machinery (a fair speedup) and is its
    losslessness reference; in fp32 its tokens, steps and tau equal --method decode's. Block verification only.
  - DDTree: best-first tree over the drafter's per-slot top-k (one drafter run per step, node at depth d uses slot d),
    verified in one target forward with a 4D additive ancestor-only mask (attn_implementation sdpa or eager). After
    it the target cache holds every tree node: the accepted path's entries are gathered in place (a node's KV only
    depends on its ancestors under that mask, so they equal a sequential forward's), no re-feed.
  - Timing: wall time of the whole decode (prefill included) with and without the drafter, after an untimed
    warm-up; tokens/s = generated tokens / seconds summed over prompts.
  - Several drafters (--drafter a b ..., evaluate_drafters): one target load, one warm-up (with the first drafter)
    and one greedy reference per prompt serve them all; each gets its own full result and report block. Prompts are
    checked against the largest block size, so every drafter sees the same prompts.
  - --workers N: N processes of this script (hidden --shard k/N), each loading the target on the same device and
    dealt the kept prompts round-robin (worker k: k, k+N, k+2N, ...: prompt files keep categories, hence lengths,
    grouped, so contiguous shards would finish unevenly); each writes its per-prompt results to a temp JSON, the
    parent interleaves them back into prompt order (merge_shards) and aggregates them with the same summarize() as
    one process: per-prompt results, tau, histogram and losslessness equal --workers 1's. Tokens/s are then per
    stream under contention, comparable only between runs with --workers 1 (the report says so). Torch CPU threads
    per worker: cpu_count // N. A failing worker kills the others and fails the run with the end of its stderr.
  - --out JSON: with one drafter the result dict that evaluate() returns (plus target/drafter/prompts_file/torch/
    workers in its config); with several {"drafters": [{"drafter": path, ...that result...}, ...]} in the order
    given. main() returns the same object.
"""
import argparse
import heapq
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

from data.chat import render
from model.engine import SUPPORTED
from model.drafter import DrafterCache
from model.export import load_drafter
from model.fastdecode import ATTENTION, FastDecoder
from model.hub import resolve_model_path
from model.target import Target

MAX_NEW_TOKENS = 256   # tokens generated per prompt (eos stops earlier)
METHODS = ("decode", "fast", "walk")   # --method: see evaluate_drafters
TREE_TOP_K = 8         # DDTree: candidate tokens per slot, i.e. children per tree node
WARMUP_TOKENS = 8      # untimed warm-up decode on the first prompt (CUDA init, allocator)
EARLIER_ANSWER_TOKENS = 256   # multi-turn rows: the target's greedy answer to each earlier turn, cut here


class PromptTooLong(ValueError):
    pass


# ---------------------------------------------------------------------------
# Prompts

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


# ---------------------------------------------------------------------------
# Target forward with a KV cache

def eos_ids(model, tokenizer=None) -> set[int]:
    """The tokenizer's eos plus the generation config's eos id(s) (Qwen3/SmolLM2 list <|im_end|> there)."""
    ids = set()
    for v in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        ids |= set(v if isinstance(v, (list, tuple)) else [v] if v is not None else [])
    return ids


def _cache_kw(model) -> str:
    # transformers 5.2x renamed past_key_values -> cache (the old name still works, with a warning)
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def target_forward(model, ids, positions, cache, layer_ids=None, mask=None, last_only=False):
    """ids, positions [n] -> logits [n or 1, V], features [n, K*H] of layer_ids (None without layer_ids).
    Appends the n tokens' KV to cache. mask: None (causal) or a 4D additive mask [1, 1, n, past + n]."""
    out = model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, use_cache=True,
                output_hidden_states=bool(layer_ids), logits_to_keep=1 if last_only else 0,
                **{_cache_kw(model): cache})
    # decoder layer l == hidden_states[l + 1] (index 0 is the embedding output; the last layer's entry is after the
    # final norm, and model.target.Target's features of it are normed alike, so training reads what this reads)
    feats = torch.cat([out.hidden_states[l + 1][0] for l in layer_ids], dim=-1) if layer_ids else None
    return out.logits[0], feats


def crop_cache(cache, n: int):
    """Keep the first n positions (negative crop = tokens to remove: transformers 5 and 4 agree on that form)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


def gather_cache(cache, keep):
    """Keep the positions `keep` [n] (in order) of every layer: the accepted path of a verified tree."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]


def device_name(device) -> str:
    """What a speed was measured on: the GPU's name, or the CPU with its torch threads."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_decode(model, prompt_ids, max_new_tokens, eos) -> list[int]:
    """Plain greedy decoding, one token per forward: the losslessness reference."""
    dev, L = model.device, len(prompt_ids)
    cache = DynamicCache()
    logits, _ = target_forward(model, torch.tensor(prompt_ids, device=dev), torch.arange(L, device=dev), cache,
                               last_only=True)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in eos:
        pos = L + len(out) - 1
        logits, _ = target_forward(model, torch.tensor([out[-1]], device=dev), torch.tensor([pos], device=dev), cache)
        out.append(int(logits[-1].argmax()))
    return out


# ---------------------------------------------------------------------------
# Proposals

class DrafterProposer:
    """Proposals of a Drafter with its context KV cache. The decode loop calls reset() after the prefill,
    propose() once per step and commit() with the features of the accepted tokens. Anything with these three
    methods and `layer_ids` (None: no features needed) can stand in for it (tests use an oracle)."""

    def __init__(self, drafter, model):
        drafter = getattr(drafter, "_orig_mod", drafter)          # unwrap torch.compile
        self.drafter = getattr(drafter, "module", drafter)        # unwrap DDP
        cfg = self.drafter.config
        self.layer_ids, self.mask_id = list(cfg.target_layer_ids), cfg.mask_token_id
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.dtype = next(self.drafter.parameters()).dtype
        tc = model.config.get_text_config()
        if (cfg.hidden_size, cfg.num_target_layers) != (tc.hidden_size, tc.num_hidden_layers):
            raise ValueError(f"drafter (hidden {cfg.hidden_size}, for a {cfg.num_target_layers}-layer target) does "
                             f"not fit this target (hidden {tc.hidden_size}, {tc.num_hidden_layers} layers)")
        self.cache = None

    def reset(self, prompt_ids, features):
        """features [L, K*H] of the prompt."""
        self.cache = DrafterCache(self.drafter)
        self.commit(features, torch.arange(len(prompt_ids), device=features.device))

    def commit(self, features, positions):
        self.cache.append(features.to(self.dtype), positions)

    def propose(self, tokens, start, block_size):
        """tokens: prompt + committed so far, tokens[-1] at position `start` -> logits [B-1, V] for slots 1..B-1."""
        assert len(self.cache) == start, f"drafter context holds {len(self.cache)} positions, block starts at {start}"
        dev = self.cache.positions.device
        ids = torch.tensor([tokens[-1]] + [self.mask_id] * (block_size - 1), device=dev)
        h = self.drafter.step(self.cache, self.embed(ids).to(self.dtype),
                              torch.arange(start, start + block_size, device=dev))            # [B, H]
        return self.lm_head(h[1:].to(self.lm_head.weight.dtype))                              # [B-1, V]


@torch.no_grad()
def drafts_at_every_anchor(proposer, feats, ids, prompt_len, block_size, top_k=0, rows_per_chunk=4096):
    """The drafter's proposals with each completion token but the last as the anchor, in one training-style forward
    (Drafter.forward, dense mask): feats [L, K*H] the target's features of ids [L] (prompt + completion), anchors at
    positions P..L-2 (N = L-1-P) -> drafts [N, B-1] (argmax of slots 1..B-1), and with top_k also (log-probs, ids)
    [N, B-1, k] of each slot's top_k (what build_tree reads). Anchor P+i sees the features of positions < P+i and
    the block [ids[P+i], MASK...] at positions P+i..: what the decode loop's drafter sees once ids[:P+i+1] are
    committed. The lm_head runs rows_per_chunk rows at a time (the [N*(B-1), V] logits would not fit)."""
    d, P, L, B = proposer.drafter, prompt_len, len(ids), block_size
    dev = ids.device
    anchors = torch.arange(P, L - 1, device=dev)                                          # [N]
    k = torch.arange(B, device=dev)
    block = torch.where(k[None, :] == 0, ids[anchors][:, None], proposer.mask_id)         # [N, B]
    zeros = torch.zeros(L, dtype=torch.long, device=dev)
    attn = d.attn_spec(anchors, zeros[: len(anchors)], zeros)
    h = d(feats.to(proposer.dtype), torch.arange(L, device=dev), proposer.embed(block.flatten()).to(proposer.dtype),
          (anchors[:, None] + k[None, :]).flatten(), attn)                                # [N*B, H]
    h = h.view(len(anchors), B, -1)[:, 1:].flatten(0, 1).to(proposer.lm_head.weight.dtype)   # [N*(B-1), H]
    drafts, top_lp, top_id = [], [], []
    for s in range(0, h.shape[0], rows_per_chunk):
        logits = proposer.lm_head(h[s:s + rows_per_chunk])                                # [c, V]
        drafts.append(logits.argmax(-1))
        if top_k:
            lp, ix = logits.float().log_softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1)
            top_lp.append(lp)
            top_id.append(ix)
    shape = (len(anchors), B - 1)
    drafts = torch.cat(drafts).view(shape) if drafts else torch.empty(shape, dtype=torch.long, device=dev)
    if not top_k:
        return drafts
    return drafts, torch.cat(top_lp).view(*shape, -1), torch.cat(top_id).view(*shape, -1)


@torch.no_grad()
def teacher_forced_streak(model, proposer, prompt_ids, completion, block_size) -> float | None:
    """The training-time streak on the served tokens: the drafter's training forward (Drafter.forward, dense mask)
    reads the target's features of prompt + greedy `completion`, every generated position is an anchor, and the
    streak of an anchor is the correct prefix of its slots 1..B-1 (cut at the end of the completion). Decoding
    commits 1 + this per step on average when inference matches training (the anchors it visits are a subset, so
    the two agree closely, not exactly). tau - 1 far below it means the served path differs from the trained one;
    this far below the training log's streak means the drafter does not generalise to these prompts."""
    if len(completion) < 2:
        return None
    ids = torch.tensor(list(prompt_ids) + list(completion), device=model.device)            # [L]
    _, feats = target_forward(model, ids, torch.arange(len(ids), device=model.device), DynamicCache(),
                              proposer.layer_ids)                                          # [L, K*H]
    return _streak(drafts_at_every_anchor(proposer, feats, ids, len(prompt_ids), block_size), ids, len(prompt_ids))


def _streak(drafts, ids, prompt_len) -> float:
    """Mean correct prefix of drafts [N, B-1] (anchors P..L-2 of ids [L]), cut at the end of ids."""
    L, B = len(ids), drafts.shape[1] + 1
    idx = torch.arange(prompt_len, L - 1, device=ids.device)[:, None] + torch.arange(1, B, device=ids.device)
    ok = (drafts == ids[idx.clamp(max=L - 1)]) & (idx < L)                                 # [N, B-1]
    return float(torch.cumprod(ok.int(), dim=1).sum(1).float().mean())


# ---------------------------------------------------------------------------
# Verification: a block (chain) or a DDTree

def verify_block(model, cache, root, draft_logits, start, layer_ids):
    """-> (accepted path incl. the root [a+1] tokens, bonus token, features of the path [a+1, K*H])."""
    dev = draft_logits.device
    draft = draft_logits.argmax(-1)                                               # [B-1]
    block = torch.cat([torch.tensor([root], device=dev), draft])                  # [B]
    logits, feats = target_forward(model, block, torch.arange(start, start + len(block), device=dev), cache,
                                   layer_ids)
    post = logits.argmax(-1)                                                      # [B] target's next token per slot
    a = int((draft == post[:-1]).int().cumprod(0).sum())
    crop_cache(cache, start + a + 1)
    return block[: a + 1].tolist(), int(post[a]), None if feats is None else feats[: a + 1]


def build_tree(logp, budget, top_k):
    """Best-first draft tree. logp [D, V] per-slot log-probs (depth d uses row d-1). Node 0 is the root (the last
    committed token); returns tokens, parents, depths of nodes 1..N (N <= budget), parents before children. A node's
    score is the sum of log-probs along its path; pushing only a node's best child and its next sibling keeps the
    frontier exact because both score no higher than the node itself."""
    return tree_from_topk(*(x.tolist() for x in logp.topk(min(top_k, logp.shape[1]), dim=-1)), budget)


def tree_from_topk(top_lp, top_id, budget):
    """build_tree from each slot's top-k log-probs and ids ([D][k] lists, best first)."""
    D, k = len(top_id), len(top_id[0])
    tokens, parents, depths = [], [], []
    # (-score, tiebreak, parent node, parent score, depth, rank among the parent's candidates)
    heap = [(-top_lp[0][0], 0, 0, 0.0, 1, 0)]
    while heap and len(tokens) < budget:
        neg, _, parent, pscore, d, r = heapq.heappop(heap)
        tokens.append(top_id[d - 1][r])
        parents.append(parent)
        depths.append(d)
        node = len(tokens)
        if r + 1 < k:
            heapq.heappush(heap, (-(pscore + top_lp[d - 1][r + 1]), len(tokens) * 2, parent, pscore, d, r + 1))
        if d < D:
            heapq.heappush(heap, (neg - top_lp[d][0], len(tokens) * 2 + 1, node, -neg, d + 1, 0))
    return tokens, parents, depths


def verify_tree(model, cache, root, draft_logits, start, layer_ids, budget, top_k):
    dev = draft_logits.device
    tokens, parents, depths = build_tree(draft_logits.float().log_softmax(-1), budget, top_k)
    n = len(tokens) + 1
    anc = torch.zeros(n, n, dtype=torch.bool)                                     # anc[i, j]: j is i or its ancestor
    anc[0, 0] = True
    for i, p in enumerate(parents, 1):
        anc[i] = anc[p]
        anc[i, i] = True
    mask = torch.zeros(1, 1, n, start + n, dtype=model.dtype, device=dev)         # all past visible
    mask[0, 0, :, start:].masked_fill_(~anc.to(dev), torch.finfo(model.dtype).min)
    ids = torch.tensor([root] + tokens, device=dev)
    pos = start + torch.tensor([0] + depths, device=dev)
    logits, feats = target_forward(model, ids, pos, cache, layer_ids, mask=mask)
    post = logits.argmax(-1).tolist()                                             # [n]
    children = defaultdict(dict)
    for i, (p, t) in enumerate(zip(parents, tokens), 1):
        children[p].setdefault(t, i)
    path = [0]
    while post[path[-1]] in children[path[-1]]:                                   # follow the target's argmax
        path.append(children[path[-1]][post[path[-1]]])
    gather_cache(cache, torch.cat([torch.arange(start, device=dev), start + torch.tensor(path, device=dev)]))
    return ids[path].tolist(), post[path[-1]], None if feats is None else feats[path]


@torch.no_grad()
def speculative_decode(model, prompt_ids, proposer, block_size, max_new_tokens, eos, tree_budget=0,
                       tree_top_k=TREE_TOP_K) -> dict:
    """-> {tokens: generated ids, steps: tokens committed per verify step}. tree_budget > 0: DDTree verification."""
    dev, L = model.device, len(prompt_ids)
    cache = DynamicCache()
    logits, feats = target_forward(model, torch.tensor(prompt_ids, device=dev), torch.arange(L, device=dev), cache,
                                   proposer.layer_ids, last_only=True)
    new, steps = [int(logits[-1].argmax())], []
    proposer.reset(prompt_ids, feats)
    while len(new) < max_new_tokens and new[-1] not in eos:
        start = L + len(new) - 1                                   # position of the last committed token
        draft_logits = proposer.propose(prompt_ids + new, start, block_size)                 # [B-1, V]
        if tree_budget:
            path, bonus, feats = verify_tree(model, cache, new[-1], draft_logits, start, proposer.layer_ids,
                                             tree_budget, tree_top_k)
        else:
            path, bonus, feats = verify_block(model, cache, new[-1], draft_logits, start, proposer.layer_ids)
        committed = path[1:] + [bonus]
        cut = next((i + 1 for i, t in enumerate(committed) if t in eos), len(committed))
        committed = committed[: min(cut, max_new_tokens - len(new))]
        new += committed
        steps.append(len(committed))
        proposer.commit(feats, torch.arange(start, start + len(path), device=dev))
    return {"tokens": new, "steps": steps}


# ---------------------------------------------------------------------------
# The walk: the decode loop's tau without decoding. Greedy speculative decoding is lossless, so it outputs the
# greedy continuation y; its proposal at each step depends only on the target's features of the committed tokens
# and the anchor (the last committed token). So one teacher-forced target forward over prompt + y and one drafter
# forward with every position of y as an anchor give every proposal it could make, and walking them as the loop
# would (accept the longest prefix equal to y, commit it plus the bonus token, jump) gives its steps exactly. What
# it assumes is the losslessness the decode method checks: exact in fp32; in bf16 the loop's block forwards round
# unlike one full forward and a near-tie can flip.

@torch.no_grad()
def greedy_references(model, prompts_ids, max_new_tokens, eos, batch_size=64) -> list[list[int]]:
    """Plain greedy continuations of many prompts (what lossless speculative decoding outputs), each up to its
    first eos: HF generate, batched with left padding, prompts of similar length together. The one place to swap
    in a faster engine."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos) or None,
                           pad_token_id=min(eos) if eos else 0)   # outputs are cut at the first eos: pads unread
    order = sorted(range(len(prompts_ids)), key=lambda i: len(prompts_ids[i]))
    out = [None] * len(prompts_ids)
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        S = max(len(prompts_ids[i]) for i in idx)
        ids = torch.zeros(len(idx), S, dtype=torch.long)
        mask = torch.zeros(len(idx), S, dtype=torch.long)
        for r, i in enumerate(idx):
            n = len(prompts_ids[i])
            ids[r, S - n:], mask[r, S - n:] = torch.tensor(prompts_ids[i]), 1
        new = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=gen)[:, S:].tolist()                       # [b, <= max_new_tokens]
        for r, i in enumerate(idx):
            cut = next((j + 1 for j, t in enumerate(new[r]) if t in eos), len(new[r]))
            out[i] = new[r][:cut]
    return out


def walk_steps(drafts, completion, block_size) -> list[int]:
    """Tokens committed per verify step of speculative_decode (block verification) when it outputs `completion`
    (the greedy continuation: cut at its eos or at max_new_tokens): drafts [N, B-1] the proposals with
    completion[i] as the anchor (drafts_at_every_anchor). With n tokens committed the anchor is completion[n-1];
    the loop accepts the longest prefix of its drafts equal to what follows and commits that plus the target's
    bonus token, at most the m - n tokens left (the loop's eos / max_new_tokens cut). Drafts past completion[m-1]
    cannot change a step: the cut ends it there."""
    m, n, steps = len(completion), 1, []
    while n < m:
        row, a = drafts[n - 1], 0
        while a < min(block_size - 1, m - n - 1) and row[a] == completion[n + a]:
            a += 1
        steps.append(min(a + 1, m - n))
        n += steps[-1]
    return steps


def walk_tree_steps(top_lp, top_id, completion, budget) -> list[int]:
    """walk_steps for DDTree verification: at each anchor the tree speculative_decode would build from the same
    top-k (tree_from_topk), the accepted path is the longest path from the root spelling what follows."""
    m, n, steps = len(completion), 1, []
    while n < m:
        tokens, parents, _ = tree_from_topk(top_lp[n - 1], top_id[n - 1], budget)
        child = {(p, t): i for i, (p, t) in reversed(list(enumerate(zip(parents, tokens), 1)))}   # first wins
        node, a = 0, 0
        while a < m - n - 1 and (node, completion[n + a]) in child:
            node, a = child[(node, completion[n + a])], a + 1
        steps.append(min(a + 1, m - n))
        n += steps[-1]
    return steps


@torch.no_grad()
def walk_evaluate(model, proposers, block_sizes, items, max_new_tokens, eos, tree_budget, tree_top_k, reference,
                  log) -> list[list[dict]]:
    """Per drafter, the per-prompt results of the walk over items [(row, prompt ids)]: the greedy references in
    batches, then per prompt one target forward shared by every drafter and one drafter forward each."""
    todo = [ids for _, ids in items if ("walk", tuple(ids), max_new_tokens) not in reference]
    for ids, y in zip(todo, greedy_references(model, todo, max_new_tokens, eos)):
        reference[("walk", tuple(ids), max_new_tokens)] = y
    layers = sorted({l for p in proposers for l in p.layer_ids})
    results = [[] for _ in proposers]
    for n, (row, ids) in enumerate(items, 1):
        y = reference[("walk", tuple(ids), max_new_tokens)]
        seq = torch.tensor(ids + y, device=model.device)                                  # [L]
        logits, feats = target_forward(model, seq, torch.arange(len(seq), device=model.device), DynamicCache(),
                                       layers)                                             # [L, V], [L, |layers|*H]
        # the reference must be the greedy continuation of this very forward, or the walk is of another path
        nxt = logits[len(ids) - 1:-1].argmax(-1).tolist()                                  # [len(y)]
        bad = next((i for i, (a, b) in enumerate(zip(nxt, y)) if a != b), None)
        H = feats.shape[1] // len(layers)
        for j, (proposer, bs) in enumerate(zip(proposers, block_sizes)):
            cols = torch.cat([torch.arange(layers.index(l) * H, (layers.index(l) + 1) * H) for l in proposer.layer_ids])
            r = {"id": row["id"], "category": row.get("category", "all"), "prompt_tokens": len(ids),
                 "new_tokens": len(y), "tokens": y, "reference_mismatch": bad, "tf_streak": None}
            if len(y) < 2:                                        # done after the prefill token: no verify step
                r |= {"steps": [], "tau": None} | ({"tree_steps": [], "tree_tau": None} if tree_budget else {})
            else:
                out = drafts_at_every_anchor(proposer, feats[:, cols.to(feats.device)], seq, len(ids), bs,
                                             top_k=tree_top_k if tree_budget else 0)
                drafts = out[0] if tree_budget else out
                r["steps"] = walk_steps(drafts.tolist(), y, bs)
                r["tau"] = _mean(r["steps"])
                r["tf_streak"] = _streak(drafts, seq, len(ids))
                if tree_budget:
                    r["tree_steps"] = walk_tree_steps(out[1].tolist(), out[2].tolist(), y, tree_budget)
                    r["tree_tau"] = _mean(r["tree_steps"])
            results[j].append(r)
        log(f"[{n}/{len(items)}] {row['id']} prompt={len(ids)} new={len(y)} "
            + " ".join(f"tau={_fmt(res[-1]['tau'])}" for res in results)
            + ("" if bad is None else f" REFERENCE differs from the full forward's argmax at {bad}"))
    return results


# ---------------------------------------------------------------------------
# Evaluation over a prompt set

def _first_mismatch(got, want):
    if got == want:
        return None
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {"position": i, "got": got[i] if i < len(got) else None, "want": want[i] if i < len(want) else None,
            "got_len": len(got), "want_len": len(want)}


def _mean(xs):
    xs = [x for x in xs if x is not None]      # a prompt done after the prefill token has no verify step
    return sum(xs) / len(xs) if xs else None


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"


def _by_category(rows, key):
    """Mean of rows[key] per category, plus per group for categories like 'mtbench/math' -> 'mtbench'."""
    groups = defaultdict(list)
    for r in rows:
        cat = r["category"]
        groups[cat].append(r[key])
        if "/" in cat:
            groups[cat.split("/")[0]].append(r[key])
    return {c: _mean(v) for c, v in sorted(groups.items())}


def mean_se(xs) -> tuple:
    """(n, mean, standard error sd / sqrt(n)) of the values that are not None; the SE is None below two values,
    the mean below one."""
    xs = [x for x in xs if x is not None]
    n = len(xs)
    mean = sum(xs) / n if n else None
    se = (sum((x - mean) ** 2 for x in xs) / (n - 1) / n) ** 0.5 if n > 1 else None
    return n, mean, se


def category_stats(rows, key="tau") -> tuple[dict, dict]:
    """Per category (the rows' exact `category`) and their macro-average, each category weighted equally:
    ({category: {"prompts": n, "mean": m, "se": se}}, {"mean": mean of the category means, "se": sqrt(sum of
    se_c^2) / C, "categories": C}). Rows are prompts (rows[key] their tau) or paired differences (tools.tau_diff);
    a category whose rows all lack a value is left out, and the macro SE is None when one category's SE is."""
    groups = defaultdict(list)
    for r in rows:
        groups[r.get("category", "all")].append(r[key])
    cats = {}
    for c, xs in sorted(groups.items()):
        n, mean, se = mean_se(xs)
        if n:
            cats[c] = {"prompts": n, "mean": mean, "se": se}
    ses = [v["se"] for v in cats.values()]
    macro = {"mean": sum(v["mean"] for v in cats.values()) / len(cats) if cats else None,
             "se": sum(x * x for x in ses) ** 0.5 / len(cats) if cats and None not in ses else None,
             "categories": len(cats)}
    return cats, macro


def evaluate(target_model, tokenizer, drafter, prompts, block_size=None, max_new_tokens=MAX_NEW_TOKENS,
             tree_budget=0, device=None, **kw) -> dict:
    """tau, losslessness and speed of `drafter` on `prompts` (rows as in load_prompts): evaluate_drafters with one
    drafter. The keyword-only options (tree_top_k, enable_thinking, on_too_long, reference, log) are its."""
    return evaluate_drafters(target_model, tokenizer, [drafter], prompts, block_size, max_new_tokens, tree_budget,
                             device, **kw)[0]


def evaluate_drafters(target_model, tokenizer, drafters, prompts, block_size=None, max_new_tokens=MAX_NEW_TOKENS,
                      tree_budget=0, device=None, *, tree_top_k=TREE_TOP_K, enable_thinking=None, on_too_long="error",
                      reference=None, shard=(0, 1), log=print, method="decode", cuda_graphs=True,
                      attention="sdpa") -> list[dict]:
    """One result per drafter, over the same prompts, with one warm-up and one greedy reference per prompt for all.

    target_model: an HF causal LM (attn_implementation sdpa or eager for trees) or a model.target.Target;
    drafters: Drafters in memory (on the target's device; any dtype) or proposers (see DrafterProposer);
    block_size: default each drafter's own; tree_budget > 0 also runs DDTree on the same prompts;
    reference: a dict kept by the caller across calls (the trainer) to reuse the greedy reference decodes and their
    timing: they depend on the target and prompts only, not on the drafter;
    shard=(k, n): decode only the kept prompts k, k+n, k+2n, ... (a --workers process; merge_shards joins them);
    log: called with one line per prompt (None: quiet);
    method: "decode" (the decode loop: tau, losslessness, tokens/s), "fast" (the same loop on static caches and
    CUDA graphs, model.fastdecode, with its own greedy as the baseline and reference: block verification only,
    Drafters only, an HF Llama / Mistral / Qwen2 / Qwen3 target; cuda_graphs=False runs its steps eagerly;
    attention: its attention kernel, model.fastdecode.attend's how) or
    "walk" (walk_evaluate: the same tau and steps from batched greedy references and one forward per prompt,
    without decoding: no speed, no losslessness check; Drafters only)."""
    model = target_model.model if isinstance(target_model, Target) else target_model
    model.eval()
    device = torch.device(device) if device is not None else model.device
    if device.type == "cuda" and device.index is None:   # "cuda" means the current GPU
        device = torch.device("cuda", torch.cuda.current_device())
    assert model.device == device, f"target is on {model.device}, evaluation asked for {device}"
    proposers = [d if hasattr(d, "propose") else DrafterProposer(d, model) for d in drafters]
    assert method in METHODS, f"method {method!r} is not one of {METHODS}"
    if method in ("walk", "fast") and not all(isinstance(p, DrafterProposer) for p in proposers):
        raise ValueError(f"--method {method} runs the Drafter itself: it needs Drafters, not other proposers")
    if method == "fast" and tree_budget:
        raise ValueError("--method fast verifies blocks only: drop --tree-budget, or use --method decode for DDTree")
    block_sizes = [block_size or p.drafter.config.block_size for p in proposers]
    if tree_budget and model.config._attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"DDTree needs a 4D custom mask: load the target with attn_implementation='sdpa' or "
                         f"'eager' (it has {model.config._attn_implementation!r})")
    eos = eos_ids(model, tokenizer)
    log = log or (lambda *_: None)
    reference = {} if reference is None else reference
    k, n_shards = shard

    # every shard checks every prompt, so all workers keep the same list (and report the same `skipped`)
    limit, B = model.config.get_text_config().max_position_embeddings, max(block_sizes)
    items, skipped = [], []

    def answer(ids):          # an earlier turn's answer: plain greedy, untimed, once per target and prompt
        key = ("answer", tuple(ids), EARLIER_ANSWER_TOKENS)
        if key not in reference:
            reference[key] = [t for t in greedy_decode(model, ids, EARLIER_ANSWER_TOKENS, eos) if t not in eos]
        return reference[key]
    for row in prompts:
        ids = encode_prompt(tokenizer, row, enable_thinking, answer)
        need = len(ids) + max_new_tokens + B - 1
        if need > limit:
            msg = (f"prompt {row['id']!r} has {len(ids)} tokens: with max_new_tokens={max_new_tokens} and block size "
                   f"{B} it needs {need} positions, the target has max_position_embeddings={limit}")
            if on_too_long != "skip":
                raise PromptTooLong(msg + "; shorten it, lower --max-new-tokens, or pass --skip-long")
            if k == 0:
                log(f"warning: skipped {msg}")
            skipped.append(row["id"])
            continue
        items.append((row, ids))
    assert items, "no prompts to evaluate"
    items = items[k::n_shards]

    def config(proposer, bs):
        return {"method": method, "block_size": bs, "max_new_tokens": max_new_tokens, "tree_budget": tree_budget,
                "tree_top_k": tree_top_k, "device": str(device), "device_name": device_name(device),
                "dtype": str(model.dtype).replace("torch.", ""),
                "drafter_dtype": str(getattr(proposer, "dtype", model.dtype)).replace("torch.", ""),
                "enable_thinking": enable_thinking, "eos_ids": sorted(eos)} \
            | ({"cuda_graphs": fast.cuda_graphs, "attention": fast.attention} if method == "fast" else {})
    if method == "walk":
        t0 = time.perf_counter()
        per = walk_evaluate(model, proposers, block_sizes, items, max_new_tokens, eos, tree_budget, tree_top_k,
                            reference, log)
        secs = time.perf_counter() - t0
        return [summarize(pp, skipped, config(p, bs) | {"walk_seconds": secs})
                for pp, p, bs in zip(per, proposers, block_sizes)]

    modes = {"dflash": 0} | ({"ddtree": tree_budget} if tree_budget else {})
    if method == "fast":
        fast = fast_decoder(model, [ids for _, ids in items], max_new_tokens, max(block_sizes), cuda_graphs,
                            attention)
        states = [fast.drafter(p.drafter, bs) for p, bs in zip(proposers, block_sizes)]
        greedy = lambda ids, m: fast.greedy(ids, m, eos)                                       # noqa: E731
        spec = lambda j, ids, m, budget: fast.speculative(ids, states[j], m, eos)              # noqa: E731
        warm = range(len(proposers))                  # each drafter's step is its own CUDA graph, captured here
    else:
        greedy = lambda ids, m: greedy_decode(model, ids, m, eos)                              # noqa: E731
        spec = lambda j, ids, m, budget: speculative_decode(model, ids, proposers[j], block_sizes[j], m,  # noqa: E731
                                                            eos, budget, tree_top_k)
        warm = range(1)
    if items:                                                      # untimed warm-up of every code path
        ids0 = items[0][1]
        greedy(ids0, WARMUP_TOKENS)
        for j in warm:
            for budget in modes.values():
                spec(j, ids0, WARMUP_TOKENS, budget)

    results = []
    for j, (proposer, bs) in enumerate(zip(proposers, block_sizes)):
        who = f"drafter {j + 1}/{len(proposers)} " if len(proposers) > 1 else ""
        per_prompt = []
        for n, (row, ids) in enumerate(items, 1):
            key = (method, tuple(ids), max_new_tokens)            # fast's greedy is its own baseline
            if key not in reference:
                _sync(device)
                t0 = time.perf_counter()
                want = greedy(ids, max_new_tokens)
                _sync(device)
                reference[key] = (want, time.perf_counter() - t0)
            want, secs = reference[key]
            r = {"id": row["id"], "category": row.get("category", "all"), "prompt_tokens": len(ids),
                 "seconds": {"greedy": secs}, "gen_tokens": {"greedy": len(want)}}
            for mode, budget in modes.items():
                _sync(device)
                t0 = time.perf_counter()
                got = spec(j, ids, max_new_tokens, budget)
                _sync(device)
                r["seconds"][mode] = time.perf_counter() - t0
                r["gen_tokens"][mode] = len(got["tokens"])
                pre = "" if mode == "dflash" else "tree_"
                r |= {f"{pre}tau": _mean(got["steps"]) if got["steps"] else None, f"{pre}steps": got["steps"],
                      f"{pre}mismatch": _first_mismatch(got["tokens"], want)}
                if mode == "dflash":
                    r |= {"new_tokens": len(got["tokens"]), "tokens": got["tokens"]}
                    if tokenizer is not None:
                        r["text"] = tokenizer.decode(got["tokens"])
            r["lossless"] = all(r[f"{p}mismatch"] is None for p in ("", "tree_") if f"{p}mismatch" in r)
            if isinstance(proposer, DrafterProposer):
                r["tf_streak"] = teacher_forced_streak(model, proposer, ids, want, bs)
            per_prompt.append(r)
            tree = f" tree_tau={_fmt(r['tree_tau'])}" if tree_budget else ""
            bad = "" if r["lossless"] else f" MISMATCH {r['mismatch'] or r['tree_mismatch']}"
            log(f"{who}[{n}/{len(items)}] {r['id']} prompt={len(ids)} new={r['new_tokens']} steps={len(r['steps'])} "
                f"tau={_fmt(r['tau'])}{tree} lossless={'yes' if r['lossless'] else 'no'}{bad}")
        results.append(summarize(per_prompt, skipped, config(proposer, bs)))
    return results


def fast_decoder(model, prompts_ids, max_new_tokens, block_size, cuda_graphs, attention="sdpa") -> FastDecoder:
    """A FastDecoder whose static cache fits every prompt of prompts_ids with max_new_tokens and the last block
    (need <= max_position_embeddings, as evaluate_drafters checked), rounded up to a multiple of 16 positions (the
    attention kernels' alignment) within max_position_embeddings."""
    need = max(map(len, prompts_ids)) + max_new_tokens + block_size - 1
    limit = model.config.get_text_config().max_position_embeddings
    return FastDecoder(model, min(-(-need // 16) * 16, limit), cuda_graphs=cuda_graphs, attention=attention)


def summarize(per_prompt, skipped, config) -> dict:
    """The aggregates of per-prompt results given in prompt order. The one code path for a single process and for
    the merged shards of --workers, so both give the same numbers. Speed (decode, fast): generated tokens / seconds
    summed over prompts, per mode, with the device and dtypes it was measured on."""
    tree = bool(config["tree_budget"])
    result = {
        "tau": _mean([r["tau"] for r in per_prompt]),
        "prompts": len(per_prompt),
        "tau_by_category": _by_category(per_prompt, "tau"),
        **_spread_stats(per_prompt, "tau"),
        "tf_streak": _mean([r["tf_streak"] for r in per_prompt if r.get("tf_streak") is not None]),
        "accept_hist": dict(sorted(Counter(s for r in per_prompt for s in r["steps"]).items())),
    }
    if config.get("method", "decode") == "walk":
        # lossless is what the walk assumes, not what it checks; what it can check is that each reference is the
        # greedy continuation of its own full forward
        result |= {"lossless": None,
                   "reference_mismatches": [{"id": r["id"], "position": r["reference_mismatch"]}
                                            for r in per_prompt if r["reference_mismatch"] is not None]}
    else:
        modes = ["greedy", "dflash"] + (["ddtree"] if tree else [])
        seconds = {m: sum(r["seconds"][m] for r in per_prompt) for m in modes}
        tok_s = {m: sum(r["gen_tokens"][m] for r in per_prompt) / seconds[m] if seconds[m] else float("nan")
                 for m in modes}
        result |= {
            "lossless": all(r["lossless"] for r in per_prompt),
            "tokens_per_s": tok_s,
            "speedup": tok_s["dflash"] / tok_s["greedy"],
            "measured_on": {k: config[k] for k in ("device", "device_name", "dtype", "drafter_dtype", "method",
                                                   "cuda_graphs", "attention") if k in config},
            "mismatches": [{"id": r["id"], "dflash": r["mismatch"], "ddtree": r.get("tree_mismatch")}
                           for r in per_prompt if not r["lossless"]],
        }
        if tree:
            result["tree_speedup"] = tok_s["ddtree"] / tok_s["greedy"]
    if tree:
        result |= {"tree_tau": _mean([r["tree_tau"] for r in per_prompt]),
                   "tree_tau_by_category": _by_category(per_prompt, "tree_tau"),
                   **_spread_stats(per_prompt, "tree_tau"),
                   "tree_accept_hist": dict(sorted(Counter(s for r in per_prompt for s in r["tree_steps"]).items()))}
    return result | {"skipped": skipped, "config": config, "per_prompt": per_prompt}


def _spread_stats(per_prompt, key) -> dict:
    """{key}_se (over prompts), {key}_categories (category_stats), {key}_macro and {key}_macro_se."""
    cats, macro = category_stats(per_prompt, key)
    return {f"{key}_se": mean_se([r[key] for r in per_prompt])[2], f"{key}_categories": cats,
            f"{key}_macro": macro["mean"], f"{key}_macro_se": macro["se"]}


def merge_shards(shards) -> list[dict]:
    """shards[k]: worker k's results (one per drafter) over the kept prompts k, k+n, k+2n, ... -> one result per
    drafter over all of them, interleaved back into prompt order and aggregated by summarize."""
    n = len(shards)
    merged = []
    for j, first in enumerate(shards[0]):
        parts = [s[j]["per_prompt"] for s in shards]
        total = sum(map(len, parts))
        assert [len(p) for p in parts] == [len(range(k, total, n)) for k in range(n)], \
            f"workers returned {[len(p) for p in parts]} prompts, not a round-robin deal of {total}"
        merged.append(summarize([parts[i % n][i // n] for i in range(total)], first["skipped"], first["config"]))
    return merged


def report_lines(res) -> list[str]:
    """Human summary; the last line is `tau=<x.xx> lossless=<yes|no|unchecked> prompts=<n>` (unchecked: the walk)."""
    tree = bool(res["config"]["tree_budget"])
    lines = [f"{'category':<24} {'prompts':>7} {'tau':>6} {'SE':>5}" + (f" {'tree_tau':>8}" if tree else "")]
    rows = [(c, v["prompts"], v["mean"], v["se"], res["tree_tau_by_category"].get(c) if tree else None)
            for c, v in res["tau_categories"].items()]
    rows += [("all prompts", res["prompts"], res["tau"], res["tau_se"], res.get("tree_tau")),
             (f"macro ({len(res['tau_categories'])} categories)", None, res["tau_macro"], res["tau_macro_se"],
              res.get("tree_tau_macro"))]
    for cat, n, tau, se, tree_tau in rows:
        lines.append(f"{cat:<24} {'' if n is None else n:>7} {_fmt(tau):>6} {_fmt(se):>5}"
                     + (f" {_fmt(tree_tau):>8}" if tree else ""))
    total = max(1, sum(res["accept_hist"].values()))
    hist = "  ".join(f"{k}:{v / total:.1%}" for k, v in res["accept_hist"].items())
    lines.append(f"committed tokens per step: {hist}")
    if res.get("tf_streak") is not None:
        lines.append(f"teacher-forced streak on the same tokens {_fmt(res['tf_streak'])}: decoding should commit "
                     f"about 1 + that = {_fmt(1 + res['tf_streak'])} per step (tau {_fmt(res['tau'])})")
    c = res["config"]
    if res["lossless"] is None:                                   # the walk
        bad = res["reference_mismatches"]
        lines.append(f"walk: tau of the decode loop from {res['prompts']} greedy references and one forward each "
                     f"({c['walk_seconds']:.1f}s on {c['device_name']}, {c['dtype']} target); no decoding, so no "
                     f"speed and no losslessness check (--method decode measures both)")
        for m in bad:
            lines.append(f"REFERENCE {m['id']}: not the full forward's greedy continuation from token {m['position']} "
                         f"(a near-tie in {c['dtype']}?): its tau is of another path")
    else:
        s, workers = res["tokens_per_s"], c.get("workers", 1)
        shared = f" ({workers} workers sharing the device: speed only means something with --workers 1)" \
            if workers > 1 else ""
        loop = "HF decode loop" if c.get("method", "decode") == "decode" else \
            f"fast loop, {'CUDA graphs' if c['cuda_graphs'] else 'eager'}, {c.get('attention', 'sdpa')} attention"
        lines.append(f"tok/s on {c['device_name']} ({c['device']}, target {c['dtype']}, drafter {c['drafter_dtype']}, "
                     f"{loop}): "
                     f"greedy {s['greedy']:.1f} | dflash {s['dflash']:.1f} (speedup {res['speedup']:.2f}x)"
                     + (f" | ddtree {s['ddtree']:.1f} (speedup {res['tree_speedup']:.2f}x, tree_tau "
                        f"{_fmt(res['tree_tau'])}, budget {c['tree_budget']})" if tree else "") + shared)
        for m in res["mismatches"]:
            lines.append(f"NOT LOSSLESS {m['id']}: dflash {m['dflash']} ddtree {m['ddtree']}")
    if res["skipped"]:
        lines.append(f"skipped (too long): {len(res['skipped'])}")
    lossless = {None: "unchecked", True: "yes", False: "no"}[res["lossless"]]
    lines.append(f"macro tau {_fmt(res['tau_macro'])} +- {_fmt(res['tau_macro_se'])} (each of "
                 f"{len(res['tau_categories'])} categories weighted equally; +- its SE)")
    lines.append(f"tau={_fmt(res['tau'])} lossless={lossless} prompts={res['prompts']}")
    return lines


# ---------------------------------------------------------------------------
# CLI: one process, or --workers processes of this script merged

def run_here(a, prompts, shard=(0, 1), log=print) -> list[dict]:
    """Load the target and every drafter of the parsed CLI args `a` in this process and evaluate them."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    dtype = getattr(torch, a.dtype) if a.dtype != "auto" else torch.bfloat16 if device.type == "cuda" else torch.float32
    target = Path(a.target).expanduser()
    tokenizer = None                       # a target folder without a tokenizer can still run input_ids rows
    if (target / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    elif any("input_ids" not in r for r in prompts):
        sys.exit(f"error: {target} has no tokenizer (tokenizer_config.json); without one only pre-tokenized "
                 f"prompt rows (input_ids) can be evaluated")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True).to(device)
    drafter_dtype = dtype if a.drafter_dtype == "auto" else getattr(torch, a.drafter_dtype)
    drafters = [load_drafter(Path(d).expanduser(), device=device, dtype=drafter_dtype).eval() for d in a.drafter]
    log(f"target {target.name} | {len(prompts)} prompts | {device} {str(dtype).replace('torch.', '')} | drafter "
        f"{str(drafter_dtype).replace('torch.', '')}")
    for path, d in zip(a.drafter, drafters):
        log(f"drafter {path} ({d.config.num_hidden_layers} layers, taps {d.config.target_layer_ids})")
    try:
        return evaluate_drafters(model, tokenizer, drafters, prompts, a.block_size, a.max_new_tokens, a.tree_budget,
                                 device, tree_top_k=a.tree_top_k, shard=shard, log=log,
                                 enable_thinking=THINKING[a.thinking],
                                 on_too_long="skip" if a.skip_long else "error", method=a.method,
                                 cuda_graphs=a.cuda_graphs == "on", attention=a.attention)
    except PromptTooLong as e:
        sys.exit(f"error: {e}")


def run_workers(argv, n) -> list[dict]:
    """This CLI as n processes (`--shard k/n`, each loading the target itself on the same device, writing its
    results to a temp JSON), waited for and merged. A failing worker stops the others and fails the run with the
    end of its stderr. Workers print their own progress lines, prefixed [worker k/n]."""
    with tempfile.TemporaryDirectory(prefix="eval_dflash_") as tmp:
        outs = [Path(tmp) / f"worker{k}.json" for k in range(n)]
        errs = [Path(tmp) / f"worker{k}.stderr" for k in range(n)]
        procs = []
        try:
            for k in range(n):
                with open(errs[k], "w") as err:
                    procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv,
                                                   "--shard", f"{k}/{n}", "--out", str(outs[k])], stderr=err))
            while (rcs := [p.poll() for p in procs]).count(0) < n:
                failed = next((k for k, rc in enumerate(rcs) if rc not in (None, 0)), None)
                if failed is not None:
                    tail = "\n".join(errs[failed].read_text().splitlines()[-25:])
                    sys.exit(f"error: worker {failed}/{n} failed (exit code {rcs[failed]}); the end of its "
                             f"stderr:\n{tail}")
                time.sleep(0.1)
        finally:
            for p in procs:                                        # only left running when one has failed
                if p.poll() is None:
                    p.kill()
                p.wait()
        return merge_shards([json.loads(o.read_text())["drafters"] for o in outs])


def drafter_folder(path) -> Path:
    """An exported drafter folder; a checkpoint folder stands for its drafter/ (what the trainer writes there)."""
    path = Path(path).expanduser()
    if not (path / "config.json").exists() and (path / "drafter" / "config.json").exists():
        return path / "drafter"
    return path


def check_args(a) -> list[str]:
    """What is wrong with the parsed CLI args, each with its fix, found from config files alone: before the target
    loads (minutes for a large one), not after it."""
    errs = []
    for name, value, lo in [("--max-new-tokens", a.max_new_tokens, 1), ("--limit", a.limit, 1),
                            ("--block-size", a.block_size, 2), ("--tree-budget", a.tree_budget, 0),
                            ("--tree-top-k", a.tree_top_k, 1), ("--workers", a.workers, 1)]:
        if value is not None and value < lo:
            errs.append(f"{name} {value}: must be at least {lo}")
    if a.method == "fast" and a.tree_budget:
        errs.append(f"--tree-budget {a.tree_budget} with --method fast: the fast loop verifies blocks only; drop "
                    f"--tree-budget, or use --method decode for DDTree")
    if a.method != "fast" and a.attention != "sdpa":
        errs.append(f"--attention {a.attention} with --method {a.method}: it picks the fast loop's attention; add "
                    f"--method fast, or drop --attention")
    try:
        a.target = str(resolve_model_path(a.target))   # a Hub id: its folder in the local Hugging Face cache
    except FileNotFoundError as e:
        return errs + [f"--target: {e}"]
    try:
        target = AutoConfig.from_pretrained(Path(a.target).expanduser(), local_files_only=True).get_text_config()
    except (OSError, ValueError) as e:
        return errs + [f"--target {a.target} is not a local Hugging Face model folder ({str(e)[:120]})"]
    if a.method == "fast" and target.model_type not in SUPPORTED:
        errs.append(f"--method fast runs the decoder layers of {SUPPORTED} models; --target {a.target} is "
                    f"{target.model_type!r}: use --method decode")
    for path in a.drafter:
        if not (path / "config.json").exists():
            errs.append(f"--drafter {path} has no config.json: pass an exported drafter folder (config.json + "
                        f"model.safetensors), e.g. runs/NAME/checkpoints/step_NNNNNN/drafter")
            continue
        c = json.loads((path / "config.json").read_text())
        mask_id = (c.get("dflash_config") or {}).get("mask_token_id")
        if not isinstance(mask_id, int) or not 0 <= mask_id < target.vocab_size:
            errs.append(f"--drafter {path}: its mask_token_id {mask_id} is not a row of the target's embedding "
                        f"(vocab_size {target.vocab_size}): the drafter was made for another target; pass that "
                        f"target, or train one for this target (train_dflash.py --MASK_TOKEN_ID=-1 picks a valid id)")
        if (c.get("hidden_size"), c.get("num_target_layers")) != (target.hidden_size, target.num_hidden_layers):
            errs.append(f"--drafter {path} (hidden {c.get('hidden_size')}, for a {c.get('num_target_layers')}-layer "
                        f"target) does not fit --target {a.target} (hidden {target.hidden_size}, "
                        f"{target.num_hidden_layers} layers): pass the target it was trained for")
    return errs


def write_json(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    """-> what --out holds: the result dict for one drafter, {"drafters": [{"drafter": path, ...}, ...]} for several."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="local HF causal LM folder, or a Hub id in the local Hugging Face cache")
    p.add_argument("--drafter", required=True, nargs="+",
                   help="exported drafter folder(s) (config.json + model.safetensors); several share one target load, "
                        "warm-up and greedy reference, each gets its own report")
    p.add_argument("--prompts", required=True, help="JSONL rows with messages | prompt | input_ids, optional category")
    p.add_argument("--block-size", type=int, default=None, help="default: each drafter's block_size")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--method", choices=METHODS, default="decode",
                   help="decode: the decode loop (tau, losslessness, tokens/s); fast: the same loop on static KV "
                        "caches and CUDA graphs, its own greedy as the baseline (the GPU speedup; Llama/Qwen "
                        "targets, no --tree-budget); walk: the same tau and steps from batched greedy references "
                        "and one forward per prompt (no speed, no losslessness check)")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on",
                   help="--method fast: replay each step as a CUDA graph (on) or run it eagerly (off; same maths)")
    p.add_argument("--attention", choices=ATTENTION, default="sdpa",
                   help="--method fast: the attention of the target and the drafter: SDPA's kernel (sdpa) or two "
                        "batched matmuls and a float32 softmax (matmul; the same maths, rounded differently). Its "
                        "greedy baseline uses the same, so the speedup compares like with like")
    p.add_argument("--tree-budget", type=int, default=0, help="DDTree node budget; 0 = block verification only")
    p.add_argument("--tree-top-k", type=int, default=TREE_TOP_K, help="DDTree candidates per slot")
    p.add_argument("--limit", type=int, default=None,
                   help="N prompts only, dealt round-robin over the categories (each category's first ones)")
    p.add_argument("--categories", default=None,
                   help="comma list of the prompts' categories to evaluate (chat,explain), or to leave out "
                        "(-system); applied before --limit")
    p.add_argument("--thinking", choices=["auto", "on", "off"], default="auto",
                   help="enable_thinking for the chat template: the same as the training data (auto: template default)")
    p.add_argument("--skip-long", action="store_true", help="skip prompts over the context limit (default: error)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's: auto = bfloat16 on GPU, float32 on CPU")
    p.add_argument("--drafter-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the drafter's (auto: the target's); it only changes the proposals, never the output: the "
                        "target verifies every token in its own --dtype")
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the device, prompts dealt round-robin; same tau/lossless as 1, but "
                        "tokens/s are only meaningful with 1")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)     # K/N: this process is worker K of N
    p.add_argument("--out", default=None, help="write everything as JSON here")
    a = p.parse_args(argv)
    a.drafter = [drafter_folder(d) for d in a.drafter]
    errs = check_args(a)
    try:
        prompts = load_prompts(a.prompts, a.limit, a.categories)
        if not prompts:
            raise ValueError(f"{a.prompts} has no prompt rows (JSONL, one object per line with `messages`, `prompt` "
                             f"or `input_ids`)")
        tok_dir = Path(a.target).expanduser()
        if not errs and not a.shard and (tok_dir / "tokenizer_config.json").exists():   # before any model loads
            tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
            if refused := refused_by_template(tok, prompts, THINKING[a.thinking]):
                raise ValueError(template_refusal_message(refused, prompts))
    except (OSError, ValueError) as e:
        errs.append(f"--prompts: {e}")
    if errs:
        sys.exit("error: " + "\n       ".join(errs))

    if a.shard:                                                    # a worker: results of its prompts to --out
        k, n = (int(x) for x in a.shard.split("/"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))  # n processes share the cores
        results = run_here(a, prompts, (k, n), log=lambda s: print(f"[worker {k}/{n}] {s}", flush=True))
        write_json(a.out, {"drafters": results})
        return results
    workers = max(1, min(a.workers, len(prompts)))
    if workers > 1:
        print(f"{workers} workers on one device, prompts dealt round-robin (worker k: prompts k, k+{workers}, ...)",
              flush=True)                                          # before the workers write to the same stdout
        results = run_workers(argv, workers)
    else:
        results = run_here(a, prompts)
    for path, res in zip(a.drafter, results):
        res["config"] |= {"target": str(Path(a.target).expanduser()), "drafter": str(path),
                          "prompts_file": str(a.prompts), "categories": a.categories, "limit": a.limit,
                          "torch": torch.__version__, "workers": workers}
    out = results[0] if len(results) == 1 else {"drafters": [{"drafter": str(d)} | r
                                                            for d, r in zip(a.drafter, results)]}
    if a.out:
        write_json(a.out, out)
        print(f"wrote {a.out}")
    for path, res in zip(a.drafter, results):
        if len(results) > 1:
            print(f"== drafter {path}")
        for line in report_lines(res):
            print(line)
    return out


if __name__ == "__main__":
    main()
