"""Faults injected into real runs (issue 4): kill -9 of each role, SIGTERM and SIGKILL during a checkpoint write,
truncated / corrupted / missing checkpoints, a full disk, a hung and a frozen rank, bad rows in the dataset and
impossible configuration. Each test asserts what the job does; docs/faults.md's table points here.

Runs are real torchrun jobs on the tiny target of tests/helpers/runs.py (1 target + 2 drafter ranks, gloo, CPU). Faults
inside a process come from tests/helpers/faults/sitecustomize.py, put on PYTHONPATH and switched on by FAULT_* variables
(see its docstring). Kill points are drawn from a seeded generator, so a failure names a point that reproduces.
`-m slow` runs the remaining kill points.
"""
import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from trainer import checkpoint as ckpt
import runs

FAULTS = Path(__file__).resolve().parents[1] / "helpers" / "faults"
RUN = dict(EPOCHS=2, SAVE_EVERY=2, KEEP_LAST=10)   # 10 micro-batches/epoch, 2 drafters => 10 steps, saves 2,4,..,10
STEPS = 10
SLOW_FORWARD = 0.15      # s per target forward while a kill is pending: ~0.3 s per step, so kill points spread out
KILL_SEED = 20261130
ROLES = {"target": 0, "writer": 1, "drafter": 2}   # rank of each role; the first drafter writes checkpoints


# --- fixtures and helpers ---------------------------------------------------------------------------------------------

def args(assets, out, **kw):
    target, data = assets
    return runs.base_args(target, data, out, **{**RUN, **kw})


@pytest.fixture(scope="module")
def reference_run(assets, tmp_path_factory):
    """A run that was never interrupted: (OUT_DIR, its CompletedProcess)."""
    out = tmp_path_factory.mktemp("fault_reference") / "run"
    return out, runs.run(3, args(assets, out))


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run's OUT_DIR: the weights every resumed run must end with."""
    out, r = reference_run
    assert f"done: {STEPS} steps" in r.stdout, r.stdout[-5000:] + r.stderr[-3000:]
    return out


@pytest.mark.job
def test_reference_run_ends_cleanly(reference_run):
    """After the last save every rank exits 0 and none reports the others' normal exit as a death (a race seen
    while this suite was written: the master left first and a waiting rank's watchdog called it dead)."""
    out, r = reference_run
    completed(r)
    assert steps_of(out) == list(range(2, STEPS + 1, 2))


def set_faults(mp, **kw):
    """FAULT_NAME=value for the runs started afterwards (tests/helpers/faults/sitecustomize.py on PYTHONPATH)."""
    if str(FAULTS) not in os.environ.get("PYTHONPATH", ""):
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p))
    for k in [k for k in os.environ if k.startswith("FAULT_")]:
        mp.delenv(k)
    for k, v in kw.items():
        mp.setenv(f"FAULT_{k}", str(v))


@pytest.fixture
def faults(monkeypatch):
    """faults(NAME=value, ...) switches FAULT_NAME on for the runs started afterwards; faults() switches all off."""
    set_faults(monkeypatch)
    return lambda **kw: set_faults(monkeypatch, **kw)


class Job:
    """A started torchrun job whose output is collected; `close()` kills whatever is left (workers run in their
    own sessions, so the agent's process group does not reach them)."""

    def __init__(self, argv, nproc=3):
        self.proc = runs.start(nproc, argv)
        self.lines = []
        self.pids = {}

    def wait_for(self, pattern, timeout=150):
        found = runs.wait_for(self.proc, pattern, timeout, self.lines)
        # not runs.rank_pids: print() writes a message and its newline separately, so two ranks' identity lines
        # can share one line of the merged output
        self.pids.update({int(r): int(pid) for r, pid in re.findall(r"\] rank (\d+)/\d+ \S+ on .*? pid (\d+)",
                                                                     self.text)})
        assert found, f"never saw {pattern!r}:\n{self.text[-6000:]}"

    def finish(self, timeout):
        """(exit code or None if still running after `timeout` s, seconds waited)."""
        code, rest, waited = runs.finish(self.proc, timeout)
        self.lines.append(rest)
        return code, waited

    @property
    def text(self):
        return "".join(self.lines)

    def close(self):
        for pid in self.pids.values():
            try:
                if b"train_dflash.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue                       # gone, and the pid reused
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)       # a stopped process dies only once continued
            except (FileNotFoundError, ProcessLookupError):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


def completed(r, steps=STEPS):
    """The run trained to the end, saved, and every rank exited 0."""
    log = r.stdout + r.stderr
    assert r.returncode == 0 and f"done: {steps} steps" in log and "ABORT" not in log, \
        f"exit {r.returncode}\n{r.stdout[-5000:]}\n{r.stderr[-3000:]}"
    return r


