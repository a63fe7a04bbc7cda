"""Record the golden output of z-lab's reference DFlashDraftModel on a fixed tiny drafter (tests/unit/test_zlab_golden.py).

    python -m tools.zlab_golden --zlab /work/.mirror/z-lab+dflash/repo      # a bare git dir or a checkout

writes tests/fixtures/zlab_golden/ (about 0.2 MB):
  drafter/            the tiny drafter as this project exports it (config.json + model.safetensors, fp32): seeded
                      random weights, norms moved off their ones so that they matter
  io.safetensors      the inputs and z-lab's outputs: feats [T, K*H] (target hidden states of three packed documents),
                      doc [T], pos [T], anchor_idx [N], noise [N, B, H] (embeddings of each block: its anchor
                      token, then MASK), want [N, B, H] (z-lab's last hidden states of every block)
  meta.json           the reference's commit, the versions used, this command
z-lab's model.py is read from the reference at run time and executed from a temp folder, never copied here. Each
block is run the way z-lab serves it: its document's features before the anchor as target_hidden, the block at
positions p .. p+B-1, no mask. Run it again only when the reference changes (or to add a case); commit the folder.
"""
import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "zlab_golden"
TARGET = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              intermediate_size=64, num_hidden_layers=4, max_position_embeddings=128, rms_norm_eps=1e-6,
              rope_theta=100000.0)   # not the default 10000: a loader that drops rope_theta fails the comparison
NUM_LAYERS, BLOCK_SIZE, MASK_ID = 2, 4, 63
LENGTHS = (14, 9, 11)        # three packed documents
ANCHORS = [3, 10, 13, 14, 19, 30]   # token indices: mid-document, a document's last token, a document's first


def reference_source(zlab: Path) -> tuple[str, str]:
    """-> (dflash/model.py of the reference, its commit; "working tree" for a plain folder, whose caller names the
    commit)."""
    if (zlab / "dflash" / "model.py").is_file():
        # a checkout's own HEAD, not that of a repository the folder merely sits in
        top_rev = subprocess.run(["git", "-C", str(zlab), "rev-parse", "--show-toplevel", "HEAD"],
                                 capture_output=True, text=True).stdout.split()
        own = len(top_rev) == 2 and Path(top_rev[0]).resolve() == zlab.resolve()
        return (zlab / "dflash" / "model.py").read_text(), top_rev[1] if own else "working tree"
    try:
        src = subprocess.run(["git", "-C", str(zlab), "show", "HEAD:dflash/model.py"], capture_output=True,
                             text=True, check=True).stdout
        rev = subprocess.run(["git", "-C", str(zlab), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"error: --zlab {zlab} is neither a checkout of z-lab/dflash nor its git dir ({e})")
    return src, rev


def load_reference(src: str, tmp: Path):
    path = tmp / "zlab_dflash_model.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_drafter():
    from transformers import Qwen3Config
    from model.drafter import Drafter, DrafterConfig
    cfg = DrafterConfig.from_target(Qwen3Config(**TARGET), NUM_LAYERS, BLOCK_SIZE, mask_token_id=MASK_ID)
    torch.manual_seed(0)
    d = Drafter(cfg).eval()
    with torch.no_grad():
        for p in d.parameters():   # norms start at ones: make them matter
            p += 0.1 * torch.randn_like(p)
    return d


def inputs(cfg, lm_head=False) -> dict:
    """The packed documents, the target's features and the blocks' noise embeddings, drawn from seed 0 (what the
    recorded fixtures hold). lm_head=True (tools/zlab_golden2.py) also draws a [V, H] lm_head, after the embedding
    and before the ids, the order its fixture was recorded in."""
    g = torch.Generator().manual_seed(0)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])                 # [T]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])                                    # [T]
    anchor_idx = torch.tensor(ANCHORS)                                                      # [N]
    feats = torch.randn(len(doc), cfg.num_taps * cfg.hidden_size, generator=g)             # [T, K*H]
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.5                  # the target's, stand-in
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.5 if lm_head else None   # [V, H]
    ids = torch.randint(0, cfg.vocab_size - 1, (len(doc),), generator=g)
    block_ids = torch.full((len(ANCHORS), cfg.block_size), cfg.mask_token_id)
    block_ids[:, 0] = ids[anchor_idx]                                                       # [N, B]
    out = dict(feats=feats, doc=doc, pos=pos, anchor_idx=anchor_idx, noise=emb[block_ids])   # noise [N, B, H]
    return out if not lm_head else dict(out, anchor_ids=block_ids[:, 0].clone(), lm_head=head)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zlab", type=Path, required=True, help="z-lab/dflash: a checkout or its bare git dir")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    import transformers
    from model.export import export_drafter
    src, rev = reference_source(a.zlab)
    d = tiny_drafter()
    io = inputs(d.config)
    B = d.config.block_size
    with tempfile.TemporaryDirectory() as tmp:
        zlab = load_reference(src, Path(tmp))
        export_drafter(d, a.out / "drafter", dtype=torch.float32)
        ref = zlab.DFlashDraftModel.from_pretrained(a.out / "drafter", attn_implementation="eager").eval()
        want = []
        for a_i in io["anchor_idx"].tolist():
            ctx = (io["doc"] == io["doc"][a_i]) & (torch.arange(len(io["doc"])) < a_i)
            p = int(io["pos"][a_i])
            with torch.no_grad():
                out = ref(position_ids=torch.arange(p + B)[None], noise_embedding=io["noise"][len(want)][None],
                          target_hidden=io["feats"][ctx][None], attention_mask=None, is_causal=False)
            want.append(out[0])                                                              # [B, H]
    io["want"] = torch.stack(want)                                                           # [N, B, H]
    save_file({k: v.contiguous() for k, v in io.items()}, str(a.out / "io.safetensors"))
    meta = {"reference": "https://github.com/z-lab/dflash", "reference_file": "dflash/model.py", "commit": rev,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "command": "python -m tools.zlab_golden --zlab PATH_TO_Z_LAB_DFLASH",
            "target": TARGET, "num_layers": NUM_LAYERS, "block_size": BLOCK_SIZE, "lengths": list(LENGTHS),
            "anchors": ANCHORS}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {a.out}: {len(ANCHORS)} blocks of {B}, reference commit {rev[:12]}")


if __name__ == "__main__":
    main()
