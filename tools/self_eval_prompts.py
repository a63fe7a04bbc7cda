"""Held-out prompts of the training data's own kind: the target writes them (data.synthesize, with the openers) under a
seed no training run uses, and they are kept out of every training set after (data/filters.py HELDOUT_DEFAULTS).

    python -m tools.self_eval_prompts --model ~/.cache/dflash/smollm2-135m-instruct --num 100 --seed 777 \
        --openers data/default/openers.jsonl --out data/default/eval_self_prompts.jsonl

The shipped evaluation set is HumanEval and odd MT-Bench: code and hard questions, which a 135M model writes rarely
when left free. Tau on these prompts says how well a drafter learned the data it was given; the gap to the shipped
set's tau is the distribution's share. Only the user turns are kept (the evaluation has the target answer them
greedily itself), so the answers are generated one token long. Rows: {"id": "self/<i>", "category":
"self/<opener name>", "messages": [user turn]}, as data/default/eval_prompts.jsonl.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

from data import synthesize


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--num", type=int, default=100)
    ap.add_argument("--seed", type=int, default=777, help="a seed no training run uses (they use 0)")
    ap.add_argument("--openers", type=Path, default=Path("data/default/openers.jsonl"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    if a.out.exists():
        sys.exit(f"self_eval_prompts: {a.out} exists; a held-out set is made once (delete it to remake it)")
    names = {o.text: o.name for o in synthesize.read_openers(a.openers)}
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "rows.jsonl"
        synthesize.main(["--model", a.model, "--num", str(a.num), "--out", str(raw), "--seed", str(a.seed),
                         "--openers", str(a.openers), "--prompt-tokens", str(a.prompt_tokens),
                         "--prompt-temperature", "1.0", "--max-new-tokens", "1", "--batch-size", str(a.batch_size),
                         "--device", a.device])
        rows = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
    out = [{"id": r["id"], "category": f"self/{names.get(r.get('opener', ''), 'free')}",
            "messages": [m for m in r["messages"] if m["role"] == "user"][:1]} for r in rows]
    a.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    print(f"self_eval_prompts: {len(out)} prompts to {a.out}")
    return out


if __name__ == "__main__":
    main()
