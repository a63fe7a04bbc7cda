"""Generation throughput of model.engine (and, for reference, transformers' generate) on one GPU.

    python -m bench.generate_bench --model ~/.cache/dflash/smollm2-135m-instruct --slots 256,512,1024 --hf 256
    python -m bench.generate_bench --shape smollm2-135m --slots 256,512,1024 --prompt-len 20:400 --new 64:512
    python -m bench.generate_bench --shape qwen3-8b --slots 64,128,256 --prompt-len 100:1000 --new 64:512
    python -m bench.generate_bench --shape tiny --device cpu --slots 4 --prompts 8      # CPU smoke test

--model: a real HF folder, prompts from a JSONL through its chat template, real stop ids. --shape: a random
model of a named real shape (built on the meta device, then materialised on the GPU), synthetic prompts with
lengths drawn uniformly from --prompt-len, no stop ids, so each request makes exactly its --new draw of tokens.
One line per configuration: slots, prompt / new-token lengths (mean), generated tok/s, conversations/s, ms per
decode step (pure replay of the largest bucket the run used, and wall time per step with prefill and host syncs),
busy (tokens made / slot-steps run: idle slots while refills wait, and the drain at the end), peak GPU memory. A
configuration that fails (out of memory, a failed compile) prints its error and the next one runs. --attention and
--sampler take comma lists: one configuration per combination.
"""
import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

from model.engine import Engine, default_stop_ids, load_model

# name: transformers config class, its fields (random weights; only the shape matters for speed)
SHAPES = {
    "smollm2-135m": ("LlamaConfig", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                     tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                 tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "tiny": ("Qwen3Config", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, vocab_size=256, tie_word_embeddings=False)),
}


def random_model(shape: str, device: str):
    """A random-initialised model of a named shape, bf16 on CUDA (fp32 on CPU), without a CPU copy of the weights."""
    import transformers
    cls_name, fields = SHAPES[shape]
    cfg = getattr(transformers, cls_name)(**fields, max_position_embeddings=32768)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        model = model_cls(cfg).to(dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)   # 1-d: the RMSNorm weights
    rotary = model.get_decoder().rotary_emb     # its inv_freq buffer was left empty by to_empty
    model.get_decoder().rotary_emb = type(rotary)(config=cfg).to(device)
    return model.eval().requires_grad_(False)


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def real_prompts(path: Path, tok, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    msgs = [[m for m in r["messages"] if m["role"] != "assistant"] for r in rows][:n]
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in msgs]
    return [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]


