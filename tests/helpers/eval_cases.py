"""trainer/evaluate.py's cases, for tests/unit/test_eval.py and tests/jobs/test_eval_jobs.py: block size B,
pre-tokenized prompt rows for the tiny targets, and a per-prompt result without its timings."""
import torch

B = 4


def prompts(lengths=(5, 13, 30), vocab=127):
    g = torch.Generator().manual_seed(1)
    return [{"id": f"p{i}", "category": ("a", "b/x", "b/y")[i % 3],
             "input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for i, n in enumerate(lengths)]


def untimed(r):
    """A per-prompt result without its timings (the only part that may differ between runs)."""
    return {k: v for k, v in r.items() if k != "seconds"}
