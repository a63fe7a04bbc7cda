"""The measurement over a prompt set that eval_dflash.py (the CLI), the trainer's evaluation and tools/ share:
tau per category and macro (`mean_se`, `category_stats`), losslessness, speed, DDTree (`evaluate`,
`evaluate_drafters`), the walk (`walk_evaluate`), the aggregates (`summarize`, `merge_shards` for --workers) and the
report (`report_lines`). The loops are model/decode.py's and model/fastdecode.py's; eval_dflash.py's docstring
states the loop and its choices once."""
import time
from collections import Counter, defaultdict

import torch
from transformers import DynamicCache

from data.prompts import PromptTooLong, encode_prompt
from model.decode import (TREE_TOP_K, DrafterProposer, device_name, draft_streak, drafts_at_every_anchor, eos_ids,
                          greedy_decode, greedy_references, speculative_decode, sync_device, target_forward,
                          teacher_forced_streak, walk_steps, walk_tree_steps)
from model.drafter import Drafter
from model.fastdecode import FastDecoder
from model.target import Target

MAX_NEW_TOKENS = 256   # tokens generated per prompt (eos stops earlier)
METHODS = ("decode", "fast", "walk")   # --method: see evaluate_drafters
WARMUP_TOKENS = 8      # untimed warm-up decode on the first prompt (CUDA init, allocator)
EARLIER_ANSWER_TOKENS = 256   # multi-turn rows: the target's greedy answer to each earlier turn, cut here


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
                r["tf_streak"] = draft_streak(drafts, seq, len(ids))
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
    check_method(method, proposers, tree_budget, model)
    block_sizes = [block_size or p.drafter.config.block_size for p in proposers]
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
        if (msg := too_long(row, ids, max_new_tokens, B, limit)) is None:
            items.append((row, ids))
            continue
        if on_too_long != "skip":
            raise PromptTooLong(msg + "; shorten it, lower --max-new-tokens, or pass --skip-long")
        if k == 0:
            log(f"warning: skipped {msg}")
        skipped.append(row["id"])
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
    greedy, spec, warm, fast = decoders(method, model, proposers, block_sizes, [ids for _, ids in items],
                                        max_new_tokens, eos, tree_top_k, cuda_graphs, attention)
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
            want, secs = timed_reference(reference, (method, tuple(ids), max_new_tokens), greedy, ids, device)
            r = {"id": row["id"], "category": row.get("category", "all"), "prompt_tokens": len(ids),
                 "seconds": {"greedy": secs}, "gen_tokens": {"greedy": len(want)}}
            r |= time_modes(lambda m, budget: spec(j, ids, m, budget), modes, want, max_new_tokens, device, tokenizer,
                            r["seconds"], r["gen_tokens"])
            if isinstance(proposer, DrafterProposer):
                r["tf_streak"] = teacher_forced_streak(model, proposer, ids, want, bs)
            per_prompt.append(r)
            log(prompt_line(f"{who}[{n}/{len(items)}]", r, len(ids), tree_budget))
        results.append(summarize(per_prompt, skipped, config(proposer, bs)))
    return results


def check_method(method, proposers, tree_budget, model) -> None:
    """What each method needs: walk and fast run Drafters themselves, fast verifies blocks only, DDTree's 4D mask
    needs an sdpa or eager target."""
    assert method in METHODS, f"method {method!r} is not one of {METHODS}"
    if method in ("walk", "fast") and not all(isinstance(p, DrafterProposer) for p in proposers):
        raise ValueError(f"--method {method} runs the Drafter itself: it needs Drafters, not other proposers")
    if method == "fast" and tree_budget:
        raise ValueError("--method fast verifies blocks only: drop --tree-budget, or use --method decode for DDTree")
    if tree_budget and any(type(p.drafter).draft_tokens is not Drafter.draft_tokens for p in proposers
                           if isinstance(p, DrafterProposer)):
        raise ValueError("DDTree expands each slot's unary top-k, and a DFlash2 drafter proposes by its selector's "
                         "walk: drop --tree-budget for a DFlash2 drafter")
    if tree_budget and model.config._attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"DDTree needs a 4D custom mask: load the target with attn_implementation='sdpa' or "
                         f"'eager' (it has {model.config._attn_implementation!r})")


