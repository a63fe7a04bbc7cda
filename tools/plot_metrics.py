"""Plot a run's metrics.jsonl as one PNG: loss, acc, streak, tau, tokens/s and queue depths over steps.

    python -m tools.plot_metrics runs/dflash            # writes runs/dflash/metrics.png
    python -m tools.plot_metrics runs/dflash/metrics.jsonl --out plot.png
"""
import argparse
import json
from pathlib import Path

PANELS = [  # (title, keys)
    ("loss", ["loss"]),
    ("accuracy (teacher-forced)", ["acc"]),
    ("streak / tau", ["streak", "tau"]),
    ("tokens/s", ["tok_s"]),
    ("micro-batches/s", ["tgt_mb_s", "dft_mb_s"]),
    ("queue depth", ["q_pre", "q_hs"]),
]


def load(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill: skip it
    if not rows:
        raise SystemExit(f"{path} has no metrics rows yet")
    return rows


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if not pts:
                continue
            if isinstance(pts[0][1], list):  # per-rank queue depths: one line per rank
                for i in range(len(pts[0][1])):
                    ax.plot([s for s, _ in pts], [v[i] if i < len(v) else None for _, v in pts], label=f"{key}[{i}]")
            else:
                ax.plot([s for s, _ in pts], [v for _, v in pts], label=key, marker="o" if key == "tau" else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder (OUT_DIR) or its metrics.jsonl")
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default: next to metrics.jsonl)")
    args = ap.parse_args()
    path = args.run / "metrics.jsonl" if args.run.is_dir() else args.run
    if not path.exists():
        raise SystemExit(f"no metrics at {path}")
    print(plot(load(path), args.out or path.with_name("metrics.png")))


if __name__ == "__main__":
    main()
