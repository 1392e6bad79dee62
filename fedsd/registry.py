"""What installed packages add to fedsd: methods (entry-point group `fedsd.methods`) and
clipping routes (`fedsd.clippers`), the way pytest and Flower-style tools take plugins."""
from __future__ import annotations

import warnings


def load_entry_points(group: str, register) -> None:
    """Register what installed packages offer under the entry-point group `group`: each entry is
    a class (passed to `register`) or a module that registers its own on import. One that fails
    to load is said once, and the rest go on."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=group):
        try:
            loaded = ep.load()
            if isinstance(loaded, type):
                register(loaded)
        except Exception as e:  # noqa: BLE001  (another package's code: name it, do not stop fedsd)
            warnings.warn(f"fedsd: the {group} entry point {ep.name} = {ep.value} could not be loaded: "
                          f"{type(e).__name__}: {e}", stacklevel=2)
