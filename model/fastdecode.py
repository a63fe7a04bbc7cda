"""Batch-1 greedy and DFlash speculative decoding whose cost is the GPU work: static KV caches, static-shape steps,
one CUDA graph per step kind (eval_dflash.py --method fast measures speedup with it).

    fast = FastDecoder(model, max_len=L + max_new + B - 1)           # an HF Llama / Mistral / Qwen2 / Qwen3
    tokens = fast.greedy(prompt_ids, max_new, eos)                   # the baseline
    draft = fast.drafter(drafter, block_size=B)                      # a model.drafter.Drafter, its own static cache
    out = fast.speculative(prompt_ids, draft, max_new, eos)          # {"tokens": [...], "steps": [...]}

The target runs the model's own submodules with model/engine.py's wiring (check_supported, qkv, the RoPE tables;
q and k roped in one pass by rope(), bit for bit the models' apply_rotary_pos_emb): per layer a static cache [1, kv_heads, max_len, head_dim], written by position; a query at position p attends to
the keys at positions <= p. So a verify block at p..p+B-1 is causal inside itself and full over the prefix, and the
entries a rejected draft wrote are simply overwritten by the next block (its first position is the first one not
committed) before anything reads them: no crop. The drafter's context cache (model.drafter.Drafter.step's keys and
values) is static the same way: row = position, visible while < the block's start; a step writes the context
rows of all B block tokens and only the accepted ones fall below the next start.

Two step kinds, each one CUDA graph (replayed on static buffers; eager on a CPU or with cuda_graphs=False, same
code): the greedy step (one token at `start` -> its argmax, start += 1) and the speculative step (drafter proposes
from [token, MASK x (B-1)] at start..start+B-1 -> the target verifies [token, drafts] -> accepted count a = the
longest prefix of drafts equal to the target's argmax -> the drafter's context gets the block's features -> the
next token is the target's argmax after the a accepted drafts, start += a + 1). The host reads back one small
tensor per step (the next token; or the block's argmax ids and a) to cut at eos / max_new_tokens, as
model.decode.speculative_decode does. The prompt prefill is one eager forward of the same code.

Kernels per step (aten ops that do work, counted on the CPU by `python -m tools.count_ops`: SmolLM2-135M target,
30 layers, a 5-layer drafter, B=16; before = commit b72f6aa). At batch 1 on a small model every kernel is a launch
and little else, so the counts are the graph's node counts, not its time:

| component                               | greedy before |    after | speculative before |    after |
|-----------------------------------------|--------------:|---------:|-------------------:|---------:|
| target layers (per layer)               |     1170 (39) | 930 (31) |          1230 (41) | 990 (33) |
| target embed, mask, final norm, lm_head |            13 |       13 |                 14 |       14 |
| drafter layers (per layer)              |             - |        - |           255 (51) | 195 (39) |
| drafter embed, masks, RoPE, norm, head  |             - |        - |                 24 |       14 |
| drafter context-cache update            |             - |        - |                 93 |       22 |
| acceptance and bookkeeping              |             3 |        2 |                 13 |       10 |
| total                                   |          1186 |      945 |               1629 |     1245 |

Where they went: SDPA turns a bool mask into 0 / -inf with 3 kernels in every layer (an additive mask built once
per step instead); rotate_half's neg and q's and k's separate RoPE (one pass over q and k concatenated, the negation
in the sin table); the drafter's q_norm and k_norm (one norm over its q and k heads), its RoPE tables (built once),
its context K/V (every layer's k and v projection one matmul of concatenated weights, k_norm and RoPE batched over
layers, one cache write instead of ten) and the out= writes of the acceptance. The drafter folds GQA into its
queries as the target does (2 copies a layer on the CPU; on CUDA it keeps fp32 off SDPA's math kernel where the
efficient one refuses enable_gqa). Every cut is the same arithmetic per element (tests/unit/test_fastdecode.py checks
the drafter's pieces bit for bit on the CPU). The verify of B tokens runs the greedy step's kernels plus 2 per layer
(the copies that fold GQA into q's rows and unfold o). So the speculative step is 1.32x a greedy step in kernels
(was 1.37x), yet it measured far more than that in time on an H200 (BENCHMARKS.md, Generation and decoding speed):
the rest must be the kernels' own time at 16 rows (likely the fp32 matmuls, no longer matrix-vector, and the two
49152-column lm_heads), which counts cannot see; `python -m tools.count_ops --device cuda --profile 20` shows each
op's device time.
"""
import torch
import torch.nn.functional as F

