"""Quality filters for generated conversations: what data.synthesize keeps, usable on any conversations JSONL.

    python -m data.filters IN.jsonl --out OUT.jsonl [--stats STATS.json] [--heldout FILE.jsonl ...]

A row is rejected for the first reason that applies, checked in this order (the reason codes in the stats):
  empty_user, truncated_user    a user turn that is blank (or only its `opener`, the text data.synthesize
                                started it with), or was cut at the prompt cap (`user_finish_reasons` "length",
                                written by data.synthesize: the model never ended its message)
  repetition                    a turn that loops: too many repeated word 4-grams, one line over and over, or text
                                that compresses too well (a run of emoji or symbols the word checks cannot see)
  heldout_copy, heldout_near    a user turn equal (normalised) or nearly equal (MinHash) to an evaluation prompt
                                (data/default/eval_prompts.jsonl, eval_self_prompts.jsonl and every --heldout file):
                                evaluation stays held out
  duplicate, near_duplicate     the first user turn equals / nearly equals that of a row admitted before it
  empty_answer                  a blank assistant turn
Answers cut at the length cap (`finish_reasons` "length") are kept and counted as `length_capped`; data.prepare
then leaves their end-of-turn unsupervised. Duplicates are judged on the first user turn, the message that opens
the conversation (later turns depend on it). A row is admitted to the duplicate index once its first user turn
passes, even if a later turn rejects it: so the decision on a row depends only on the rows before it, never on how
a run was cut into pieces (data.synthesize checks the opening turn before it pays for the answer).

Rows are read as data.prepare reads them (data.chat.read_turns): OpenAI `messages` or ShareGPT `conversations`, role
aliases (`human`, `gpt`, `User`, ...) in any case. The command also rejects a line that is not UTF-8 (`bad_encoding`)
and a row with a turn data.prepare cannot read (its reason: `unknown_role`, `non_string_content`, ...). It writes OUT
and the stats to temporary files renamed at the end, so a failure leaves the previous run's pair; an --out or
--stats that is the input (the same file, hard links included) or a --heldout file, or both the same, is refused.

Near duplicates: MinHash (datasketch) over word 3-shingles of the normalised text, banded LSH with an index that
grows row by row: about 100 us and 3.5 KB of host RAM per row admitted (1M rows: 2 minutes of one core, 3.5 GB).
"""
import argparse
import hashlib
import json
import os
import re
import zlib
from collections import Counter
from pathlib import Path

from data.chat import RowError, decode_line, read_turns


HELDOUT_DEFAULT = Path(__file__).resolve().parent / "default" / "eval_prompts.jsonl"
# the self-written evaluation prompts (data.synthesize's distribution, a seed no training run uses): held out too
HELDOUT_SELF = HELDOUT_DEFAULT.with_name("eval_self_prompts.jsonl")
HELDOUT_DEFAULTS = [p for p in (HELDOUT_DEFAULT, HELDOUT_SELF) if p.exists()]

REPEAT_NGRAM = 4               # words per n-gram of the repetition filter
MAX_REPEATED_NGRAM_SHARE = 0.5  # share of a turn's word 4-grams that repeat an earlier one, above which it loops.
                               # Measured on the 2,304 SmolLM2 answers in data/default/smollm2_regen.jsonl: answers
                               # that stopped by themselves have median 0.015 and p99 0.48 (code and lists repeat some
                               # phrases); over 0.5 are 0.8% of them and 46% of the answers cut at the length cap,
                               # which are the loops that never end. 0.5 = the text says everything at least twice.
MIN_LINE_CHARS = 16            # lines shorter than this (`}`, `---`, blank) may repeat freely
MAX_SAME_LINE = 4              # the same line (>= MIN_LINE_CHARS, normalised) this many times in a turn: a loop.
                               # 12 of the 1,811 stopped answers above reach it, 91 of the 493 length-capped ones.