def hf_reference(model, prompts, max_new, stop_ids, pad_id):
    """transformers' generate on one left-padded batch -> (generated tokens, seconds)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    sync(model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new, do_sample=False,
                             eos_token_id=stop_ids or None, pad_token_id=pad_id, top_p=None, top_k=None)
    sync(model.device)
    seconds = time.perf_counter() - t0
    tokens = 0
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_ids), None)
        tokens += len(row) if cut is None else cut + 1
    return tokens, seconds


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(model, slots, prompts, max_new, stop_ids, args, attention, sampler="eager"):
    engine = Engine(model, max_batch=slots, max_len=args.max_len, seed=0, attention=attention,
                    compile_sampler=sampler == "compiled")
    dev = model.device
    # warm-up on a few prompts: graph capture and first-call costs stay out of the timing
    list(engine.generate(prompts[:slots], max_new_tokens=4, temperature=args.temperature, stop_ids=stop_ids))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    steps0 = engine.stats["decode_steps"]
    sync(dev)
    t0 = time.perf_counter()
    n_tok, n_conv, biggest = 0, 0, 0
    for i, ids, why in engine.generate(prompts, max_new_tokens=max_new, temperature=args.temperature,
                                       stop_ids=stop_ids):
        n_tok += len(ids) + (why == "stop")
        n_conv += 1
        biggest = max(biggest, len(prompts[i]) + len(ids) + 1)
    sync(dev)
    seconds = time.perf_counter() - t0
    steps = engine.stats["decode_steps"] - steps0
    bucket = next(b for b in engine.buckets if b >= biggest)
    t1 = time.perf_counter()
    with torch.inference_mode():
        engine._launch(bucket, args.temperature > 0, 20)   # every slot idle: the same work as a full step
    sync(dev)
    step_ms = (time.perf_counter() - t1) / 20 * 1e3
    peak = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else 0.0
    new = max_new if isinstance(max_new, int) else sum(max_new) / len(max_new)
    print(f"engine {attention:6s} {sampler:8s} slots {slots:5d} | prompt {sum(map(len, prompts)) / len(prompts):6.0f} "
          f"tok | new {new:5.0f} tok | {n_tok / seconds:9,.0f} tok/s | {n_conv / seconds:7.1f} conv/s | step "
          f"{step_ms:6.2f} ms (L={bucket}) | wall/step {seconds / steps * 1e3:6.2f} ms | busy "
          f"{n_tok / (steps * slots):4.0%} | peak {peak:6.1f} GiB | {seconds:5.1f} s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local HF model folder")
    src.add_argument("--shape", choices=sorted(SHAPES), help="random model of this shape")
    ap.add_argument("--data", type=Path, default=Path("data/default/train_prompts.jsonl"), help="--model: prompts")
    ap.add_argument("--slots", default="256,512,1024", help="comma-separated engine slot counts, one config each")
    ap.add_argument("--prompts", type=int, default=0, help="requests per config (0 = 4 x slots)")
    ap.add_argument("--prompt-len", default="20:400", help="--shape: prompt lengths LO:HI, uniform")
    ap.add_argument("--new", default="256", help="max new tokens; LO:HI draws each request's uniformly")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--attention", default="sdpa", help="comma-separated decode attentions (sdpa, matmul), one "
                                                        "config each")
    ap.add_argument("--sampler", default="eager", help="comma-separated: eager, compiled (torch.compile of the "
                                                       "decode step's draw; --temperature > 0), one config each")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--hf", type=int, default=0, help="also time transformers' generate on this many prompts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    new_lo, new_hi = span(args.new)
    if args.model:
        model, tok = load_model(args.model, args.device)
        stop_ids, pad_id = default_stop_ids(model, tok), tok.pad_token_id or 0
    else:
        model, stop_ids, pad_id = random_model(args.shape, args.device), [], 0
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"generate_bench: {args.model or args.shape} on {where}, "
          f"{model.dtype}, torch {torch.__version__}, temperature {args.temperature}", flush=True)
    for slots in [int(s) for s in args.slots.split(",")]:
        n = args.prompts or 4 * slots
        if args.model:
            pool = real_prompts(args.data, tok, 10 ** 9)
            prompts = [pool[i % len(pool)] for i in range(n)]
        else:
            lo, hi = span(args.prompt_len)
            prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        max_new = new_lo if new_lo == new_hi else [rng.randint(new_lo, new_hi) for _ in range(n)]
        for attention in args.attention.split(","):
            for sampler in args.sampler.split(","):
                try:
                    run_config(model, slots, prompts, max_new, stop_ids, args, attention, sampler)
                except Exception as e:  # noqa: BLE001 - OOM or a failed compile: report it, go on to the next
                    print(f"engine {attention} {sampler} slots {slots:5d} | {type(e).__name__} "
                          f"({str(e).splitlines()[0][:120] if str(e) else ''})", flush=True)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.hf:
        prompts = prompts[:args.hf]
        tokens, seconds = hf_reference(model, prompts, new_hi, stop_ids, pad_id)
        print(f"hf generate batch {len(prompts):5d} | new {new_hi} tok | {tokens / seconds:9,.0f} tok/s | "
              f"{len(prompts) / seconds:7.1f} conv/s | {seconds:5.1f} s", flush=True)


if __name__ == "__main__":
    main()