from model.engine import check_family, check_supported, rope_tables
from model import drafter as drafter_lib
from model.drafter import rope_cos_sin

GRAPH_WARMUP = 2      # eager runs of a step on a side stream before its capture (lazy inits, allocator)


def rope(x, cos, rot_sin):
    """x [..., D] rotated: the models' apply_rotary_pos_emb (x * cos + rotate_half(x) * sin; HF's four SUPPORTED
    families and model.drafter's alike) with rotate_half's negation folded into rot_sin = sin with its first half
    negated (-(a * b) == a * (-b) exactly), so q and k concatenated take 4 kernels instead of 10."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * rot_sin


def rotated_sin(sin):
    """sin [P, D] -> rope()'s rot_sin: the first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)


ATTENTION = ("sdpa", "matmul")


def attend(q, k, v, mask, scale, how):
    """Attention of q [1, kv, M, D] over k, v [1, kv, L, D] under the additive mask (broadcast to [M, L]) ->
    [1, kv, M, D]. how="sdpa": F.scaled_dot_product_attention (on CUDA in fp32 its memory-efficient kernel, whose
    blocks split the queries but not the keys: a decode step's few query rows run on one block per KV head);
    "matmul": the scores as one batched matmul over all keys (scale and mask fused into it), a float32 softmax, one
    more matmul, as model.engine's matmul attention (in bf16 the scores round to bf16 before the softmax, as HF's
    eager attention does). The same maths; they differ in rounding only."""
    if how == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    kv, M, D, L = q.shape[1], q.shape[2], q.shape[3], k.shape[2]
    s = torch.baddbmm(mask.expand(kv, M, L), q[0], k[0].transpose(1, 2),
                      alpha=D ** -0.5 if scale is None else scale)                  # [kv, M, L]
    return torch.bmm(s.softmax(-1, dtype=torch.float32).to(v.dtype), v[0])[None]


def additive_mask(visible, zero, neg_inf):
    """bool visible -> 0 / -inf in the attention's dtype: what SDPA turns a bool mask into, built once per step
    instead of once per layer (3 kernels a layer on the CPU and the GPU alike)."""
    return torch.where(visible, zero, neg_inf)


