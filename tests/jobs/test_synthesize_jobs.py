"""data/synthesize.py as real processes on the scripted engine (tests/helpers/synth_cases.py): stopped part-way by
SIGINT, SIGKILL and SIGTERM, each rerun goes on, and the files end as one uninterrupted run's."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data import synthesize as syn
from synth_cases import by_id, read_jsonl, scripted  # noqa: F401 (a fixture)

CHILD = """
import sys, time
sys.path.insert(0, "tests/helpers")
from synth_cases import ScriptedEngine
from data import synthesize as syn
draw = ScriptedEngine.draw
ScriptedEngine.draw = lambda self, key, n: (time.sleep(0.01), draw(self, key, n))[1]  # slow enough to stop
syn.load_engine = lambda args, max_len: (ScriptedEngine(syn.load_tokenizer(args.model), args.seed), None)
syn.main(sys.argv[1:])
"""


@pytest.mark.slow  # ~25 s of CPU: five processes start (torch, pyarrow, datasketch imports)
def test_stops_and_kills_resume_into_one_runs_files(tmp_path, qwen3_dir, scripted):
    """Real processes, stopped part-way by SIGINT, SIGKILL (twice: the lock file then names a dead run) and SIGTERM:
    each stop but the kills exits 1 with the command to go on, the final run exits 0, and both files equal those
    of one uninterrupted run, id for id."""
    out, one = tmp_path / "k.jsonl", tmp_path / "one.jsonl"
    argv = ["--model", str(qwen3_dir), "--num", "60", "--out", str(out), "--prompt-tokens", "24",
            "--max-new-tokens", "16", "--batch-size", "4", "--mix", "data/default/train_prompts.jsonl",
            "--mix-ratio", "0.1"]
    root = Path(__file__).resolve().parents[2]
    before = None
    for sig in (signal.SIGINT, signal.SIGKILL, signal.SIGKILL, signal.SIGTERM):
        rows = len(read_jsonl(out)) if out.exists() else 0
        p = subprocess.Popen([sys.executable, "-c", CHILD, *argv], cwd=root, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while (not out.exists() or len(out.read_bytes().splitlines()) < rows + 5) and time.time() < deadline:
            time.sleep(0.05)
        p.send_signal(sig)
        err = p.communicate(timeout=60)[1]
        assert 0 < len(read_jsonl(out)) < 60, err
        assert ("names a run that is gone" in err) == (before == signal.SIGKILL), err  # the lock, taken over
        before = sig
        if sig == signal.SIGKILL:
            assert p.returncode == -signal.SIGKILL
        else:
            assert p.returncode == 1 and f"stopped by {sig.name}. Run the same command again" in err, err
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "names a run that is gone" not in done.stderr, done.stderr
    syn.main([a if a != str(out) else str(one) for a in argv])
    assert by_id(out) == by_id(one) and by_id(syn.rejected_path(out)) == by_id(syn.rejected_path(one))
