"""GPU only (skipped on CPU): the compiled flex path (forward and backward, queries padded to the flex tile) equals
the SDPA dense path, and a worker thread can run it once the main thread has warmed it up."""
import threading

import pytest
import torch

from model.attention import warmup_flex_attention
from model.objective import make_blocks, pack, sample_anchors, weighted_ce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flex has no backward on CPU)")


def test_compiled_flex_matches_sdpa_fwd_bwd(build_drafter, tiny_qwen3_dir):
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=16, sliding_window_layers=1, sliding_window=64).cuda()
    cfg = d.config
    warmup_flex_attention("cuda", torch.float32, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                          cfg.block_size)
    g = torch.Generator().manual_seed(0)
    doc, pos = pack(torch.tensor([300, 170, 90]))
    T = len(doc)
    ids = torch.randint(0, cfg.vocab_size - 1, (T,), generator=g)
    lm = torch.ones(T, dtype=torch.uint8)
    bl = make_blocks(ids, lm, doc, pos, sample_anchors(lm, doc, 37, g), cfg.block_size, 7.0, cfg.mask_token_id)
    feats = torch.randn(T, cfg.num_taps * cfg.hidden_size, generator=g).cuda()
    emb = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.5).cuda()
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.1).cuda()
    doc, pos = doc.cuda(), pos.cuda()

    def step(flex):
        d.zero_grad()
        attn = d.attn_spec(bl.anchor_idx.cuda(), bl.anchor_doc.cuda(), doc, flex=flex)
        out = d(feats, pos, emb[bl.ids.flatten().cuda()], bl.positions.flatten().cuda(), attn)
        p = weighted_ce(out, lm_head, bl.labels.flatten().cuda(), bl.weights.flatten().cuda(), chunk_size=128)
        (p.loss_sum / p.weight_sum).backward()
        return out.detach(), {k: v.grad.clone() for k, v in d.named_parameters()}

    torch.backends.cuda.matmul.allow_tf32 = False
    out_d, grads_d = step(False)
    out_f, grads_f = step(True)
    assert d.attn_spec(bl.anchor_idx.cuda(), bl.anchor_doc.cuda(), doc, flex=True).full.seq_lengths[0] % 128 == 0
    torch.testing.assert_close(out_f, out_d, atol=2e-4, rtol=2e-4)
    for k in grads_d:
        torch.testing.assert_close(grads_f[k], grads_d[k], atol=2e-4, rtol=2e-3, msg=k)

    # after the main-thread warmup, a worker thread runs the compiled kernel without the FX/dynamo error
    errors = []

    def worker():
        try:
            step(True)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors


def test_fallback_block_mask_planned_on_cpu_runs_on_the_gpu():
    """Interleaved documents take block_mask's reference path; planned on the CPU for the GPU (as the trainer plans),
    its mask_mod must read GPU tensors: flex's output equals SDPA with the dense mask."""
    from model.attention import block_mask, dense_mask, run_flex
    doc = torch.tensor([0] * 40 + [1] * 40 + [0] * 40)            # document 0 in two pieces
    anchors = torch.tensor([5, 45, 85, 100])
    bm = block_mask(anchors, doc[anchors], doc, 16, device="cuda")
    g = torch.Generator().manual_seed(0)
    M, T = 4 * 16, len(doc)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).cuda() for n in (M, T + M, T + M))
    got = run_flex(q, k, v, bm, False)
    dense = dense_mask(anchors.cuda(), doc[anchors].cuda(), doc.cuda(), 16)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