class FastDecoder:
    """The target with a static KV cache of max_len positions (a prompt plus its generated tokens plus B - 1 must
    fit), the greedy and verify steps, and their CUDA graphs (cuda_graphs: None = on CUDA, False = never)."""

    def __init__(self, model, max_len, cuda_graphs=None, attention="sdpa"):
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: one of {', '.join(ATTENTION)}")
        self.attention = attention                                 # attend()'s how, the drafter's too
        cfg = model.config.get_text_config()
        check_family(cfg, fallback="--method decode")   # before its modules are read: a GPT-2 has no .layers
        self.decoder = model.get_decoder()
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        check_supported(cfg, attn, self.decoder.rotary_emb, max_len, fallback="--method decode")
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        self.group = self.n_heads // self.n_kv                     # query heads per KV head
        self.max_len, self.last_layer = max_len, len(self.layers) - 1
        dev, dt = self.embed.weight.device, self.embed.weight.dtype
        self.cache = [(torch.zeros(1, self.n_kv, max_len, self.head_dim, dtype=dt, device=dev),
                       torch.zeros(1, self.n_kv, max_len, self.head_dim, dtype=dt, device=dev)) for _ in self.layers]
        cos, sin = rope_tables(self.decoder, self.embed, max_len)                 # [max_len, head_dim]
        self.cos, self.rot_sin = cos, rotated_sin(sin)
        self.positions = torch.arange(max_len, device=dev)
        self.zero, self.neg_inf = torch.tensor(0.0, dtype=dt, device=dev), torch.tensor(-torch.inf, dtype=dt, device=dev)
        # the state every step reads and updates in place: the last committed token and its position
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.cuda_graphs = dev.type == "cuda" and cuda_graphs is not False
        self.graphs, self.pool = {}, None

    def drafter(self, drafter, block_size=None):
        """A Drafter (on the target's device, any dtype) with its own static context cache."""
        return DraftState(drafter, self.embed, self.lm_head, block_size or drafter.config.block_size, self.max_len,
                          self.attention)

    # --- the target --------------------------------------------------------------------------------------------------

    def forward(self, ids, pos, taps=(), last_only=False):
        """ids [n] at positions pos [n] (consecutive) -> logits [n (1 if last_only), V] float32 and the decoder
        layers' outputs at `taps` concatenated, [n, K*H] (None without taps; the last layer's after the final norm,
        as HF's hidden_states and model.target.Target give it). Writes the n tokens' KV."""
        cos, rot_sin = self.cos[pos][None, :, None], self.rot_sin[pos][None, :, None]   # [1, n, 1, D]
        # GQA without repeating the cache: a KV head's `group` query heads are group * n queries of that head
        visible = (self.positions[None, :] <= pos[:, None]).repeat(self.group, 1)       # [group*n, max_len]
        mask = additive_mask(visible, self.zero, self.neg_inf)
        x = self.embed(ids)[None]                                                  # [1, n, H]
        feats = {}
        for l, (layer, cache) in enumerate(zip(self.layers, self.cache)):
            x = self._layer(layer, cache, x, pos, cos, rot_sin, mask)
            if l in taps:
                feats[l] = x[0]
        h = self.decoder.norm(x[0])                                                # [n, H]
        if self.last_layer in feats:
            feats[self.last_layer] = h
        logits = self.lm_head(h[-1:] if last_only else h).float()
        return logits, torch.cat([feats[l] for l in taps], dim=-1) if taps else None

    def _layer(self, layer, cache, x, pos, cos, rot_sin, mask):
        """One decoder layer, model/engine.py's wiring (its qkv, with q and k roped in one pass; then attention over
        the whole cache): x [1, n, H] at positions pos [n] -> [1, n, H]; writes the n tokens' KV into cache."""
        attn, (kc, vc), n, D = layer.self_attn, cache, x.shape[1], self.head_dim
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, n, self.n_heads, D)
        k = attn.k_proj(h).view(1, n, self.n_kv, D)
        v = attn.v_proj(h).view(1, n, self.n_kv, D)
        if hasattr(attn, "q_norm"):                             # Qwen3: RMSNorm over head_dim before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        qk = rope(torch.cat([q, k], dim=2), cos, rot_sin)                         # [1, n, heads + kv, D]
        kc.index_copy_(2, pos, qk[:, :, self.n_heads:].transpose(1, 2))
        vc.index_copy_(2, pos, v.transpose(1, 2))
        q = qk[:, :, :self.n_heads].transpose(1, 2).reshape(1, self.n_kv, self.group * n, D)
        o = attend(q, kc, vc, mask, attn.scaling, self.attention)                # [1, kv, g*n, D]
        x = x + attn.o_proj(o.reshape(1, -1, n, D).transpose(1, 2).reshape(1, n, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _prefill(self, prompt_ids, taps=()):
        """Eager forward of the prompt at positions 0..L-1 -> its features [L, K*H] (None without taps); token =
        the target's first generated token, start = L."""
        L = len(prompt_ids)
        logits, feats = self.forward(torch.tensor(prompt_ids, device=self.start.device), self.positions[:L], taps,
                                     last_only=True)
        self.token.copy_(logits.argmax(-1))
        self.start.fill_(L)
        return feats

    def _check_fits(self, prompt_len, max_new_tokens, block_size=1):
        # the last step writes up to B - 1 positions past the last token: an index past the cache would fail on the
        # GPU asynchronously, in a graph, far from its cause
        need = prompt_len + max_new_tokens + block_size - 1
        if need > self.max_len:
            raise ValueError(f"a prompt of {prompt_len} tokens + {max_new_tokens} new tokens + block size "
                             f"{block_size} - 1 needs {need} cache positions; the decoder has max_len {self.max_len}: "
                             f"build FastDecoder with a larger max_len")

    # --- the two steps (static shapes, no host sync: graph-safe) -----------------------------------------------------

    def _greedy_step(self):
        logits, _ = self.forward(self.token, self.start)                          # [1, V]
        torch.argmax(logits, -1, out=self.token)
        self.start += 1

    def _spec_step(self, d: "DraftState"):
        pos = self.start + self.positions[:d.B]                                   # [B]
        draft = d.propose(self.token, pos)                                        # [B-1]
        logits, feats = self.forward(torch.cat([self.token, draft]), pos, d.taps)  # [B, V], [B, K*H]
        post = logits.argmax(-1)                                                  # [B] the target's next tokens
        a = (draft == post[:-1]).cumprod(0).sum(0, keepdim=True)                  # [1] accepted drafts (bool -> long)
        d.write(feats, pos)                  # rows past the accepted ones stay >= the next start: never read
        torch.cat([post, a], out=d.out)
        torch.gather(post, 0, a, out=self.token)
        self.start += a + 1

    def _launch(self, key, step):
        """Run step() once: replay its CUDA graph (captured by _ready before the decode began), or eagerly."""
        if self.cuda_graphs:
            self.graphs[key].replay()
        else:
            step()

    def _capture(self, key, step):
        """The engine's pattern (model/engine.py Engine._capture): warm-up runs on a side stream, then the capture,
        every graph in one memory pool (they never run concurrently and keep nothing in it between replays). The
        warm-up runs change the state, so it is called before a decode's prefill, which sets it (see _ready)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP):
                step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            step()
        self.pool = self.pool or g.pool()
        self.graphs[key] = g

    def _ready(self, key, step):
        """Capture step's graph if it has none yet: before a decode's prefill, never in the middle of one."""
        if self.cuda_graphs and key not in self.graphs:
            self.start.zero_()               # warm-up steps write near position 0, which the prefill then rewrites
            self._capture(key, step)

    # --- the decode loops --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def greedy(self, prompt_ids, max_new_tokens, eos) -> list[int]:
        """Plain greedy decoding (model.decode.greedy_decode's tokens): up to max_new_tokens, the first eos included."""
        self._check_fits(len(prompt_ids), max_new_tokens)
        self._ready("greedy", self._greedy_step)
        self._prefill(prompt_ids)
        out = [int(self.token)]
        while len(out) < max_new_tokens and out[-1] not in eos:
            self._launch("greedy", self._greedy_step)
            out.append(int(self.token))                                           # the one sync per token
        return out

    @torch.inference_mode()
    def speculative(self, prompt_ids, d: "DraftState", max_new_tokens, eos) -> dict:
        """-> {tokens, steps}, as model.decode.speculative_decode with block verification: steps = tokens
        committed per verify step (accepted + the bonus token, cut at the first eos and at max_new_tokens)."""
        self._check_fits(len(prompt_ids), max_new_tokens, d.B)
        step = lambda: self._spec_step(d)                                         # noqa: E731
        self._ready(d, step)
        feats = self._prefill(prompt_ids, d.taps)                                 # [L, K*H]
        d.write(feats, self.positions[:len(prompt_ids)])
        new, steps = [int(self.token)], []
        while len(new) < max_new_tokens and new[-1] not in eos:
            self._launch(d, step)
            *post, a = d.out.tolist()                                             # the one sync per step
            committed = post[:a + 1]        # the accepted drafts equal the target's argmax ids there, + the bonus
            cut = next((i + 1 for i, t in enumerate(committed) if t in eos), len(committed))
            committed = committed[: min(cut, max_new_tokens - len(new))]
            new += committed
            steps.append(len(committed))
        return {"tokens": new, "steps": steps}


class DraftState:
    """A Drafter with a static context cache (what model.drafter.DrafterCache holds, as rows indexed by position),
    its step re-wired for few kernels (Drafter.step's and Drafter.context_kv's maths, per element: checked against
    them in tests/unit/test_fastdecode.py), and the output buffer of its verify step, out [B + 1] = the target's argmax
    ids of the block, then the accepted count. It copies the drafter's k/v projection and q/k norm weights
    (about 2 * kv_heads * head_dim * H values per layer): build it once the drafter's weights are final."""

    def __init__(self, drafter, embed, lm_head, block_size, max_len, attention="sdpa"):
        drafter = getattr(drafter, "_orig_mod", drafter)          # unwrap torch.compile
        self.drafter = getattr(drafter, "module", drafter)        # unwrap DDP
        c = self.drafter.config
        p = next(self.drafter.parameters())
        self.B, self.taps, self.dtype, self.config = block_size, list(c.target_layer_ids), p.dtype, c
        self.attention = attention
        self.embed, self.lm_head = embed, lm_head
        L, nh, nkv, D = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.n_heads, self.n_kv, self.group = nh, nkv, nh // nkv
        attns = [layer.self_attn for layer in self.drafter.layers]
        with torch.no_grad():
            # every layer's context keys and values from one matmul: rows (layer, k | v, kv head, D)
            self.w_ctx = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)])   # [L*2*nkv*D, H]
            self.b_ctx = torch.cat([b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)]) if c.attention_bias \
                else None
            self.k_norm_w = torch.stack([a.k_norm.weight for a in attns])[:, None]                  # [L, 1, D]
            # a layer's q_norm and k_norm as one norm over its concatenated q and k heads
            self.qk_norm_w = torch.stack([torch.cat([a.q_norm.weight.expand(nh, D), a.k_norm.weight.expand(nkv, D)])
                                          for a in attns])                                          # [L, nh+nkv, D]
        # row = position; [:, l, 0] the keys and [:, l, 1] the values of layer l
        self.kv = torch.zeros(max_len, L, 2, nkv, D, dtype=p.dtype, device=p.device)
        self.positions = torch.arange(max_len, device=p.device)                     # row i holds position i
        # the key positions a block attends to: the cache rows, then B block rows visible whatever the start
        self.key_pos = torch.cat([self.positions, self.positions.new_full((block_size,), -1)])     # [max_len + B]
        cos, sin = rope_cos_sin(self.positions, c)                                  # [max_len, D] fp32
        self.cos, self.rot_sin = cos.to(p.dtype), rotated_sin(sin).to(p.dtype)     # as _apply_rope casts them
        self.zero = torch.tensor(0.0, dtype=p.dtype, device=p.device)
        self.neg_inf = torch.tensor(-torch.inf, dtype=p.dtype, device=p.device)
        self.masks = torch.full((block_size - 1,), c.mask_token_id, dtype=torch.long, device=p.device)
        self.out = torch.zeros(block_size + 1, dtype=torch.long, device=p.device)

    def write(self, features, positions):
        """Context keys/values of features [n, K*H] (the target's, of the tokens at positions [n]): Drafter.context_kv
        with the layers' k/v projections, k_norms and RoPE batched over layers, and one cache write."""
        c, n = self.config, positions.shape[0]
        ctx = self.drafter.hidden_norm(self.drafter.fc(features.to(self.dtype)))                  # [n, H]
        kv = F.linear(ctx, self.w_ctx, self.b_ctx).view(n, c.num_hidden_layers, 2, self.n_kv, c.head_dim)
        k = drafter_lib.rms_norm(kv[:, :, 0], self.k_norm_w, c.rms_norm_eps)                     # [n, L, nkv, D]
        k = rope(k, self.cos[positions][:, None, None], self.rot_sin[positions][:, None, None])
        self.kv.index_copy_(0, positions, torch.stack([k, kv[:, :, 1]], dim=2))

    def propose(self, token, positions):
        """token [1] at positions[0], positions [B] of the block -> draft ids [B-1] (argmax of slots 1..B-1),
        given the context rows before the block."""
        h = self.hidden(token, positions)                                                 # [B, H]
        if type(self.drafter).draft_tokens is not drafter_lib.Drafter.draft_tokens:   # DFlash2: the walk (static)
            return self.drafter.draft_tokens(h[None, 1:], self.lm_head, token)[0]
        return self.lm_head(h[1:].to(self.lm_head.weight.dtype)).argmax(-1)

    def hidden(self, token, positions):
        """-> the drafter's output states [B, H] of the block [token, MASK x (B-1)]: Drafter.step with the masks
        built once as additive biases."""
        c = self.config
        emb = self.embed(torch.cat([token, self.masks])).to(self.dtype)                 # [B, H]
        cos, rot_sin = self.cos[positions][:, None], self.rot_sin[positions][:, None]   # [B, 1, D]
        visible = self.key_pos < positions[0]                      # [max_len + B]: context rows, the whole block
        masks = {"full_attention": additive_mask(visible, self.zero, self.neg_inf)[None]}      # [1, max_len + B]
        if "sliding_attention" in c.layer_types:
            dist = positions[:, None] - torch.cat([self.positions, positions])[None]             # [B, max_len + B]
            sliding = (dist >= 0) & (dist < c.sliding_window) & visible
            masks["sliding_attention"] = additive_mask(sliding, self.zero, self.neg_inf).repeat(self.group, 1)
        x = emb
        for l, (layer, kind) in enumerate(zip(self.drafter.layers, c.layer_types)):
            x = self._layer(l, layer, x, cos, rot_sin, masks[kind])
        return self.drafter.norm(x)

    def _layer(self, l, layer, x, cos, rot_sin, mask):
        """DecoderLayer.step of layer l against the cache: x [B, H] -> [B, H], q_norm and k_norm as one norm, q and
        k roped in one pass. mask: additive, [1, max_len + B] or [group*B, max_len + B] (a row per folded query)."""
        attn, M, D = layer.self_attn, x.shape[0], self.config.head_dim
        convs = (layer.attention_conv, layer.mlp_conv) if hasattr(layer, "attention_conv") else None   # DFlash2
        h = layer.input_layernorm(x)
        if convs:
            h, coef = convs[0].prepare(h)
        qk = torch.cat([attn.q_proj(h).view(M, self.n_heads, D), attn.k_proj(h).view(M, self.n_kv, D)], dim=1)
        qk = rope(drafter_lib.rms_norm(qk, self.qk_norm_w[l], self.config.rms_norm_eps), cos, rot_sin)  # [B, nh+nkv, D]
        k = torch.cat([self.kv[:, l, 0], qk[:, self.n_heads:]]).transpose(0, 1)[None]   # [1, nkv, max_len + B, D]
        v = torch.cat([self.kv[:, l, 1], attn.v_proj(h).view(M, self.n_kv, D)]).transpose(0, 1)[None]
        # GQA as the target does it (a KV head's group * B queries), not SDPA's enable_gqa: the efficient CUDA
        # kernel of some torch versions refuses enable_gqa, and fp32 then takes the math one (k and v repeated, the
        # scores materialised: ~10 kernels)
        q = qk[:, :self.n_heads].transpose(0, 1).reshape(1, self.n_kv, self.group * M, D)
        o = attend(q, k, v, mask, None, self.attention)                                   # [1, nkv, group*B, D]
        y = attn.o_proj(o.reshape(self.n_heads, M, D).transpose(0, 1).reshape(M, self.n_heads * D))
        if not convs:
            x = x + y
            return x + layer.mlp(layer.post_attention_layernorm(x))
        x = x + convs[0].finish(y, coef)
        u, coef = convs[1].prepare(layer.post_attention_layernorm(x))
        return x + convs[1].finish(layer.mlp(u), coef)
