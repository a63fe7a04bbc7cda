"""DFlash2: identity init == the DFlash backbone, block-local convolutions, the selector's walk and loss against
slow references, warm start from DFlash, the export's config and weight names."""
import json

import pytest
import torch
import torch.nn.functional as F

from model.dflash2 import (DFlash2Drafter, block_conv, candidates, dflash2_keys, selector_lattice, selector_walk,
                           walk_lattice, warm_start)
from model.dflash2_loss import dflash2_loss, selector_loss, selector_metrics, training_candidates
from model.objective import block_metrics, weighted_ce
from dflash2_cases import build_dflash2, randomize_dflash2  # noqa: F401 (a fixture)
from test_drafter import packed_batch, run


# ---------------------------------------------------------------------------
# Identity init and warm start

@pytest.mark.parametrize("sliding", [0, 2])
def test_fresh_dflash2_is_its_dflash_backbone(build_dflash2, tiny_qwen3_dir, sliding):
    d2, d1 = build_dflash2(tiny_qwen3_dir, sliding_window_layers=sliding)
    b = packed_batch(d1)
    assert torch.equal(run(d2, b), run(d1, b))                       # bitwise: the identity multiplies by 1, adds 0
    # and the T=0 proposal is the unary argmax (zero transition)
    h = run(d2, b)[:, 1:]                                             # [N, B-1, H]
    anchors = b["blocks"].ids[:, 0]
    assert torch.equal(selector_walk(d2.candidate_selector, h, b["emb"], anchors), (h @ b["emb"].T).argmax(-1))


def test_warm_start_is_strict_on_the_backbone(build_dflash2, tiny_qwen3_dir):
    d2, d1 = build_dflash2(tiny_qwen3_dir)
    sd = d2.state_dict()
    for k, v in d1.state_dict().items():
        assert torch.equal(sd[k], v), k
    assert set(sd) - set(d1.state_dict()) == dflash2_keys(d2)
    bad = dict(d1.state_dict())
    bad.pop("layers.0.mlp.up_proj.weight")
    with pytest.raises(AssertionError, match="backbone keys missing"):
        warm_start(d2, bad)
    with pytest.raises(AssertionError, match="already holds DFlash2 keys"):
        warm_start(d2, d2.state_dict())


def test_the_convolutions_train_from_identity(build_dflash2, tiny_qwen3_dir):
    """At init the dynamic projections get gradients (the identity is not a dead point)."""
    d2, _ = build_dflash2(tiny_qwen3_dir)
    b = packed_batch(d2)
    bl = b["blocks"]
    attn = d2.attn_spec(bl.anchor_idx, bl.anchor_doc, b["doc"])
    out = d2(b["feats"], b["pos"], b["emb"][bl.ids.flatten()], bl.positions.flatten(), attn)
    out.square().sum().backward()
    for layer in d2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert conv.kernel_projection.weight.grad.abs().sum() > 0
            assert conv.base_kernel.grad.abs().sum() > 0


# ---------------------------------------------------------------------------
# The convolution stays inside its block

