"""model/ce_kernel.py's Triton CE epilogue against the eager epilogue on CPU, through Triton's interpreter: a
subprocess with TRITON_INTERPRET=1 (Triton reads it at import) runs tests/helpers/ce_cases.py's checks."""
import os
import subprocess
import sys

import pytest

from runs import REPO

pytest.importorskip("triton", reason="triton is not installed (CPU-only platforms without wheels)")


def test_kernel_matches_eager_interpreted():
    helpers = REPO / "tests" / "helpers"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), str(helpers)]))
    r = subprocess.run([sys.executable, str(helpers / "ce_cases.py")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
