"""trainer/optim.py's cases, for tests/unit/test_optim.py and tests/gpu/test_optim_cuda.py: a drafter's forward
inputs on a device."""
import torch

from model.attention import make_attn_spec
from model.objective import pack


def drafter_inputs(drafter, device, seed=0):
    """(features, positions, block embeddings, block positions, attention spec) of two packed documents, 4 anchors."""
    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([13, 9])
    doc, pos = pack(lengths)
    T, B = len(doc), cfg.block_size
    anchors = torch.tensor([3, 7, 15, 18])
    feats = torch.randn(T, cfg.num_taps * cfg.hidden_size, generator=g)
    emb = torch.randn(len(anchors) * B, cfg.hidden_size, generator=g)
    bpos = (pos[anchors][:, None] + torch.arange(B)).flatten()
    attn = make_attn_spec(anchors, doc[anchors], doc, B, cfg.layer_types, cfg.sliding_window, device=device)
    return [x.to(device) for x in (feats, pos, emb, bpos)] + [attn]