def drafter_tensors(out, step=STEPS):
    from safetensors.torch import load_file
    folder = ckpt.step_dir(Path(out) / "checkpoints", step)
    ckpt.verify(folder)
    state = torch.load(folder / "state.pt", weights_only=False)
    return state["drafter"], load_file(folder / "drafter" / "model.safetensors"), state["optimizer"]["state"]


def assert_same_final_weights(out, reference):
    got, got_served, got_opt = drafter_tensors(out)
    want, want_served, want_opt = drafter_tensors(reference)
    assert got.keys() == want.keys() and got_served.keys() == want_served.keys()
    diff = [k for k in want if not torch.equal(got[k], want[k])]
    diff += [f"served {k}" for k in want_served if not torch.equal(got_served[k], want_served[k])]
    diff += [f"adam {i}.{k}" for i in want_opt for k in want_opt[i] if not torch.equal(got_opt[i][k], want_opt[i][k])]
    assert not diff, f"final weights differ from the uninterrupted run in {diff[:8]}"


def steps_of(out):
    return [int(p.name[len(ckpt.PREFIX):]) for p in ckpt.list_checkpoints(Path(out) / "checkpoints")]


DEAD = "{who} died (process"


def check_named_dead(log, rank):
    """The survivors name the killed rank, not the transport error its death caused on their side (a gloo
    "Connection closed by peer" can reach them before their watchdog looks at the peer pids)."""
    role = "target" if rank == 0 else "drafter"
    aborts = [l for l in log.splitlines() if "ABORT" in l][:3]
    assert DEAD.format(who=f"rank {rank} ({role})") in log, f"kill -9 of rank {rank} reported as {aborts}"


# --- kill -9 at random moments, then RESUME=auto ----------------------------------------------------------------------

def kill_points():
    """(role, step K, delay s): kill after the status line of step K plus the delay. Seeded: reproducible."""
    rng = random.Random(KILL_SEED)
    plan = [("target", False), ("writer", False), ("drafter", True), ("drafter", True), ("target", True),
            ("writer", True)]
    points = []
    for role, slow in plan:
        k, delay = rng.randint(1, STEPS - 3), round(rng.uniform(0.0, 0.3), 2)
        points.append(pytest.param(role, k, delay, id=f"{role}-step{k}+{delay}s",
                                   marks=[pytest.mark.slow] if slow else []))
    return points


@pytest.mark.job
@pytest.mark.parametrize("role,k,delay", kill_points())
def test_kill9_ends_job_and_resume_matches_uninterrupted(role, k, delay, assets, reference, faults, tmp_path):
    rank = ROLES[role]
    out = tmp_path / "run"
    faults(SLOW_FORWARD=SLOW_FORWARD)
    job = Job(args(assets, out))
    try:
        job.wait_for(f"step={k}/")
        time.sleep(delay)
        os.kill(job.pids[rank], signal.SIGKILL)
        code, waited = job.finish(60)
    finally:
        job.close()
    log = job.text
    assert code is not None, f"job still running 60 s after kill -9 of rank {rank}:\n{log[-5000:]}"
    assert code != 0 and "ABORT" in log, log[-5000:]
    assert f"done: {STEPS} steps" not in log, "the kill came after the end: pick an earlier kill point"

    before = ckpt.latest_complete(out / "checkpoints", quiet=True)   # what RESUME=auto must pick
    faults()
    r = completed(runs.run(3, args(assets, out)))
    if before is not None:
        assert f"RESUMING from step {int(before.name[len(ckpt.PREFIX):])} of {before}" in r.stdout, r.stdout[-3000:]
    else:
        assert "RESUMING" not in r.stdout
    assert not list((out / "checkpoints").glob(".tmp-*")), "a killed writer's folder was left behind"
    assert_same_final_weights(out, reference)
    check_named_dead(log, rank)


@pytest.mark.job
def test_kill9_of_target_names_it_while_drafters_wait_on_it(assets, faults, tmp_path):
    """Deterministic version of the naming check: both drafters are blocked receiving from the target when it
    dies, so their gloo receive fails at once."""
    faults(SLOW_FORWARD=1.0)
    job = Job(args(assets, tmp_path / "run"))
    try:
        job.wait_for("step=1/")
        time.sleep(0.3)
        os.kill(job.pids[0], signal.SIGKILL)
        code, _ = job.finish(60)
    finally:
        job.close()
    assert code is not None
    aborts = [l for l in job.text.splitlines() if "ABORT" in l]
    assert aborts and all(DEAD.format(who="rank 0 (target)") in l for l in aborts), aborts


def wait_mid_save(job, ck):
    """Until the writer sleeps inside the step-4 save with state.pt half on disk (SLOW_SAVE armed for rank 1)."""
    job.wait_for("FAULT: slow save")
    assert (ck / ".tmp-step_000004" / "state.pt").is_file(), (sorted(map(str, ck.rglob("*"))), job.text[-3000:])


