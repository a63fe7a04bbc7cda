"""Record the golden output of z-lab's reference DFlash2DraftModel on a fixed tiny DFlash2 drafter
(tests/unit/test_zlab_golden.py, its DFlash2 half).

    python -m tools.zlab_golden2 --zlab DIR --commit SHA    # DIR holds dflash/model.py (a checkout: no --commit)

writes tests/fixtures/zlab_golden_dflash2/ (about 0.2 MB):
  drafter/            the tiny DFlash2 drafter as export_dflash2 writes it (fp32), its config.json and
                      model.safetensors only: seeded random weights, norms off their ones, the convolutions' base
                      kernels and kernel projections off the identity and both selector codebooks off their init,
                      so that each of them matters (NOISE); two full layers and a sliding one (window
                      SLIDING_WINDOW, shorter than most contexts)
  io.safetensors      the inputs: feats [T, K*H] (target hidden states of three packed documents), doc [T], pos [T],
                      anchor_idx [N], anchor_ids [N] (each block's verified token), noise [N, B, H] (embeddings of
                      its anchor token, then MASK), lm_head [V, H] (the target's output head, a stand-in);
                      z-lab's outputs: want [N, B, H] (last hidden states of every block), cand_ids, cand_logits
                      [N, B-1, K] (the unary top-K of each drafted slot, best first), scores [N, B-1, K] (the
                      selector's scores of those candidates along z-lab's own T=0 walk), tokens [N, B-1] (the
                      T=0 proposal: DFlash2DraftModel.propose)
  zlab_state.json     the parameter names and shapes of z-lab's DFlash2DraftModel built from the export's config,
                      and the config values z-lab's code read (_draft_value) while loading, drafting and proposing
  meta.json           the reference's commit, the versions used, this command
z-lab's model.py is read from DIR at run time and executed from a temp folder, never copied here; the export is
loaded with z-lab's from_pretrained and must load strictly (no missing, unexpected or mismatched weight). Each block
runs the way z-lab's dflash_generate serves it: its document's features before the anchor as target_hidden,
positions 0 .. p+B-1, no mask, no is_causal; propose() gets slots 1..B-1, the anchor's token and the output head.
Run it again only when the reference changes (or to add a case); commit the folder.
"""
import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from tools.zlab_golden import ANCHORS, LENGTHS, TARGET, inputs, load_reference, reference_source

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "zlab_golden_dflash2"
NUM_LAYERS, SLIDING_LAYERS, SLIDING_WINDOW = 3, 1, 5    # layers 0, 1 full; layer 2 sliding
TAPS = [0, 1, 3]             # distinct target layers (the default spread of 3 over 4 layers is [1, 1, 1])
BLOCK_SIZE, MASK_ID = 5, 63
DFLASH2 = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=6)   # 4 groups of 8 channels


# noise added to each parameter, by name: norms start at ones, base kernels at [1, 0, 0], the kernel projections
# and the successor book at zero; the codebooks' product must rival the unary logits' spread for the walk to leave
# the unary argmax
NOISE = {"base_kernel": 0.3, "kernel_projection": 0.3, "codebook": 1.0, "hidden_projection": 0.5}
NOISE_OTHER = 0.1


def tiny_dflash2():
    from transformers import Qwen3Config
    from model.dflash2 import DFlash2Config, DFlash2Drafter
    from model.drafter import DrafterConfig
    cfg = DrafterConfig.from_target(Qwen3Config(**TARGET), NUM_LAYERS, BLOCK_SIZE, mask_token_id=MASK_ID,
                                    target_layer_ids=TAPS, sliding_window_layers=SLIDING_LAYERS,
                                    sliding_window=SLIDING_WINDOW)
    torch.manual_seed(0)
    d = DFlash2Drafter(DFlash2Config.from_drafter(cfg, **DFLASH2)).eval()
    with torch.no_grad():
        for k, p in d.named_parameters():
            scale = next((v for s, v in NOISE.items() if s in k), NOISE_OTHER)
            p += scale * torch.randn_like(p)
    return d


class _ArgmaxRecorder:
    """Stands in for `torch` inside z-lab's module while it proposes: every argmax records the scores it is given."""

    def __init__(self):
        self.seen = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def argmax(self, x, *args, **kwargs):
        self.seen.append(x.detach().clone())
        return torch.argmax(x, *args, **kwargs)


