"""What lets a data command append to one output file over several runs: one run at a time (`locked`), the rows
earlier runs wrote (`read_back`), which tool wrote them (`owner`), and with which settings and weights
(`read_settings`, `check_settings`, `weights_fingerprint`).

The lock is the trainer's OUT_DIR lock (checkpoint.lock_out_dir) for a file: flock on OUT.lock, which the kernel
releases when the holder exits however it exits (kill -9 included), so a dead run never blocks the next one; the
file's text names the holder (host, pid, start time) for the message a second run gets.
"""
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")   # what a model folder holds its weights in
FINGERPRINT_DATA = 1 << 20                              # bytes of tensor data hashed per weight file after its header


SIDE_FILES = {"synthesize": ".rejected.jsonl", "regenerate": ".errors.jsonl"}   # written beside OUT by that tool only


def real_path(out: Path) -> Path:
    """`out` as given, or the file it leads to when a symbolic link is on its way: the files beside an output (its
    lock, stats, rejected and errors files) are then the same by every path to it."""
    real = Path(os.path.realpath(out))
    return out if real == Path(os.path.abspath(out)) else real


def stats_path(out: Path) -> Path:
    """OUT.stats.json: the settings that made OUT's rows (data.synthesize's counts too)."""
    return Path(str(out) + ".stats.json")


def owner(out: Path) -> tuple[str, Path] | None:
    """-> (the data tool whose output `out` is, the file beside it that says so), or None: OUT.stats.json's "tool"
    (a stats file of data.synthesize from before that field: "synthesize"), else OUT.rejected.jsonl (data.synthesize)
    or OUT.errors.jsonl (data.regenerate), which each tool opens with its output."""
    stats = stats_path(out)
    try:
        obj = json.loads(stats.read_text())
    except (OSError, ValueError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("config"), dict):
        return obj.get("tool", "synthesize"), stats
    for tool, suffix in SIDE_FILES.items():
        if Path(str(out) + suffix).exists():
            return tool, Path(str(out) + suffix)
    return None


def check_owner(out: Path, tool: str):
    """SystemExit when `out` is the other data tool's output (owner): its rows and side files are not this tool's,
    and rows appended by this one would leave a file the other can no longer resume. Nothing is changed."""
    found = owner(out)
    if found and found[0] != tool:
        raise SystemExit(f"{tool}: {out} is an output of data.{found[0]} ({found[1]} says so): data.{tool} does not "
                         f"write into it (data.{found[0]} could no longer resume it). It was left as it is: give "
                         f"another output path")


def file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def read_settings(out: Path, tool: str) -> dict | None:
    """OUT.stats.json's content ({"tool", "config": the settings that made the rows, ...}); None when absent.
    SystemExit when it is not a stats file of `tool`."""
    path = stats_path(out)
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
        assert isinstance(old, dict) and isinstance(old.get("config"), dict)
        assert old.get("tool", "synthesize") == tool
    except (ValueError, AssertionError):
        raise SystemExit(f"{tool}: {path} is not a stats file written by data.{tool}; restore it, or write to a new "
                         f"output") from None
    return old


MODEL_SETTINGS = ("model_config", "model_weights", "served_model")   # the settings that name the model


def check_settings(tool: str, out: Path, was: dict, now: dict):
    """SystemExit naming each setting that differs between the rows' (`was`) and this run's (`now`): rows made
    with other settings, or by another model, would not match the ones written."""
    diff = [k for k in sorted(set(now) | set(was)) if was.get(k) != now.get(k)]
    if diff:
        said = "; ".join(f"{k}: was {was.get(k)!r}, now {now.get(k)!r}" for k in diff)
        model = (" The rows were written by another model (a set of two models' answers trains a drafter for "
                 "neither): use the model that wrote them." if set(diff) & set(MODEL_SETTINGS) else "")
        raise SystemExit(f"{tool}: cannot resume {out}: settings differ ({said}).{model} Rows made with other "
                         f"settings would not match the ones written: use the earlier settings, or a new output")


def lock_path(out: Path) -> Path:
    return Path(str(out) + ".lock")


@contextmanager
def locked(out: Path, tool: str):
    """Hold OUT.lock for the body; SystemExit naming the holder when another run holds it (nothing is changed).
    A lock file naming a run that is gone is taken over with a message. The lock sits beside the file itself (its
    path with symbolic links resolved), so two runs that reach one file by two paths exclude each other too."""
    path = lock_path(Path(os.path.realpath(out)))   # (the tools pass real_path; this also holds for other callers)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    held = False
    try:
        f.seek(0)
        before = f.read().strip()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"{tool}: {out} is being written by another run ({before or 'holder unknown'}); "
                             f"nothing was changed. Wait for it to end or stop it, or write to another "
                             f"output") from None
        held = True
        if before:
            print(f"{tool}: {path} names a run that is gone ({before}); taking it over", file=sys.stderr)
        f.seek(0)
        f.truncate()
        f.write(f"{tool} pid {os.getpid()} on host {socket.gethostname()}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        f.flush()
        yield
    finally:
        if held:
            f.truncate(0)   # a normal end leaves the file empty; a killed run, its name
        f.close()


def read_back(path: Path, tool: str, check, owned: bool = False) -> list[dict]:
    """The rows earlier runs wrote to `path` ([] when it does not exist), each passed through check(row), which
    raises (ValueError, TypeError, KeyError, AttributeError) for JSON that is not a row of `tool`.

    A last line that does not parse as JSON (a write cut by a kill) is cut off when it follows rows of `tool`, or
    when `owned` (the file's settings say `tool` made it: a kill during its first row); a complete last row that only
    lacks its newline gets one, so appends stay valid JSONL. Nothing else is ever changed: a bad line before the
    last (the rows after it would go too), a file whose only line does not parse and that is not known as the
    tool's (someone's text file), or a line that parses but is not this tool's row (another file given as the
    output, e.g. a prompt file) is SystemExit naming the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")  # the last item is what follows the final newline: empty unless unterminated
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if n < len(lines):
                raise SystemExit(f"{tool}: {path}:{n} is not a finished row ({e}); only a torn last line is repaired "
                                 f"by itself: fix or remove this one")
            if not rows and not owned:
                raise SystemExit(f"{tool}: {path} is not an output of {tool}: its only line is not JSON ({e}). It "
                                 f"was left as it is: give another output path, or move this file away")
            print(f"{tool}: dropping a torn last line of {path} ({len(line)} bytes)", file=sys.stderr)
            with open(path, "r+b") as f:
                f.truncate(len(data) - len(line))
            return rows
        try:
            check(row)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise SystemExit(f"{tool}: {path}:{n} is JSON but not a row that {tool} writes ({type(e).__name__}: "
                             f"{e}): is {path} really the output of an earlier {tool} run? It was left as it is: "
                             f"give another output path, or move this file away")
        rows.append(row)
    if lines[-1].strip():  # complete, without its newline
        with open(path, "ab") as f:
            f.write(b"\n")
    return rows


def weights_fingerprint(path) -> str | None:
    """sha256 over a model folder's weight files: each one's name, safetensors header and first FINGERPRINT_DATA
    bytes of tensor data (another checkpoint of the same architecture has the same header but other data), as the
    trainer's checkpoint.target_fingerprint reads them. None when the folder holds no weight file."""
    files = sorted(p for pat in WEIGHT_FILES for p in Path(path).expanduser().glob(pat))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if f.suffix == ".safetensors" else 0
            h.update(f.name.encode() + head + fh.read(n + FINGERPRINT_DATA))
    return h.hexdigest()