@pytest.mark.job
@pytest.mark.slow
def test_sigkill_of_writer_mid_save_resumes_from_previous(assets, reference, faults, tmp_path):
    """kill -9 of the checkpoint writer while state.pt is half on disk: the .tmp- folder is never a checkpoint."""
    out = tmp_path / "run"
    ck = out / "checkpoints"
    faults(RANK=1, SLOW_SAVE="2:60")
    job = Job(args(assets, out))
    try:
        wait_mid_save(job, ck)
        os.kill(job.pids[1], signal.SIGKILL)
        code, _ = job.finish(60)
    finally:
        job.close()
    assert code is not None and code != 0, job.text[-5000:]
    assert steps_of(out) == [2] and ckpt.latest_complete(ck, quiet=True) == ck / "step_000002"
    faults()
    r = completed(runs.run(3, args(assets, out)))
    assert f"RESUMING from step 2 of {ck / 'step_000002'}" in r.stdout
    assert not list(ck.glob(".tmp-*"))
    assert_same_final_weights(out, reference)
    check_named_dead(job.text, 1)


# --- SIGTERM during a checkpoint write ----------------------------------------------------------------------------------

@pytest.mark.job
def test_sigterm_during_checkpoint_write(assets, faults, tmp_path):
    """The half-written folder is never listed while it is written; the save completes, the job stops at the
    next step boundary with one more checkpoint, and every checkpoint verifies and loads."""
    out = tmp_path / "run"
    ck = out / "checkpoints"
    faults(RANK=1, SLOW_SAVE="2:8")   # the window for the checks and the SIGTERM: 3 s proved short on a loaded CPU
    job = Job(args(assets, out))
    try:
        wait_mid_save(job, ck)
        assert steps_of(out) == [2] and ckpt.latest_complete(ck, quiet=True) == ck / "step_000002"
        os.killpg(job.proc.pid, signal.SIGTERM)   # the agent forwards it to every rank, as on preemption
        code, waited = job.finish(60)
    finally:
        job.close()
    log = job.text
    # every rank exits 0; torchrun itself, signalled too, may still exit 1 with "SignalException ... got signal: 15"
    assert code == 0 or (code == 1 and "got signal: 15" in log and "exitcode" not in log), f"exit {code}\n{log[-5000:]}"
    assert "got SIGTERM" in log and "ABORT" not in log, log[-5000:]
    m = re.search(r"stopped at step (\d+) on request", log)
    assert m, log[-5000:]
    stop = int(m[1])
    assert f"saved {ck / 'step_000004'}" in log and 4 < stop < STEPS
    assert steps_of(out) == sorted(set(range(2, stop + 1, 2)) | {stop})
    assert not list(ck.glob(".tmp-*"))
    for s in steps_of(out):
        ckpt.load_state(ckpt.step_dir(ck, s))   # verifies the manifest, then loads


# --- truncated, corrupted and missing checkpoints ---------------------------------------------------------------------

def save_tiny(root, step, keep_last=0, value=None):
    state = {"drafter": {"w": torch.full((64,), float(step if value is None else value))}, "step": step}
    meta = {"step": step, "next_g": 2 * step}

    def write_drafter(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    return ckpt.save(root, step, state, meta, write_drafter, keep_last)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message", [
    (lambda p: truncate(p / "state.pt"), "state.pt has .* bytes, expected .* \\(truncated\\?\\)"),
    (lambda p: flip_byte(p / "drafter" / "model.safetensors"), "drafter/model.safetensors fails its sha256 check"),
    (lambda p: (p / "meta.json").unlink(), "file meta.json is missing"),
    (lambda p: (p / "MANIFEST.json").unlink(), "has no MANIFEST.json: it was never completed"),
    (lambda p: truncate(p / "MANIFEST.json"), "MANIFEST.json is unreadable"),
    (lambda p: (p / "MANIFEST.json").write_text('{"files": []}'), "MANIFEST.json is unreadable"),
    (lambda p: (p / "MANIFEST.json").write_text('{"files": {}}'), "MANIFEST.json does not list state.pt"),
    (lambda p: shutil.rmtree(p), "is not a checkpoint folder"),
], ids=["truncated", "corrupted", "missing-file", "no-manifest", "truncated-manifest", "bad-manifest",
        "empty-manifest", "missing-folder"])
def test_damaged_checkpoint_detected_and_skipped(tmp_path, damage, message):
    for step in (1, 2, 3):
        save_tiny(tmp_path, step)
    damage(ckpt.step_dir(tmp_path, 3))
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load_state(ckpt.step_dir(tmp_path, 3))
    logged = []
    assert ckpt.latest_complete(tmp_path, log=logged.append) == ckpt.step_dir(tmp_path, 2)
    assert len(logged) == (0 if "not a checkpoint" in message else 1)
    assert ckpt.load_state(ckpt.step_dir(tmp_path, 2))["step"] == 2


