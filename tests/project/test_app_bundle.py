"""What `flwr run .` ships (Flower's app bundle, built by Flower's own builder from
pyproject.toml's fab-include and fab-exclude): the app and the library, everything the ServerApp,
the ClientApp and the owner's warm worker import, and nothing else of the package."""
import io
import zipfile
from pathlib import Path

from tests.project.test_architecture import import_graph

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = ("cli", "simulation", "deployment", "benchmarks")
ENTRY_POINTS = ("fedsd.app.server.server_app", "fedsd.app.client.client_app", "fedsd.app.client.owner_service")


def bundled_modules() -> set[str]:
    from flwr.cli.build import build_fab_from_disk

    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist()
    modules = {n.removesuffix("/__init__.py").removesuffix(".py").replace("/", ".") for n in names
               if n.startswith("fedsd/") and n.endswith(".py")}
    assert not [n for n in names if not n.startswith("fedsd/") and n not in ("pyproject.toml", ".info/CONTENT")], names
    return modules


def imported_from(entry_points, graph) -> set[str]:
    """Every project module the entry points import, at module level or in a function, transitively."""
    seen, todo = set(), list(entry_points)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += list(graph.get(module, {}))
    return seen


def test_the_bundle_holds_what_the_apps_import_and_none_of_the_commands_or_studies():
    bundled, graph = bundled_modules(), import_graph()
    needed = imported_from(ENTRY_POINTS, graph)
    assert len(needed) > 40 and needed <= bundled, sorted(needed - bundled)
    assert not [m for m in bundled if m.split(".")[1:2] and m.split(".")[1] in LEFT_OUT], sorted(bundled)
    library_and_app = {m for m in graph if m.startswith("fedsd.") and m.split(".")[1] not in LEFT_OUT}
    assert bundled == library_and_app | {"fedsd"}, sorted(bundled ^ (library_and_app | {"fedsd"}))
    # the check can fail: a module of the app importing the command line would need what is left out
    planted = {**graph, "fedsd.app.client.client_app": {**graph["fedsd.app.client.client_app"], "fedsd.cli.main": 1}}
    assert not imported_from(ENTRY_POINTS, planted) <= bundled
