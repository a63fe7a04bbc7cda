"""Checkpoints: atomic save, keep the last K, find the newest complete one, verify before load.

Layout of OUT_DIR/checkpoints/step_NNNNNN/:
    state.pt         drafter (fp32 master weights), optimizer, step, data position, RNG states
    shards/          DRAFTER_SHARDING=fsdp instead: drafter and optimizer sharded as the drafter ranks hold them
                     (torch.distributed.checkpoint; state.pt keeps step, data position, RNG states)
    meta.json        small and human-readable: step, next_g, dataset fingerprint, config, environment
    drafter/         the serving-format drafter (config.json + model.safetensors), loadable by SGLang / vLLM
    MANIFEST.json    size and sha256 of every file above; written last

A folder is written as `.tmp-step_NNNNNN` and renamed when MANIFEST.json is on disk, so a crash or SIGKILL
mid-write never leaves something that looks like a checkpoint; a truncated or edited file fails its checksum.

One job at a time writes an OUT_DIR: lock_out_dir takes OUT_DIR/.lock for the job's life, and only its holder
removes `.tmp-*` folders (any other writer's are then dead).

The state a checkpoint holds is defined here too (`train_state`, `train_meta`), with what a resume reads back from
it: `resume_mismatches` (what the checkpoint was trained for) and `resume_point` (where the data and LR continue).
A sharded checkpoint is written by every drafter rank (`save_shards`) and read back onto any number of drafter
ranks, sharded or not (`load_shards`: DCP reshards); `full_state` gathers the sharded drafter on the master for the
serving export.
"""
import atexit
import errno
import fcntl
import hashlib
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from data.resume import WEIGHT_FILES, weights_fingerprint
from model.drafter import Drafter
from model.drafters import ARCHS

PREFIX = "step_"
SHARDS = "shards"           # the DCP folder of a sharded checkpoint


class CheckpointError(RuntimeError):
    pass


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_dir(root: Path, step: int) -> Path:
    """Where checkpoint `step` is written before its rename."""
    return Path(root) / f".tmp-{step_dir(root, step).name}"