def test_fallback_skips_a_missing_folder_in_the_middle(tmp_path):
    for step in (1, 2, 3, 4):
        save_tiny(tmp_path, step)
    shutil.rmtree(ckpt.step_dir(tmp_path, 3))
    truncate(ckpt.step_dir(tmp_path, 4) / "drafter" / "model.safetensors")
    logged = []
    assert ckpt.latest_complete(tmp_path, log=logged.append) == ckpt.step_dir(tmp_path, 2)
    assert len(logged) == 1 and "step_000004" in logged[0] and "truncated" in logged[0]
    for step in (1, 2, 4):
        ckpt.step_dir(tmp_path, step).joinpath("MANIFEST.json").unlink()
    assert ckpt.latest_complete(tmp_path, quiet=True) is None


def test_half_written_folder_is_never_a_checkpoint_and_is_cleaned(tmp_path):
    root = tmp_path / "checkpoints"
    save_tiny(root, 1)
    stale = root / ".tmp-step_000002"            # what a writer killed mid-save leaves, or another job's save
    stale.mkdir()
    (stale / "state.pt").write_bytes(b"half")
    assert ckpt.list_checkpoints(root) == [ckpt.step_dir(root, 1)]
    assert ckpt.latest_complete(root) == ckpt.step_dir(root, 1)
    save_tiny(root, 3, keep_last=0)
    assert stale.exists(), "without OUT_DIR's lock a .tmp- folder may be another job's checkpoint being written"
    ckpt.lock_out_dir(tmp_path)                  # the trainer holds it: no other job writes here, stale ones go
    save_tiny(root, 4, keep_last=0)              # keep everything: stale folders still go
    assert not stale.exists()


def test_keep_last_never_deletes_the_checkpoint_just_written(tmp_path):
    """After a resume from step 2 past broken step 4 and 5 (left from the killed run), saving step 3 with
    KEEP_LAST=1 must keep step 3: counting the broken newer folders would delete it and leave nothing loadable."""
    for step in (1, 2, 4, 5):
        save_tiny(tmp_path, step)
    for step in (4, 5):
        truncate(ckpt.step_dir(tmp_path, step) / "state.pt")
    assert ckpt.latest_complete(tmp_path, quiet=True) == ckpt.step_dir(tmp_path, 2)
    save_tiny(tmp_path, 3, keep_last=1)
    assert ckpt.latest_complete(tmp_path, quiet=True) == ckpt.step_dir(tmp_path, 3)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000003", "step_000004", "step_000005"]
    save_tiny(tmp_path, 4, keep_last=1, value=40)   # training gets there: the broken one is replaced
    assert ckpt.load_state(ckpt.step_dir(tmp_path, 4))["drafter"]["w"][0] == 40


@pytest.mark.job
def test_resume_falls_back_past_corrupt_truncated_and_missing(assets, reference, tmp_path):
    """End to end: checkpoints of the reference run with the newest truncated, the next corrupted and the one
    before missing. RESUME=<path> to a broken one is a clear error before any model loads; RESUME=auto names each
    broken checkpoint, resumes from step 4 and ends with the uninterrupted run's weights."""
    out = tmp_path / "run"
    ck = out / "checkpoints"
    shutil.copytree(reference / "checkpoints", ck)
    truncate(ck / "step_000010" / "state.pt")
    flip_byte(ck / "step_000008" / "drafter" / "model.safetensors")
    shutil.rmtree(ck / "step_000006")
    r = runs.run(1, args(assets, out, RESUME=ck / "step_000008"))
    assert r.returncode != 0 and "load target" not in r.stdout
    assert f"RESUME={ck / 'step_000008'}" in r.stderr and "fails its sha256 check (corrupted)" in r.stderr, r.stderr

    r = completed(runs.run(3, args(assets, out)))
    assert re.search(r"WARNING: skipping broken checkpoint: \S+step_000010: state.pt has \d+ bytes, expected \d+ "
                     r"\(truncated\?\)", r.stdout), r.stdout[-3000:]
    assert re.search(r"WARNING: skipping broken checkpoint: \S+step_000008: drafter/model.safetensors fails its "
                     r"sha256 check", r.stdout)
    assert f"RESUMING from step 4 of {ck / 'step_000004'}" in r.stdout
    assert_same_final_weights(out, reference)


# --- disk full --------------------------------------------------------------------------------------------------------

