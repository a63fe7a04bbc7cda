"""ARCHITECTURE.md's import rule, read from the source: every file imports only its own tier or lower ones, and the
project's modules import each other without a circle."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# ARCHITECTURE.md's picture, top to bottom
TIERS = [
    ("train_dflash", "eval_dflash", "bench", "tools"),
    ("settings", "status"),
    ("step", "pipe", "checkpoint", "planner"),
    ("optim",),
    ("data",),
    ("model",),
]
TIER = {name: len(TIERS) - i for i, names in enumerate(TIERS) for name in names}


def project_modules() -> dict[str, Path]:
    files = list(REPO.glob("*.py")) + [p for d in ("model", "data", "bench", "tools") for p in (REPO / d).glob("*.py")]
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
    assert {"train_dflash", "settings", "step", "optim", "model.engine", "data.synthesize"} <= set(modules)
    upward = []
    for name, path in modules.items():
        tier = TIER[name.split(".")[0]]
        upward += [f"{name} (tier {tier}) imports {dep} (tier {TIER[dep.split('.')[0]]})"
                   for dep in sorted(imports_of(path, modules)) if TIER[dep.split(".")[0]] > tier]
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
