"""train_dflash.py as a newcomer reads it, read from its source with ast: the constants, then main, the loop and the
drafter step in the order they run, the loop in the file's first half; and below the constants every function reads
the run's settings from its frozen `c`, never a constant as a global (the constants hold the defaults until
`configure` applies the overrides; `c` is what the run uses)."""
import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "train_dflash.py"
# the functions that make the settings from the constants: the only ones that may read them as globals
CONFIGURATION = {"constants", "defaults", "configure", "check_config"}


def parsed(source: str = None):
    text = SOURCE.read_text() if source is None else source
    tree = ast.parse(text)
    constants = {n.targets[0].id for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                 and isinstance(n.targets[0], ast.Name) and n.targets[0].id.isupper()}
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return text, constants, functions


def globals_read(source: str = None) -> dict[str, list[str]]:
    """{function: the constants it reads as globals} for every top-level function outside CONFIGURATION."""
    _, constants, functions = parsed(source)
    out = {}
    for name, node in functions.items():
        used = sorted({x.id for x in ast.walk(node) if isinstance(x, ast.Name) and x.id in constants
                       and name not in CONFIGURATION and x.id != "CONFIG_KEYS"})
        if used:
            out[name] = used
    return out


def test_no_function_reads_a_constant_as_a_global():
    bad = globals_read()
    assert not bad, (f"these read train_dflash.py's constants as globals, which hold the defaults before the "
                     f"overrides: read c.NAME (run.c in the loop) instead: {bad}")


def test_the_check_finds_a_global_read():
    planted = "LR = 1.0\n\ndef train(run):\n    return LR * 2\n\ndef configure(argv):\n    return LR\n"
    assert globals_read(planted) == {"train": ["LR"]}


def test_main_then_the_loop_then_the_drafter_step_in_the_first_half():
    text, constants, functions = parsed()
    order = [functions[n].lineno for n in ("main", "train", "drafter_step", "optimizer_step")]
    assert order == sorted(order), f"main, train, drafter_step, optimizer_step should follow each other: {order}"
    last_constant = max(n.lineno for n in ast.parse(text).body if isinstance(n, ast.Assign)
                        and isinstance(n.targets[0], ast.Name) and n.targets[0].id in constants)
    assert last_constant < functions["main"].lineno, "the constants come first"
    lines = len(text.splitlines())
    assert functions["train"].lineno <= lines / 2 and lines <= 700, (functions["train"].lineno, lines)
