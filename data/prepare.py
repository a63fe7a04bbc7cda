"""Tokenize conversations once into a `datasets` folder that the trainer reads.

    python -m data.prepare --tokenizer PATH --out DIR [--max-len 4096] [--thinking on|off] [--overlong truncate|drop]
                           [--num-proc N] [--split NAME] [--overwrite] INPUT...

INPUT: .jsonl / .json / .parquet files (.jsonl.gz, .json.gz too) or a `datasets` save_to_disk folder (of a
DatasetDict: its `train` split, or --split); rows in the OpenAI `messages` or the ShareGPT `conversations` format
(data/chat.py). Output: DIR (Arrow, `input_ids` int32 list, `loss_mask` uint8 list) and DIR/stats.json. A bad row
is skipped and counted by reason, with a few `file:line` examples (`file:N` is the N-th element of a .json array);
a file that cannot be read at all stops the job with its name. Same inputs -> same `content_hash`. --overwrite
replaces only what an earlier data.prepare (or data.merge) wrote in DIR; other files there are left alone.
"""
import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from data.chat import RowError, decode_line, end_of_turn, normalize_messages, template_hash, tokenize_chat
from model.hub import resolve_model_path

MAX_LEN = 4096               # tokens per sample; longer rows are truncated (or dropped with --overlong drop)
MAX_ROW_BYTES = 32 << 20     # a raw row larger than this is skipped as too_long without being parsed
NUM_EXAMPLES = 5             # examples kept per skip reason in stats.json
MAP_BATCH = 256              # rows per datasets.map call in a worker
FORMAT_VERSION = 1           # bump when the columns or their meaning change

RAW_SCHEMA = pa.schema([("src", pa.string()), ("text", pa.large_string()), ("err", pa.string()),
                        ("detail", pa.string())])


# ---------------------------------------------------------------------------------------------------------------
# reading: every input row becomes (src "file:line", JSON text or None, err reason or "", detail)

def _fail(path, why):
    raise SystemExit(f"data.prepare: cannot read input {path}: {why}")


def _lines(path: Path, data: bytes):
    for n, line in enumerate(data.split(b"\n"), 1):
        line = line.strip()
        if not line:
            continue
        src = f"{path}:{n}"
        if len(line) > MAX_ROW_BYTES:
            yield src, None, "too_long", f"{len(line)} bytes"
            continue
        try:
            yield src, decode_line(line), "", ""
        except RowError as e:
            yield src, None, e.reason, e.detail


