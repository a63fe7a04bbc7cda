"""Helpers for tests that run the real trainer: a tiny target, a learnable prepared dataset, torchrun on a free port.

The tiny target has no tokenizer, so runs pass MASK_TOKEN_ID explicitly (the last row of its vocabulary).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96
MASK_ID = VOCAB - 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_target(out: Path, vocab=VOCAB, layers=4, seed=0, hidden=32, head_dim=8) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // head_dim, num_key_value_heads=hidden // head_dim // 2,
                      head_dim=head_dim, max_position_embeddings=1024,
                      tie_word_embeddings=True, initializer_range=0.1)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def make_dataset(out: Path, n=48, min_len=24, max_len=64, seed=0, vocab=VOCAB) -> Path:
    """Learnable rows: a user prefix of random tokens, then an 'assistant' part made of runs of 8 equal tokens
    (ids below vocab - 1, so MASK never appears): most slots of a block repeat the anchor, which a tiny drafter
    learns in a few dozen steps."""
    import random
    import pytest
    # the trainer reads prepared data with `datasets`; a machine without it (the H200 image) skips these tests
    Dataset = pytest.importorskip("datasets", reason="the trainer's data needs the `datasets` package").Dataset
    rng = random.Random(seed)
    V = vocab - 1
    ids, masks = [], []
    for _ in range(n):
        L = rng.randint(min_len, max_len)
        p = rng.randint(2, 8)
        row = [rng.randrange(V) for _ in range(p)]
        while len(row) < L:
            row.extend([rng.randrange(V)] * 8)
        row = row[:L]
        ids.append(row)
        masks.append([0] * p + [1] * (L - p))
    Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(out))
    return out


def padded(lengths, input_ids):
    """A packed micro-batch (lengths [b], input_ids [T]) back to the padded [b, S] ids and attention mask the target
    ranks run."""
    import torch
    S, b = int(lengths.max()), len(lengths)
    ids = torch.zeros(b, S, dtype=torch.long)
    attn = torch.zeros(b, S, dtype=torch.long)
    o = 0
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n], attn[i, :n] = input_ids[o:o + n], 1
        o += n
    return ids, attn


def cpu_rowwise_scaled_mm_missing() -> str | None:
    """Why this torch build's CPU torch._scaled_mm cannot take per-row scales (HeadFP8's GEMMs on a CPU), or None
    where it can: torch 2.13's CPU build can, 2.11's (the H200 image) has per-tensor scales only."""
    import torch
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return f"this torch build has no CPU torch._scaled_mm with per-row scales ({str(e)[:120]})"
    return None


def base_args(target, data, out, **kw) -> list[str]:
    cfg = dict(TARGET=target, DATA=data, OUT_DIR=out, MASK_TOKEN_ID=MASK_ID, NUM_DRAFT_LAYERS=1, BLOCK_SIZE=4,
               GAMMA=4.0, MAX_ANCHORS=32, TOKEN_BUDGET=256, MAX_BATCH_SIZE=8, LR=3e-3, WARMUP_RATIO=0.1, EPOCHS=1,
               LOG_EVERY=1, SAVE_EVERY=1000, HEARTBEAT_TIMEOUT=20, STALL_TIMEOUT=60, RESUME="auto")
    cfg.update(kw)
    return [f"--{k}={v}" for k, v in cfg.items()]


def torchrun_cmd(nproc, args, port=None, extra=()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port or free_port()}",
            *extra, str(REPO / "train_dflash.py"), *args]


def env():
    e = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    # the repository and these helpers (a test file run as a torchrun script imports runs)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "helpers"), e.get("PYTHONPATH", "")])
    return e


def run(nproc, args, timeout=240, extra=()) -> subprocess.CompletedProcess:
    cmd = torchrun_cmd(nproc, args, extra=extra) if nproc > 1 else [sys.executable, str(REPO / "train_dflash.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def start(nproc, args, extra=()) -> subprocess.Popen:
    cmd = torchrun_cmd(nproc, args, extra=extra)
    return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """r, asserted to have exited 0 (the end of its output in the message otherwise)."""
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    return r


def metrics(out) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(out)}


def wait_for(proc, pattern, timeout, lines) -> bool:
    """Read proc's output into `lines` until a line contains `pattern` (True) or timeout/exit (False).

    Reads the pipe's file descriptor itself: select() on it followed by the text wrapper's readline() lost lines (a
    readline can pull several lines into the wrapper's buffer; the fd then looks empty and select() waits on
    output that already came, until more arrives). What was read past the matching line waits in proc._partial for
    the next call, or for finish(). Line ends as in text mode: \\r\\n and \\r end a line too (progress bars)."""
    import selectors
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    end = time.time() + timeout
    try:
        while True:
            while b"\n" in getattr(proc, "_partial", b""):        # whole lines already read come first
                raw, proc._partial = proc._partial.split(b"\n", 1)
                lines.append(raw.decode(errors="replace") + "\n")
                if pattern in lines[-1]:
                    return True
            if time.time() >= end:
                return False
            if not sel.select(timeout=min(0.5, max(0.0, end - time.time()))):
                if proc.poll() is not None and not sel.select(timeout=0):
                    return False
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return False
            proc._partial = (getattr(proc, "_partial", b"") + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    finally:
        sel.close()


def rank_pids(lines) -> dict[int, int]:
    """{rank: pid} from the start-up identity lines '[rank R role] rank R/W role on ... pid P'."""
    pids = {}
    for l in lines:
        if "] rank " in l and " pid " in l:
            r = int(l.split("] rank ")[1].split("/")[0])
            pids[r] = int(l.rsplit(" pid ", 1)[1].split()[0])
    return pids


def finish(proc, timeout) -> tuple[int | None, str, float]:
    """Wait for exit; returns (returncode or None if it had to be killed, rest of output, seconds waited)."""
    t = time.time()
    head = getattr(proc, "_partial", b"").decode(errors="replace")   # what wait_for read past its last line
    proc._partial = b""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, head + out, time.time() - t
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, head + out, time.time() - t


def stop_at_step_3_then_resume(nproc, args, out, ref) -> tuple[int | None, str]:
    """SIGTERM a run of `args` (writing to `out`) once it logged step 3, as Ctrl-C or a scheduler's preemption does;
    resume it in the same folder: every step's loss must equal `ref`'s ({step: loss} of the uninterrupted run).
    -> (the stopped torchrun's return code, its log)."""
    proc = start(nproc, args)
    lines = []
    assert wait_for(proc, "step=3/", 120, lines), "".join(lines)
    os.killpg(proc.pid, signal.SIGTERM)
    code, rest, _ = finish(proc, 90)
    log = "".join(lines) + rest
    assert "stopped at step" in log, log
    stopped = max(losses(out))
    assert 3 <= stopped < max(ref)
    r = ok(run(nproc, args))
    assert f"RESUMING from step {stopped}" in r.stdout
    got = losses(out)
    assert sorted(got) == sorted(ref)
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7), f"step {s}: {got[s]} != {ref[s]}"
    return code, log


def trainer_cfg(**kw):
    """train_dflash's constants as the trainer would pass them (a trainer.settings.Settings), plus overrides."""
    import train_dflash as td
    return td.defaults(**kw)