def test_block_conv_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    B, N, H, G, taps = 5, 3, 8, 2, 3
    M = N * B - 2                                                      # a last partial block
    x, coef, base = torch.randn(M, H, generator=g), torch.randn(M, taps, G, generator=g), torch.randn(taps, H,
                                                                                                      generator=g)
    want = torch.zeros(M, H)
    for m in range(M):
        for j in range(taps):
            if m % B >= j:
                want[m] += (base[j] + coef[m, j].repeat_interleave(H // G)) * x[m - j]
    torch.testing.assert_close(block_conv(x, coef, base, B), want)


def test_previous_blocks_tokens_never_reach_the_next_blocks_convolutions(build_dflash2, tiny_qwen3_dir):
    """Each convolution's input and output, hooked, for a change of one block's rows: the rows of every other block
    are untouched at every convolution (attention alone is the path between blocks, and blocks never see each
    other); slot 0 of a block reads zero before it."""
    d2, _ = build_dflash2(tiny_qwen3_dir, block_size=4)
    randomize_dflash2(d2)
    b = packed_batch(d2)
    bl = b["blocks"]
    attn = d2.attn_spec(bl.anchor_idx, bl.anchor_doc, b["doc"])
    B, N = bl.ids.shape[1], bl.ids.shape[0]
    seen = []

    def hook(module, args, out):
        seen.append(out[0] if isinstance(out, tuple) else out)
    handles = [m.register_forward_hook(hook) for layer in d2.layers for m in (layer.attention_conv, layer.mlp_conv)]

    def outputs(emb):
        seen.clear()
        with torch.no_grad():
            d2(b["feats"], b["pos"], emb, bl.positions.flatten(), attn)
        return [t.view(N, B, -1).clone() for t in seen]
    emb = b["emb"][bl.ids.flatten()]
    base = outputs(emb)
    for n in range(N - 1):
        moved = emb.clone()
        moved[n * B:(n + 1) * B] += torch.randn(B, emb.shape[1])       # tokens of block n (its anchor included)
        for got, want in zip(outputs(moved), base):
            others = [m for m in range(N) if m != n]
            assert torch.equal(got[others], want[others])
            assert not torch.equal(got[n], want[n])
    for h in handles:
        h.remove()
    # slot 0 reads zero: the first row of a block equals the conv of that row alone
    x, coef = torch.randn(2 * B, 64), torch.randn(2 * B, 2, 4)
    conv = d2.layers[0].attention_conv
    full = torch.stack([block_conv(x, coef, conv.base_kernel[0].detach(), B)[i] for i in (0, B)])
    alone = torch.stack([block_conv(x[i:i + 1], coef[i:i + 1], conv.base_kernel[0].detach(), B)[0] for i in (0, B)])
    assert torch.equal(full, alone)


def test_step_matches_the_packed_forward(build_dflash2, tiny_qwen3_dir):
    """The inference path (context KV cache, one block) applies the same convolutions as training's packed
    forward: the block of an anchor right after the context gives the same states both ways."""
    from model.drafter import DrafterCache
    from model.objective import pack
    d2, _ = build_dflash2(tiny_qwen3_dir, block_size=4)
    randomize_dflash2(d2)
    cfg = d2.config
    g = torch.Generator().manual_seed(3)
    T, B = 10, cfg.block_size
    doc, pos = pack(torch.tensor([T + B]))
    feats = torch.randn(T + B, cfg.num_taps * cfg.hidden_size, generator=g)
    emb = torch.randn(B, cfg.hidden_size, generator=g)
    anchor = torch.tensor([T])
    attn = d2.attn_spec(anchor, torch.zeros(1, dtype=torch.long), doc)
    with torch.no_grad():
        packed = d2(feats, pos, emb, torch.arange(T, T + B), attn)
        cache = DrafterCache(d2)
        cache.append(feats[:T], pos[:T])
        stepped = d2.step(cache, emb, torch.arange(T, T + B))
    torch.testing.assert_close(stepped, packed, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# The selector's T=0 walk

def brute_walk(sel, hidden, W, anchors):
    """One block and one slot at a time, each candidate's score from its definition."""
    n, S, _ = hidden.shape
    out = torch.zeros(n, S, dtype=torch.long)
    for i in range(n):
        prev = int(anchors[i])
        for s in range(S):
            h = hidden[i, s]
            logits = W @ h
            best, best_id = None, None
            for c in logits.topk(sel.top_k).indices.tolist():
                bil = sum(float(sel.predecessor_codebook[prev, r]) * float(sel.hidden_projection.weight[r] @ h)
                          * float(sel.successor_codebook[c, r]) for r in range(sel.predecessor_codebook.shape[1]))
                score = float(logits[c]) + bil
                if best is None or score > best:
                    best, best_id = score, c
            out[i, s] = best_id
            prev = best_id
    return out


def test_selector_walk_equals_brute_force(build_dflash2, tiny_qwen3_dir):
    d2, _ = build_dflash2(tiny_qwen3_dir, block_size=6, selector_top_k=5)
    randomize_dflash2(d2, scale=2.0)                                   # a transition strong enough to reorder
    g = torch.Generator().manual_seed(1)
    n, S, H, V = 7, 5, d2.config.hidden_size, d2.config.vocab_size
    hidden, W = torch.randn(n, S, H, generator=g), torch.randn(V, H, generator=g)
    anchors = torch.randint(0, V, (n,), generator=g)
    sel = d2.candidate_selector
    with torch.no_grad():
        got = selector_walk(sel, hidden, W, anchors)
        assert torch.equal(got, brute_walk(sel, hidden, W, anchors))
        assert not torch.equal(got, (hidden @ W.T).argmax(-1))        # the selector changed some picks
        # the lattice's edge from slot s-1's pick is the walk's score
        vals, ids = candidates(hidden, W, sel.top_k)
        lat = selector_lattice(sel, hidden, vals, ids, anchors)
        assert torch.equal(walk_lattice(lat, ids), got)


# ---------------------------------------------------------------------------
# The selector loss

def slow_selector_loss(sel, hidden, W, labels, rows, w):
    """Full logits, top-K, gold injection and the K-way CE row by row."""
    total, ces = 0.0, []
    for r, wr in zip(rows.tolist(), w.tolist()):
        h, gold, prev = hidden[r], int(labels[r]), int(labels[r - 1])
        logits = W @ h
        cand = logits.topk(sel.top_k).indices.tolist()
        if gold not in cand:
            cand[-1] = gold
        ctx = sel.predecessor_codebook[prev] * sel.hidden_projection(h)
        scores = torch.stack([logits[c] + ctx @ sel.successor_codebook[c] for c in cand])
        ce = F.cross_entropy(scores[None], torch.tensor([cand.index(gold)]))
        ces.append(ce.detach())
        total = total + wr * ce
    return total, torch.stack(ces)


def test_training_candidates_inject_a_missing_gold():
    top = torch.tensor([[5, 3, 9], [1, 2, 4]])
    cand, target, hit = training_candidates(top, torch.tensor([3, 7]))
    assert cand.tolist() == [[5, 3, 9], [1, 2, 7]] and target.tolist() == [1, 2] and hit.tolist() == [True, False]


@pytest.mark.parametrize("chunk", [0, 3, 1000])
def test_selector_loss_equals_a_slow_reference(build_dflash2, tiny_qwen3_dir, chunk):
    d2, _ = build_dflash2(tiny_qwen3_dir, block_size=4, selector_top_k=4)
    randomize_dflash2(d2)
    b = packed_batch(d2)
    bl = b["blocks"]
    labels, weights = bl.labels.flatten(), bl.weights.flatten()
    rows = (weights > 0).nonzero().squeeze(1)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(labels.shape[0], d2.config.hidden_size, generator=g, requires_grad=True)
    W = b["emb"] * 0.5 + torch.randn(b["emb"].shape, generator=g) * 0.5
    sel = d2.candidate_selector
    parts = weighted_ce(hidden, W, labels, weights, chunk, rows=rows, top_k=sel.top_k)
    got = selector_loss(sel, hidden, W, labels, rows, weights[rows], parts.top_ids, chunk)
    want, want_ce = slow_selector_loss(sel, hidden, W, labels, rows, weights[rows])
    assert got.hit.sum() < len(rows)                                   # some golds were injected
    torch.testing.assert_close(got.loss_sum, want)
    torch.testing.assert_close(got.ce, want_ce)
    params = [hidden, sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight]
    g_got = torch.autograd.grad(got.loss_sum, params)
    g_want = torch.autograd.grad(want, params)
    for a, c in zip(g_got, g_want):
        torch.testing.assert_close(a, c)


def prepared_item(cfg, seed=4):
    """A Prepared micro-batch (objective.prepare) of three documents, with random hidden states and lm_head."""
    from types import SimpleNamespace
    from model.objective import prepare
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([14, 9, 11])
    T = int(lengths.sum())
    ids = torch.randint(0, cfg.vocab_size - 1, (T,), generator=g)
    loss_mask = torch.ones(T, dtype=torch.uint8)
    loss_mask[20:23] = 0                                               # some unsupervised slots inside the blocks
    packet = SimpleNamespace(g=0, lengths=lengths, num_tokens=T, input_ids=ids, loss_mask=loss_mask,
                             features=torch.randn(T, cfg.num_taps * cfg.hidden_size, generator=g))
    item = prepare(packet, cfg, seed=0, max_anchors=8, min_per_doc=1, gamma=4.0)
    hidden = torch.randn(item.labels.shape[0], cfg.hidden_size, generator=g, requires_grad=True)
    return item, hidden, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_dflash2_loss_chunked_equals_unchunked(build_dflash2, tiny_qwen3_dir, weighting):
    """Block CE + alpha x selector CE under one set of weights, chunked over rows (top-K from the chunk loop) ==
    unchunked (full logits), in value and gradients; alpha = 0 is the block loss alone."""
    from model.objective import block_loss
    d2, _ = build_dflash2(tiny_qwen3_dir, block_size=4, selector_top_k=4)
    randomize_dflash2(d2)
    cfg = d2.config
    item, hidden, W = prepared_item(cfg)
    res = {}
    for chunk in (0, 5):
        parts, sel = dflash2_loss(d2, hidden, W, item, weighting, 0.5, chunk, alpha=0.7)
        grads = torch.autograd.grad(parts.loss_sum, [hidden, d2.candidate_selector.successor_codebook])
        res[chunk] = (parts.loss_sum.detach(), sel.loss_sum.detach(), grads)
    for a, c in zip(res[0][:2] + res[0][2], res[5][:2] + res[5][2]):
        torch.testing.assert_close(a, c)
    block = block_loss(hidden, W, item, cfg.block_size, weighting, 0.5, 5)
    torch.testing.assert_close(res[5][0], block.loss_sum.detach() + 0.7 * res[5][1])


@pytest.mark.parametrize("trained_selector", [False, True])
def test_selector_metrics(build_dflash2, tiny_qwen3_dir, trained_selector):
    """recall@K and teacher-forced accuracy count the SelectorParts; the path streak is the accepted prefix of the
    brute-force walk from each anchor, and with a fresh selector (zero transition) it is block_metrics' streak."""
    d2, _ = build_dflash2(tiny_qwen3_dir, block_size=4, selector_top_k=4)
    if trained_selector:
        randomize_dflash2(d2, scale=2.0)
    cfg, sel = d2.config, d2.candidate_selector
    item, hidden, W = prepared_item(cfg)
    hidden = hidden.detach()
    B, N = cfg.block_size, item.labels.shape[0] // cfg.block_size
    with torch.no_grad():
        parts, sp = dflash2_loss(d2, hidden, W, item, "exp", 0.5, 5, alpha=1.0)
        m = selector_metrics(sel, hidden, W, item, B, sp, parts.top_ids, 5)
        labels, sup = item.labels.view(N, B), (item.weights > 0).view(N, B)
        path = brute_walk(sel, hidden.view(N, B, -1)[:, 1:], W, labels[:, 0])
    ok = ((path == labels[:, 1:]) & sup[:, 1:]).float()
    assert m["path_streak_num"] == torch.cumprod(ok, 1).sum() and m["path_streak_den"] == N
    assert m["sel_recall_num"] == sp.hit.sum() and m["sel_den"] == len(item.rows)
    assert m["sel_tf_acc_num"] == sp.correct.sum()
    if not trained_selector:
        unary = block_metrics(parts.correct.view(N, B), item.weights.view(N, B))
        assert m["path_streak_num"] == unary["streak_num"]
        assert m["sel_tf_acc_num"] == unary["acc_num"]


# ---------------------------------------------------------------------------
# Export

def test_export_config_and_weight_names(build_dflash2, tiny_qwen3_dir, tmp_path):
    from safetensors import safe_open
    from model.export import export_dflash2, load_dflash2
    d2, _ = build_dflash2(tiny_qwen3_dir, num_layers=2, block_size=4, selector_rank=8, selector_top_k=4)
    randomize_dflash2(d2)
    out = export_dflash2(d2, tmp_path / "export", dtype=torch.float32)
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlash2DraftModel"]
    assert c["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    # no causality override: vLLM's rule (is_causal, then dflash_config.causal, then sliding layers causal) falls
    # through to the layer types, as this project trains them
    assert "is_causal" not in c and "causal" not in c["dflash_config"]
    assert c["dflash_config"] == {"mask_token_id": d2.config.mask_token_id,
                                  "target_layer_ids": d2.config.target_layer_ids, "conv_kernel_size": 2,
                                  "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    H, V = d2.config.hidden_size, d2.config.vocab_size
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{i}.{conv}.base_kernel"] == (2, 2, H)
            assert shapes[f"layers.{i}.{conv}.kernel_projection.weight"] == (2 * 2 * H // 16, H)
    assert shapes["candidate_selector.predecessor_codebook"] == (V, 8)
    assert shapes["candidate_selector.successor_codebook"] == (V, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, H)
    assert set(shapes) == set(d2.state_dict())
    back = load_dflash2(out)
    assert isinstance(back, DFlash2Drafter) and back.config == d2.config
    for k, v in d2.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("edit, loads", [
    ({"is_causal": False}, False),                              # z-lab: the sliding layer bidirectional in the block
    ({"is_causal": True}, False),                               # z-lab: the full layer causal
    ({"dflash_config.input_embedding_scale": 2.0}, False),
    ({"output_multiplier": 0.5}, False),
    ({"dflash_config.final_logit_softcapping": 30.0}, False),
    ({"dflash_config.final_logit_softcapping": None, "output_multiplier": 1.0}, True),   # z-lab's neutral values
])
def test_load_refuses_what_zlab_would_run_differently(build_dflash2, tiny_qwen3_dir, tmp_path, edit, loads):
    """A config z-lab's DFlash2DraftModel would run with other attention or logits than this drafter is refused."""
    from model.export import export_dflash2, load_dflash2
    d2, _ = build_dflash2(tiny_qwen3_dir, num_layers=2, sliding_window_layers=1)
    out = export_dflash2(d2, tmp_path / "export", dtype=torch.float32)
    c = json.loads((out / "config.json").read_text())
    for key, value in edit.items():
        *outer, name = key.split(".")
        (c[outer[0]] if outer else c)[name] = value
    (out / "config.json").write_text(json.dumps(c))
    if loads:
        assert load_dflash2(out).config == d2.config
    else:
        with pytest.raises(AssertionError):
            load_dflash2(out)


def test_spec_generate_of_a_dflash2_export_is_the_target_greedy(build_dflash2, tiny_qwen3_dir, tmp_path):
    """The export's own DFlash2DraftModel (AutoModel, trust_remote_code) drafts with the selector's walk and returns
    exactly the target's greedy output; its forward is the DFlash2 drafter's."""
    from test_export import greedy_reference
    from transformers import AutoModel, AutoModelForCausalLM
    from model.export import export_dflash2
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    input_ids = torch.randint(0, 127, (1, 12), generator=torch.Generator().manual_seed(0))
    N = 30
    want = greedy_reference(target, input_ids, N)
    d2, _ = build_dflash2(tiny_qwen3_dir, block_size=4, selector_top_k=4)
    randomize_dflash2(d2, scale=2.0)
    draft = AutoModel.from_pretrained(export_dflash2(d2, tmp_path / "d2", dtype=torch.float32), trust_remote_code=True,
                                      dtype="auto", local_files_only=True).eval()
    assert type(draft).__name__ == "DFlash2DraftModel"
    for k, v in d2.state_dict().items():
        assert torch.equal(draft.state_dict()[k], v), k
    got = draft.spec_generate(input_ids=input_ids, max_new_tokens=N, temperature=0.0, target=target,
                              stop_token_ids=None, return_stats=True)
    assert torch.equal(got.output_ids, want)
    lm_head = target.get_output_embeddings()
    h = torch.randn(3, d2.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        walked = draft.propose(h, torch.tensor([5]), lm_head)
        assert torch.equal(walked, selector_walk(d2.candidate_selector, h[None], lm_head.weight, torch.tensor([5]))[0])


# ---------------------------------------------------------------------------
# Sliding layers against z-lab's DFlash reference (DFLASH_ZLAB_REPO: the mirror's older dflash/model.py, or a later
# one with DFlash2)

def test_zlab_reference_sliding_rule(build_drafter, tiny_qwen3_dir, tmp_path):
    """What z-lab's reference does with `sliding_attention` layers (no `is_causal` in the config), under sdpa. The
    mirrored one (without DFlash2) passes no mask and its sliding_window reaches only flash-attention kernels, so they
    see the whole context and the whole block, like full layers: our drafter with the same weights as full layers
    matches it, ours as sliding layers (causal inside the block, windowed context: DFLASH_SPEC.md) does not. The
    later one (with DFlash2, 10129599) builds the mask itself: sliding layers causal with the window, as ours; its
    published DFlash2 drafters say `is_causal: false` (tests/unit/test_zlab_golden.py checks DFlash2 with a sliding layer
    without the reference's code)."""
    from model.export import export_drafter
    from test_drafter import load_zlab
    zlab = load_zlab(tmp_path)
    later = hasattr(zlab, "DFlash2DraftModel")
    sliding = build_drafter(tiny_qwen3_dir, num_layers=2, sliding_window_layers=2, sliding_window=3)
    for p in sliding.parameters():
        p.data += 0.1 * torch.randn_like(p)
    full = build_drafter(tiny_qwen3_dir, num_layers=2)
    full.load_state_dict(sliding.state_dict())
    ref = zlab.DFlashDraftModel.from_pretrained(export_drafter(sliding, tmp_path / "d", dtype=torch.float32),
                                                attn_implementation="sdpa").eval()
    b = packed_batch(sliding)
    same, other = (run(sliding, b), run(full, b)) if later else (run(full, b), run(sliding, b))
    bl, doc, pos = b["blocks"], b["doc"], b["pos"]
    for n in range(len(bl.anchor_idx)):
        a = int(bl.anchor_idx[n])
        ctx = (doc == doc[a]) & (torch.arange(len(doc)) < a)
        with torch.no_grad():
            want = ref(position_ids=torch.arange(int(pos[a]) + 4)[None], noise_embedding=b["emb"][bl.ids[n]][None],
                       target_hidden=b["feats"][ctx][None], attention_mask=None, is_causal=False)[0]
        torch.testing.assert_close(same[n], want, atol=1e-5, rtol=1e-5)
        assert (other[n] - want).abs().max() > 1e-2


# ---------------------------------------------------------------------------
# Training

def test_overfits_a_fixed_batch(build_dflash2, tiny_qwen3_dir):
    """Warm start from a DFlash drafter, then block + selector loss on one micro-batch with a tiny target's embedding
    and lm_head: at the first step every parameter but the two bilinear factors facing the zero successor codebook
    gets a gradient (they get one once it moves); the loss falls tenfold and the selector's own walk follows the
    labels."""
    from model.target import Target
    target = Target(tiny_qwen3_dir, dtype=torch.float32, layer_ids=None)
    d2, _ = build_dflash2(tiny_qwen3_dir, block_size=4, selector_top_k=4)
    cfg = d2.config
    item, _, _ = prepared_item(cfg)                                   # random features stand in for the target's
    emb = target.embed_tokens(item.block_ids)
    W = target.lm_head_weight
    opt = torch.optim.AdamW(d2.parameters(), lr=3e-2, weight_decay=0.0)
    losses = []
    for step in range(150):
        out = d2(item.features, item.ctx_pos, emb, item.block_pos, item.attn)
        parts, sel = dflash2_loss(d2, out, W, item, "exp", 0.5, 16, alpha=1.0)
        loss = parts.loss_sum / parts.weight_sum
        opt.zero_grad()
        loss.backward()
        if step < 2:
            bilinear = {"candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight"}
            for name, p in d2.named_parameters():
                moved = p.grad is not None and p.grad.abs().sum() > 0
                assert moved == (step == 1 or name not in bilinear), name
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    with torch.no_grad():
        out = d2(item.features, item.ctx_pos, emb, item.block_pos, item.attn)
        parts, sel = dflash2_loss(d2, out, W, item, "exp", 0.5, 16, alpha=1.0)
        m = selector_metrics(d2.candidate_selector, out, W, item, cfg.block_size, sel, parts.top_ids, 16)
    N = item.labels.shape[0] // cfg.block_size
    best = block_metrics(torch.ones(N, cfg.block_size, dtype=torch.bool), item.weights.view(N, -1))["streak_num"]
    assert m["sel_tf_acc_num"] == m["sel_den"] and m["path_streak_num"] == best