def test_disk_full_is_reported_and_cleaned_unit(tmp_path, monkeypatch):
    save_tiny(tmp_path, 1)
    real_save = torch.save

    def full(obj, f, *a, **kw):
        with (open(f, "wb") if isinstance(f, (str, os.PathLike)) else open(os.dup(f.fileno()), "wb")) as out:
            out.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ckpt.CheckpointError, match=r"could not save checkpoint step 2 .*the disk is full.*"
                                                   r"step_000001 is intact"):
        save_tiny(tmp_path, 2)
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001"]
    assert ckpt.load_state(ckpt.step_dir(tmp_path, 1))["step"] == 1


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs (needs root and mount); skipped where it cannot be made."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.job
@pytest.mark.parametrize("full_in", ["state.pt", "drafter"])
def test_real_full_disk_is_reported_as_disk_full(small_fs, full_in):
    """A real full filesystem, not an injected error: torch.save to a path says 'unexpected pos' (RuntimeError)
    and safetensors raises SafetensorError; both must become the same clear CheckpointError."""
    from safetensors.torch import save_file
    save_tiny(small_fs, 1)
    big = {"w": torch.zeros(200_000)}           # 800 KB: does not fit
    small = {"w": torch.zeros(4)}

    def write_drafter(folder):
        folder.mkdir()
        save_file(big if full_in == "drafter" else small, folder / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match="the disk is full.*step_000001 is intact"):
        ckpt.save(small_fs, 2, big if full_in == "state.pt" else small, {"step": 2}, write_drafter, 3)
    assert [p.name for p in small_fs.iterdir()] == ["step_000001"]
    ckpt.load_state(ckpt.step_dir(small_fs, 1))


@pytest.mark.job
def test_disk_full_while_saving_stops_the_job(assets, faults, tmp_path):
    out = tmp_path / "run"
    faults(RANK=1, SAVE_ENOSPC=2)                  # the second checkpoint (step 4) hits a full disk
    r = runs.run(3, args(assets, out), timeout=180)
    log = r.stdout + r.stderr
    assert r.returncode != 0 and "FAULT: disk full" in log, log[-5000:]
    assert re.search(r"ABORT: rank 1 \(drafter\): could not save checkpoint step 4 in \S+: the disk is full\. "
                     r"Partial files were removed; the previous checkpoint \S+step_000002 is intact", log), log[-5000:]
    assert f"done: {STEPS} steps" not in log and "saved" not in log.split("FAULT: disk full")[1]
    assert steps_of(out) == [2] and not list((out / "checkpoints").glob(".tmp-*"))
    ckpt.load_state(out / "checkpoints" / "step_000002")


# --- a rank that hangs, a rank that is frozen -------------------------------------------------------------------------

STALL = 10


@pytest.fixture(scope="module")
def hung_run(assets, tmp_path_factory):
    """The target's main thread never returns from its 4th forward (g=3); its heartbeat thread keeps beating, and
    its sender thread, slowed to lag behind, ships g=1 and g=2 meanwhile. (seconds from the hang to the first
    ABORT line, exit code, log)."""
    with pytest.MonkeyPatch.context() as mp:
        set_faults(mp, RANK=0, HANG_FORWARD=4, SLOW_SEND=0.3)
        job = Job(args(assets, tmp_path_factory.mktemp("hung") / "run", STALL_TIMEOUT=STALL, HEARTBEAT_TIMEOUT=60))
    try:
        job.wait_for("FAULT: hanging in target forward")
        t0 = time.time()
        job.wait_for("ABORT", timeout=STALL + 20)
        took = time.time() - t0
        code, _ = job.finish(60)
    finally:
        job.close()
    return took, code, job.text


@pytest.mark.job
def test_hung_target_rank_ends_the_job_within_stall_timeout(hung_run):
    took, code, log = hung_run
    assert code is not None and code != 0
    assert took <= STALL + 5, f"abort {took:.0f}s after the hang (STALL_TIMEOUT={STALL})"
    abort = next(l for l in log.splitlines() if "ABORT" in l)
    assert "no rank made progress for" in abort and f"(STALL_TIMEOUT={STALL})" in abort, abort
    assert re.search(r"states: rank 0 \(target\): .*rank 1 \(drafter\): .*rank 2 \(drafter\): ", abort), abort
    assert "no heartbeat" not in log, "a live heartbeat must not be reported as dead"


@pytest.mark.job
def test_hung_target_rank_state_names_the_stuck_forward(hung_run):
    abort = next(l for l in hung_run[2].splitlines() if "ABORT" in l)
    assert re.search(r"rank 0 \(target\): target forward g=3\b", abort), f"stuck rank/state not named: {abort}"


@pytest.mark.job
def test_frozen_rank_is_named_within_heartbeat_timeout(assets, faults, tmp_path):
    """SIGSTOP freezes every thread of the target, heartbeat included (a hung host, a stuck driver)."""
    hb = 8
    faults(SLOW_FORWARD=SLOW_FORWARD)
    job = Job(args(assets, tmp_path / "run", HEARTBEAT_TIMEOUT=hb, STALL_TIMEOUT=600))
    try:
        job.wait_for("step=2/")
        os.kill(job.pids[0], signal.SIGSTOP)
        t0 = time.time()
        job.wait_for("ABORT", timeout=hb + 20)
        took = time.time() - t0
        os.kill(job.pids[0], signal.SIGCONT)     # thawed, it finds the abort and leaves too
        code, _ = job.finish(60)
    finally:
        job.close()
    log = job.text
    assert code is not None and code != 0
    assert took <= hb + 5, f"abort {took:.0f}s after SIGSTOP (HEARTBEAT_TIMEOUT={hb})"
    abort = next(l for l in log.splitlines() if "ABORT" in l)
    assert re.search(r"rank 0 \(target\) sent no heartbeat for \d+s", abort), abort


