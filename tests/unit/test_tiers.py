"""The test tiers are a rule, read from the sources: a file under tests/unit starts no process and needs no GPU.
A test that starts one (subprocess, os.system, torchrun, the helpers that run the trainer or the server) lives in
tests/jobs, where tests/conftest.py marks it `job` by its path; a test that skips without CUDA lives in tests/gpu,
its CPU half staying here."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# calls that start a process, by the module they come from (an alias or a `from x import y` is followed)
STARTS = {"subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
          "os": {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp",
                 "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
                 "spawnl", "spawnle", "spawnlp", "spawnlpe"},
          "multiprocessing": {"Process", "Pool", "get_context"},
          "torch.multiprocessing": {"spawn", "start_processes", "Process", "Pool", "get_context"},
          "pty": {"spawn"},
          "runs": {"run", "start", "torchrun_cmd"},     # tests/helpers/runs.py: torchrun jobs of the trainer
          "server": {"serving"}}                        # tests/helpers/server.py: tools/serve_openai.py as a process
TORCHRUN = {"torchrun", "torch.distributed.run", "torch.distributed.launch"}   # as an argv element: starts it


def _aliases(tree):
    """name in the file -> the dotted name it stands for (`import subprocess as sp`, `from runs import run`)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name                 # import torch.multiprocessing as mp: mp
                else:
                    top = a.name.split(".")[0]
                    names[top] = top                         # import os.path: os
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node, names):
    """The dotted name of a call's target with the file's aliases followed ('subprocess.run'), or ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([names.get(node.id, node.id)] + parts[::-1])


def _mentions_cuda(expr, assigned):
    """Whether an expression reads CUDA, directly or through a module-level name (FP8_GPU = torch.cuda...)."""
    text = ast.unparse(expr)
    text += " ".join(assigned.get(n.id, "") for n in ast.walk(expr) if isinstance(n, ast.Name))
    return "cuda" in text


def violations(source: str, name: str) -> list[str]:
    """What in one file's source breaks the unit tier, each naming the line and the fix."""
    tree = ast.parse(source, name)
    names = _aliases(tree)
    assigned = {t.id: ast.unparse(node.value) for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    stem = Path(name).stem
    job = f"move it to tests/jobs/ (tests/jobs/{stem}_jobs.py), which marks it `job`"
    gpu = f"move it to tests/gpu/ (tests/gpu/{stem}_cuda.py) and keep its CPU half here"
    found = []
    for node in ast.walk(tree):
        line = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            called = _dotted(node.func, names)
            module, _, fn = called.rpartition(".")
            if fn in STARTS.get(module, ()):
                found.append(f"{line}: {called}() starts a process: {job}")
            elif called.endswith("mark.skipif") and node.args and _mentions_cuda(node.args[0], assigned):
                found.append(f"{line}: skipped without CUDA ({ast.unparse(node.args[0])}): {gpu}")
        elif isinstance(node, (ast.List, ast.Tuple)) and any(
                isinstance(e, ast.Constant) and e.value in TORCHRUN for e in node.elts):
            found.append(f"{line}: a torchrun command line starts torchrun: {job}")
        elif isinstance(node, ast.Attribute) and node.attr == "job" and _dotted(node, names).endswith("mark.job"):
            found.append(f"{line}: marked `job` by hand: {job}")
        elif isinstance(node, ast.If) and _mentions_cuda(node.test, assigned) and any(
                isinstance(c, ast.Call) and _dotted(c.func, names) == "pytest.skip"
                for s in node.body for c in ast.walk(s)):
            found.append(f"{line}: skipped without CUDA ({ast.unparse(node.test)}): {gpu}")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_unit_files_start_no_process_and_need_no_gpu():
    """Each kind of break is seen in a planted source, then no file under tests/unit has one."""
    planted = {
        "import subprocess\ndef test_a():\n    subprocess.run(['ls'])\n": "subprocess.run() starts a process",
        "from subprocess import Popen as P\ndef test_a():\n    P(['ls'])\n": "subprocess.Popen() starts a process",
        "import os\ndef test_a():\n    os.system('ls')\n": "os.system() starts a process",
        "from runs import run\ndef test_a():\n    run(1, [])\n": "runs.run() starts a process",
        "import sys\nCMD = [sys.executable, '-m', 'torch.distributed.run']\n": "starts torchrun",
        "import pytest\n@pytest.mark.job\ndef test_a():\n    pass\n": "marked `job`",
        "import pytest, torch\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='gpu')\ndef test_a():\n"
        "    pass\n": "skipped without CUDA",
        "import pytest, torch\nGPU = torch.cuda.device_count() > 1\npytestmark = pytest.mark.skipif(not GPU, "
        "reason='gpu')\n": "skipped without CUDA",
        "import pytest, torch\ndef test_a():\n    if not torch.cuda.is_available():\n        pytest.skip('gpu')\n":
        "skipped without CUDA",
    }
    for source, said in planted.items():
        got = violations(source, "tests/unit/test_planted.py")
        assert len(got) == 1 and said in got[0] and "test_planted" in got[0], (source, got)
    assert violations("import torch\nDEV = 'cuda' if torch.cuda.is_available() else 'cpu'\n", "x.py") == []

    files = sorted((TESTS / "unit").rglob("*.py"))
    assert len(files) > 20
    found = [v for p in files for v in violations(p.read_text(), str(p.relative_to(TESTS.parent)))]
    assert not found, "tests/unit is the in-process, CPU tier:\n" + "\n".join(found)
