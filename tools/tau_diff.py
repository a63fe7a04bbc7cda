"""Paired tau differences between drafters evaluated on the same prompts, with their standard errors.

    python -m tools.tau_diff runs/eval_walk.json [--base NAME]

Reads one `eval_dflash.py --out` file holding several drafters (each with `per_prompt`) and prints every drafter's
tau and its difference from the base drafter (the first, or the one whose path contains --base). eval_dflash's
tau is the mean over prompts of each prompt's tau, so the difference is the mean of the per-prompt differences
and its standard error is theirs (sd / sqrt(n)): pairing by prompt cancels most of the prompt-to-prompt spread (a
prompt easy for one drafter is easy for the other). That SE is the resolution to read a difference against:
|diff| <= 2 SE is within noise.
"""
import argparse
import gzip
import json
import sys


def per_prompt_tau(drafter: dict) -> dict:
    """prompt id -> that prompt's tau, for the prompts the drafter has a tau for."""
    return {p["id"]: p["tau"] for p in drafter.get("per_prompt") or [] if p.get("tau") is not None}


def paired_diff(base: dict, other: dict) -> tuple:
    """(tau base, tau other, mean difference, its SE, prompts) over the prompt ids both have."""
    ids = sorted(set(base) & set(other))
    if len(ids) < 2:
        raise SystemExit(f"tau_diff: the two drafters share {len(ids)} prompt ids; a paired SE needs two or more "
                         f"(were they evaluated on the same --prompts?)")
    d = [other[i] - base[i] for i in ids]
    mean = sum(d) / len(d)
    se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
    return sum(base[i] for i in ids) / len(ids), sum(other[i] for i in ids) / len(ids), mean, se, len(ids)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="an eval_dflash.py --out JSON with several drafters (or that JSON gzipped, .gz)")
    ap.add_argument("--base", default=None, help="a substring of the base drafter's path (default: the first)")
    args = ap.parse_args(argv)
    with (gzip.open if args.result.endswith(".gz") else open)(args.result, "rt") as fh:   # results are kept gzipped
        r = json.load(fh)
    drafters = r.get("drafters", [r])
    if len(drafters) < 2:
        raise SystemExit(f"tau_diff: {args.result} holds {len(drafters)} drafter; a difference needs two or more "
                         f"(pass several to eval_dflash.py --drafter)")
    base = drafters[0]
    if args.base:
        hits = [d for d in drafters if args.base in d["drafter"]]
        if not hits:
            raise SystemExit(f"tau_diff: no drafter path contains {args.base!r}: "
                             + ", ".join(d["drafter"] for d in drafters))
        base = hits[0]
    b = per_prompt_tau(base)
    print(f"base {base['drafter']}: tau {base['tau']:.4f} on {len(b)} prompts")
    for d in drafters:
        if d is base:
            continue
        _, to, diff, se, n = paired_diff(b, per_prompt_tau(d))
        print(f"{d['drafter']}: tau {to:.4f}, minus base {diff:+.4f} +- {se:.4f} (paired SE over {n} prompts; "
              f"{'within' if abs(diff) <= 2 * se else 'outside'} 2 SE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
