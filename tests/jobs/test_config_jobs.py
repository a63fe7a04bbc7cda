"""train_dflash.py --help as a process: it exits 0 and prints the settings with their comments, no error."""
import subprocess
import sys

from runs import REPO


def test_help_prints_instead_of_an_error():
    r = subprocess.run([sys.executable, str(REPO / "train_dflash.py"), "--help"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--TOKEN_BUDGET=16384" in r.stdout and "tokens per micro-batch" in r.stdout
    assert "error" not in r.stdout + r.stderr.lower().replace("failed to load", "")
