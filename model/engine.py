"""A throughput generation engine: continuous batching over a loaded HF causal LM's own submodules.

    model, tok = load_model(path)                       # bf16 on CUDA, fp32 on CPU
    engine = Engine(model, max_batch=auto_slots(model, 2048), max_len=2048)
    for i, ids, why in engine.generate(prompts, max_new_tokens=512, stop_ids=default_stop_ids(model, tok)):
        ...                                              # in completion order; why is "stop" or "length"

How it works. Each of `max_batch` slots holds one request: its KV cache rows ([slots, kv_heads, max_len, head_dim]
per layer, model dtype), its position, its token count. Requests are admitted longest prompt first (the longest
contexts are placed while every slot is free; the end of the run, when slots drain, holds the short ones), several
at once in one right-padded prefill that writes their KV into their slots. Every live slot then decodes together:
one step is q_len 1 per slot, attention over the slot's cache under a mask from its position, a cache write by
index (static shapes), sampling, stop checks, all on the GPU. The step is one CUDA graph per cache-length bucket
(so short contexts don't read all of max_len), replayed SYNC_EVERY times between host syncs; at a sync finished
slots are read back and, once enough are free, refilled. The model's own Linear / RMSNorm / MLP modules, its
rotary embedding module and its modeling file's `apply_rotary_pos_emb` do the maths, so outputs are the model's.

`generate` takes a fixed list. `run` takes a deque of `Request`s that the caller may append to while it iterates
(a follow-up request made from a result joins the running batch at the next refill), each with its own token cap,
temperature and sampling key: data.synthesize streams a conversation's turns through one run this way, so the batch
stays full until the very end instead of draining at the end of every stage.
"""
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # model_types whose decoder layer is exactly norm-attn-norm-mlp
SYNC_EVERY = 16           # decode steps launched between host syncs; a finished slot idles at most this many steps
REFILL_FRACTION = 1 / 8   # refill once this fraction of the slots is free (a prefill costs ~as much as a few steps)
PREFILL_TOKENS = 16384    # padded prompt tokens per prefill forward (bounds its activation memory)
CACHE_BUCKETS = 8         # cache-length buckets (one CUDA graph each) between 0 and max_len
MAX_AUTO_SLOTS = 1024     # auto_slots' ceiling: past it a step is compute-bound and latency only grows
CPU_SLOTS = 16            # auto_slots on a CPU

M32 = 0xFFFFFFFF
ATTENTION = ("sdpa", "matmul")  # the decode step's attention: SDPA with a mask, or two batched matmuls (no kernel
                                # choice, reads each cached K/V once); bench.generate_bench --attention compares them


@dataclass
class Request:
    """One generation: `tag` is the caller's, returned with the result; `key` keys the sampling noise."""
    prompt: list
    max_new: int
    temperature: float = 0.0
    key: int = 0
    tag: object = None


# --- loading ---------------------------------------------------------------------------------------------------------

def load_model(path, device="auto", dtype="auto"):
    """-> (model, tokenizer) from a local HF folder. dtype "auto": bfloat16 on CUDA, float32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(path).expanduser()
    if not (path / "config.json").exists():
        raise SystemExit(f"engine: {path} has no config.json: pass a local HF model folder")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device).eval().requires_grad_(False), tok


def default_stop_ids(model, tokenizer) -> list[int]:
    """The generation config's eos ids (Qwen3: <|im_end|> and <|endoftext|>) and the tokenizer's eos."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def kv_bytes_per_token(model) -> int:
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize


