"""Combine prepared datasets into one, removing exact duplicate conversations.

    python -m data.merge --out DIR [--overwrite] PREPARED_DIR...

Parts are concatenated in the order given; a row whose input_ids already occurred (in an earlier part or earlier in
the same part) is dropped. All parts must come from the same tokenizer (same vocabulary hash in their stats.json);
a different chat template, thinking flag or max_len is allowed but printed as a warning. DIR/stats.json holds the
stats of every part, of the whole, and the duplicate counts.
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.prepare import _column, check_out, save, token_features


def row_hashes(ds):
    """Yield a 16-byte blake2b digest of each row's input_ids (int32 bytes), in row order."""
    for chunk in _column(ds, "input_ids").chunks:
        offsets = chunk.offsets.to_numpy()  # chunk-local offsets into .values (may not start at 0)
        values = chunk.values.to_numpy(zero_copy_only=False).astype("<i4")
        for a, b in zip(offsets[:-1], offsets[1:]):
            yield hashlib.blake2b(values[a:b].tobytes(), digest_size=16).digest()


def load_part(path: Path):
    import datasets
    stats_path = path / "stats.json"
    if not stats_path.exists():
        raise SystemExit(f"data.merge: {path} is not a prepared dataset (no stats.json)")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise SystemExit(f"data.merge: cannot load {path}: {e}")
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise SystemExit(f"data.merge: {path} lacks columns {sorted(missing)}")
    try:
        stats = json.loads(stats_path.read_text(encoding="utf-8"))
        assert isinstance(stats, dict), f"it holds a {type(stats).__name__}, not an object"
    except (ValueError, AssertionError) as e:  # UnicodeDecodeError is a ValueError
        raise SystemExit(f"data.merge: {stats_path} is not the stats file data.prepare writes ({e}); restore it, or "
                         f"prepare {path} again")
    return ds, stats


def merge(parts, out, overwrite=False) -> dict:
    import datasets
    out = Path(out)
    check_out(out, overwrite, parts)
    loaded = [load_part(Path(p)) for p in parts]
    first = loaded[0][1]
    for p, (_, st) in zip(parts[1:], loaded[1:]):
        if st.get("tokenizer_hash") != first.get("tokenizer_hash"):
            raise SystemExit(f"data.merge: {p} was tokenized with a different vocabulary than {parts[0]} "
                             f"({st.get('tokenizer')} vs {first.get('tokenizer')}); re-prepare it with one tokenizer")
        for key in ("chat_template_hash", "thinking", "max_len"):
            if st.get(key) != first.get(key):
                print(f"warning: {p} has {key}={st.get(key)!r}, {parts[0]} has {first.get(key)!r}")

    seen, keep, part_stats, offset = set(), [], [], 0
    dup_within = dup_across = 0
    for p, (ds, st) in zip(parts, loaded):
        mine, kept = set(), 0
        for i, h in enumerate(tqdm(row_hashes(ds), total=len(ds), desc=f"hash {Path(p).name}", unit=" rows",
                                   mininterval=1.0)):
            if h in seen:
                if h in mine:
                    dup_within += 1
                else:
                    dup_across += 1
                continue
            seen.add(h)
            mine.add(h)
            keep.append(offset + i)
            kept += 1
        offset += len(ds)
        part_stats.append({"path": str(p), "kept": kept, "duplicates": len(ds) - kept,
                           **{k: st.get(k) for k in ("samples", "tokens", "supervised_tokens", "mean_len", "longest",
                                                    "content_hash", "skipped", "inputs", "tokenizer", "thinking",
                                                    "max_len", "chat_template_hash")}})

    parts_ds = [ds.select_columns(["input_ids", "loss_mask"]) for ds, _ in loaded]
    for p, ds in zip(parts, parts_ds):
        if ds.features != token_features():
            raise SystemExit(f"data.merge: {p} has columns {ds.features}, expected {token_features()}")
    whole = datasets.concatenate_datasets(parts_ds).select(np.asarray(keep, dtype=np.int64))
    stats = save(whole, out, dict(format_version=first.get("format_version"), parts=part_stats,
                 duplicates_removed=dup_within + dup_across, duplicates_within_parts=dup_within,
                 duplicates_across_parts=dup_across, tokenizer=first.get("tokenizer"),
                 tokenizer_hash=first.get("tokenizer_hash"), chat_template_hash=first.get("chat_template_hash"),
                 thinking=first.get("thinking"), max_len=max(st.get("max_len") or 0 for _, st in loaded)))
    for ps in part_stats:
        print(f"  {ps['path']}: {ps['samples']:,} samples, {ps['duplicates']:,} duplicates dropped")
    print(f"wrote {out}: {stats['samples']:,} samples, {stats['tokens']:,} tokens, {dup_within + dup_across:,} "
          f"duplicates removed ({dup_across:,} across parts), content_hash {stats['content_hash'][:16]}")
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", type=Path, help="folders written by data.prepare or data.merge")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    a = ap.parse_args(argv)
    merge(a.parts, a.out, a.overwrite)


if __name__ == "__main__":
    sys.exit(main())
