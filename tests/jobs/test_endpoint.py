"""The server path end to end: data.synthesize and data.regenerate with --endpoint, talking HTTP to the project's
real OpenAI-compatible server (tools/serve_openai.py, a process on 127.0.0.1) on a tiny chat model. A SIGKILL of
the tool mid-run and a rerun give every id once; a wrong --served-model stops before any row with exit status 2;
a server that is not there stops with a clear message; two servers share a run, and when one dies the other
finishes it. One server per module (a second only where two are needed): each is a process loading torch."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data import openai_client as oc
from data import regenerate as regen
from data import synthesize as syn
from server import dead_url, serving, tiny_chat_model

pytestmark = pytest.mark.job
ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"
EOS = 151645          # <|im_end|>: the chat model's end of turn
EOS_BOOST = 2.5       # the end-of-turn logit's lead (x the normed hidden's first dim): a turn ends after ~5 tokens
MIX = ROOT / "data" / "default" / "train_prompts.jsonl"


def chatty_model(out: Path) -> Path:
    """tests/helpers/server.py's tiny Qwen3 chat model made to end its turns: the decoder layer's output projections are
    zeroed (the next token depends on the current one only) and every embedding row (tied: also the output row) gets
    a large first coordinate, the end-of-turn row a larger one, so the normed hidden state always points toward it.
    Sampled at temperature 1 it writes a few random tokens and ends the turn, as a chat model does."""
    import torch
    from transformers import AutoModelForCausalLM
    tiny_chat_model(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight   # [V, 16]
        emb[:, 0] = 10.0
        emb[EOS, 0] += EOS_BOOST
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chatty_model(tmp_path_factory.mktemp("chatty"))


@pytest.fixture(scope="module")
def url(model_dir):
    with one_thread(), serving(model_dir, "--served-model", NAME) as u:
        yield u


@contextlib.contextmanager
def one_thread():
    """A server started inside runs torch on one thread: on two shared cores, its default thread count made a
    request six times slower."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(oc, "RETRY_BACKOFF_S", 0.05)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def by_id(path: Path) -> dict:
    rows = lines(path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"duplicate ids in {path}"
    return {r["id"]: r for r in rows}


def killed_at(cmd, out: Path, rows: int, timeout=240) -> None:
    """Run the tool `cmd` and SIGKILL it once `out` holds `rows` rows (it must still be running then)."""
    proc = subprocess.Popen([sys.executable, "-m", *map(str, cmd)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while len(lines(out)) < rows and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    running = proc.poll() is None
    proc.kill()
    err = proc.communicate()[1]
    assert running, f"the run ended before it could be killed (make it longer):\n{err[-2000:]}"


# ---------------------------------------------------------------------------------------------------------------
# data.synthesize

def synth_args(url, model_dir, out, num, *extra):
    return ["--endpoint", url, "--tokenizer", model_dir, "--num", num, "--out", out, "--seed", 3,
            "--temperature", 1.0, "--max-new-tokens", 12, "--prompt-tokens", 16, "--concurrency", 2,
            "--mix", MIX, "--mix-ratio", 0.25, *extra]


def test_synthesize_through_a_server_killed_and_resumed(tmp_path, url, model_dir):
    """A run SIGKILLed after a few rows and run again holds every id once, and (this server honours the API's
    seed, one request at a time) the same rows, rejections and stats as an uninterrupted run."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    killed_at(["data.synthesize", *synth_args(url, model_dir, a, 16)], a, 4)
    cut = by_id(a)
    assert 4 <= len(cut) < 16
    again = syn.main(synth_args(url, model_dir, a, 16))
    one = syn.main(synth_args(url, model_dir, b, 16))
    assert by_id(a) == by_id(b) and by_id(syn.rejected_path(a)) == by_id(syn.rejected_path(b))
    assert {k: v for k, v in by_id(a).items() if k in cut} == cut       # the rows before the kill stay as written
    for k in ("kept", "rejected", "candidates", "streams", "config"):
        assert again[k] == one[k], k
    assert one["kept"] == 16 and one["config"]["served_model"] == [NAME] and one["rejected"]["server_error"] == 0
    rows = by_id(b).values()
    assert sum(r["source"] != "self" for r in rows) == 4
    for r in rows:   # a self-written user turn, then the answer, as the local path writes them
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] and len(r["finish_reasons"]) == 1
        assert r["source"] != "self" or r["user_finish_reasons"] == ["stop"]
    assert one["runs"][-1]["endpoints"] == [oc.base_url(url)]


def test_synthesize_wrong_model_name_and_no_tokenizer(tmp_path, url, model_dir, capsys):
    out = tmp_path / "s.jsonl"
    with pytest.raises(SystemExit) as e:
        syn.main(synth_args(url, model_dir, out, 4, "--served-model", "default"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"does not serve a model named 'default'; it serves ['{NAME}']" in err and "--served-model" in err
    assert not lines(out) and not lines(syn.rejected_path(out))
    with pytest.raises(SystemExit) as e:
        syn.main(["--endpoint", url, "--num", 2, "--out", out])
    assert e.value.code == 2 and "--tokenizer DIR" in capsys.readouterr().err
    # a local tokenizer whose template is not the server's: the probe says so (the rows would not match)
    args = syn.parse_args([str(a) for a in synth_args(url, model_dir, out, 4)])
    tok = syn.load_tokenizer(model_dir)
    syn.connect(args, tok)
    assert "warning" not in capsys.readouterr().err
    tok.chat_template = ("{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
                         "{% if add_generation_prompt %}A:{% endif %}")
    syn.connect(args, tok)
    assert "renders a one-message chat to" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# data.regenerate

PROMPTS = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} squared?"}]
            + ([{"role": "assistant", "content": "old"}, {"role": "user", "content": "And cubed?"}] if i % 3 == 0
               else [])} for i in range(24)]


def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def regen_args(inp, out, *urls, extra=()):
    return [str(a) for a in ["--input", inp, "--output", out, "--endpoint", *urls, "--temperature", 1.0, "--seed", 5,
                             "--max-new-tokens", 12, "--concurrency", 1, "--retries", 2, *extra]]


def test_regenerate_through_a_server_killed_and_resumed(tmp_path, url):
    inp, a, b = prompts_file(tmp_path), tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    killed_at(["data.regenerate", *regen_args(inp, a, url)], a, 3)
    cut = by_id(a)
    assert 3 <= len(cut) < len(PROMPTS)
    counts = regen.main(regen_args(inp, a, url))
    assert counts["done_before"] == len(cut) and counts["failed"] == 0
    assert regen.main(regen_args(inp, b, url))["failed"] == 0
    assert by_id(a) == by_id(b) and set(by_id(a)) == {p["id"] for p in PROMPTS}   # seeded: the same answers
    row = by_id(b)["p3"]
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user", "assistant"]
    assert len(row["finish_reasons"]) == 2


def test_regenerate_wrong_model_name_stops_before_any_row(tmp_path, url, capsys):
    """The old failure: a name the server does not serve was retried like a network error and every row ended up
    in the errors file. Now: exit status 2 before any row, naming the served model; nothing recorded as failed."""
    inp, out = prompts_file(tmp_path), tmp_path / "r.jsonl"
    with pytest.raises(SystemExit) as e:
        regen.main(regen_args(inp, out, url, extra=["--served-model", "default"]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"it serves ['{NAME}']" in err and "--served-model" in err and oc.base_url(url) in err
    assert not lines(out) and not lines(Path(f"{out}.errors.jsonl"))


def test_regenerate_dead_server_is_named_and_nothing_is_lost(tmp_path, url, capsys):
    inp, out = prompts_file(tmp_path), tmp_path / "r.jsonl"
    regen.main(regen_args(inp, out, url, extra=["--limit", 2]))
    before = out.read_bytes()
    dead = dead_url()
    with pytest.raises(SystemExit, match=f"{dead}/v1 does not answer after 2 tries.*Start the server"):
        regen.main(regen_args(inp, out, dead))
    assert "retry 2/2" in capsys.readouterr().err
    assert out.read_bytes() == before and not lines(Path(f"{out}.errors.jsonl"))


def stop_server(name: str, timeout=60):
    """SIGTERM the tools.serve_openai process with `name` in its command line and wait until it has exited (tests/helpers/server.py's
    `serving` then finds it stopped, with its exit status 0)."""
    pid = next(int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and
               {b"tools.serve_openai", name.encode()} <= set(Path(d, "cmdline").read_bytes().split(b"\0")))
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"serve_openai ({name}, pid {pid}) did not stop within {timeout}s of SIGTERM")


def test_two_servers_share_a_run_and_one_dying_loses_nothing(tmp_path, url, model_dir):
    """Two server processes of one model (the second from another path to its folder, which names its process);
    the second stops mid-run: its request in flight goes to the first, the run ends with every row once, none
    failed."""
    inp, out = prompts_file(tmp_path), tmp_path / "r.jsonl"
    second = tmp_path / "second"
    second.symlink_to(model_dir)
    with one_thread(), serving(second, "--served-model", NAME) as other:
        proc = subprocess.Popen([sys.executable, "-m", "data.regenerate", *map(str, regen_args(inp, out, url, other))],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while len(lines(out)) < 6 and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        stop_server(str(second))
        err = proc.communicate(timeout=240)[1]
        assert proc.returncode == 0, err[-2000:]
    assert f"{oc.base_url(other)}: model '{NAME}'" in err and f"{oc.base_url(url)}: model '{NAME}'" in err
    assert f"{oc.base_url(other)} is down" in err and f"its requests go to {oc.base_url(url)}" in err
    assert set(by_id(out)) == {p["id"] for p in PROMPTS} and not lines(Path(f"{out}.errors.jsonl"))
