"""Paired tau differences between drafters evaluated on the same prompts, per category and macro, with their SEs.

    python -m tools.tau_diff runs/eval_walk.json [--base NAME]
    python -m tools.tau_diff runs/a.json runs/b.json.gz [--base NAME]

Reads `eval_dflash.py --out` files (one drafter each, or several; gzipped ones too) and prints every drafter's
difference from the base drafter (the first, or the one whose path contains --base), on the prompt ids both have a
tau for: ids only one side has are left out, and how many from each side is said. eval_dflash's tau is the mean over
prompts of each prompt's tau, so the difference is the mean of the per-prompt differences and its standard error
is theirs (sd / sqrt(n)): pairing by prompt cancels most of the prompt-to-prompt spread (a prompt easy for one
drafter is easy for the other). Per category the same over its prompts; the macro difference is the mean of the
per-category mean differences (each category weighted equally), its SE sqrt(sum se_c^2) / C
(trainer.evaluate.category_stats). That SE is the resolution to read a difference against: |diff| <= 2 SE is within
noise.
"""
import argparse
import gzip
import json
import math
import sys

from trainer.evaluate import category_stats, mean_se


def read_result(path: str) -> list[dict]:
    """The drafters of one --out file, each with its `drafter` label; SystemExit naming what is wrong."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:   # results are kept gzipped
            r = json.load(fh)
    except OSError as e:
        raise SystemExit(f"tau_diff: cannot read {path}: {e}")
    except ValueError as e:
        raise SystemExit(f"tau_diff: {path} is not JSON ({e}); pass an eval_dflash.py --out file")
    drafters = r.get("drafters", [r]) if isinstance(r, dict) else None
    if not isinstance(drafters, list) or not all(isinstance(d, dict) for d in drafters):
        raise SystemExit(f"tau_diff: {path} is not an eval_dflash.py --out result (an object with `per_prompt`, or "
                         f"`drafters`: a list of them)")
    out = []
    for d in drafters:
        label = d.get("drafter") or (d.get("config") or {}).get("drafter") or path
        out.append(d | {"drafter": str(label), "per_prompt": per_prompt(d, f"{path} ({label})")})
    return out


def per_prompt(drafter: dict, where: str) -> dict:
    """prompt id -> {"tau", "category"} of a drafter's per_prompt rows (tau None: done after the prefill);
    SystemExit on missing fields or repeated ids."""
    rows = drafter.get("per_prompt")
    if not isinstance(rows, list):
        raise SystemExit(f"tau_diff: {where} has no `per_prompt` list (write the file with eval_dflash.py --out)")
    out, repeated = {}, []
    for n, p in enumerate(rows):
        if not isinstance(p, dict) or "id" not in p or "tau" not in p:
            raise SystemExit(f"tau_diff: {where}: per_prompt[{n}] lacks `id` or `tau` (has "
                             f"{sorted(p) if isinstance(p, dict) else type(p).__name__})")
        tau, category = p["tau"], p.get("category", "all")
        # json reads NaN and Infinity, and bool is an int: each would average into a tau that means nothing
        if not (tau is None or isinstance(tau, (int, float)) and not isinstance(tau, bool) and math.isfinite(tau)):
            raise SystemExit(f"tau_diff: {where}: per_prompt[{n}] (id {p['id']!r}) has tau {tau!r}, not a number: a "
                             f"tau is finite, or null (no step after the prefill)")
        if isinstance(p["id"], bool) or not isinstance(p["id"], (str, int)):
            raise SystemExit(f"tau_diff: {where}: per_prompt[{n}] has id {p['id']!r}: a prompt id is a string or an "
                             f"integer")
        if not isinstance(category, str):
            raise SystemExit(f"tau_diff: {where}: per_prompt[{n}] (id {p['id']!r}) has category {category!r}: a "
                             f"string, or no `category` key for \"all\"")
        if p["id"] in out:
            repeated.append(str(p["id"]))
        out[p["id"]] = {"tau": tau, "category": category}
    if repeated:
        raise SystemExit(f"tau_diff: {where} repeats prompt ids {', '.join(sorted(set(repeated))[:10])}: a paired "
                         f"difference needs each prompt once")
    return out


def per_prompt_tau(drafter: dict) -> dict:
    """prompt id -> that prompt's tau, for the prompts the drafter has a tau for."""
    return {i: p["tau"] for i, p in per_prompt(drafter, drafter.get("drafter", "drafter")).items()
            if p["tau"] is not None}


