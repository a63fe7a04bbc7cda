"""The commands in README.md, ARCHITECTURE.md and docs/*.md name only flags their program has: every `--flag` of a
`python -m tool`, `eval_dflash.py`, `train_dflash.py` or `launch.sh` line of a shell block is in that program's
--help, run as a process (train flags `--NAME=VALUE` among the settings it lists). Programs outside this repo
(SGLang, vLLM, pip, pytest, torchrun's own flags) are not checked."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULES = ("data.", "tools.", "bench.", "model.")                      # python -m these
SCRIPTS = ("eval_dflash.py", "train_dflash.py", "launch.sh")            # launch.sh passes its flags to the trainer


def commands(text):
    """(program, its arguments) of every command of this repo in the page's shell blocks."""
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for seg in re.split(r"&&|\|\||;|\|", line.split(" #")[0]):
                try:
                    toks = shlex.split(seg)
                except ValueError:
                    continue
                for i, t in enumerate(toks):
                    if t == "-m" and i + 1 < len(toks) and toks[i + 1].startswith(MODULES):
                        yield toks[i + 1], toks[i + 2:]
                        break
                    if t.endswith(SCRIPTS):
                        yield "train_dflash.py" if t.endswith("launch.sh") else t.rsplit("/", 1)[-1], toks[i + 1:]
                        break


def defined_flags(help_text: str) -> set[str]:
    """The flags a --help defines: those opening a line of its option list (argparse's `  -h, --help`, `  --out OUT`;
    train_dflash.py's `  --NAME=default`), not a flag a help text only mentions in its prose."""
    return set(re.findall(r"^ {2}(?:-[A-Za-z], )?(--[A-Za-z][A-Za-z0-9_-]*)", help_text, re.M))


def test_defined_flags_reads_the_option_column_only():
    text = ("usage: x [-h] [--out OUT]\n\noptions:\n  -h, --help  show this\n  --out OUT   where (see --mode)\n"
            "  --NAME=1                         [>= 1] one (python -m tools.y --logdir D)\n")
    assert defined_flags(text) == {"--help", "--out", "--NAME"}


def test_the_pages_name_only_flags_their_programs_have():
    found, helps, bad = 0, {}, []
    for page in PAGES:
        for prog, args in commands(page.read_text()):
            if prog not in helps:
                cmd = [sys.executable] + ([prog] if prog.endswith(".py") else ["-m", prog]) + ["--help"]
                run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
                assert run.returncode == 0, (prog, run.stderr[-2000:])
                helps[prog] = defined_flags(run.stdout)
            for a in args:
                flag = re.match(r"--[A-Za-z][A-Za-z0-9_-]*", a)
                if flag:
                    found += 1
                    if flag.group() not in helps[prog]:
                        bad.append(f"{page.name}: {prog} {flag.group()}")
    assert found > 50 and {"train_dflash.py", "eval_dflash.py", "data.synthesize"} <= set(helps), (found, helps.keys())
    assert not bad, "flags the pages name that their program does not have:\n" + "\n".join(bad)