def _read_bytes(path: Path) -> bytes:
    try:
        with (gzip.open(path) if path.suffix == ".gz" else open(path, "rb")) as f:
            return f.read().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM would spoil the first row
    except EOFError:
        _fail(path, "the gzip stream ends early (a truncated download or copy?)")
    except (OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        _fail(path, e)


_JSON_SYNTAX = re.compile(r'["\\\[\]{},]')  # the only characters that decide where an element of an array ends


def _array_elements(text: str) -> list[str] | None:
    """The texts of the elements of the JSON array `text` that json.loads rejected, split at its top-level commas
    (outside strings), so that one broken element is one bad row and the others still load. An element whose
    brackets do not balance swallows the rest of the array (one bad row). None when `text` is not an array."""
    text = text.lstrip()
    if not text.startswith("["):
        return None
    elements, depth, start, in_string, skip_to = [], 0, 1, False, 0
    for m in _JSON_SYNTAX.finditer(text):
        i, c = m.start(), m.group()
        if i < skip_to:
            continue
        if c == "\\":
            skip_to = i + 2  # the escaped character, whatever it is
        elif c == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return elements + [text[start:i]]
        elif depth == 1:  # a comma between elements
            elements.append(text[start:i])
            start = i + 1
    return elements + [text[start:]]  # the array never closes: what is left is one (bad) element


def _json_rows(path: Path, data: bytes):
    try:
        rows = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        try:
            elements = _array_elements(data.decode("utf-8"))
        except UnicodeDecodeError:
            elements = None
        if elements is None:  # often JSONL under a .json name: go line by line
            yield from _lines(path, data)
            return
        for n, element in enumerate(elements, 1):
            if element.strip():  # a trailing comma leaves an empty one
                yield f"{path}:{n}", element.strip(), "", ""
        return
    rows = rows if isinstance(rows, list) else [rows]
    for n, row in enumerate(rows, 1):
        yield f"{path}:{n}", json.dumps(row, ensure_ascii=False), "", ""


def read_rows(path: Path, split: str | None = None):
    """Yield (src, text, err, detail) for every row of one input; SystemExit when the input is unreadable.
    split: the split of a DatasetDict folder (None: `train`)."""
    if not path.exists():
        _fail(path, "no such file or folder")
    if path.is_dir():
        yield from _read_datasets_folder(path, split)
        return
    kind = path.name.removesuffix(".gz").rsplit(".", 1)[-1].lower()
    if kind == "jsonl":
        yield from _lines(path, _read_bytes(path))
    elif kind == "json":
        yield from _json_rows(path, _read_bytes(path))
    elif kind == "parquet":
        import pyarrow.parquet as pq
        try:
            pf = pq.ParquetFile(path)
            n = 0
            for batch in pf.iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    n += 1
                    yield f"{path}:{n}", json.dumps(row, ensure_ascii=False, default=str), "", ""
        except (OSError, pa.ArrowException) as e:
            _fail(path, e)
    else:
        _fail(path, "unsupported format (expected .jsonl, .json, .parquet or a datasets folder)")


def _read_datasets_folder(path: Path, split: str | None):
    import datasets
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # not a save_to_disk folder, or corrupt
        _fail(path, f"not a datasets folder ({e})")
    tag = str(path)
    if isinstance(ds, datasets.DatasetDict):  # never all splits: a test split must not leak into training
        names = list(ds)
        pick = split or ("train" if "train" in ds else names[0] if len(names) == 1 else None)
        if pick not in ds:
            _fail(path, f"it has no split {split!r} (splits: {', '.join(names)}); pick one with --split" if split
                  else f"it has splits {', '.join(names)} and none is called train; pick one with --split")
        if len(names) > 1:
            print(f"note: {path} has splits {', '.join(names)}: reading {pick!r} only"
                  + ("" if split else " (--split picks another)"))
        ds, tag = ds[pick], f"{path}[{pick}]"
    elif split:
        print(f"note: {path} is a single dataset without splits; --split {split} does not apply to it")
    for n, row in enumerate(ds, 1):
        yield f"{tag}:{n}", json.dumps(row, ensure_ascii=False, default=str), "", ""


def write_raw(inputs, raw_path: Path, split=None) -> list[dict]:
    """Stream every row of every input into one Arrow file (memory-mapped by the workers); -> per-input counts."""
    counts = []
    with pa.OSFile(str(raw_path), "wb") as sink, pa.ipc.new_stream(sink, RAW_SCHEMA) as w:
        for path in inputs:
            n, buf = 0, defaultdict(list)
            for src, text, err, detail in tqdm(read_rows(Path(path), split), desc=f"read {Path(path).name}",
                                               unit=" rows", mininterval=1.0):
                for k, v in zip(("src", "text", "err", "detail"), (src, text, err, detail)):
                    buf[k].append(v)
                n += 1
                if len(buf["src"]) >= 4096:
                    w.write_batch(pa.record_batch(buf, schema=RAW_SCHEMA))
                    buf = defaultdict(list)
            if buf:
                w.write_batch(pa.record_batch(buf, schema=RAW_SCHEMA))
            if n == 0:
                print(f"warning: input {path} has no rows (an empty or blank-only file?)")
            counts.append({"path": str(path), "rows": n})
    return counts


# ---------------------------------------------------------------------------------------------------------------
# tokenizing (runs in datasets.map workers)

_TOKENIZERS = {}


def load_tokenizer(path: str):
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


def _tokenize_batch(batch, tokenizer_path, max_len, enable_thinking, overlong):
    tok = load_tokenizer(tokenizer_path)
    out = {"input_ids": [], "loss_mask": [], "reason": [], "detail": []}
    for text, err, detail in zip(batch["text"], batch["err"], batch["detail"]):
        ids, mask = [], []
        try:
            if err:
                raise RowError(err, detail)
            ids, mask = tokenize_chat(tok, normalize_messages(text), max_len, enable_thinking, overlong)
            err, detail = "", ""
        except RowError as e:
            err, detail = e.reason, e.detail
        except Exception as e:  # a row that trips anything else is still one row: count it, show it, go on
            err, detail = "internal_error", f"{type(e).__name__}: {e}"[:120]
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["reason"].append(err)
        out["detail"].append(detail)
    return out


# ---------------------------------------------------------------------------------------------------------------
# dataset stats and content hash (shared with data.merge)

def token_features():
    import datasets
    seq = getattr(datasets, "List", datasets.Sequence)
    return datasets.Features({"input_ids": seq(datasets.Value("int32")), "loss_mask": seq(datasets.Value("uint8"))})


def _column(ds, name) -> pa.ChunkedArray:
    assert ds._indices is None, "flatten or save the dataset first (a column view would copy it into memory)"
    return ds.data.table[name]


def content_hash(ds) -> str:
    """sha256 over the token columns in row order (lengths, ids as int32, mask as uint8): the dataset's identity."""
    hl, hi, hm = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()  # one per stream: chunking cannot matter
    for ids in _column(ds, "input_ids").chunks:
        hl.update(pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype("<i8").tobytes())
        hi.update(pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype("<i4").tobytes())
    for mask in _column(ds, "loss_mask").chunks:
        hm.update(pc.list_flatten(mask).to_numpy(zero_copy_only=False).astype("u1").tobytes())
    return hashlib.sha256(hl.digest() + hi.digest() + hm.digest()).hexdigest()


def dataset_stats(ds, max_len=None) -> dict:
    lengths = pc.list_value_length(_column(ds, "input_ids")).to_numpy(zero_copy_only=False)
    supervised = pc.sum(pc.list_flatten(_column(ds, "loss_mask")).cast(pa.int64())).as_py() or 0
    return {"samples": len(lengths), "tokens": int(lengths.sum()), "supervised_tokens": int(supervised),
            "mean_len": round(float(lengths.mean()), 2) if len(lengths) else 0.0,
            "longest": int(lengths.max()) if len(lengths) else 0,
            "at_max_len": int((lengths >= max_len).sum()) if max_len else 0,  # truncated, or exactly max_len
            "content_hash": content_hash(ds)}


def tokenizer_hash(tok) -> str:
    """sha256 of the vocabulary (ids must mean the same tokens before datasets can be merged)."""
    return hashlib.sha256(json.dumps(sorted(tok.get_vocab().items())).encode()).hexdigest()


def save(ds, out: Path, extra: dict) -> dict:
    """Write ds into out.tmp, compute its stats from the written copy (memory-mapped), add `extra`, write
    stats.json, then move it to out: a half-written DIR never looks finished (stats.json goes last). Into an
    existing out (--overwrite, checked by check_out) only the files a previous save wrote are replaced. -> the stats."""
    import datasets
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    stats = {**dataset_stats(datasets.load_from_disk(str(tmp)), extra.get("max_len")), **extra}
    (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    if out.is_dir() and any(out.iterdir()):
        for f in sorted(written_by_save(out), key=lambda f: f.name != "stats.json"):  # unfinished from here on
            f.unlink()
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "stats.json"):       # finished again at the end
            os.replace(f, out / f.name)
        tmp.rmdir()
    else:
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)
    return stats