def save(root: Path, step: int, state: dict, meta: dict, write_drafter, keep_last: int, write_shards=None) -> Path:
    """Write checkpoint `step` atomically; `write_drafter(folder)` writes the serving export, `write_shards(folder)`
    (a sharded drafter: save_shards, which the other drafter ranks call at the same time) the shards into it.
    Raises CheckpointError (disk full or any other write error) after removing the partial folder; older
    checkpoints are untouched."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = tmp_dir(root, step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        # through a Python file object: torch.save(path) reports a full disk as RuntimeError("unexpected pos"),
        # a file object raises OSError(ENOSPC)
        with open(tmp / "state.pt", "wb") as f:
            torch.save(state, f)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        if write_shards:
            write_shards(tmp)
        write_drafter(tmp / "drafter")
        files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / "MANIFEST.json").write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError, torch RuntimeError: same outcome
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_complete(root, quiet=True)
        why = "the disk is full" if _is_disk_full(e) else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"could not save checkpoint step {step} in {root}: {why}. Partial files were removed; "
            + (f"the previous checkpoint {prev} is intact." if prev else "no earlier checkpoint exists.")
            + " Free space (or point OUT_DIR elsewhere) and resume with RESUME=auto.") from e
    prune(root, keep_last, newest=step)
    return final


def _is_disk_full(e: BaseException) -> bool:
    while e is not None:
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def prune(root: Path, keep_last: int, newest: int | None = None) -> None:
    """Keep the last `keep_last` checkpoints up to step `newest` (the one just written; 0 = keep all) and, when this
    process holds the OUT_DIR lock above root, remove folders of killed writers (without it a `.tmp-*` folder may be
    another live job's checkpoint being written). Checkpoints past `newest` are left alone: they are left over from
    before a resume from an older checkpoint (usually because they failed verification) and are replaced when
    training gets there, so counting them would delete the checkpoint just written."""
    if holds_lock(root):
        for stale in Path(root).glob(".tmp-*"):  # left by a killed writer: the lock says no other job is writing
            shutil.rmtree(stale, ignore_errors=True)
    if keep_last <= 0:
        return
    done = [p for p in list_checkpoints(root) if newest is None or _step_of(p) <= newest]
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


# --- one job per OUT_DIR ----------------------------------------------------------------------------------------------

LOCK_NAME = ".lock"
_HELD = {}   # resolved OUT_DIR -> the open lock file (kept open: closing it releases the lock)


def lock_out_dir(out_dir: Path, log=print) -> None:
    """Take OUT_DIR's exclusive lock for the rest of this process's life, or raise CheckpointError naming the job
    that holds it. flock: the kernel releases it when the holder exits, however it exits (kill -9 included), so a
    dead job never leaves a stale lock; the file's text (host pid) names the holder. flock works on local disks and,
    through fcntl emulation, on NFS."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        f = open(out_dir / LOCK_NAME, "a+")
    except OSError as e:
        raise CheckpointError(f"cannot create the lock file in OUT_DIR={out_dir} ({e.strerror}): point OUT_DIR at "
                              f"a writable folder") from e
    f.seek(0)
    before = f.read().strip()
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        host, _, pid = before.partition(" ")
        raise CheckpointError(f"OUT_DIR={out_dir} is in use by another job (host {host or '?'} pid {pid or '?'}), "
                              f"which writes its checkpoints and logs there; nothing was changed. Wait for it to "
                              f"end or stop it, or use another OUT_DIR") from None
    if before:
        log(f"NOTE: {out_dir / LOCK_NAME} names a job that is gone ({before}); taking it over")
    f.seek(0)
    f.truncate()
    f.write(f"{socket.gethostname()} {os.getpid()}\n")
    f.flush()
    _HELD[out_dir.resolve()] = f
    atexit.register(_release, out_dir.resolve())   # a normal exit leaves the file empty; a killed job, its name


def _release(out_dir: Path) -> None:
    f = _HELD.pop(out_dir, None)
    if f is not None:
        f.truncate(0)
        f.close()


def holds_lock(path: Path) -> bool:
    """Whether this process holds the lock of an OUT_DIR that is `path` or contains it."""
    path = Path(path).resolve()
    return any(path == d or d in path.parents for d in _HELD)


def _step_of(path: Path) -> int:
    return int(Path(path).name[len(PREFIX):])


def list_checkpoints(root: Path) -> list[Path]:
    """Renamed (complete-looking) checkpoint folders, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=_step_of)


REQUIRED = ("state.pt", "meta.json")


def verify(path: Path, deep: bool = True) -> None:
    """Raise CheckpointError naming what is wrong: missing folder or manifest, missing file, wrong size or
    checksum."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder (missing)")
    man = path / "MANIFEST.json"
    if not man.exists():
        raise CheckpointError(f"{path} has no MANIFEST.json: it was never completed")
    try:
        files = json.loads(man.read_text())["files"]
        entries = [(name, int(info["bytes"]), str(info["sha256"])) for name, info in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:   # JSONDecodeError is a ValueError
        raise CheckpointError(f"{man} is unreadable ({type(e).__name__}: {e})") from e
    sharded = [f"{SHARDS}/.metadata"] if any(name.startswith(SHARDS + "/") for name in files) else []
    for name in (*REQUIRED, *sharded):   # DCP's .metadata is written last: without it the shards are unreadable
        if name not in files:
            raise CheckpointError(f"{man} does not list {name}")
    for name, size, digest in entries:
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} has {f.stat().st_size} bytes, expected {size} (truncated?)")
        if deep and _sha256(f) != digest:
            raise CheckpointError(f"{path}: {name} fails its sha256 check (corrupted)")


def latest_complete(root: Path, quiet: bool = False, log=print) -> Path | None:
    """Newest checkpoint that passes `verify`; broken ones are reported and skipped."""
    for path in reversed(list_checkpoints(root)):
        try:
            verify(path)
            return path
        except CheckpointError as e:
            if not quiet:
                log(f"WARNING: skipping broken checkpoint: {e}")
    return None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def load_state(path: Path, map_location="cpu") -> dict:
    verify(path)
    return torch.load(Path(path) / "state.pt", map_location=map_location, weights_only=False)


def environment() -> dict:
    """What a run needs to be reproduced; never the process environment (it holds tokens)."""
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "python": platform.python_version(), "host": socket.gethostname(), "git": git_revision()}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                                "--format=csv,noheader"], capture_output=True, text=True,
                                               timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return env


def git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if rev.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# --- the training state: what a checkpoint holds, and what a resume reads back ----------------------------------------



def train_state(drafter, opt, step: int, next_g: int, sharded: bool = False) -> dict:
    """state.pt: fp32 master weights, optimizer, the next step and micro-batch, every RNG (per-micro-batch draws come
    from (SEED, g), so these only matter to code outside them). sharded: the weights and optimizer go to the
    shards (save_shards), state.pt names that folder instead."""
    state = {"drafter": drafter.state_dict(), "optimizer": opt.state_dict()} if not sharded else {"shards": SHARDS}
    return {**state, "step": step, "next_g": next_g,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}}


# --- sharded drafter state (DRAFTER_SHARDING=fsdp) ---------------------------------------------------------------------