def paired_diff(base: dict, other: dict) -> tuple:
    """(tau base, tau other, mean difference, its SE, prompts) over the prompt ids both have (id -> tau)."""
    ids = sorted(set(base) & set(other), key=str)
    if len(ids) < 2:
        raise SystemExit(f"tau_diff: the two drafters share {len(ids)} prompt ids with a tau; a paired SE needs two "
                         f"or more (were they evaluated on the same --prompts?)")
    n, mean, se = mean_se([other[i] - base[i] for i in ids])
    return sum(base[i] for i in ids) / n, sum(other[i] for i in ids) / n, mean, se, n


def category_diffs(base: dict, other: dict) -> tuple[dict, dict]:
    """category_stats of the paired differences other - base (per_prompt dicts) over their shared ids with a
    tau; SystemExit when a shared id has another category on each side (not the same prompt file)."""
    rows = []
    for i in sorted(set(base) & set(other), key=str):
        if base[i]["tau"] is None or other[i]["tau"] is None:
            continue
        if base[i]["category"] != other[i]["category"]:
            raise SystemExit(f"tau_diff: prompt {i!r} is {base[i]['category']!r} on one side and "
                             f"{other[i]['category']!r} on the other: were they evaluated on the same --prompts?")
        rows.append({"category": base[i]["category"], "d": other[i]["tau"] - base[i]["tau"]})
    return category_stats(rows, "d")


def _f(x, spec="+.4f"):
    return "-" if x is None else format(x, spec)


def report(base: dict, other: dict) -> list[str]:
    """The lines comparing `other` with `base` (drafters as read_result gives them)."""
    b, o = ({i: p["tau"] for i, p in d["per_prompt"].items() if p["tau"] is not None} for d in (base, other))
    shared = set(b) & set(o)
    if not shared:
        raise SystemExit(f"tau_diff: {base['drafter']} and {other['drafter']} share no prompt id with a tau "
                         f"(base has {len(b)}, the other {len(o)}): evaluate both on the same --prompts")
    tb, to, diff, se, n = paired_diff(b, o)
    lines = [f"{other['drafter']}: tau {to:.4f} vs base {tb:.4f} on the same prompts, minus base {diff:+.4f} +- "
             f"{se:.4f} (paired SE over {n} prompts; {'within' if abs(diff) <= 2 * se else 'outside'} 2 SE)"]
    if len(b) > n or len(o) > n:
        lines.append(f"  left out, not in both: {len(b) - n} of the base's {len(b)} prompts, {len(o) - n} of this "
                     f"one's {len(o)}")
    cats, macro = category_diffs(base["per_prompt"], other["per_prompt"])
    lines.append(f"  {'category':<24} {'prompts':>7} {'diff':>8} {'SE':>7}")
    for c, v in cats.items():
        lines.append(f"  {c:<24} {v['prompts']:>7} {_f(v['mean']):>8} {_f(v['se'], '.4f'):>7}")
    lines.append(f"  macro ({macro['categories']} categories, each weighted equally): minus base {_f(macro['mean'])} "
                 f"+- {_f(macro['se'], '.4f')}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", nargs="+", help="eval_dflash.py --out JSON file(s) (or gzipped, .gz); their drafters "
                                              "are compared together")
    ap.add_argument("--base", default=None, help="a substring of the base drafter's path (default: the first)")
    args = ap.parse_args(argv)
    drafters = [d for path in args.result for d in read_result(path)]
    if len(drafters) < 2:
        raise SystemExit(f"tau_diff: {' '.join(args.result)} holds {len(drafters)} drafter; a difference needs two "
                         f"or more (pass several to eval_dflash.py --drafter, or several result files)")
    base = drafters[0]
    if args.base:
        hits = [d for d in drafters if args.base in d["drafter"]]
        if not hits:
            raise SystemExit(f"tau_diff: no drafter path contains {args.base!r}: "
                             + ", ".join(d["drafter"] for d in drafters))
        base = hits[0]
    print(f"base {base['drafter']}: {sum(p['tau'] is not None for p in base['per_prompt'].values())} prompts "
          f"with a tau")
    for d in drafters:
        if d is not base:
            print("\n".join(report(base, d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
