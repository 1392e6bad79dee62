"""The server's per-round checkpoint: `<out>/checkpoint.pt`, one file replaced atomically after
every completed round, so a server stopped at any moment can go on with `--resume <out>`.

It holds what the next round needs and what the result must report: the round number, the
global model (every group), the strategy's own state (FedAdam's moments, the sampling RNG),
the per-round log, each client's ε so far, and the experiment id under which every client
keeps its privacy state on its own disk (so a resumed run finds it; a fresh run does not).
The settings travel with it: a resumed run uses the checkpoint's, never new ones.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from fedsd.config import ConfigError, TrainConfig
from fedsd.federation import FedOptions, from_flat, to_flat
from fedsd.results import save_atomic

from .strategy import inner_strategies

CHECKPOINT = "checkpoint.pt"
# Keys of the flat settings that name places or this launch, not the training itself.
NOT_SETTINGS = ("out-dir", "resume-dir", "experiment-id")
# Attributes of Flower strategies that change from round to round (FedOpt family: m_t, v_t).
STRATEGY_STATE = ("m_t", "v_t")


def settings(cfg: TrainConfig, fed: FedOptions) -> dict:
    return {k: v for k, v in to_flat(cfg, fed).items() if k not in NOT_SETTINGS}


def path_in(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT


def load(run_dir: str | Path) -> dict:
    """The checkpoint in `run_dir`, or ConfigError naming --resume when there is none."""
    path = path_in(run_dir)
    if not path.is_file():
        raise ConfigError(f"--resume: no {CHECKPOINT} in {run_dir} (a run writes one after each completed round)")
    return torch.load(path, weights_only=False)


def resumed_settings(run_dir: str | Path, saved: dict | None = None) -> tuple[TrainConfig, FedOptions]:
    """The settings of the run in `run_dir` (its checkpoint `saved`, if already loaded), set to
    resume it there."""
    cfg, fed = from_flat((saved or load(run_dir))["settings"])
    fed.resume_dir = fed.out_dir = str(Path(run_dir).absolute())
    return cfg, fed


def strategy_state(strategy) -> dict:
    state = {"python_random": random.getstate()}  # Flower samples nodes with `random`
    for depth, s in enumerate(inner_strategies(strategy)):
        for name in STRATEGY_STATE:
            if getattr(s, name, None) is not None:
                state[f"{depth}.{name}"] = getattr(s, name)
    return state


def restore_strategy_state(strategy, state: dict) -> None:
    random.setstate(state["python_random"])
    for depth, s in enumerate(inner_strategies(strategy)):
        for name in STRATEGY_STATE:
            if f"{depth}.{name}" in state:
                setattr(s, name, state[f"{depth}.{name}"])


def save(run_dir: Path, *, round: int, model, settings: dict, experiment_id: str, rounds: list,
         recorder: dict, strategy) -> None:
    save_atomic(path_in(run_dir), dict(round=round, model=model, settings=settings, experiment_id=experiment_id,
                                       rounds=rounds, recorder=recorder, strategy=strategy_state(strategy)))
