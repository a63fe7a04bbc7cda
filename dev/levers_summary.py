"""One round of dev/levers_h200.sh in one table: per arm, macro tau on the broad set (+- its SE), its difference
from the first arm paired by prompt (+- SE), the weakest category, tau on the 204-prompt set, the rows trained on and
the training seconds; then tau per category for every arm, and the fast decode loop's speedups on the best arm.
Writes OUT/summary.json too.

    python -m dev.levers_summary --out OUT --round N --arms "$ARMS" --sets "$SETS"
"""
import argparse
import json
import sys
from pathlib import Path

from tools.tau_diff import category_diffs, read_result


def arm_of(drafter: str) -> str:
    """runs/<arm>/checkpoints/step_N/drafter -> arm."""
    parts = Path(drafter).parts
    return parts[parts.index("checkpoints") - 1] if "checkpoints" in parts else drafter


def step_of(drafter: str) -> int | None:
    name = Path(drafter).parent.name
    return int(name.split("_")[1]) if name.startswith("step_") else None


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_seconds(out: Path, arm: str, step: int | None) -> float | None:
    """Wall seconds of training up to `step` (the metrics row at or just past it), from OUT/metrics_<arm>.jsonl."""
    try:
        rows = [json.loads(line) for line in (out / f"metrics_{arm}.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    rows = [r for r in rows if "elapsed_s" in r and "step" in r]
    at = [r for r in rows if step is None or r["step"] >= step]
    return (at[0] if at else rows[-1])["elapsed_s"] if rows else None


def summarize(out: Path, round_: str, arms: str, sets: str) -> dict:
    broad = read_result(str(out / "walk_broad.json"))
    prompts = {arm_of(d["drafter"]): d for d in read_result(str(out / "walk_prompts.json"))} \
        if (out / "walk_prompts.json").exists() else {}
    specs = {a.split(":")[0]: a for a in arms.split()}
    base = broad[0]
    rows = []
    for d in broad:
        arm, step = arm_of(d["drafter"]), step_of(d["drafter"])
        prep = read_json(out / f"prep_{arm}_stats.json") or {}
        cats = {c: v["mean"] for c, v in d["tau_categories"].items()}
        row = {"arm": arm, "spec": specs.get(arm, ""), "step": step, "rows": prep.get("samples"),
               "train_s": train_seconds(out, arm, step), "macro": d["tau_macro"], "macro_se": d["tau_macro_se"],
               "categories": cats, "weakest": min(cats.items(), key=lambda kv: kv[1]) if cats else None,
               "tau_204": prompts[arm]["tau"] if arm in prompts else None}
        if d is not base:
            _, macro = category_diffs(base["per_prompt"], d["per_prompt"])
            row["macro_diff"], row["macro_diff_se"] = macro["mean"], macro["se"]
            if arm in prompts and arm_of(base["drafter"]) in prompts:
                b, o = prompts[arm_of(base["drafter"])], prompts[arm]
                _, m204 = category_diffs(b["per_prompt"], o["per_prompt"])
                row["diff_204_macro"], row["diff_204_macro_se"] = m204["mean"], m204["se"]
        rows.append(row)
    by_arm = {arm_of(d["drafter"]): d for d in broad}
    seeds = []   # an arm X_sN against X: the same data and steps, another training seed
    for arm, d in by_arm.items():
        twin = arm.rsplit("_s", 1)[0]
        if twin != arm and twin in by_arm and arm.rsplit("_s", 1)[1].isdigit():
            _, macro = category_diffs(by_arm[twin]["per_prompt"], d["per_prompt"])
            seeds.append({"arm": arm, "twin": twin, "macro_diff": macro["mean"], "macro_diff_se": macro["se"]})
    fast = {}
    for name in ("fast_bf16", "fast_fp32_bf16drafter", "fast_fp32_bf16drafter_matmul"):
        r = read_json(out / f"{name}.json")
        if r:
            fast[name] = {"speedup": r.get("speedup"), "tau": r.get("tau"), "tau_macro": r.get("tau_macro"),
                          "lossless": r.get("lossless"), "drafter": (r.get("config") or {}).get("drafter")}
    return {"round": round_, "sets": sets.split(), "arms": rows, "seeds": seeds, "fast": fast}


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def table(s: dict) -> str:
    n_cats = max((len(r["categories"]) for r in s["arms"]), default=0)
    lines = [f"round {s['round']}: macro tau on the broad set ({n_cats} categories weighted equally), paired against "
             f"{s['arms'][0]['arm']}; 204 = eval_prompts.jsonl (164 HumanEval + 40 MT-Bench)",
             f"{'arm':<12} {'step':>5} {'rows':>7} {'train_s':>8} {'macro':>6} {'+-SE':>6} {'vs base':>8} {'+-SE':>6} "
             f"{'weakest':>20} {'tau204':>7}"]
    for r in s["arms"]:
        weak = f"{r['weakest'][0]} {r['weakest'][1]:.2f}" if r["weakest"] else "-"
        lines.append(f"{r['arm']:<12} {fmt(r['step'], 'd'):>5} {fmt(r['rows'], ',d'):>7} {fmt(r['train_s'], '.0f'):>8} "
                     f"{fmt(r['macro']):>6} {fmt(r['macro_se']):>6} {fmt(r.get('macro_diff'), '+.3f'):>8} "
                     f"{fmt(r.get('macro_diff_se')):>6} {weak:>20} {fmt(r['tau_204']):>7}")
    cats = sorted({c for r in s["arms"] for c in r["categories"]})
    lines.append("tau per category: " + "  ".join(f"{r['arm']}" for r in s["arms"]))
    for c in cats:
        lines.append(f"  {c:<14} " + "  ".join(fmt(r["categories"].get(c)) for r in s["arms"]))
    for d in s["seeds"]:
        lines.append(f"seeds: {d['arm']} minus {d['twin']} (same data, another training seed): macro "
                     f"{fmt(d['macro_diff'], '+.3f')} +- {fmt(d['macro_diff_se'])}: differences between arms of about "
                     f"this size are the seeds', not the lever's")
    for name, f in s["fast"].items():
        lines.append(f"{name}: speedup {fmt(f['speedup'], '.2f')}x, tau {fmt(f['tau'], '.2f')}, macro "
                     f"{fmt(f['tau_macro'], '.2f')}, lossless {f['lossless']} ({arm_of(f['drafter'] or '')})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--round", default="?")
    ap.add_argument("--arms", default="")
    ap.add_argument("--sets", default="")
    a = ap.parse_args(argv)
    s = summarize(a.out, a.round, a.arms, a.sets)
    (a.out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    print(table(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