def save_shards(folder: Path, model, opt, group) -> None:
    """Every drafter rank at once: the drafter and its optimizer as this rank holds them (FSDP2 DTensor shards) into
    folder/shards, one file per rank plus DCP's .metadata (written last, by the group's first rank). The barrier:
    the master has made `folder` (checkpoint.save) before any rank writes into it."""
    dist.barrier(group=group)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=Path(folder) / SHARDS, process_group=group)


def is_sharded(path: Path) -> bool:
    return (Path(path) / SHARDS).is_dir()


def load_shards(path: Path, model, opt, group) -> dict:
    """A sharded checkpoint into this run's drafter and optimizer, on every drafter rank at once: DCP reads each
    rank's share of every tensor whatever the number of ranks that wrote it, and into an unsharded drafter
    (DRAFTER_SHARDING=ddp, or the one process: group None) the whole tensors. -> state.pt (step, next_g, RNG)."""
    msd, osd = get_state_dict(model, opt)        # the optimizer's state made (zeros) so DCP has tensors to fill
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=Path(path) / SHARDS, process_group=group)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)


def load_full_into_sharded(model, opt, plain, plain_opt) -> None:
    """An unsharded drafter's weights and optimizer (plain, plain_opt: a DDP checkpoint's state.pt loaded into them)
    into the sharded model and opt: every rank keeps its share of the full tensors."""
    set_state_dict(model, opt, model_state_dict=plain.state_dict(),
                   optim_state_dict=get_optimizer_state_dict(plain, plain_opt),
                   options=StateDictOptions(full_state_dict=True))