DATASET_FILE = re.compile(r"(data|cache)-.*\.arrow|dataset_info\.json|state\.json|stats\.json|dataset_dict\.json")


def written_by_save(out: Path) -> list[Path]:
    """The files an earlier save() left in out (its stats.json says it was one): stats.json, state.json,
    dataset_info.json and the Arrow files state.json lists. [] when out holds no finished save."""
    if not (out / "stats.json").is_file():
        return []
    try:
        arrow = [f["filename"] for f in json.loads((out / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        arrow = []
    return [out / n for n in {*arrow, "dataset_info.json", "state.json", "stats.json"} if (out / n).is_file()]


def check_out(out: Path, overwrite: bool, inputs=()):
    """Refuse before any work: an --out that is a file, that holds (or is) an input, that exists without
    --overwrite, or that holds dataset files an earlier save() did not write (they would be replaced)."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out} is a file, not a folder: give the path of a folder to write the dataset to")
    for path in map(Path, inputs):
        if out.resolve() in (path.resolve(), *path.resolve().parents):
            raise SystemExit(f"input {path} is inside --out {out}, which the output replaces: write to another "
                             f"--out, or move the input out of it first")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise SystemExit(f"{out} already exists; pass --overwrite to replace it (only what data.prepare or "
                         f"data.merge wrote there is replaced)")
    ours = set(written_by_save(out))
    foreign = sorted(f.name for f in out.iterdir() if DATASET_FILE.fullmatch(f.name) and f not in ours)
    if foreign:
        raise SystemExit(f"--out {out} holds dataset files that are not a data.prepare output ({', '.join(foreign[:5])}"
                         f"); --overwrite would replace them: pick another --out or remove them yourself")


# ---------------------------------------------------------------------------------------------------------------

def prepare(inputs, tokenizer_path, out, max_len=MAX_LEN, thinking=None, overlong="truncate", num_proc=None,
            overwrite=False, split=None) -> dict:
    """The whole command as a function (tests call it). thinking: None (template default), True, False;
    split: the split of DatasetDict inputs (None: train)."""
    import datasets
    out = Path(out)
    if max_len < 2:
        raise SystemExit(f"data.prepare: --max-len {max_len} leaves no room for a sample (an anchor and the token "
                         f"after it need 2); use the length the drafter trains on, e.g. --max-len {MAX_LEN}")
    if num_proc is not None and num_proc < 1:
        raise SystemExit(f"data.prepare: --num-proc {num_proc} must be at least 1 (or left out: all CPU cores)")
    check_out(out, overwrite, inputs)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we parallelise over processes, not threads
    try:
        tok = load_tokenizer(str(tokenizer_path))
    except Exception as e:
        raise SystemExit(f"data.prepare: cannot load tokenizer {tokenizer_path}: {e}")
    if not getattr(tok, "is_fast", False):
        raise SystemExit(f"data.prepare: tokenizer {tokenizer_path} has no fast (tokenizers) backend; the loss mask "
                         f"needs its offset mapping")
    if not tok.chat_template:
        raise SystemExit(f"data.prepare: tokenizer {tokenizer_path} has no chat template")
    try:
        end_of_turn(tok, thinking)  # probes the template once: a template we cannot mask fails here, not per row
    except ValueError as e:
        raise SystemExit(f"data.prepare: tokenizer {tokenizer_path}: {e}")
    if thinking is not None and "enable_thinking" not in str(tok.chat_template):
        print("note: the chat template has no enable_thinking switch; --thinking is ignored by it")
    for path in map(Path, inputs):  # fail before hours of work, not after
        kind = path.name.removesuffix(".gz").rsplit(".", 1)[-1].lower()
        if not path.exists():
            _fail(path, "no such file or folder")
        if not path.is_dir() and kind not in ("jsonl", "json", "parquet"):
            _fail(path, "unsupported format (expected .jsonl, .json, .parquet or a datasets folder)")
    num_proc = num_proc or os.cpu_count() or 1

    work = out.with_name(out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        input_counts = write_raw(inputs, work / "raw.arrow", split)
        raw = datasets.Dataset.from_file(str(work / "raw.arrow"))
        if len(raw) == 0:
            raise SystemExit(f"data.prepare: no rows in {', '.join(map(str, inputs))}: every input is empty or "
                             f"blank-only")
        feats = datasets.Features({"src": datasets.Value("string"), **token_features(),
                                   "reason": datasets.Value("string"), "detail": datasets.Value("string")})
        done = raw.map(_tokenize_batch, batched=True, batch_size=MAP_BATCH, remove_columns=["text", "err"],
                       features=feats, num_proc=num_proc if num_proc > 1 and len(raw) > MAP_BATCH else None,
                       fn_kwargs=dict(tokenizer_path=str(tokenizer_path), max_len=max_len,
                                      enable_thinking=thinking, overlong=overlong),
                       cache_file_name=str(work / "tokenized.arrow"), load_from_cache_file=False,
                       desc="tokenize")
        reasons = np.asarray(done.data.table["reason"].to_pylist(), dtype=object)
        skipped = Counter(r for r in reasons if r)
        examples = {}
        bad = np.flatnonzero(reasons != "")
        if len(bad):
            rows = done.select(bad).select_columns(["src", "reason", "detail"]).to_dict()
            for src, reason, detail in zip(rows["src"], rows["reason"], rows["detail"]):
                ex = examples.setdefault(reason, [])
                if len(ex) < NUM_EXAMPLES:
                    ex.append(f"{src}: {detail}" if detail else src)
        good = done.select(np.flatnonzero(reasons == "")).select_columns(["input_ids", "loss_mask"])
        if len(good) == 0:
            raise SystemExit(f"data.prepare: no usable rows in {list(map(str, inputs))}; skipped: {dict(skipped)}")
        stats = save(good, out, dict(
            format_version=FORMAT_VERSION, rows_read=len(reasons),
            skipped=dict(sorted(skipped.items())), examples=dict(sorted(examples.items())), inputs=input_counts,
            tokenizer=str(tokenizer_path), tokenizer_hash=tokenizer_hash(tok), chat_template_hash=template_hash(tok),
            max_len=max_len, thinking={None: None, True: "on", False: "off"}[thinking], overlong=overlong))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(stats, out)
    return stats


def _report(stats, out):
    print(f"read {stats['rows_read']:,} rows from {len(stats['inputs'])} input(s); kept {stats['samples']:,} "
          f"({stats['tokens']:,} tokens, {stats['supervised_tokens']:,} supervised, mean len {stats['mean_len']}, "
          f"longest {stats['longest']}, {stats['at_max_len']:,} at max_len)")
    for reason, n in stats["skipped"].items():
        print(f"  skipped {n:,} {reason}, e.g. " + " | ".join(stats["examples"].get(reason, [])[:3]))
    print(f"wrote {out} (content_hash {stats['content_hash'][:16]})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help=".jsonl/.json/.parquet files or datasets folders")
    ap.add_argument("--tokenizer", required=True, help="the TARGET's tokenizer folder, or its Hub id in the local "
                    "Hugging Face cache (its chat template is used)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-len", type=int, default=MAX_LEN, help="tokens per sample")
    ap.add_argument("--thinking", choices=["on", "off"], default=None,
                    help="enable_thinking for templates that have it (Qwen3); default: the template's default")
    ap.add_argument("--overlong", choices=["truncate", "drop"], default="truncate",
                    help="rows over --max-len: truncate them, or skip them as too_long")
    ap.add_argument("--num-proc", type=int, default=None, help="worker processes (default: all CPU cores)")
    ap.add_argument("--split", default=None, help="split of datasets folders holding several (default: train)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier data.prepare output in --out (other files there are kept)")
    a = ap.parse_args(argv)
    try:
        a.tokenizer = str(resolve_model_path(a.tokenizer))   # a Hub id: its folder in the local Hugging Face cache
    except FileNotFoundError as e:
        ap.error(f"--tokenizer: {e}")
    prepare(a.inputs, a.tokenizer, a.out, a.max_len, {None: None, "on": True, "off": False}[a.thinking],
            a.overlong, a.num_proc, a.overwrite, a.split)


if __name__ == "__main__":
    sys.exit(main())