# --- bad rows in a prepared dataset -----------------------------------------------------------------------------------

@pytest.mark.job
def test_bad_rows_are_dropped_counted_and_the_run_completes(assets, tmp_path):
    from datasets import Dataset, load_from_disk
    target, data = assets
    good = load_from_disk(str(data))
    bad_ids = [list(range(1, 91)) * 3 + [1] * 30,              # 300 tokens > TOKEN_BUDGET=256
               [5, 6, 7, 8, 9, 10],                            # nothing supervised
               [5, 6, 7, 8, 9, 10, 11, 12],                    # nothing supervised
               [5, 6, 500, 8, 9, 10],                          # token id past the vocabulary (96)
               [5, 6, -1, 8, 9, 10]]                           # negative token id
    bad_mask = [[0] * 10 + [1] * 290, [0] * 6, [0] * 8, [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    bad = tmp_path / "bad_data"
    Dataset.from_dict({"input_ids": list(good["input_ids"][:24]) + bad_ids + list(good["input_ids"][24:]),
                       "loss_mask": list(good["loss_mask"][:24]) + bad_mask + list(good["loss_mask"][24:])}
                      ).save_to_disk(str(bad))
    out = tmp_path / "run"
    r = runs.run(1, runs.base_args(target, bad, out, MAX_STEPS=3))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = re.search(r"data: 53 rows, 48 trainable \(dropped (\{.*?\})\)", r.stdout)
    assert m, r.stdout[-3000:]
    got = eval(m[1])                                            # the dict as printed
    assert got == {"token_id_outside_vocab_0..95": 2, "longer_than_TOKEN_BUDGET_256": 1,
                   "no_two_consecutive_supervised_tokens": 2}, got
    assert json.loads((out / "run.json").read_text())["data"]["dropped"] == got
    assert "done: 3 steps" in r.stdout


def test_row_with_mismatched_mask_length_is_dropped(tmp_path):
    from datasets import Dataset
    import train_dflash as td
    from data.loader import Data
    ids = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14, 15]]
    masks = [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1, 1]]  # row 0: 7 mask values for 6 tokens
    Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(tmp_path / "d"))
    data = Data(str(tmp_path / "d"), 96, td.TOKEN_BUDGET, td.MAX_BATCH_SIZE, td.SEED)
    assert data.dropped == {"loss_mask_length_differs": 1}
    got = {tuple(i[:n].tolist()): m[:n].tolist() for g in range(data.plan.num_batches)
           for i, m, _, lens in [data.batch(g)] for n, i, m in zip(lens.tolist(), i, m)}
    assert got == {(7, 8, 9, 10): [0, 1, 1, 1], (11, 12, 13, 14, 15): [0, 0, 0, 1, 1]}


# --- impossible configuration: a clear error before any model is loaded --------------------------------------------

SMOLLM2 = Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash")) / "smollm2-135m-instruct"


def not_a_causal_lm(tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert",
                                                    "vocab_size": 96}))
    return {"TARGET": folder}


@pytest.mark.job
@pytest.mark.parametrize("nproc,override,message", [
    (3, lambda p: {"TARGET_RANKS": 3}, r"TARGET_RANKS=3 must be between 1 and world size - 1 = 2"),
    (1, lambda p: {"BLOCK_SIZE": 1}, r"BLOCK_SIZE=1 must be >= 2"),
    (1, lambda p: {"GRAD_ACCUM": 0}, r"GRAD_ACCUM=0 must be >= 1"),
    (1, lambda p: {"TOKEN_BUDGET": 16}, r"no trainable rows .*'longer_than_TOKEN_BUDGET_16': 48"),
    (1, not_a_causal_lm, r"TARGET=\S+ is not a causal LM \(architectures=\['BertForMaskedLM'\]\)"),
    (1, lambda p: {"TARGET": p / "nothing"}, r"TARGET=\S+ has no config.json"),
    (1, lambda p: {"TARGET": SMOLLM2, "MASK_TOKEN_ID": 100}, r"(?i)mask_token_id 100 is an ordinary vocabulary token"),
    (1, lambda p: {"BOGUS": 1}, r"unknown setting --BOGUS"),
    (1, lambda p: {"BLOKC_SIZE": 4}, r"unknown setting --BLOKC_SIZE \(did you mean BLOCK_SIZE"),
    (1, lambda p: {"GRAD_ACCUM": "two"}, r"--GRAD_ACCUM='two' is not a valid int"),
], ids=["target-ranks", "block-size", "grad-accum-0", "token-budget", "not-causal-lm", "no-target", "mask-in-vocab",
        "bogus", "typo", "wrong-type"])