def auto_slots(model, max_len: int) -> int:
    """Slots whose KV cache (and the step's [slots, vocab] logits and sampler temporaries) fit in 90% of the free GPU
    memory, after a reserve for prefill activations; a multiple of 8, at most MAX_AUTO_SLOTS. Printed once."""
    if model.device.type != "cuda":
        return CPU_SLOTS
    cfg = model.config.get_text_config()
    free = torch.cuda.mem_get_info(model.device)[0]
    per_token = kv_bytes_per_token(model)
    per_slot = per_token * max_len + 8 * (max_len + 1) + 32 * cfg.vocab_size
    reserve = PREFILL_TOKENS * (3 * cfg.intermediate_size + 8 * cfg.hidden_size) * model.dtype.itemsize + 2 ** 30
    slots = int(max(0.9 * free - reserve, 0) // per_slot) // 8 * 8
    slots = max(1, min(slots, MAX_AUTO_SLOTS))
    print(f"engine: {slots} slots x {max_len} tokens (KV {per_token / 2 ** 10:.0f} KiB/token, "
          f"{slots * max_len * per_token / 2 ** 30:.1f} GiB) of {free / 2 ** 30:.1f} GiB free")
    return slots


# --- sampling --------------------------------------------------------------------------------------------------------

def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xorshift-multiply, Hash Prospector's [15 2c1b3c6d 12 297a2d39 15]) on int64
    tensors holding values < 2**32. Both multipliers are < 2**31, so products fit in int64 and never overflow."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & M32
    return x ^ (x >> 15)


def _fold(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Hash of (h, v) for 32-bit hashes h and int64 values v >= 0 (both halves of v)."""
    return _mix32(_mix32(h ^ (v & M32)) ^ (v >> 32))


def key_hash(seed: int, k: torch.Tensor) -> torch.Tensor:
    """k [n] int64 keys >= 0 -> [n] 32-bit hashes of (seed, key), the per-request part of the sampling noise."""
    return _fold(_fold(torch.full_like(k, 0x9E3779B9), torch.full_like(k, seed)), k)


def gumbel_argmax(scaled: torch.Tensor, row_hash: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """scaled [n, V] float32 (logits / T), row_hash [n], vocab_hash [V] -> [n] token ids drawn from softmax(scaled).

    Gumbel-max: argmax(scaled + G) with G = -log(-log(U)) iid per entry is an exact draw from the softmax. U comes
    from a counter-based hash of (seed, request key, position, token id) instead of an RNG stream, so a request's
    draw depends only on its own logits and that key: not on which requests share its batch, which slot it got, or
    whether the run was resumed. U = (23 hash bits + 0.5) / 2**23 lies strictly inside (0, 1), so G is finite."""
    x = _mix32(row_hash[:, None] ^ vocab_hash[None, :])               # [n, V]
    u = ((x >> 9).to(torch.float32) + 0.5) * 2.0 ** -23
    return (scaled - torch.log(-torch.log(u))).argmax(-1)


def draw(logits: torch.Tensor, temp: torch.Tensor, row_hash: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """logits [n, V] float32, temp [n] (0: greedy) -> [n] ids: argmax where temp is 0, else a Gumbel-max draw from
    softmax(logits / temp). One function so torch.compile can fuse the whole draw (the [n, V] hash, logs, argmax)
    into a few kernels: eager it is ~12 passes over [n, V] int64 tensors (what they add to a step: BENCHMARKS.md,
    Generation and decoding speed)."""
    best = logits.argmax(-1)                                    # ties -> lowest id, as torch.argmax
    t = torch.where(temp > 0, temp, 1.0)[:, None]
    return torch.where(temp > 0, gumbel_argmax(logits / t, row_hash, vocab_hash), best)


# --- the engine ------------------------------------------------------------------------------------------------------

class Engine:
    """Continuous-batching greedy / sampled decoding of a Llama / Mistral / Qwen2 / Qwen3 causal LM (see the module
    docstring). `stats` accumulates over generate calls: prompts, generated (tokens, stop tokens included),
    seconds (wall), decode_steps, prefill_tokens."""

    def __init__(self, model, *, max_batch=256, max_len=2048, cuda_graphs=None, seed=0, attention="sdpa",
                 compile_sampler=False):
        if attention not in ATTENTION:
            raise ValueError(f"engine: attention {attention!r} is not one of {ATTENTION}")
        self.attention = attention
        # compile_sampler: the decode step's draw (always [slots, V]: one compile) through torch.compile, warmed up
        # before graph capture; prefill's draws stay eager (their row count varies). The draw stays exact, but its
        # float logs may round differently from eager, so a row can differ from an eager run's
        self._draw_step = torch.compile(draw, dynamic=False) if compile_sampler else draw
        cfg = model.config.get_text_config()
        check_family(cfg)                                       # before reading the layers: others have no .layers
        self.decoder = model.get_decoder()
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        check_supported(cfg, attn, self.decoder.rotary_emb, max_len)
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.rope = model_rope(attn)
        self.n_kv, self.head_dim = cfg.num_key_value_heads, attn.head_dim
        self.group = cfg.num_attention_heads // self.n_kv      # query heads per KV head
        self.S, self.max_len, self.seed = max_batch, max_len, seed
        dev, dt = self.embed.weight.device, self.embed.weight.dtype
        S, V = max_batch, self.lm_head.out_features
        self.cache = [(torch.zeros(S, self.n_kv, max_len, self.head_dim, dtype=dt, device=dev),
                       torch.zeros(S, self.n_kv, max_len, self.head_dim, dtype=dt, device=dev)) for _ in self.layers]
        self.cos, self.sin = rope_tables(self.decoder, self.embed, max_len)   # [max_len, head_dim]
        # per-slot state: static buffers that the decode step (and its CUDA graphs) read and update in place
        z = dict(dtype=torch.long, device=dev)
        self.tokens, self.pos, self.ngen = torch.zeros(S, **z), torch.zeros(S, **z), torch.zeros(S, **z)
        self.max_new, self.khash = torch.zeros(S, **z), torch.zeros(S, **z)
        self.temp = torch.zeros(S, dtype=torch.float32, device=dev)  # per slot; 0 = greedy
        self.active = torch.zeros(S, dtype=torch.bool, device=dev)
        self.seq = torch.zeros(S, max_len + 1, **z)             # prompt + generated ids; the last column is a sink
        self.slot_ids, self.positions = torch.arange(S, device=dev), torch.arange(max_len, device=dev)
        self.is_stop = torch.zeros(V, dtype=torch.bool, device=dev)
        self.vocab_hash = _mix32(torch.arange(V, device=dev))
        step = -(-max_len // CACHE_BUCKETS // 16) * 16
        self.buckets = sorted({min(max_len, b) for b in range(step, max_len + step, step)})
        self.cuda_graphs = dev.type == "cuda" and cuda_graphs is not False
        self.graphs, self.pool = {}, None
        self.stats = dict(prompts=0, generated=0, seconds=0.0, decode_steps=0, prefill_tokens=0)

    def check_prompt(self, n_tokens: int, max_new: int) -> None:
        if n_tokens + max_new > self.max_len:
            raise ValueError(f"a prompt of {n_tokens} tokens + {max_new} new tokens exceeds the engine's max_len "
                             f"{self.max_len}: raise --max-len (or lower --max-new-tokens)")

    # --- the model, layer by layer -----------------------------------------------------------------------------------

    def _logits(self, h):
        """h [n, H] -> [n, V] float32: lm_head in the model dtype, then float, as HF generate does."""
        return self.lm_head(self.decoder.norm(h)).float()

    def _sample(self, logits, sampled, khash, pos, temp, fn=draw):
        """-> [n] next ids; pos [n] is the position the new token takes (part of its noise's key), temp [n] each
        row's temperature (0: greedy). sampled=False: every row is greedy, the sampler is skipped."""
        if not sampled:
            return logits.argmax(-1)                            # ties -> lowest id, as torch.argmax
        return fn(logits, temp, _fold(khash, pos), self.vocab_hash)

    def _prefill(self, slots, reqs, sampled):
        """Run right-padded prompts, write their KV into `slots`, sample each one's first token, arm the slots."""
        prompts = [r.prompt for r in reqs]
        n, P = len(prompts), max(len(p) for p in prompts)
        lens = [len(p) for p in prompts]
        ids = self._h2d([p + [0] * (P - len(p)) for p in prompts])             # [n, P]
        sl, ln, mx = self._h2d(slots), self._h2d(lens), self._h2d([r.max_new for r in reqs])
        temp = torch.tensor([float(r.temperature) for r in reqs]).to(self.temp.device)
        x = self.embed(ids)                                                     # [n, P, H]
        cos, sin = self.cos[None, :P], self.sin[None, :P]
        for layer, (kc, vc) in zip(self.layers, self.cache):
            attn = layer.self_attn
            q, k, v = qkv(attn, layer.input_layernorm(x), cos, sin, self.rope)
            kc[sl, :, :P], vc[sl, :, :P] = k, v
            # right padding + causal: a real token never sees a pad; the pads' own rows are ignored
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(n, P, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self._logits(x[torch.arange(n, device=x.device), ln - 1])   # [n, V]
        kh = key_hash(self.seed, self._h2d([r.key for r in reqs]))
        first = self._sample(logits, sampled, kh, ln, temp)
        self.tokens[sl], self.pos[sl], self.seq[sl, ln] = first, ln, first
        self.ngen[sl], self.max_new[sl], self.khash[sl], self.temp[sl] = 1, mx, kh, temp
        self.active[sl] = ~(self.is_stop[first] | (mx <= 1))
        self.stats["prefill_tokens"] += sum(lens)

    def _attend(self, attn, q, kc, vc, L, mask):
        """q [S, kv_heads, group, D] over cache positions [0, L) under mask [S, 1, 1, L] -> [S, kv_heads, group, D].
        GQA without repeating the cache: a KV head's `group` query heads are its `group` queries."""
        k, v = kc[:, :, :L], vc[:, :, :L]                                        # strided views, no copy
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        s = torch.matmul(q, k.transpose(-1, -2)).float() * attn.scaling         # [S, kv_heads, group, L]
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.matmul(p.to(v.dtype), v)

    def _step(self, L, sampled):
        """One decode step of every slot over cache positions [0, L): static shapes, no host sync (graph-safe).
        Idle and finished slots run too, masked out of every state update."""
        S = self.S
        x = self.embed(self.tokens)[:, None]                                    # [S, 1, H]
        cos, sin = self.cos[self.pos][:, None], self.sin[self.pos][:, None]     # [S, 1, D]
        mask = (self.positions[:L] <= self.pos[:, None])[:, None, None]         # [S, 1, 1, L]
        for layer, (kc, vc) in zip(self.layers, self.cache):
            attn = layer.self_attn
            q, k, v = qkv(attn, layer.input_layernorm(x), cos, sin, self.rope)  # q [S, heads, 1, D]
            kc[self.slot_ids, :, self.pos], vc[self.slot_ids, :, self.pos] = k[:, :, 0], v[:, :, 0]
            o = self._attend(attn, q.reshape(S, self.n_kv, self.group, self.head_dim), kc, vc, L, mask)
            x = x + attn.o_proj(o.reshape(S, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        nxt = self._sample(self._logits(x[:, 0]), sampled, self.khash, self.pos + 1, self.temp, self._draw_step)
        live = self.active
        nxt = torch.where(live, nxt, self.tokens)
        self.seq[self.slot_ids, torch.where(live, self.pos + 1, self.max_len)] = nxt
        self.ngen += live
        done = self.is_stop[nxt] | (self.ngen >= self.max_new)
        self.tokens.copy_(nxt)
        self.pos += live
        self.active &= ~done

    def _capture(self, sampled):
        """One CUDA graph per bucket, largest first, sharing one memory pool (graphs never run concurrently and
        keep nothing in the pool between replays). Only while every slot is idle: the warm-up steps then change no
        state (idle slots write KV and ids only where nothing live reads)."""
        for L in reversed(self.buckets):
            if (L, sampled) in self.graphs:
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(L, sampled)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._step(L, sampled)
            self.pool = self.pool or g.pool()
            self.graphs[L, sampled] = g

    def _launch(self, L, sampled, steps):
        for _ in range(steps):
            if self.cuda_graphs:
                self.graphs[L, sampled].replay()
            else:
                self._step(L, sampled)
        self.stats["decode_steps"] += steps

    def _h2d(self, data):
        t = torch.tensor(data, dtype=torch.long)
        if self.seq.device.type != "cuda":
            return t
        return t.pin_memory().to(self.seq.device, non_blocking=True)  # queued behind the running steps, no sync

    # --- the loop ----------------------------------------------------------------------------------------------------

    def generate(self, prompts, *, max_new_tokens, temperature=0.0, stop_ids, keys=None):
        """prompts: list[list[int]]; max_new_tokens: int or list[int]; keys: per-prompt int keys (0 <= key < 2**63)
        of the sampling noise (default: the index). Yields (index, generated_ids, "stop" | "length") in completion
        order; a stop id ends a request and is not returned. ValueError for a prompt that does not fit max_len."""
        n = len(prompts)
        max_new = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        keys = list(range(n)) if keys is None else list(keys)
        if len(max_new) != n or len(keys) != n:
            raise ValueError(f"{n} prompts but {len(max_new)} max_new_tokens and {len(keys)} keys")
        reqs = [Request(p, m, temperature, k, i) for i, (p, m, k) in enumerate(zip(prompts, max_new, keys))]
        for r in reqs:
            self.check_request(r)
        # longest first: the longest contexts are placed while every slot is free, the short ones fill the drain
        pending = deque(sorted(reqs, key=lambda r: -len(r.prompt)))
        for r, ids, why in self.run(pending, stop_ids=stop_ids, sampled=temperature > 0):
            yield r.tag, ids, why

    def check_request(self, r: Request) -> None:
        if not r.prompt or r.max_new < 1:
            raise ValueError(f"request {r.tag}: {len(r.prompt)} prompt tokens and max_new_tokens {r.max_new}; both "
                             f"must be >= 1")
        if r.temperature < 0:
            raise ValueError(f"request {r.tag}: temperature {r.temperature} < 0")
        self.check_prompt(len(r.prompt), r.max_new)

    @torch.inference_mode()
    def run(self, pending: deque, *, stop_ids, sampled=None):
        """pending: a deque of Requests, taken from the left; the caller may append to it while iterating. Yields
        (request, generated_ids, "stop" | "length") in completion order and ends once pending is empty and no slot
        is live after the caller has seen every result. sampled: whether any request samples (temperature > 0);
        None: whether any in `pending` now does. The step's graphs are captured for it, so a later request with a
        temperature > 0 in a run started with sampled=False is refused."""
        stops = set(stop_ids)
        if any(not 0 <= t < len(self.is_stop) for t in stops):
            raise ValueError(f"stop_ids {sorted(stops)} are not all ids of the {len(self.is_stop)}-token vocabulary")
        if sampled is None:
            sampled = any(r.temperature > 0 for r in pending)
        self.is_stop.zero_()
        if stops:
            self.is_stop[self._h2d(sorted(stops))] = True
        self.active.zero_()                      # slots a previous, abandoned run left live are free again
        if self.cuda_graphs:
            self._capture(sampled)
        t0, finished = time.perf_counter(), []
        owner = [None] * self.S                  # the request per slot
        reach = [0] * self.S                     # an upper bound on the slot's position after the steps launched
        refill = max(1, int(self.S * REFILL_FRACTION))
        try:
            while True:
                free = [s for s in range(self.S) if owner[s] is None]
                # admit once enough slots are free to pay for a prefill, or when the batch is nearly empty anyway
                if pending and (len(free) >= refill or self.S - len(free) < refill):
                    self._admit(free, pending, sampled, owner, reach)
                live_any = any(o is not None for o in owner)
                if live_any:
                    need = max(min(reach[s] + SYNC_EVERY, len(o.prompt) + o.max_new)
                               for s, o in enumerate(owner) if o is not None)
                    self._launch(next(b for b in self.buckets if b >= need), sampled, SYNC_EVERY)
                    reach = [r + SYNC_EVERY for r in reach]
                yield from finished              # the consumer works (and may append) while the GPU runs the steps
                finished = []
                if live_any:
                    live, ngen = torch.stack([self.active.long(), self.ngen]).cpu().tolist()
                    done = [s for s in range(self.S) if owner[s] is not None and not live[s]]
                    finished = self._collect(done, owner, ngen, stops)
                elif not pending:
                    break
        finally:
            self.stats["seconds"] += time.perf_counter() - t0

    def _admit(self, free, pending, sampled, owner, reach):
        """Prefill the next requests into free slots, longest first, in forwards of at most PREFILL_TOKENS."""
        take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
        for r in take:
            if r.temperature > 0 and not sampled:
                raise ValueError(f"request {r.tag} samples (temperature {r.temperature}) in a run started greedy: "
                                 f"start the run with sampled=True")
            self.check_request(r)
        take.sort(key=lambda r: -len(r.prompt))
        start = 0
        while start < len(take):
            width = len(take[start].prompt)     # the longest of this chunk
            end = min(len(take), start + max(1, PREFILL_TOKENS // width))
            chunk, slots = take[start:end], free[start:end]
            self._prefill(slots, chunk, sampled)
            for s, r in zip(slots, chunk):
                owner[s], reach[s] = r, len(r.prompt)
            start = end

    def _collect(self, done, owner, ngen, stops):
        """Read finished slots' ids back, free the slots -> [(request, ids, reason)]."""
        if not done:
            return []
        width = max(len(owner[s].prompt) + ngen[s] for s in done)
        rows = self.seq[torch.tensor(done, device=self.seq.device), :width].cpu().tolist()
        out = []
        for s, row in zip(done, rows):
            r = owner[s]
            P = len(r.prompt)
            ids = row[P:P + ngen[s]]
            stopped = ids[-1] in stops
            out.append((r, ids[:-1] if stopped else ids, "stop" if stopped else "length"))
            self.stats["prompts"] += 1
            self.stats["generated"] += ngen[s]
            owner[s] = None
        return out


# --- the decoder layer's wiring (also model/fastdecode.py's) ---------------------------------------------------------

def check_family(cfg, fallback="--engine hf"):
    """Refuse a model_type whose decoder layer is not the one the engine runs (read from the config alone, so a
    GPT-2 or BERT-style model gets this message, not an AttributeError on its modules)."""
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"engine: model_type {cfg.model_type!r} is not one of {SUPPORTED} (their decoder layers are "
                         f"what the engine runs): use {fallback}")


def check_supported(cfg, attn, rotary, max_len, fallback="--engine hf"):
    """The engine re-implements the decoder layer's wiring: refuse models whose wiring or RoPE differs.
    fallback: what the message tells the user to use instead."""
    check_family(cfg, fallback)
    window = getattr(attn, "sliding_window", getattr(cfg, "sliding_window", None))
    if window is not None and window < max_len:
        raise ValueError(f"engine: {cfg.model_type} uses sliding-window attention ({window} tokens) and max_len "
                         f"{max_len} exceeds it; the engine attends to the whole cache: lower --max-len to {window}, "
                         f"or use {fallback}")
    rope_type = getattr(rotary, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise ValueError(f"engine: rope_type {rope_type!r} changes with the sequence length; the engine "
                         f"precomputes one table: use {fallback}")


def model_rope(attn):
    """The attention module's own modeling file's apply_rotary_pos_emb(q, k, cos, sin)."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


@torch.no_grad()
def rope_tables(decoder, embed, max_len):
    """-> cos, sin [max_len, head_dim]: the decoder's rotary module's own values at positions 0..max_len-1."""
    cos, sin = decoder.rotary_emb(embed.weight[:1], torch.arange(max_len, device=embed.weight.device)[None])
    return cos[0], sin[0]


def qkv(attn, h, cos, sin, rope):
    """h [b, s, H] -> q [b, heads, s, D], k and v [b, kv_heads, s, D], with the model's q/k norms and RoPE
    (rope = model_rope(attn); cos, sin broadcastable to [b, s, D])."""
    b, s, _ = h.shape
    q = attn.q_proj(h).view(b, s, -1, attn.head_dim)
    k = attn.k_proj(h).view(b, s, -1, attn.head_dim)
    v = attn.v_proj(h).view(b, s, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):                             # Qwen3: RMSNorm over head_dim before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)
