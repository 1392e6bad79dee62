"""fedsd/ is the algorithm library and imports nothing of Flower (the brief's layering)."""
import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "fedsd"


def test_library_imports_nothing_of_flower():
    offenders = []
    for path in LIBRARY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names
                          if n.split(".")[0] in ("flwr", "flwr_datasets", "ray", "clients", "server", "simulations")]
    assert offenders == []
