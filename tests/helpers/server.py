"""Test helpers for the server path: a tiny chat model with the real Qwen3 tokenizer and chat template,
tools.serve_openai started as a real process on 127.0.0.1 (`serving`), and JSON over HTTP (`get`, `post`)."""
import contextlib
import json
import lzma
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QWEN3_TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_tokenizer"
READY_TIMEOUT_S = 180     # loading torch + transformers on 2 busy cores


def tiny_chat_model(out: Path) -> Path:
    """A random 1-layer Qwen3 (hidden 16, the tokenizer's 151,936-row vocab, tied) with the Qwen3 tokenizer and chat
    template (tests/fixtures/qwen3_tokenizer) and Qwen3's eos ids, saved to `out`. Large initial weights give clear
    argmax margins, so greedy decoding does not hinge on rounding."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, initializer_range=0.5)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_bytes(lzma.open(QWEN3_TOKENIZER / "tokenizer.json.xz").read())
    shutil.copy(QWEN3_TOKENIZER / "tokenizer_config.json", out)
    return out


@contextlib.contextmanager
def serving(model, *args, timeout=READY_TIMEOUT_S):
    """Start `python -m tools.serve_openai --model MODEL --host 127.0.0.1 --port 0 ARGS`, wait for its ready line,
    yield its base URL (http://127.0.0.1:PORT); then SIGTERM it and check that it stopped cleanly (exit 0)."""
    err = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", "tools.serve_openai", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
           *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def stderr_tail():
        err.seek(0)
        return err.read().decode(errors="replace")[-3000:]
    try:
        deadline, url = time.time() + timeout, None
        while url is None:
            if not select.select([proc.stdout], [], [], max(0.0, deadline - time.time()))[0]:
                raise TimeoutError(f"serve_openai printed no ready line in {timeout}s:\n{stderr_tail()}")
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"serve_openai exited ({proc.wait()}) before serving:\n{stderr_tail()}")
            if line.startswith("serving "):
                url = line.rsplit(" on ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        assert rc == 0, f"serve_openai exited {rc} on SIGTERM:\n{stderr_tail()}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        err.close()


def _call(req, timeout):
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url, path, timeout=60):
    """-> (HTTP status, JSON body)."""
    return _call(urllib.request.Request(url + path), timeout)


def post(url, path, body, timeout=300):
    """body: a dict (sent as JSON) or raw bytes -> (HTTP status, JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _call(urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"}), timeout)


def dead_url():
    """A port nothing listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"
