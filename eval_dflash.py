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
The measurement itself (evaluate, evaluate_drafters, the walk, summarize, merge_shards, report_lines) is
trainer/evaluate.py's, which the trainer's evaluation and tools/ import too; this file is its command line.
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
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from data.prompts import THINKING, PromptTooLong, load_prompts, refused_by_template, template_refusal_message
from model.decode import TREE_TOP_K
from model.drafters import export_arch, load_export
from model.engine import SUPPORTED
from model.fastdecode import ATTENTION
from model.hub import resolve_model_path
from trainer.evaluate import MAX_NEW_TOKENS, METHODS, evaluate_drafters, merge_shards, report_lines


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
    drafters = [load_export(Path(d).expanduser(), device=device, dtype=drafter_dtype).eval() for d in a.drafter]
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
        if a.tree_budget and export_arch(path) != "dflash":
            errs.append(f"--tree-budget {a.tree_budget} with --drafter {path}: DDTree expands each slot's unary top-k, "
                        f"and a DFlash2 drafter proposes by its selector's walk; drop --tree-budget for it")
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
