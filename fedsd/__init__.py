"""fedsd: differentially private training with self-distillation (DP3SD, DPDSD) and baselines.

The algorithm library: data, models, losses, privacy accounting and the one DP training loop.
It imports nothing of Flower; `clients/` and `server/` adapt it to Flower.
"""
from .cache import cache_root  # noqa: F401  (fedsd.cache_root(): the on-disk cache)

# Importing fedsd changes nothing about the process (environment, allocator, logging):
# fedsd.runtime.tune_process() does, called by fedsd's entry points.

__version__ = "0.1.0"


def load_model(run_dir):
    """The model a finished run released in `run_dir`, with its weights and its input
    normalisation, ready for eval() (fedsd.released.load_model). Imported when called, so that
    `import fedsd` stays light (torch and the models load only for a run's model)."""
    from .released import load_model as load

    return load(run_dir)