MIN_ZLIB_BYTES = 256           # turns at least this long (UTF-8 bytes) are also checked for compressibility
MIN_ZLIB_RATIO = 0.12          # zlib-compressed / raw size below this: a loop the word filters cannot see (a run of
                               # emoji or symbols is one "word", or none). The 1,250 stopped SmolLM2 answers >= 256
                               # bytes in data/default/smollm2_regen.jsonl: min 0.142, p1 0.257, none below 0.12; 127
                               # of its 493 length-capped ones are below. In 200 self-written rows of the H200 run,
                               # 4 emoji loops (0.067-0.090) passed the word filters
SHINGLE_WORDS = 3              # words per MinHash shingle; a text with fewer words is one shingle
NUM_PERM = 128                 # MinHash permutations: the Jaccard estimate's error is about 1/sqrt(128) = 0.09
NEAR_DUP_JACCARD = 0.8         # user turns at least this similar are near duplicates: a reworded copy of the same
                               # request, which teaches the drafter nothing new
HELDOUT_JACCARD = 0.6          # stricter for evaluation prompts: a leaked eval prompt inflates tau, so a looser
                               # match (a copy with a sentence added or changed) is rejected too
REASONS = ("empty_user", "truncated_user", "repetition", "heldout_copy", "heldout_near", "duplicate",
           "near_duplicate", "empty_answer")

_WORD = re.compile(r"\w+")


# --- text measures --------------------------------------------------------------------------------------------------

def normalize(text: str) -> str:
    """Lowercased, whitespace collapsed: what the exact-duplicate hash sees."""
    return " ".join(text.lower().split())


def text_hash(text: str) -> bytes:
    return hashlib.blake2b(normalize(text).encode(), digest_size=16).digest()  # 16 B per row: 1M rows in ~100 MB


def shingles(text: str) -> list[bytes]:
    words = _WORD.findall(text.lower())  # punctuation dropped: "What is AI?" and "what is AI" are one shingle set
    if len(words) <= SHINGLE_WORDS:
        return [" ".join(words).encode()]
    return list({" ".join(words[i:i + SHINGLE_WORDS]).encode() for i in range(len(words) - SHINGLE_WORDS + 1)})


def repeated_ngram_share(text: str, n: int = REPEAT_NGRAM) -> float:
    words = _WORD.findall(text.lower())
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def max_line_repeats(text: str) -> int:
    lines = [normalize(line) for line in text.splitlines()]
    counts = Counter(line for line in lines if len(line) >= MIN_LINE_CHARS)
    return max(counts.values(), default=0)


def zlib_ratio(text: str) -> float:
    raw = text.encode()
    return len(zlib.compress(raw)) / len(raw) if raw else 1.0


def loops(text: str) -> bool:
    return (repeated_ngram_share(text) > MAX_REPEATED_NGRAM_SHARE or max_line_repeats(text) >= MAX_SAME_LINE
            or (len(text.encode()) >= MIN_ZLIB_BYTES and zlib_ratio(text) < MIN_ZLIB_RATIO))


# --- rows -----------------------------------------------------------------------------------------------------------

def user_turns(row: dict) -> list[str]:
    """The row's user turns, read as data.prepare reads them (data.chat.read_turns: `messages` or ShareGPT
    `conversations`, role aliases in any case); RowError for a turn data.prepare could not read."""
    return [m["content"] for m in read_turns(row) if m["role"] == "user"]


def answers(row: dict) -> list[str]:
    return [m["content"] for m in read_turns(row) if m["role"] == "assistant"]


def heldout_prompts(paths) -> list[str]:
    """Every user turn of every row of the given JSONL files (eval prompt files: {messages: [user, ...]})."""
    out = []
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise SystemExit(f"filters: cannot read held-out prompts {path}: {e}")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out += [t for t in user_turns(json.loads(line)) if t.strip()]
            except (ValueError, AttributeError) as e:
                raise SystemExit(f"filters: {path}:{n} is not a JSON row with `messages` ({e}); fix the line or "
                                 f"leave the file out of --heldout")
    return out


