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

REPO = Path(__file__).resolve().parents[1]
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
    from datasets import Dataset
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
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
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
    """Read proc's output into `lines` until a line contains `pattern` (True) or timeout/exit (False)."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    end = time.time() + timeout
    while time.time() < end:
        if not sel.select(timeout=0.5):
            if proc.poll() is not None:
                return False
            continue
        line = proc.stdout.readline()
        if not line:
            return False
        lines.append(line)
        if pattern in line:
            return True
    return False


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
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.time() - t
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.time() - t
