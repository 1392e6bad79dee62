"""Central training (`fedsd train`): the papers' setup, one epoch per call of the shared loop."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import data as data_lib
from .client_data import input_stats
from . import privacy, routes
from .config import TrainConfig, validate
from .models import build_model, check_private_trainable
from .results import RunResult, check_out_dir, fresh_out_dir, save_atomic, write_json, write_run
from .training import DPTrainer, TrainingDiverged, TrainState, evaluate, initial_model, released
from .errors import ConfigError, ResumeError  # noqa: F401 (ResumeError: also importable from here)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device: cuda was asked for but torch sees no GPU; use cpu or auto")
    return torch.device(name)


@dataclass
class PreparedRun:
    cfg: TrainConfig
    data: data_lib.ImageData
    train_indices: torch.Tensor
    device: torch.device


def prepare_run(cfg: TrainConfig) -> PreparedRun:
    """Everything that can fail on bad input, before any work: settings, data, model, device."""
    cfg = cfg.resolved()
    images = data_lib.load(cfg.dataset, cfg.data_dir, cfg.download)
    indices = data_lib.training_indices(images, cfg.subset, cfg.seed, cfg.validation)
    validate(cfg, len(indices))
    check_private_trainable(build_model(cfg.model, images.num_classes, activation=cfg.activation))
    return PreparedRun(cfg, images, indices, resolve_device(cfg.device))


def plan_run(cfg: TrainConfig, out: str | Path | None = None,
             overwrite: bool = False) -> tuple[PreparedRun, privacy.PrivacyPlan]:
    """prepare_run, the result folder and the calibrated σ: every check before the first step."""
    run = prepare_run(cfg)
    if out is not None:
        check_out_dir(out, overwrite)
    cfg = run.cfg
    return run, privacy.plan(cfg.epsilon, cfg.delta, len(run.train_indices), cfg.batch_size, cfg.epochs,
                             cfg.accountant)


# An unfinished run's folder: its state after the last completed epoch (checkpoint.pt, written
# atomically every epoch) and a note a person can read (progress.json). A finished run's folder
# has result.json, model.pt and curve.png, and neither of these.
CHECKPOINT, PROGRESS = "checkpoint.pt", "progress.json"
CHECKPOINT_FORMAT = 1


def unfinished(out: str | Path) -> bool:
    """Whether `out` holds an unfinished run (a checkpoint and no result.json)."""
    out = Path(out)
    return (out / CHECKPOINT).is_file() and not (out / "result.json").exists()


def load_checkpoint(out: str | Path) -> dict:
    """An unfinished run's saved state; ResumeError, with the reason, for anything else."""
    out = Path(out)
    if not out.is_dir():
        raise ResumeError(f"--resume: {out} is not a folder")
    if (out / "result.json").exists():
        raise ResumeError(f"--resume: {out} is a finished run (it has result.json); nothing to resume")
    if not (out / CHECKPOINT).is_file():
        raise ResumeError(f"--resume: {out} holds no unfinished run (no {CHECKPOINT})")
    try:
        saved = torch.load(out / CHECKPOINT, weights_only=True)
    except Exception as e:  # noqa: BLE001  (a damaged or foreign file, whatever torch raises)
        raise ResumeError(f"--resume: {out / CHECKPOINT} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT:
        found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ResumeError(f"--resume: {out / CHECKPOINT} is of format {found!r}; this version of fedsd continues "
                          f"format {CHECKPOINT_FORMAT} only")
    try:
        saved["config"] = TrainConfig(**saved["config"])
    except TypeError as e:
        raise ResumeError(f"--resume: the saved settings do not fit this version of fedsd ({e})") from None
    return saved


def train(cfg: TrainConfig | None, out: str | Path | None = None, overwrite: bool = False,
          progress: bool = True, resume: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train centrally; write result.json, model.pt and curve.png to `out` (when given).

    With `out`, the state after every epoch is saved there (CHECKPOINT), so a run stopped at any
    moment, SIGKILL included, loses at most the epoch under way: `resume=True` continues the
    unfinished run in `out` with its own saved settings (`cfg` is then None) and ends with the
    weights of a run that was never stopped. Returns (result, released weights)."""
    saved = load_checkpoint(out) if resume else None
    if saved is not None:
        cfg = saved["config"]
    run, plan = plan_run(cfg, None if resume else out, overwrite)
    cfg = run.cfg
    n = len(run.train_indices)
    if saved is not None and saved["privacy"] != plan.to_dict():
        raise ResumeError(f"--resume: the run was planned as {saved['privacy']}; this code plans {plan.to_dict()}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)

    started = time.perf_counter()
    route = routes.Route.from_dict(saved["route"]) if saved is not None and saved["route"] else None
    stats = input_stats(cfg)  # --mean / --std, for the training, test and validation images alike
    trainer = DPTrainer(cfg, data_lib.prepare(run.data, run.train_indices, run.device, stats), plan, route=route)
    tensors = trainer.data  # in the trainer's memory format, for evaluation too
    if saved is None:
        model, state, epochs, before = initial_model(cfg, tensors.num_classes), None, [], 0.0
        if out is not None:
            fresh_out_dir(Path(out), overwrite)
    else:
        model, epochs, before = saved["model"], saved["epochs"], saved["wall_seconds"]
        state = TrainState.from_state_dict(saved["state"], plan) if saved["state"] is not None else None
    val_x, val_y = data_lib.validation_split(run.data, cfg.validation, stats)
    val_x = val_x.to(run.device).contiguous(memory_format=trainer.memory_format)
    val_y = val_y.to(run.device)

    def save(model, state, epochs) -> None:
        """The run as it stands after a completed epoch: atomically, then the note for people."""
        save_atomic(Path(out) / CHECKPOINT, dict(
            format=CHECKPOINT_FORMAT, config=cfg.to_dict(), privacy=plan.to_dict(), epochs=epochs, model=model,
            state=state.state_dict(plan) if state is not None else None,
            route=trainer.route.to_dict() if trainer.route is not None else None,
            wall_seconds=before + time.perf_counter() - started))
        write_json(Path(out) / PROGRESS, dict(finished=False, epochs_done=len(epochs), epochs=cfg.epochs,
                                              test_accuracy=epochs[-1]["test_accuracy"] if epochs else None,
                                              resume_with=f"fedsd train --resume {Path(out)}"))

    if out is not None and saved is None:
        save(model, state, epochs)  # from the first moment on, the folder says it is unfinished
    bar = tqdm(range(1, cfg.epochs + 1), initial=len(epochs), desc=f"{cfg.dataset} {cfg.method} ε={cfg.epsilon}",
               unit="epoch", disable=not progress)
    for epoch in range(len(epochs) + 1, cfg.epochs + 1):
        try:
            model, state, metrics = trainer.local_update(model, state, [epoch])
        except TrainingDiverged:
            if out is not None and saved is None:  # nothing of it is released, nor kept to resume
                shutil.rmtree(out, ignore_errors=True)
            raise
        trainer.model.load_state_dict(released(model))
        accuracy, loss = evaluate(trainer.model, tensors.x_test, tensors.y_test)
        epochs.append(dict(epoch=epoch, test_accuracy=accuracy, test_loss=loss, epsilon=metrics["epsilon"],
                           train_loss=metrics["train_loss"], seconds=metrics["seconds"]))
        if cfg.validation:
            epochs[-1]["validation_accuracy"] = evaluate(trainer.model, val_x, val_y)[0]
        if out is not None:
            save(model, state, epochs)
        bar.update(1)
        bar.set_postfix(acc=f"{accuracy:.4f}", eps=f"{metrics['epsilon']:.3f}")
    bar.close()
    result = RunResult(
        dataset=cfg.dataset, method=cfg.method, epsilon_target=cfg.epsilon,
        epsilon_spent=epochs[-1]["epsilon"], delta=cfg.delta, noise_multiplier=plan.noise_multiplier,
        sample_rate=plan.sample_rate, steps=state.steps, num_train=n, test_accuracy=epochs[-1]["test_accuracy"],
        validation_accuracy=epochs[-1].get("validation_accuracy"),
        seed=cfg.seed, wall_seconds=before + time.perf_counter() - started, device=str(run.device),
        data_source=run.data.source, config=cfg.to_dict(), privacy=plan.to_dict(),
        route=trainer.route.to_dict() if trainer.route is not None else None, epochs=epochs,
        resumed=True if saved is not None else None)
    weights = {k: v.cpu() for k, v in released(model).items()}
    if out is not None:
        write_run(Path(out), result, weights)  # result.json last: from here on the run is finished
        for name in (CHECKPOINT, PROGRESS):
            (Path(out) / name).unlink(missing_ok=True)
    return result.to_dict(), weights
