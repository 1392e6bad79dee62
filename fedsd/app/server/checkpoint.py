"""The server's per-round checkpoint: `<out>/checkpoint.pt`, one file replaced atomically after
every completed round, so a server stopped at any moment can go on with `--resume <out>`.

It holds what the next round needs and what the result must report: the round number, the
global model (every group), the strategy's state_dict (its records, FedAdam's moments, the
sampling RNG), the round book's (the per-round log), under noise=distributed the server
optimizer's (its momentum buffers: a resumed run steps as an uninterrupted one), and the
experiment id under which every client keeps its privacy state on its own disk (so a resumed
run finds it; a fresh run does not). The settings travel with it: a resumed run uses the checkpoint's, never new ones.

The file holds tensors and plain values only, under a format number: it loads with
`weights_only=True` (no code runs from a file), and an old or foreign file is refused with the
reason before anything starts.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedsd.settings.run import TrainConfig
from fedsd.errors import ResumeError
from fedsd.settings.federation import FedConfig, from_flat, to_flat
from fedsd.files.results import check_out_dir, finished_run_refusal, save_atomic

CHECKPOINT = "checkpoint.pt"
FORMAT = 2  # 1: the unversioned pickle of fedsd before 2026-11-23 (not continued)
# Keys of the flat settings that name places or this launch, not the training itself.
NOT_SETTINGS = ("out-dir", "resume-dir", "experiment-id")


def settings(cfg: TrainConfig, fed: FedConfig) -> dict:
    return {k: v for k, v in to_flat(cfg, fed).items() if k not in NOT_SETTINGS}


def path_in(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT


def load(run_dir: str | Path) -> dict:
    """The checkpoint in `run_dir`; ResumeError naming --resume and the reason when there is
    none, or it is not a checkpoint of this format."""
    path = path_in(run_dir)
    if (Path(run_dir) / "result.json").is_file():
        raise ResumeError(finished_run_refusal(run_dir, "--rounds"))
    if not path.is_file():
        raise ResumeError(f"--resume: no {CHECKPOINT} in {run_dir} (a run writes one after each completed round)")
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001  (a damaged, old or foreign file, whatever torch raises)
        raise ResumeError(f"--resume: {path} is not a fedsd server checkpoint this version can read "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        found = saved.get("format", 1) if isinstance(saved, dict) else type(saved).__name__
        raise ResumeError(f"--resume: {path} is of format {found!r}; this version of fedsd continues format "
                          f"{FORMAT} only")
    return saved


def resumed_settings(run_dir: str | Path, saved: dict | None = None) -> tuple[TrainConfig, FedConfig]:
    """The settings of the run in `run_dir` (its checkpoint `saved`, if already loaded), set to
    resume it there."""
    cfg, fed = from_flat((saved or load(run_dir))["settings"])
    fed.resume_dir = fed.out_dir = str(Path(run_dir).absolute())
    return cfg, fed


@dataclass
class Launch:
    """Where a launch of the server starts, decided once before anything reads the settings:
    a fresh run (round 0, a new experiment id) or the run checkpointed in --resume's folder
    (its settings, folder, round, experiment id, model and the strategy's, round book's and,
    under noise=distributed, the server optimizer's state_dicts)."""

    cfg: TrainConfig
    fed: FedConfig
    out: Path | None
    round: int = 0
    experiment_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    model: dict | None = None
    strategy: dict | None = None
    book: dict | None = None
    optimizer: dict | None = None  # noise=distributed: the server's optimizer (its momentum); None: none kept

    @property
    def resumed(self) -> bool:
        return self.model is not None

    @property
    def settings(self) -> dict:
        """What each round's checkpoint records of the settings."""
        return settings(self.cfg, self.fed)


def start(cfg: TrainConfig, fed: FedConfig, out: str | Path | None, overwrite: bool = False) -> Launch:
    """A fresh run into `out` (refused before anything starts when `out` holds something and
    not `overwrite`), or, with fed.resume_dir, the run checkpointed there with its own settings."""
    if fed.resume_dir:
        saved = load(fed.resume_dir)
        cfg, fed = resumed_settings(fed.resume_dir, saved)
        return Launch(cfg, fed, Path(fed.resume_dir), saved["round"], saved["experiment_id"], saved["model"],
                        saved["strategy"], saved["book"], saved.get("optimizer"))
    if out is not None:
        out = check_out_dir(out, overwrite)
    return Launch(cfg, fed, out)


def save(run_dir: Path, *, round: int, model, settings: dict, experiment_id: str, book: dict, strategy: dict,
         optimizer: dict | None = None) -> None:
    """`book` and `strategy`: the RoundBook's and the RecordingStrategy's state_dict; `optimizer`:
    under noise=distributed the server's optimizer's (fedsd.secure.distributed_step.ServerOptimizer)."""
    save_atomic(path_in(run_dir), dict(format=FORMAT, round=round, model=model, settings=settings,
                                       experiment_id=experiment_id, book=book, strategy=strategy, optimizer=optimizer))
