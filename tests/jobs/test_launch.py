"""launch.sh: flags are checked before anything starts, the log follows a --OUT_DIR= flag, the CPU demo settings
sit under the flags given, torchrun gets a free port, and a tmux session whose job has ended is replaced while one
still running is left alone. Runs launch.sh with the venv of this interpreter, DRY=1 where nothing needs to start;
the tmux part skips, saying so, where tmux is not installed."""
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import SMOLLM2_DIR
from runs import MASK_ID, REPO, make_dataset, make_target

DEMO_MAX_STEPS = "--MAX_STEPS=400"  # one of launch.sh's CPU demo settings


def launch(*flags, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "VENV": sys.prefix, "NGPU": "0", "SESSION": f"dflash-test-{os.getpid()}", **env}
    return subprocess.run(["bash", str(REPO / "launch.sh"), *flags], env=e, capture_output=True, text=True,
                          timeout=180)


def train_args(r: subprocess.CompletedProcess) -> list[str]:
    """The train_dflash.py arguments of the command launch.sh printed (and would run)."""
    line = next(x for x in r.stdout.splitlines() if x.startswith("launch: ") and "train_dflash.py" in x)
    cmd = shlex.split(line.removeprefix("launch: "))
    return cmd[cmd.index("train_dflash.py") + 1:]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    return make_target(d / "target"), make_dataset(d / "data", n=8)


@pytest.mark.job
def test_bad_flags_stop_before_anything_starts(tmp_path, tiny):
    target, data = tiny
    out = tmp_path / "run"
    for flag, error in [("--NOPE=1", "unknown setting --NOPE"), ("--BLOCK_SIZE=x", "--BLOCK_SIZE='x' is not a valid"),
                        ("--TARGET_RANKS=2", "TARGET_RANKS=2 must be between 1 and world size - 1 = 1")]:
        r = launch(f"--TARGET={target}", f"--DATA={data}", f"--OUT_DIR={out}", flag, FOREGROUND="1")
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert error in r.stderr and "launch: not started" in r.stderr and "Traceback" not in r.stderr
        assert not out.exists(), "nothing may start (or be created) for a bad flag"
    r = launch(f"--TARGET={target}", f"--DATA={data}", "--OUT_DIR=", DRY="1")
    assert r.returncode == 2 and "OUT_DIR is empty" in r.stderr


@pytest.mark.job
def test_out_dir_flag_demo_settings_and_port(tmp_path, tiny):
    if not (SMOLLM2_DIR / "config.json").exists():
        pytest.skip(f"the demo target is missing ({SMOLLM2_DIR}): build it with `.venv/bin/python -m tools.smollm2`")
    out = tmp_path / "mine"
    r = launch("--MAX_STEPS=5", f"--OUT_DIR={out}", DRY="1")   # the demo, shorter, in another folder
    assert r.returncode == 0, r.stderr
    assert f"log {out}/train.log" in r.stdout and not out.exists()
    args = train_args(r)
    assert DEMO_MAX_STEPS in args and args.index(DEMO_MAX_STEPS) < args.index("--MAX_STEPS=5")  # the flag wins
    assert args[0] == f"--OUT_DIR={out}" and args[-1] == f"--OUT_DIR={out}"
    cmd = shlex.split(next(x for x in r.stdout.splitlines() if "torchrun" in x).removeprefix("launch: "))
    port = int(cmd[cmd.index("--master-port") + 1])
    with socket.socket() as s:   # picked free, not a fixed 29500 that a second job on this machine would hold
        s.bind(("", port))
    target, data = tiny   # own target and data: no demo settings; MASTER_PORT is taken as given
    r = launch(f"--TARGET={target}", f"--DATA={data}", f"--MASK_TOKEN_ID={MASK_ID}", DRY="1", MASTER_PORT="29999",
               OUT_DIR=str(out))
    assert r.returncode == 0, r.stderr
    assert "CPU demo settings" not in r.stdout and DEMO_MAX_STEPS not in train_args(r)
    assert "--master-port 29999" in r.stdout
    assert f"log {out}/train.log" in r.stdout  # OUT_DIR from the environment when no flag names one


@pytest.mark.job
def test_tmux_session_of_an_ended_job_is_replaced(tmp_path, tiny):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: launch.sh runs in the foreground without it")
    target, data = tiny
    session = f"dflash-test-{os.getpid()}-tmux"
    out = tmp_path / "run"

    def tmux(*args):
        return subprocess.run(["tmux", *args], capture_output=True, text=True)

    def job_ended():
        return tmux("show-environment", "-t", f"={session}", "DFLASH_JOB").stdout.strip() == "DFLASH_JOB=ended"

    flags = (f"--TARGET={target}", f"--DATA={data}", f"--OUT_DIR={out}", f"--MASK_TOKEN_ID={MASK_ID}", "--DRY_RUN=1")
    try:
        tmux("new-session", "-d", "-s", session, "sleep 120")   # a session whose job still runs
        r = launch(*flags, SESSION=session, NPROC="1")
        assert r.returncode == 1 and "is still running a job" in r.stdout and not out.exists()
        tmux("set-environment", "-t", f"={session}", "DFLASH_JOB", "ended")   # as a pane does when its job ends
        r = launch(*flags, SESSION=session, NPROC="1")
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert f"replacing tmux session '{session}'" in r.stdout and f"started in tmux session '{session}'" in r.stdout
        deadline = time.time() + 120
        while not job_ended() and time.time() < deadline:   # the new pane marks its session when the job ends
            time.sleep(0.5)
        assert job_ended(), tmux("capture-pane", "-p", "-t", f"={session}:").stdout
        assert "DRY_RUN: config and data are fine" in (out / "train.log").read_text()
        ended = "[launch] job ended: DRY_RUN: config and data are fine"   # how it ended, printed right after
        deadline = time.time() + 10
        while ended not in (pane := tmux("capture-pane", "-p", "-t", f"={session}:").stdout) and time.time() < deadline:
            time.sleep(0.2)
        assert ended in pane, pane
    finally:
        tmux("kill-session", "-t", f"={session}")


