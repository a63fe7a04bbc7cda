"""The teacher-forced streak of a drafter on a prepared dataset (the training text), to set beside the one
eval_dflash.py prints for served tokens: a drafter that streaks far better here than on held-out greedy outputs
does not generalise to those prompts (docs/evaluation.md).

    python -m tools.train_streak --target ~/.cache/dflash/smollm2-135m-instruct \
        --drafter runs/cpu-long/checkpoints/step_001000/drafter --data data/default/smollm2 --rows 200
"""
import argparse

import torch
from transformers import AutoModelForCausalLM

from data.loader import read_arrow_dataset
from model.decode import DrafterProposer, teacher_forced_streak
from model.export import load_drafter


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="local HF causal LM folder")
    p.add_argument("--drafter", required=True, help="exported drafter folder")
    p.add_argument("--data", required=True, help="prepared dataset folder (python -m data.prepare)")
    p.add_argument("--rows", type=int, default=200, help="random rows (seed 0) to score")
    a = p.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True).eval()
    drafter = load_drafter(a.drafter).eval()
    proposer = DrafterProposer(drafter, model)
    table = read_arrow_dataset(a.data)
    ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
    streaks = []
    for r in torch.randperm(table.num_rows, generator=torch.Generator().manual_seed(0))[:a.rows].tolist():
        ids, mask = ids_col[r].as_py(), mask_col[r].as_py()
        if 1 not in mask:
            continue
        start = end = mask.index(1)
        while end < len(mask) and mask[end]:                       # the first assistant turn
            end += 1
        s = teacher_forced_streak(model, proposer, ids[:start], ids[start:end], drafter.config.block_size)
        if s is not None:
            streaks.append(s)
    print(f"teacher-forced streak on {len(streaks)} rows of {a.data} (first assistant turn): "
          f"{sum(streaks) / len(streaks):.3f}")


if __name__ == "__main__":
    main()
