"""A function is a paragraph of the story; kept as a number, as ARCHITECTURE.md states it (under the import rule):
no function of the product code is over 100 lines, read from the source with ast. The product code is the programs
at the root and trainer/, model/, data/, tools/, bench/ (not tests/ or dev/); a function's length runs from its
`def` line to its last line, docstring and comments included, decorators not; methods and nested functions count on
their own, under their qualified names."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 100
PRODUCT = ("trainer", "model", "data", "tools", "bench")   # with the root's *.py


def product_files() -> list[Path]:
    return sorted([*REPO.glob("*.py"), *(p for d in PRODUCT for p in (REPO / d).rglob("*.py"))])


def function_lengths() -> dict[str, int]:
    """{"path:qualified.name": lines} of every function in the product code."""
    lengths = {}

    def visit(node, prefix: str, rel: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{rel}:{prefix}{child.name}"
                n = child.end_lineno - child.lineno + 1
                lengths[name] = max(lengths.get(name, 0), n)   # a name defined twice (if/else branches): the longer
                visit(child, f"{prefix}{child.name}.", rel)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", rel)
            else:
                visit(child, prefix, rel)

    for path in product_files():
        visit(ast.parse(path.read_text(), str(path)), "", path.relative_to(REPO).as_posix())
    return lengths


def test_the_walk_reads_every_product_folder():
    folders = {p.relative_to(REPO).parts[0] if p.parent != REPO else "." for p in product_files()}
    assert folders == {".", *PRODUCT}, folders
    assert len(function_lengths()) > 100


def test_no_product_function_is_over_100_lines():
    over = {name: n for name, n in function_lengths().items() if n > MAX_LINES}
    assert not over, (f"over {MAX_LINES} lines (split each into named helpers: a function is a paragraph of the "
                      "story): " + "; ".join(f"{name} ({n} lines)" for name, n in sorted(over.items())))