def full_state(model, keep: bool) -> dict:
    """The sharded drafter's whole fp32 state dict on the CPU of the rank with keep=True (the master, for the serving
    export), gathered one tensor at a time (every drafter rank calls it: each gather is a collective), so no rank
    holds more than one unsharded tensor on its device. get_model_state_dict(full_state_dict, cpu_offload) keeps the
    result on global rank 0 only, a target rank here."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = full.detach().cpu()
    return out


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["rng"]["torch"].cpu())
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])


def train_meta(step, next_g, planned_g, split, config, data, drafter_cfg, target) -> dict:
    """meta.json: small and readable; everything resume_mismatches and resume_point compare. data: a
    data.loader.Data; drafter_cfg: the DrafterConfig; target: target_fingerprint(TARGET)."""
    return {"step": step, "next_g": next_g, "planned_g": planned_g, "epoch": next_g / data.plan.num_batches,
            "split": split, "config": config, "env": environment(), "data": data.fingerprint(),
            "drafter": drafter_cfg.__dict__, "target": target, "time": time.time()}


def target_fingerprint(path) -> dict:
    """What identifies a target without loading it: its config.json (hashed, less the fields a re-save changes) and
    its weight files' headers plus their first MiB of tensor data (another checkpoint of the same architecture
    differs there)."""
    path = Path(path).expanduser()
    cfg = json.loads((path / "config.json").read_text())
    for k in ("_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    weights = weights_fingerprint(path) or hashlib.sha256().hexdigest()   # no weight file: the hash of nothing
    config_sha = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()
    return {"path": str(path.resolve()), "config_sha256": config_sha, "weights_sha256": weights}


# drafter config field -> the setting that decides it (fields not listed come from the target's config), with each
# arch's knobs (model/drafters.py Arch.knobs) read when a resume is checked
SHAPED_BY = {"num_hidden_layers": "NUM_DRAFT_LAYERS", "block_size": "BLOCK_SIZE",
             "target_layer_ids": "TARGET_LAYER_IDS", "mask_token_id": "MASK_TOKEN_ID",
             "layer_types": "SLIDING_WINDOW_LAYERS", "sliding_window": "SLIDING_WINDOW"}


def resume_mismatches(meta: dict, dcfg, fingerprint: dict) -> list[str]:
    """What a checkpoint was written for that this run would change: the drafter's shape (by setting) and the target
    (by fingerprint). -> one line per difference, naming the setting and both values."""
    errs = []
    old = meta.get("drafter") or {}
    shaped_by = SHAPED_BY | {key: name for a in ARCHS.values() for name, key in a.knobs.items()}
    for name, new in dcfg.__dict__.items():
        if name in old and old[name] != new:
            setting = shaped_by.get(name, f"TARGET (its config's {name})")
            errs.append(f"{setting}: the checkpoint has {name}={old[name]}, this run {new}")
    was = meta.get("target")
    if was and (was["config_sha256"], was["weights_sha256"]) != (fingerprint["config_sha256"],
                                                                 fingerprint["weights_sha256"]):
        what = "config and weights" if was["config_sha256"] != fingerprint["config_sha256"] else "weights"
        errs.append(f"TARGET: the checkpoint was trained on {was['path']} (config {was['config_sha256'][:12]}, weights "
                    f"{was['weights_sha256'][:12]}), this run's {fingerprint['path']} has other {what} (config "
                    f"{fingerprint['config_sha256'][:12]}, weights {fingerprint['weights_sha256'][:12]})")
    return errs


@dataclass
class ResumePoint:
    start_g: int = 0                 # the first micro-batch this run trains on
    step: int = 0                    # optimizer steps already done
    planned_g: int | None = None     # the LR schedule's length; None = plan it afresh
    notes: list = field(default_factory=list)   # lines for the master's log, in order
    error: str | None = None         # why this run must not continue (the data changed)


def resume_point(meta: dict | None, data, cfg) -> ResumePoint:
    """Where a run continues: the checkpoint's next micro-batch and LR schedule, moved to the same fraction of the
    data when the batching or (with cfg.ALLOW_DATA_CHANGE) the dataset changed. meta: the checkpoint's meta.json
    or None (a fresh run); data: the run's data.loader.Data; cfg: the run's settings (trainer.settings.Settings: EPOCHS,
    MAX_STEPS, ALLOW_DATA_CHANGE). Pure: reads nothing else, logs nothing."""
    if not meta:
        return ResumePoint()
    rp = ResumePoint(start_g=meta["next_g"], step=meta["step"])
    old, nb = meta["data"], data.plan.num_batches
    # the schedule's length stays the checkpoint's unless what defines it changed
    if (meta["config"].get("EPOCHS"), meta["config"].get("MAX_STEPS")) == (cfg.EPOCHS, cfg.MAX_STEPS):
        rp.planned_g = meta.get("planned_g")
    else:
        rp.notes.append("NOTE: EPOCHS/MAX_STEPS changed since the checkpoint: the LR schedule is re-planned")
    if old["content_hash"] == data.content_hash and old["num_batches"] != nb:
        # same data, other TOKEN_BUDGET / MAX_BATCH_SIZE: micro-batch numbers mean other batches now
        rp.start_g, rp.planned_g = round(rp.start_g / old["num_batches"] * nb), None
        rp.notes.append(f"NOTE: batching changed since the checkpoint ({old['num_batches']} -> {nb} micro-batches/"
                        f"epoch): continuing at the same fraction of the data (micro-batch {rp.start_g}), LR schedule "
                        f"re-planned")
    elif old["content_hash"] != data.content_hash:
        what = (f"dataset changed since the checkpoint: it had {old['rows']} rows / {old['num_batches']} micro-batches "
                f"(hash {old['content_hash'][:12]}), now {data.num_rows} / {nb} (hash {data.content_hash[:12]})")
        if not cfg.ALLOW_DATA_CHANGE:
            rp.error = (what + ". Set --ALLOW_DATA_CHANGE=True to continue on the new data (the LR schedule is "
                               "re-planned), or restore the old dataset")
            return rp
        rp.start_g, rp.planned_g = round(rp.start_g / max(1, old["num_batches"]) * nb), None   # same fraction
        rp.notes.append(f"WARNING: {what}; ALLOW_DATA_CHANGE: continuing at micro-batch {rp.start_g}, re-planned LR")
    return rp


def environment_notes(meta: dict, split: list[int], start_g: int) -> list[str]:
    """What differs between the checkpoint's environment and split and this run's: log lines."""
    ck_env, env = meta.get("env", {}), environment()
    notes = [f"WARNING: {k} version differs from the checkpoint's: {ck_env.get(k)} -> {env.get(k)}"
             for k in ("torch", "cuda", "transformers") if ck_env.get(k) != env.get(k)]
    if meta.get("split") != split:
        notes.append(f"NOTE: checkpoint split {meta.get('split')} -> now {split[0]} targets : {split[1]} drafters; "
                     f"continuing from the same data position (micro-batch {start_g})")
    return notes


def write_run_info(out_dir, config, world, split, data, dcfg, fingerprint, resume_path):
    """OUT_DIR/run.json: what reproduces the run (settings, environment, split, data, drafter, target)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    run_info = {"config": config, "env": environment(), "world": world, "split": split,
                "drafter": dcfg.__dict__, "data": {"rows": data.num_rows, "trainable": len(data.rows),
                                                   "dropped": data.dropped, "content_hash": data.content_hash,
                                                   "num_batches": data.plan.num_batches},
                "target": fingerprint, "resumed_from": str(resume_path) if resume_path else None, "time": time.time()}
    (out_dir / "run.json").write_text(json.dumps(run_info, indent=1, default=str))


def whole_drafter(dcfg, state, device, cls=Drafter) -> Drafter:
    """A sharded drafter's gathered state as one plain drafter of class cls (model/drafters.py ARCHS) on `device`,
    for the master's evaluation (the FSDP2 module's forward is a collective of every drafter rank)."""
    with torch.device("meta"):
        drafter = cls(dcfg)
    drafter.load_state_dict(state, assign=True)
    return drafter.to(device)
