"""data/regenerate.py as a real process against an OpenAI-shaped stub (tests/helpers/stub_server.py): stopped by
Ctrl-C or SIGTERM it names the rows it kept and the command that goes on, which writes the rest."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from data import regenerate as regen
from runs import REPO
from stub_server import stubs  # noqa: F401 (a fixture)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_regenerate_stopped_by_ctrl_c_or_sigterm_says_how_to_go_on(stubs, tmp_path, sig):
    """A real process stopped part-way by Ctrl-C (SIGINT) or SIGTERM ends with exit status 1 and no traceback,
    naming the rows it kept and the command that goes on; that command writes the rest, every id once."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                               for i in range(8)))
    s, proc = stubs(), []

    def answer(prompt, body):
        if prompt == "q3":
            proc[0].send_signal(getattr(signal, sig))
        return f"a:{prompt}"
    s.answer = answer
    cmd = [sys.executable, "-m", "data.regenerate", "--input", str(prompts), "--output", str(out), "--endpoint",
           s.url, "--concurrency", "1"]
    proc.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    err = proc[0].communicate(timeout=120)[1]
    assert proc[0].returncode == 1 and "Traceback" not in err, err
    kept = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert 3 <= len(kept) < 8 and not Path(f"{out}.errors.jsonl").read_text()
    by = "Ctrl-C" if sig == "SIGINT" else "SIGTERM"
    assert f"stopped by {by}: {len(kept)} rows written to {out} by this run stay" in err
    again = err.split("Run the same command again to go on:\n", 1)[1].strip()
    assert again.endswith(" -m data.regenerate " + " ".join(cmd[3:]))
    s.answer = None
    assert regen.main(cmd[3:])["done_before"] == len(kept)
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [f"p{i}" for i in range(8)]