def run_reference(zlab, drafter_dir: Path, io: dict, B: int) -> tuple[dict, dict]:
    """z-lab's DFlash2DraftModel on every block -> (outputs, zlab_state)."""
    from transformers import AutoConfig
    reads = {}
    draft_value = zlab._draft_value

    def recording_draft_value(config, name, default=None):   # which config values z-lab's code reads, and gets
        value = draft_value(config, name, default)
        reads[name] = {"value": value, "default": default}
        return value
    zlab._draft_value = recording_draft_value

    ref, info = zlab.DFlash2DraftModel.from_pretrained(drafter_dir, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"the export does not load strictly into z-lab's DFlash2DraftModel: {bad}"
    ref.eval()
    head = torch.nn.Linear(io["lm_head"].shape[1], io["lm_head"].shape[0], bias=False)
    head.weight.data.copy_(io["lm_head"])
    scale = float(zlab._draft_value(ref.config, "input_embedding_scale", 1.0))
    assert scale == 1.0, f"input_embedding_scale={scale}: the noise below is unscaled"
    out = {k: [] for k in ("want", "cand_ids", "cand_logits", "scores", "tokens")}
    doc, pos = io["doc"], io["pos"]
    for n, a in enumerate(io["anchor_idx"].tolist()):
        ctx = (doc == doc[a]) & (torch.arange(len(doc)) < a)       # the document's tokens before the anchor
        p = int(pos[a])
        rec = _ArgmaxRecorder()
        with torch.no_grad():
            h = ref(position_ids=torch.arange(p + B)[None], noise_embedding=io["noise"][n][None],
                    target_hidden=io["feats"][ctx][None], attention_mask=None)              # [1, B, H]
            zlab.torch = rec
            try:
                tokens, cand, _ = ref.propose(h[:, 1:], io["anchor_ids"][n:n + 1], head, 0.0)  # [1, S], [1, S, K]
            finally:
                zlab.torch = torch
            logits = ref.compute_logits(h[:, 1:], head)                                     # [1, S, V]
        assert len(rec.seen) == B - 1, f"{len(rec.seen)} argmax calls for {B - 1} slots: not the walk's scores"
        scores = torch.stack(rec.seen, dim=1)                                                 # [1, S, K]
        unary = logits.gather(-1, cand)                                                       # [1, S, K]
        order = unary.argsort(dim=-1, descending=True)                 # z-lab's top-K is unsorted: best first here
        out["want"].append(h[0])
        out["cand_ids"].append(cand.gather(-1, order)[0])
        out["cand_logits"].append(unary.gather(-1, order)[0])
        out["scores"].append(scores.gather(-1, order)[0])
        out["tokens"].append(tokens[0])
    zlab._draft_value = draft_value

    fresh = zlab.DFlash2DraftModel(AutoConfig.from_pretrained(drafter_dir))
    state = {"parameters": {k: list(v.shape) for k, v in fresh.state_dict().items()},
             "config_reads": reads}
    return {k: torch.stack(v) for k, v in out.items()}, state


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zlab", type=Path, required=True, help="a folder holding z-lab/dflash's dflash/model.py")
    ap.add_argument("--commit", default=None, help="the reference's commit, where --zlab is not its git checkout")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    import transformers
    from model.export import export_dflash2
    src, rev = reference_source(a.zlab)
    rev = a.commit or rev
    if rev == "working tree":
        ap.error(f"--zlab {a.zlab} is not a git checkout: name the reference's commit with --commit")
    d = tiny_dflash2()
    io = inputs(d.config, lm_head=True)
    B = d.config.block_size
    with tempfile.TemporaryDirectory() as tmp:
        zlab = load_reference(src, Path(tmp))
        export_dflash2(d, a.out / "drafter", dtype=torch.float32)
        for f in (a.out / "drafter").iterdir():   # the weights and config only: the modeling code is model/'s own
            if f.name not in ("config.json", "model.safetensors"):
                f.unlink()
        got, state = run_reference(zlab, a.out / "drafter", io, B)
    io.update(got)
    unary_argmax = io["cand_ids"][..., 0]
    moved = int((io["tokens"] != unary_argmax).sum())
    assert moved > 0, "the selector never leaves the unary argmax: the fixture would not test it"
    save_file({k: v.contiguous() for k, v in io.items()}, str(a.out / "io.safetensors"))
    (a.out / "zlab_state.json").write_text(json.dumps(state, indent=1) + "\n")
    meta = {"reference": "https://github.com/z-lab/dflash", "reference_file": "dflash/model.py", "commit": rev,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "command": "python -m tools.zlab_golden2 --zlab DIR --commit SHA",
            "target": TARGET, "num_layers": NUM_LAYERS, "target_layer_ids": TAPS,
            "sliding_layers": SLIDING_LAYERS, "sliding_window": SLIDING_WINDOW, "block_size": BLOCK_SIZE,
            "dflash2": DFLASH2, "lengths": list(LENGTHS), "anchors": ANCHORS,
            "slots_off_the_unary_argmax": moved}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {a.out}: {len(ANCHORS)} blocks of {B}, {moved}/{io['tokens'].numel()} proposed tokens off the "
          f"unary argmax, reference commit {rev[:12]}")


if __name__ == "__main__":
    main()
