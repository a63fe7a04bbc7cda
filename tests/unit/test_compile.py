"""compile_drafter's fused paths compute what the eager drafter computes: outputs and every parameter gradient,
on a packed micro-batch with padding-free documents of different lengths and a sliding-window layer. CPU: SDPA
with the dense mask; CUDA: flex_attention (bf16 autocast as in training)."""
import pytest
import torch

from model.drafter import compile_drafter
from model.objective import make_blocks, pack, sample_anchors, weighted_ce

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _batch(cfg, lengths, n_anchors, seed=0):
    g = torch.Generator().manual_seed(seed)
    doc, pos = pack(torch.tensor(lengths))
    T = len(doc)
    ids = torch.randint(0, cfg.vocab_size - 1, (T,), generator=g)
    lm = torch.ones(T, dtype=torch.uint8)
    bl = make_blocks(ids, lm, doc, pos, sample_anchors(lm, doc, n_anchors, g), cfg.block_size, 7.0,
                     cfg.mask_token_id)
    feats = torch.randn(T, cfg.num_taps * cfg.hidden_size, generator=g)
    return doc, pos, bl, feats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["elementwise", "layers"])
def test_compiled_drafter_equals_eager(build_drafter, tiny_qwen3_dir, mode, device):
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=8, sliding_window_layers=1, sliding_window=24)
    d = d.to(device)
    cfg = d.config
    flex = device == "cuda"
    if flex:
        from model.attention import warmup_flex_attention
        warmup_flex_attention(device, torch.bfloat16, cfg.num_attention_heads, cfg.num_key_value_heads,
                              cfg.head_dim, cfg.block_size)
    g = torch.Generator().manual_seed(1)
    emb = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.5).to(device)
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.1).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if flex else torch.autocast("cpu", enabled=False)

    def step(lengths, n_anchors, seed):
        doc, pos, bl, feats = _batch(cfg, lengths, n_anchors, seed)
        doc, pos, feats = doc.to(device), pos.to(device), feats.to(device)
        d.zero_grad()
        with autocast:
            attn = d.attn_spec(bl.anchor_idx.to(device), bl.anchor_doc.to(device), doc, flex=flex)
            out = d(feats, pos, emb[bl.ids.flatten().to(device)], bl.positions.flatten().to(device), attn)
            p = weighted_ce(out, lm_head, bl.labels.flatten().to(device), bl.weights.flatten().to(device),
                            chunk_size=64)
        (p.loss_sum / p.weight_sum).backward()
        return out.detach().float(), {k: v.grad.clone() for k, v in d.named_parameters()}

    # two micro-batches of different context lengths: the compiled graphs are dynamic, not re-specialised wrongly
    shapes = [([70, 41, 17], 13, 0), ([55, 90], 21, 1)]
    try:
        compile_drafter(d, "off")
        ref = [step(*s) for s in shapes]
        compile_drafter(d, mode)
        import model.drafter as md
        assert (md.rms_norm is not md._rms_norm) if mode == "elementwise" else \
            all(layer._compiled_call_impl is not None for layer in d.layers)
        got = [step(*s) for s in shapes]
    finally:
        compile_drafter(d, "off")
    tol = dict(atol=2e-2, rtol=2e-2) if flex else dict(atol=1e-5, rtol=1e-4)
    for (out_r, gr), (out_c, gc) in zip(ref, got):
        torch.testing.assert_close(out_c, out_r, **tol)
        for k in gr:
            torch.testing.assert_close(gc[k], gr[k], **tol, msg=k)


def test_compile_mode_is_checked(build_drafter, tiny_qwen3_dir):
    with pytest.raises(AssertionError, match="not one of"):
        compile_drafter(build_drafter(tiny_qwen3_dir), "fast")
