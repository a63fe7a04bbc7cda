"""ARCHITECTURE.md's import rule, read from the source: every file imports only its own tier or lower ones, and the
project's modules import each other without a circle."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# ARCHITECTURE.md's picture, top to bottom
TIERS = [
    ("train_dflash", "eval_dflash", "bench", "tools"),
    ("trainer.phases",),
    ("trainer.settings", "trainer.status"),
    ("trainer.micro_batch", "trainer.pipe", "trainer.checkpoint", "trainer.planner", "trainer.watchdog",
     "trainer.evaluate"),
    ("trainer.optim",),
    ("data",),
    ("model",),
]
TIER = {name: len(TIERS) - i for i, names in enumerate(TIERS) for name in names}
PROGRAMS = {"train_dflash.py", "eval_dflash.py"}   # the root holds the programs; their library is trainer/ and model/


def tier(module: str) -> int:
    """A module's tier: its own entry (trainer.pipe), else its folder's (model.drafter -> model)."""
    return TIER[module] if module in TIER else TIER[module.split(".")[0]]


def project_modules() -> dict[str, Path]:
    files = list(REPO.glob("*.py")) + [p for d in ("trainer", "model", "data", "bench", "tools")
                                        for p in (REPO / d).glob("*.py")]
    files = [p for p in files if p != REPO / "trainer" / "__init__.py"]   # a docstring: `from trainer import x` is x
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def imports_of(path: Path, modules) -> set[str]:
    """The project modules a file imports, at any depth of the file (imports inside functions count too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def test_every_file_imports_only_its_tier_or_lower():
    modules = project_modules()
    assert {"train_dflash", "trainer.settings", "trainer.micro_batch", "trainer.optim", "model.engine",
            "data.synthesize"} <= set(modules)
    upward = []
    for name, path in modules.items():
        t = tier(name)
        upward += [f"{name} (tier {t}) imports {dep} (tier {tier(dep)})"
                   for dep in sorted(imports_of(path, modules)) if tier(dep) > t]
    assert not upward, "imports against ARCHITECTURE.md's import rule:\n" + "\n".join(upward)


def test_the_project_imports_without_a_circle():
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    done, path = set(), []

    def visit(n):
        if n in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
        if n in done:
            return
        path.append(n)
        for m in sorted(graph[n]):
            visit(m)
        path.pop()
        done.add(n)

    for n in sorted(graph):
        visit(n)


def test_the_root_holds_only_the_programs():
    """`ls` shows where to start: the two programs are the root's only Python files."""
    assert {p.name for p in REPO.glob("*.py")} == PROGRAMS


def test_test_files_have_unique_names_across_tiers():
    """pytest imports test files by their base name (no packages under tests/): two tiers holding test_x.py make one
    of them fail to collect, and which one depends on the xdist worker that gets both."""
    from collections import Counter
    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