def timed_reference(reference, key, greedy, ids, device) -> tuple[list[int], float]:
    """The greedy reference of a prompt and its decode time, made once per key (method, prompt, max_new_tokens:
    fast's greedy is its own baseline) and kept in `reference` across drafters and calls."""
    if key not in reference:
        sync_device(device)
        t0 = time.perf_counter()
        want = greedy(ids, key[2])
        sync_device(device)
        reference[key] = (want, time.perf_counter() - t0)
    return reference[key]


def prompt_line(head, r, prompt_len, tree_budget) -> str:
    """The per-prompt log line."""
    tree = f" tree_tau={_fmt(r['tree_tau'])}" if tree_budget else ""
    bad = "" if r["lossless"] else f" MISMATCH {r['mismatch'] or r['tree_mismatch']}"
    return (f"{head} {r['id']} prompt={prompt_len} new={r['new_tokens']} steps={len(r['steps'])} "
            f"tau={_fmt(r['tau'])}{tree} lossless={'yes' if r['lossless'] else 'no'}{bad}")


def decoders(method, model, proposers, block_sizes, prompts_ids, max_new_tokens, eos, tree_top_k, cuda_graphs,
             attention):
    """The decode functions `method` times: greedy(ids, m) and spec(j, ids, m, tree_budget) for drafter j, the drafters
    to warm up (fast: each drafter's step is its own CUDA graph, captured then) and the FastDecoder (else None)."""
    if method == "fast":
        fast = fast_decoder(model, prompts_ids, max_new_tokens, max(block_sizes), cuda_graphs, attention)
        states = [fast.drafter(p.drafter, bs) for p, bs in zip(proposers, block_sizes)]
        return (lambda ids, m: fast.greedy(ids, m, eos), lambda j, ids, m, budget: fast.speculative(
            ids, states[j], m, eos), range(len(proposers)), fast)
    return (lambda ids, m: greedy_decode(model, ids, m, eos), lambda j, ids, m, budget: speculative_decode(
        model, ids, proposers[j], block_sizes[j], m, eos, budget, tree_top_k), range(1), None)


def too_long(row, ids, max_new_tokens, block_size, limit) -> str | None:
    """Why a prompt cannot be decoded within the target's max_position_embeddings (`limit`), or None: the last
    block drafts up to block_size - 1 positions past the last token."""
    need = len(ids) + max_new_tokens + block_size - 1
    if need <= limit:
        return None
    return (f"prompt {row['id']!r} has {len(ids)} tokens: with max_new_tokens={max_new_tokens} and block size "
            f"{block_size} it needs {need} positions, the target has max_position_embeddings={limit}")


def time_modes(spec, modes, want, max_new_tokens, device, tokenizer, seconds, gen_tokens) -> dict:
    """One prompt decoded by each mode (dflash: blocks; ddtree: the tree, its budget), each timed alone; want: the
    greedy reference. Fills seconds and gen_tokens per mode; -> the per-prompt result's tau, steps, mismatch
    (tree_ for the tree), the tokens and text, and lossless."""
    r = {}
    for mode, budget in modes.items():
        sync_device(device)
        t0 = time.perf_counter()
        got = spec(max_new_tokens, budget)
        sync_device(device)
        seconds[mode] = time.perf_counter() - t0
        gen_tokens[mode] = len(got["tokens"])
        pre = "" if mode == "dflash" else "tree_"
        r |= {f"{pre}tau": _mean(got["steps"]) if got["steps"] else None, f"{pre}steps": got["steps"],
              f"{pre}mismatch": _first_mismatch(got["tokens"], want)}
        if mode == "dflash":
            r |= {"new_tokens": len(got["tokens"]), "tokens": got["tokens"]}
            if tokenizer is not None:
                r["text"] = tokenizer.decode(got["tokens"])
    r["lossless"] = all(r[f"{p}mismatch"] is None for p in ("", "tree_") if f"{p}mismatch" in r)
    return r


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
