"""fedsd: differentially private training with self-distillation (DP3SD, DPDSD) and baselines.

The algorithm library: data, models, losses, privacy accounting and the one DP training loop.
It imports nothing of Flower; `clients/` and `server/` adapt it to Flower.
"""
import os

# Importing fedsd changes nothing about the process (environment, allocator, logging):
# fedsd.runtime.tune_process() does, called by fedsd's entry points.

__version__ = "0.1.0"


def cache_root():
    """fedsd's on-disk cache, shared by its processes and runs (calibrated σ, the built conv
    kernel): FEDSD_CACHE_DIR, else ~/.cache/fedsd (XDG_CACHE_HOME respected)."""
    from pathlib import Path

    return Path(os.environ.get("FEDSD_CACHE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedsd")


def load_model(run_dir):
    """The model a finished run released in `run_dir`, with its weights and its input
    normalisation, ready for eval() (fedsd.results.load_model)."""
    from .results import load_model as load

    return load(run_dir)
