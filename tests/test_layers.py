"""The layering the brief asks for: fedsd/ is the algorithm library and imports nothing of
Flower; clients/ and server/ are Flower adapters that share only task/ (Flower's task module)
and never import each other."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_packages(folder: str) -> dict[str, set[str]]:
    """Every top-level package a folder's modules import, by module file."""
    found = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[path.name] = names
    return found


@pytest.mark.parametrize("folder,forbidden", [
    ("fedsd", {"flwr", "flwr_datasets", "ray", "task", "clients", "server", "simulations"}),
    ("task", {"clients", "server", "simulations"}),
    ("clients", {"server", "simulations"}),
    ("server", {"clients", "simulations"}),
])
def test_layer_imports_nothing_it_must_not(folder, forbidden):
    offenders = {f"{name}: {sorted(names & forbidden)}" for name, names in imported_packages(folder).items()
                 if names & forbidden}
    assert offenders == set()