class Filters:
    """The filter state of one run: duplicate indexes (exact hashes + MinHash LSH) and the held-out index.

    check(row) = opener_reason(row), then admit(row), then rest_reason(row): the first reason or None. data.synthesize
    calls the three parts as the turns of a row are generated, which gives the same decisions."""

    def __init__(self, heldout_texts=(), dedup_jaccard=NEAR_DUP_JACCARD, heldout_jaccard=HELDOUT_JACCARD):
        from datasketch import MinHash, MinHashLSH
        self._minhash = MinHash
        self._last = (None, None)
        proto = MinHash(num_perm=NUM_PERM, seed=1)
        self._perms, self._scheme = proto.permutations, proto.scheme  # drawn once, not per row (the slow part)
        self.seen, self.lsh, self.n_admitted = set(), MinHashLSH(threshold=dedup_jaccard, num_perm=NUM_PERM), 0
        self.heldout_seen = {text_hash(t) for t in heldout_texts}
        self.heldout_lsh = MinHashLSH(threshold=heldout_jaccard, num_perm=NUM_PERM)
        for i, t in enumerate(heldout_texts):
            self.heldout_lsh.insert(i, self.minhash(t), check_duplication=False)

    def minhash(self, text: str):
        if self._last[0] == text:  # the opener is hashed once for its held-out query, duplicate query and insert
            return self._last[1]
        m = self._minhash(num_perm=NUM_PERM, seed=1, permutations=self._perms, scheme=self._scheme)
        m.update_batch(shingles(text))
        self._last = (text, m)
        return m

    def _heldout(self, text):
        if text_hash(text) in self.heldout_seen:
            return "heldout_copy"
        if self.heldout_lsh.query(self.minhash(text)):
            return "heldout_near"
        return None

    def _user_reason(self, text, finish):
        if not text.strip():
            return "empty_user"
        if finish == "length":
            return "truncated_user"
        if loops(text):
            return "repetition"
        return self._heldout(text)

    def opener_reason(self, row, dedup=True):
        """Checks of the first user turn, the duplicate checks among them; the indexes are not changed."""
        users, finishes = user_turns(row), row.get("user_finish_reasons") or []
        if not users:
            return "empty_user"
        if row.get("opener") and users[0].strip() == row["opener"].strip():
            return "empty_user"                  # the model ended the turn right after the text it was given
        reason = self._user_reason(users[0], finishes[0] if finishes else None)
        if reason or not dedup:
            return reason
        if text_hash(users[0]) in self.seen:
            return "duplicate"
        if self.lsh.query(self.minhash(users[0])):
            return "near_duplicate"
        return None

    def admit(self, row):
        text = user_turns(row)[0]
        self.seen.add(text_hash(text))
        self.lsh.insert(self.n_admitted, self.minhash(text), check_duplication=False)
        self.n_admitted += 1

    def rest_reason(self, row):
        """Checks of the turns after the first user turn (those present: a row still being generated is fine)."""
        users, finishes = user_turns(row), row.get("user_finish_reasons") or []
        for k in range(1, len(users)):
            reason = self._user_reason(users[k], finishes[k] if k < len(finishes) else None)
            if reason:
                return reason
        for text in answers(row):
            if not text.strip():
                return "empty_answer"
            if loops(text):
                return "repetition"
        return None

    def check(self, row, dedup=True):
        reason = self.opener_reason(row, dedup)
        if reason:
            return reason
        if dedup:
            self.admit(row)
        return self.rest_reason(row)


def length_capped(row) -> bool:
    return "length" in (row.get("finish_reasons") or [])


def empty_stats() -> dict:
    return {"kept": 0, "length_capped": 0, "rejected": dict.fromkeys(REASONS, 0)}


def count(stats: dict, row: dict, reason) -> None:
    if reason:   # REASONS, or the RowError reason of a row data.prepare cannot read (data.filters' command)
        stats["rejected"][reason] = stats["rejected"].get(reason, 0) + 1
    else:
        stats["kept"] += 1
        stats["length_capped"] += length_capped(row)