def test_impossible_config_fails_before_any_model_loads(assets, tmp_path, nproc, override, message):
    kw = override(tmp_path)
    if kw.get("TARGET") == SMOLLM2 and not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip(f"no SmolLM2 tokenizer at {SMOLLM2}")
    r = runs.run(nproc, args(assets, tmp_path / "run", **kw), timeout=120)
    log = r.stdout + r.stderr
    assert r.returncode != 0, log[-3000:]
    assert re.search(message, log), log[-3000:]
    assert "load target" not in log and "build drafter" not in log, "a model was loaded before the error"
    assert "Traceback" not in re.split(r"torch[/.]distributed[/.]elastic", r.stderr)[0], r.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- errors on a worker thread of the one-process mode ------------------------------------------------------------------

@pytest.mark.job
def test_one_process_mode_ends_on_an_error_in_its_feeder_thread(assets, faults, tmp_path):
    """`python train_dflash.py`: the thread that pads micro-batches fails at its 3rd batch. The job ends with that
    error (it waited forever for the next micro-batch before)."""
    faults(BATCH_ERROR=3)
    t = time.time()
    r = runs.run(1, args(assets, tmp_path / "run"), timeout=90)
    log = r.stdout + r.stderr
    assert "FAULT: error in batch call 3" in log, log[-3000:]
    assert r.returncode != 0 and time.time() - t < 60, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: ") and "injected fault in BatchPlan.batch(g=2)" in last, last


