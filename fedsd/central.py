"""Central training (`fedsd train`): the papers' setup, one epoch per call of the shared loop."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import data as data_lib
from . import privacy
from .config import TrainConfig, validate
from .models import build_model, check_private_trainable
from .results import check_out_dir, staged_out_dir, write_run
from .training import DPTrainer, evaluate, initial_model, released


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda was asked for but torch sees no GPU; use cpu or auto")
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
    check_private_trainable(build_model(cfg.model, images.num_classes))
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


def train(cfg: TrainConfig, out: str | Path | None = None, overwrite: bool = False,
          progress: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train centrally; write result.json, model.pt and curve.png to `out` (when given).

    Returns (result, released weights)."""
    run, plan = plan_run(cfg, out, overwrite)
    cfg = run.cfg
    n = len(run.train_indices)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)

    started = time.perf_counter()
    trainer = DPTrainer(cfg, data_lib.prepare(run.data, run.train_indices, run.device), plan)
    tensors = trainer.data  # in the trainer's memory format, for evaluation too
    model, state = initial_model(cfg, tensors.num_classes), None
    held_out = data_lib.validation_indices(run.data, cfg.validation)
    val_x = run.data.normalised(run.data.x_train[held_out]).to(run.device).contiguous(
        memory_format=trainer.memory_format)
    val_y = run.data.y_train[held_out].to(run.device)
    epochs = []
    bar = tqdm(range(1, cfg.epochs + 1), desc=f"{cfg.dataset} {cfg.method} ε={cfg.epsilon}",
               unit="epoch", disable=not progress)
    for epoch in bar:
        model, state, metrics = trainer.local_update(model, state, [epoch])
        trainer.model.load_state_dict(released(model))
        accuracy, loss = evaluate(trainer.model, tensors.x_test, tensors.y_test)
        epochs.append(dict(epoch=epoch, test_accuracy=accuracy, test_loss=loss, epsilon=metrics["epsilon"],
                           train_loss=metrics["train_loss"], seconds=metrics["seconds"]))
        if cfg.validation:
            epochs[-1]["validation_accuracy"] = evaluate(trainer.model, val_x, val_y)[0]
        bar.set_postfix(acc=f"{accuracy:.4f}", eps=f"{metrics['epsilon']:.3f}")
    result = dict(
        dataset=cfg.dataset, method=cfg.method, epsilon_target=cfg.epsilon,
        epsilon_spent=epochs[-1]["epsilon"], delta=cfg.delta, noise_multiplier=plan.noise_multiplier,
        sample_rate=plan.sample_rate, steps=state.steps, num_train=n, test_accuracy=epochs[-1]["test_accuracy"],
        validation_accuracy=epochs[-1].get("validation_accuracy"),
        seed=cfg.seed, wall_seconds=time.perf_counter() - started, device=str(run.device),
        data_source=run.data.source, config=cfg.to_dict(), privacy=plan.to_dict(), epochs=epochs)
    weights = {k: v.cpu() for k, v in released(model).items()}
    if out is not None:
        with staged_out_dir(out, overwrite) as scratch:
            write_run(scratch, result, weights, "epoch")
    return result, weights