def format_stats(stats: dict) -> str:
    rejected = {r: n for r, n in stats["rejected"].items() if n}
    total = stats["kept"] + sum(rejected.values())
    why = ", ".join(f"{r} {n:,}" for r, n in sorted(rejected.items(), key=lambda kv: -kv[1])) or "none"
    return (f"kept {stats['kept']:,} of {total:,} ({stats['length_capped']:,} with an answer at the length cap, kept "
            f"and flagged); rejected: {why}")


# --- command --------------------------------------------------------------------------------------------------------

def row_reason(filters: Filters, line: bytes, where: str):
    """-> (row or None, the first reason to reject it or None) of one input line. A line that is not UTF-8 is
    `bad_encoding` and a turn data.prepare cannot read is its RowError reason (`unknown_role`, ...), as
    data.prepare counts them; SystemExit for a line that is not a JSON object (not a conversations file)."""
    try:
        row = json.loads(decode_line(line))
    except RowError as e:
        return None, e.reason
    except ValueError:
        row = None
    if not isinstance(row, dict):
        raise SystemExit(f"filters: {where} is not a JSON object with `messages` (or ShareGPT `conversations`); "
                         f"fix or remove that line")
    try:
        return row, filters.check(row)
    except RowError as e:
        return row, e.reason


def check_paths(ap, args, stats_path: Path):
    """Refuse an --out or --stats that is an input (os.path.samefile: a hard link or symlink too) or that is the
    other output: writing one would destroy what is read or written."""
    def same(a: Path, b: Path) -> bool:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    for flag, path in (("--out", args.out), ("--stats", stats_path)):
        if path.is_dir():
            ap.error(f"{flag} {path} is a folder: give a file path")
        for inp in [args.input, *args.heldout]:
            if same(path, inp):
                ap.error(f"{flag} {path} is the input {inp} (the same file): nothing was written; give another "
                         f"{flag} path")
    if same(args.out, stats_path):
        ap.error(f"--out and --stats are the same file {args.out}: give --stats another path (default: "
                 f"OUT.stats.json)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", type=Path, help="conversations JSONL ({messages, finish_reasons?, ...} per line)")
    ap.add_argument("--out", type=Path, required=True, help="JSONL of the kept rows (replaced once all is written)")
    ap.add_argument("--stats", type=Path, help="counts by reason as JSON (default: OUT.stats.json)")
    ap.add_argument("--heldout", type=Path, action="append", default=[],
                    help=f"more evaluation prompts to keep out (always: "
                         f"{', '.join(p.name for p in HELDOUT_DEFAULTS)})")
    args = ap.parse_args(argv)
    stats_path = args.stats or Path(str(args.out) + ".stats.json")
    if not args.input.is_file():
        raise SystemExit(f"filters: no such file {args.input}")
    check_paths(ap, args, stats_path)
    filters = Filters(heldout_prompts([*HELDOUT_DEFAULTS, *args.heldout]))
    stats = empty_stats()
    # written beside their final names and moved there at the end: a failure leaves the previous run's files
    tmp_out, tmp_stats = (p.with_name(f"{p.name}.tmp{os.getpid()}") for p in (args.out, stats_path))
    for p in (tmp_out, tmp_stats):
        p.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm
    try:
        with open(args.input, "rb") as inp, open(tmp_out, "w", encoding="utf-8") as out:
            for n, line in enumerate(tqdm(inp, desc="filter", unit=" rows", mininterval=1.0), 1):  # streamed
                line = line.removeprefix(b"\xef\xbb\xbf") if n == 1 else line  # a UTF-8 BOM, as data.prepare
                if not line.strip():
                    continue
                row, reason = row_reason(filters, line, f"{args.input}:{n}")
                count(stats, row, reason)
                if not reason:
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp_stats.write_text(json.dumps(stats, indent=2) + "\n")
        os.replace(tmp_out, args.out)
        os.replace(tmp_stats, stats_path)
    finally:
        for p in (tmp_out, tmp_stats):
            p.unlink(missing_ok=True)
    print(f"filters: {format_stats(stats)}; wrote {args.out} and {stats_path}")
    return stats


if __name__ == "__main__":
    main()