@pytest.mark.job
def test_the_last_line_says_how_the_job_ended(tmp_path, tiny):
    """tools/job_outcome.sh, which launch.sh prints when a job ends: the first ABORT line of this run's part of the
    appended log (torchrun's [rankN]: prefix dropped), else its last done / stopped / error / DRY_RUN line; an
    earlier run's lines do not count. Then a real foreground launch ends with its own line."""
    log = tmp_path / "train.log"
    log.write_text("[rank1]:ABORT: rank 0 (target) died (process 7 is gone) -- ending the job\n"     # an earlier run
                   "x\n[0m] step=2/2 loss=1.0\r\nsaved runs/x/checkpoints/step_000002 (0.1s)\n"
                   "done: 2 steps; final drafter in runs/x/checkpoints/step_000002/drafter\n")
    outcome = lambda *a: subprocess.run(["bash", str(REPO / "tools" / "job_outcome.sh"), str(log), *map(str, a)],
                                        capture_output=True, text=True).stdout.strip()
    assert outcome() == "ABORT: rank 0 (target) died (process 7 is gone) -- ending the job"
    assert outcome(2) == "done: 2 steps; final drafter in runs/x/checkpoints/step_000002/drafter"
    assert outcome(9) == f"no outcome line in {log}: see its last lines"
    target, data = tiny
    out = tmp_path / "run"
    for _ in range(2):   # the second run's line, not the first's, though both are in the log
        r = launch(f"--TARGET={target}", f"--DATA={data}", f"--OUT_DIR={out}", f"--MASK_TOKEN_ID={MASK_ID}",
                   "--DRY_RUN=1", FOREGROUND="1", NPROC="1")
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert r.stdout.strip().splitlines()[-1].startswith("[launch] job ended: DRY_RUN: config and data are fine")
    assert (out / "train.log").read_text().count("DRY_RUN: config and data are fine") == 2


@pytest.mark.job
def test_help_prints_the_usage_and_starts_nothing(tmp_path):
    """--help: launch.sh's own environment variables, the demo settings it would apply here, the trainer's --help
    once; exit 0 before a venv, a folder or a job is made."""
    r = launch("--help", VENV=str(tmp_path / "venv"), OUT_DIR=str(tmp_path / "run"))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "SESSION [dflash]" in r.stdout and "CPU_DEMO [1" in r.stdout and DEMO_MAX_STEPS in r.stdout
    assert "need the venv" in r.stdout and not (tmp_path / "venv").exists() and not (tmp_path / "run").exists()
    r = launch("--MAX_STEPS=5", "--help", OUT_DIR=str(tmp_path / "run"))   # with the venv: the trainer's --help too
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.count("usage: python train_dflash.py") == 1 and "--GRAD_CLIP=" in r.stdout
    assert DEMO_MAX_STEPS in r.stdout and "launch: " not in r.stdout and not (tmp_path / "run").exists()
    r = launch("--TARGET=/models/x", "-h", VENV=str(tmp_path / "venv"))
    assert r.returncode == 0 and "applies no demo settings" in r.stdout and DEMO_MAX_STEPS not in r.stdout


@pytest.mark.job
def test_a_tracker_without_its_package_stops_the_launch(tmp_path, tiny):
    """The pre-check is the trainer's whole start-up check: TENSORBOARD / WANDB_PROJECT without their package stop
    launch.sh, not the job in its pane."""
    target, data = tiny
    hidden = tmp_path / "hidden"   # packages that fail to import, as when they are not installed
    for name in ("tensorboard", "wandb"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(f'raise ImportError("No module named {name}")\n')
    out = tmp_path / "run"
    for flag, error in [("--TENSORBOARD=1", "pip install tensorboard"), ("--WANDB_PROJECT=mine", "pip install wandb")]:
        r = launch(f"--TARGET={target}", f"--DATA={data}", f"--OUT_DIR={out}", f"--MASK_TOKEN_ID={MASK_ID}", flag,
                   FOREGROUND="1", PYTHONPATH=str(hidden))
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert error in r.stderr and "launch: not started" in r.stderr and "Traceback" not in r.stderr
        assert not out.exists()
