"""DFlash2 drafters for the tests of tests/unit (test_dflash2.py, test_dflash2_integration.py) and
tests/gpu/test_dflash2_cuda.py: the factory fixture `build_dflash2`, `randomize_dflash2`, and `walkers` (two drafters
on conftest's 8-token target whose walks differ from their unary argmax). A test module imports the fixtures it
uses by name."""
import pytest
import torch

from model.dflash2 import DFlash2Config, DFlash2Drafter, dflash2_keys, warm_start

B = 4


@pytest.fixture(scope="module")
def build_dflash2(build_drafter):
    """build_dflash2(target_dir, seed=0, **dflash2) -> (DFlash2Drafter, the DFlash Drafter it was built from); tiny
    hidden 64 -> conv_group_size 16 gives 4 groups; vocab 128."""
    def build(target_dir, seed=0, num_layers=2, block_size=4, sliding_window_layers=0, **dflash2):
        dflash = build_drafter(target_dir, num_layers=num_layers, block_size=block_size, seed=seed,
                               sliding_window_layers=sliding_window_layers,
                               sliding_window=64 if sliding_window_layers else None)
        dflash2.setdefault("selector_rank", 8)
        dflash2.setdefault("selector_top_k", 4)
        torch.manual_seed(seed + 1)
        d2 = DFlash2Drafter(DFlash2Config.from_drafter(dflash.config, **dflash2))
        warm_start(d2, dflash.state_dict())
        return d2, dflash
    return build


def randomize_dflash2(d2, seed=0, scale=0.3):
    """Non-trivial convolutions and transition: random base kernels and projections, a non-zero successor book."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k in sorted(dflash2_keys(d2)):
            p = d2.get_parameter(k)
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module")
def walkers(small_vocab, build_dflash2):
    """Two DFlash2 drafters (block size B) on the 8-token target whose walks differ from their unary argmax
    somewhere."""
    path, model, rows = small_vocab
    out = []
    for seed in (0, 1):
        d2, _ = build_dflash2(path, seed=seed, block_size=B, selector_top_k=3, selector_rank=4)
        randomize_dflash2(d2, seed=seed, scale=1.0)
        out.append(d2.eval())
    return out