@contextlib.contextmanager
def one_process(argv):
    """`python train_dflash.py ARGV` in its own session, output on proc.stdout; killed if still running at the end."""
    proc = subprocess.Popen([runs.sys.executable, str(runs.REPO / "train_dflash.py"), *argv], cwd=runs.REPO,
                            env=runs.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.job
def test_one_process_mode_ends_on_a_second_signal_while_stuck(assets, faults, tmp_path):
    """The feeder thread hangs in its 3rd target forward: the first SIGTERM asks for a checkpoint at the next step,
    which never comes; the second ends the job at once, saying so."""
    faults(HANG_FORWARD=3)
    lines = []
    with one_process(args(assets, tmp_path / "run")) as proc:
        assert runs.wait_for(proc, "FAULT: hanging in target forward", 60, lines), "".join(lines)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert runs.wait_for(proc, "saving a checkpoint at the next step", 10, lines), "".join(lines)
        from trainer.watchdog import SECOND_SIGNAL_S
        time.sleep(SECOND_SIGNAL_S + 0.5)          # sooner it would be the same signal, forwarded (next test)
        proc.send_signal(signal.SIGTERM)
        code, rest, waited = runs.finish(proc, 20)
    log = "".join(lines) + rest
    assert code not in (0, None) and waited < 10, log[-3000:]
    assert "error: got a second SIGTERM: ending now, without a checkpoint" in log, log[-3000:]


@pytest.mark.job
def test_one_signal_delivered_twice_still_saves_a_checkpoint(assets, faults, tmp_path):
    """Ctrl-C in launch.sh's tmux pane reaches each rank twice: from the terminal, and forwarded by torchrun a moment
    later. Two signals within SECOND_SIGNAL_S are one request: the job saves a checkpoint and stops cleanly."""
    faults(SLOW_FORWARD=0.2)                       # steps slow enough that the run is still going at the signals
    lines = []
    with one_process(args(assets, tmp_path / "run", MAX_STEPS=400)) as proc:
        assert runs.wait_for(proc, "step=2/", 60, lines), "".join(lines)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        code, rest, _ = runs.finish(proc, 60)
    log = "".join(lines) + rest
    assert code == 0 and "stopped at step" in log and "second SIGINT" not in log, log[-3000:]
    assert list((tmp_path / "run" / "checkpoints").glob("step_*")), log[-3000:]


# --- two jobs on one OUT_DIR --------------------------------------------------------------------------------------------

@pytest.mark.job
def test_out_dir_lock_refuses_a_second_holder_and_survives_a_dead_one(tmp_path):
    """flock semantics: a second open of the lock (another job) is refused with the holder's host and pid; the
    lock of a process that was killed is free again, and the file's leftover name is reported."""
    import socket
    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        with pytest.raises(ckpt.CheckpointError, match=rf"OUT_DIR={out} is in use by another job \(host "
                                                         rf"{socket.gethostname()} pid {holder.pid}\)"):
            ckpt.lock_out_dir(out)
    finally:
        holder.kill()
        holder.wait()
    notes = []
    ckpt.lock_out_dir(out, log=notes.append)      # killed -9: the kernel dropped its lock
    assert notes and f"names a job that is gone ({socket.gethostname()} {holder.pid})" in notes[0], notes
    assert (out / ".lock").read_text() == f"{socket.gethostname()} {os.getpid()}\n"


def hold_lock(out):
    """A process holding OUT_DIR's lock, as a running job does."""
    p = subprocess.Popen([runs.sys.executable, "-c", "import time; from trainer import checkpoint; "
                          f"checkpoint.lock_out_dir({str(out)!r}); print('locked', flush=True); time.sleep(60)"],
                         cwd=runs.REPO, env=runs.env(), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


@pytest.mark.job
def test_trainer_refuses_a_locked_out_dir_before_any_model_loads(assets, tmp_path):
    out = tmp_path / "run"
    holder = hold_lock(out)
    try:
        r = runs.run(1, args(assets, out))
    finally:
        holder.kill()
        holder.wait()
    log = r.stdout + r.stderr
    assert r.returncode != 0 and f"OUT_DIR={out} is in use by another job (host " in log, log[-3000:]
    assert f"pid {holder.pid})" in log and "load target" not in log and "Traceback" not in log, log[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [".lock"], "the refused job wrote nothing"


@pytest.mark.job
@pytest.mark.slow
def test_second_job_on_a_busy_out_dir_is_refused_before_any_model_loads(assets, faults, tmp_path):
    out = tmp_path / "run"
    faults(SLOW_FORWARD=1.0)                     # the first job (1 target + 1 drafter) runs ~10 s after its step 1
    first = Job(args(assets, out, MAX_STEPS=STEPS), nproc=2)
    try:
        first.wait_for("step=1/")
        faults()
        r = runs.run(1, args(assets, out))
        code, _ = first.finish(120)
    finally:
        first.close()
    log = r.stdout + r.stderr
    assert r.returncode != 0 and re.search(rf"OUT_DIR={out} is in use by another job \(host \S+ pid "
                                           rf"{first.pids[1]}\)", log), log[-3000:]
    assert "load target" not in log and "Traceback" not in log, log[-3000:]
    assert code == 0 and f"done: {STEPS} steps" in first.text, first.text[-3000:]
    assert steps_of(out) == list(range(2, STEPS + 1, 2)), "the first job's checkpoints are all there"


# --- the in-training evaluation -------------------------------------------------------------------------------------

def eval_assets(assets, tmp_path, thinking="off"):
    """The dataset with a stats.json saying how it was prepared, and a prompts file of token ids (the tiny target
    has no tokenizer)."""
    target, data = assets
    shutil.copytree(data, tmp_path / "data")
    (tmp_path / "data" / "stats.json").write_text(json.dumps({"thinking": thinking}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [3 + i, 7, 7, 7, 9, 9]}) + "\n" for i in range(2)))
    return target, tmp_path / "data", prompts


@pytest.mark.job
def test_slow_evaluation_is_not_a_stall(assets, faults, tmp_path):
    """EVAL_EVERY's evaluation holds the other ranks up for longer than STALL_TIMEOUT: the watchdog knows it is an
    evaluation (it ended the job as a stall before). It also renders prompts in the dataset's thinking mode."""
    target, data, prompts = eval_assets(assets, tmp_path)
    faults(SLOW_EVAL=7)
    r = runs.run(2, runs.base_args(target, data, tmp_path / "run", MAX_STEPS=2, SAVE_EVERY=2, EVAL_EVERY=1,
                                   EVAL_PROMPTS=prompts, EVAL_LIMIT=2, EVAL_MAX_NEW_TOKENS=4, STALL_TIMEOUT=3))
    completed(r, steps=2)
    log = r.stdout + r.stderr
    assert "FAULT: slow evaluation, 7s (enable_thinking=False)" in log, log[-3000:]
    assert "eval: every 1 checkpoint(s), 2 prompts of" in log and "thinking=off (as DATA was prepared)" in log
    assert [m["step"] for m in runs.metrics(tmp_path / "run") if "tau" in m] == [2]


@pytest.mark.job
@pytest.mark.parametrize("row,message", [
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "has no user turn"),
    ('{"prompt": "hello"}', "is text, and TARGET=\\S+ has no tokenizer"),
    ('{"text": "hello"}', "a prompt row needs `messages`, `prompt` or `input_ids`"),
    ('not json', "prompts.jsonl:2: not JSON"),
    ('', "holds no prompts"),
], ids=["no-user-turn", "text-without-tokenizer", "no-prompt", "not-json", "empty"])
def test_bad_eval_prompts_are_refused_at_start_up(assets, tmp_path, row, message):
    target, data, prompts = eval_assets(assets, tmp_path)
    prompts.write_text((prompts.read_text().splitlines()[0] + "\n" + row + "\n") if row else "")
    r = runs.run(1, args(assets, tmp_path / "run", EVAL_EVERY=1, EVAL_PROMPTS=prompts))
    assert r.returncode != 0 and re.search(message, r.stderr), r.stdout[-2000:] + r.stderr[-2000:]
    assert "load target" not in r.stdout and "Traceback" not in r.stderr, r.stderr[-2000:]
