"""Greedy and speculative decoding at batch 1 with HF KV caches, the loops that eval_dflash.py measures, the trainer
evaluates with and the tools reuse: the target forward with its tapped hidden states, plain greedy decoding (the
losslessness reference), the drafter's proposals (`DrafterProposer`), block and DDTree verification
(`speculative_decode`), and the walk's pieces (batched greedy references, steps from teacher-forced drafts).
eval_dflash.py's docstring states the loop and its choices once."""
import heapq
import inspect
from collections import defaultdict

import torch
from transformers import DynamicCache, GenerationConfig

from model.drafter import Drafter, DrafterCache

TREE_TOP_K = 8         # DDTree: candidate tokens per slot, i.e. children per tree node


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


def sync_device(device):
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

    def hidden(self, tokens, start, block_size):
        """tokens: prompt + committed so far, tokens[-1] at position `start` -> the drafter's output [B, H]."""
        assert len(self.cache) == start, f"drafter context holds {len(self.cache)} positions, block starts at {start}"
        dev = self.cache.positions.device
        ids = torch.tensor([tokens[-1]] + [self.mask_id] * (block_size - 1), device=dev)
        return self.drafter.step(self.cache, self.embed(ids).to(self.dtype),
                                 torch.arange(start, start + block_size, device=dev))            # [B, H]

    def propose(self, tokens, start, block_size):
        """-> the unary logits [B-1, V] of slots 1..B-1 (DDTree's input; a DFlash drafter's argmax is its draft)."""
        return self.lm_head(self.hidden(tokens, start, block_size)[1:].to(self.lm_head.weight.dtype))   # [B-1, V]

    def draft(self, tokens, start, block_size):
        """-> the draft tokens [B-1] of slots 1..B-1 by the drafter's own rule (Drafter.propose: the argmax of
        propose's logits for DFlash, the selector's walk from the anchor for DFlash2)."""
        if type(self.drafter).draft_tokens is Drafter.draft_tokens:
            return self.propose(tokens, start, block_size).argmax(-1)
        h = self.hidden(tokens, start, block_size)
        anchor = torch.tensor([tokens[-1]], device=h.device)
        return self.drafter.draft_tokens(h[None, 1:], self.lm_head, anchor)[0]


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
    if type(d).draft_tokens is not Drafter.draft_tokens:   # the drafter's own rule (DFlash2: the selector's walk)
        assert not top_k, "DDTree expands the unary top-k of each slot: a DFlash2 drafter proposes by its walk"
        h = h.view(len(anchors), B, -1)[:, 1:]                                            # [N, B-1, H]
        step = max(1, rows_per_chunk // max(1, B - 1))
        return torch.cat([d.draft_tokens(h[s:s + step], proposer.lm_head, ids[anchors[s:s + step]])
                          for s in range(0, len(anchors), step)]) if len(anchors) else \
            torch.empty(len(anchors), B - 1, dtype=torch.long, device=dev)
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
    return draft_streak(drafts_at_every_anchor(proposer, feats, ids, len(prompt_ids), block_size), ids, len(prompt_ids))


def draft_streak(drafts, ids, prompt_len) -> float:
    """Mean correct prefix of drafts [N, B-1] (anchors P..L-2 of ids [L]), cut at the end of ids."""
    L, B = len(ids), drafts.shape[1] + 1
    idx = torch.arange(prompt_len, L - 1, device=ids.device)[:, None] + torch.arange(1, B, device=ids.device)
    ok = (drafts == ids[idx.clamp(max=L - 1)]) & (idx < L)                                 # [N, B-1]
    return float(torch.cumprod(ok.int(), dim=1).sum(1).float().mean())


# ---------------------------------------------------------------------------
# Verification: a block (chain) or a DDTree

def verify_block(model, cache, root, draft, start, layer_ids):
    """draft [B-1] token ids -> (accepted path incl. the root [a+1] tokens, bonus token, features of the path
    [a+1, K*H])."""
    dev = draft.device
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
        if tree_budget:
            draft_logits = proposer.propose(prompt_ids + new, start, block_size)             # [B-1, V]
            path, bonus, feats = verify_tree(model, cache, new[-1], draft_logits, start, proposer.layer_ids,
                                             tree_budget, tree_top_k)
        else:
            draft = proposer.draft(prompt_ids + new, start, block_size) if hasattr(proposer, "draft") else \
                proposer.propose(prompt_ids + new, start, block_size).argmax(-1)             # [B-1]
            path, bonus, feats = verify_block(model, cache, new[-1], draft, start, proposer.layer_ids)
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
