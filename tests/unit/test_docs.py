"""CI runs what the README says: .ci/run's first command is the README's test command, verbatim, and its FP8 step
runs every test that needs torchao. (The pages' commands name only flags their programs have:
tests/jobs/test_docs_jobs.py, which runs each program's --help.)"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readmes_test_command_as_written_with_no_extras_before_it():
    """.ci/run's first command is the README's second quick-start command, verbatim, and nothing before it installs
    an extra: CI sees what a new machine sees (an FP8 test that passed only with torchao once landed that way). Its
    FP8 step (FP8=1 installs torchao) then runs every test file that needs torchao, whichever tier holds it."""
    quick = re.search(r"## Quick start\n+```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    readme_test = quick.splitlines()[1].split(" #")[0].strip()
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    runs = [ln for ln in ci if not ln.startswith(("set ", "cd "))]
    assert runs[0] == readme_test, (runs[0], readme_test)
    launch = (ROOT / "launch.sh").read_text()
    assert re.search(r"^FP8=\$\{FP8:-0\}$", launch, re.M), "launch.sh installs torchao only when FP8=1 is asked for"
    fp8 = next(ln for ln in runs if ln.startswith("FP8=1 "))
    named = [ROOT / t.split("::")[0] for t in fp8.split() if t.startswith("tests/")]
    needs = [p for p in sorted((ROOT / "tests").rglob("test_*.py"))
             if re.search(r"importorskip\(\s*[\"']torchao|^\s*(import|from) torchao\b", p.read_text(), re.M)]
    assert needs, "no test file needs torchao: the FP8 step of .ci/run runs nothing"
    left_out = [str(p.relative_to(ROOT)) for p in needs if not any(p == n or n in p.parents for n in named)]
    assert not left_out, f".ci/run's FP8 step ({fp8}) leaves out tests that need torchao: {left_out}"
