"""fedsd: differentially private training with self-distillation (DP3SD, DPDSD) and baselines.

One package, in rooms (docs/architecture.md). The library: `data/`, `models/`, `methods/`,
`clipping/`, `privacy/`, `secure/`, `training/`, `settings/`, `files/`; it imports nothing of
Flower. The Flower app: `app/` (`app/client/`, `app/server/` and what both share). The command
line: `cli/` (one module a command, which only parses and calls), the simulation engine
`simulation/`, `deployment/` and `benchmarks/`. This repository's studies (its result tables) are
outside the package, in the checkout's `simulations/`.
"""
from fedsd.files.cache import cache_root  # noqa: F401  (fedsd.cache_root(): the on-disk cache)

# Importing fedsd changes nothing about the process (environment, allocator, logging):
# fedsd.runtime.tune_process() does, called by fedsd's entry points.

__version__ = "0.2.0"


def load_model(run_dir):
    """The model a finished run released in `run_dir`, with its weights and its input
    normalisation, ready for eval() (fedsd.models.released.load_model). Imported when called, so that
    `import fedsd` stays light (torch and the models load only for a run's model)."""
    from fedsd.models.released import load_model as load

    return load(run_dir)
