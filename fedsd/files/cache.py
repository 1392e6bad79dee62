"""fedsd's on-disk cache, shared by its processes and runs (calibrated σ, measured routes, the
built conv kernel, prepared custom data, ScatterNet features)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """FEDSD_CACHE_DIR, else ~/.cache/fedsd (XDG_CACHE_HOME respected)."""
    return Path(os.environ.get("FEDSD_CACHE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedsd")
