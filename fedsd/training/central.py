"""Central training (`fedsd train`): the papers' setup, one epoch per call of the shared loop."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fedsd.data import datasets as data_lib
from fedsd.data.client_data import input_stats, run_images, task_for, with_custom_task
from fedsd.data import features
from fedsd.privacy import accounting as privacy
from fedsd.clipping import routes
from fedsd.training import tensorboard
from fedsd.settings.run import TrainConfig, renamed_settings, validate
from fedsd.clipping.bookkeeping import BookKeepingEngine
from fedsd.models.networks import (check_fits_task, feature_source, image_shape_of, input_shape_of, model_for,
                                   start_report, with_pinned_weights)
from fedsd.training.seeds import SEED_FEATURE_NORM, derive_seed
from fedsd.files.results import (RunResult, check_out_dir, finished_run_refusal, fresh_out_dir, save_atomic, write_json,
                                 write_run)
from fedsd.training.loop import DPTrainer, TrainState, evaluate, initial_model, planned_trainer
from fedsd.errors import ResumeError, TrainingDiverged
from fedsd.runtime import resolve_device
from fedsd.methods import released


@dataclass
class CentralInputs:
    """A central run's inputs, checked: its resolved settings, the data set, the training
    samples it takes and the device (a run itself is a CentralRun, its result a RunResult)."""
    cfg: TrainConfig
    data: data_lib.ImageData
    train_indices: torch.Tensor
    device: torch.device


def prepare_run(cfg: TrainConfig) -> CentralInputs:
    """Everything that can fail on bad input, before any work: settings, data, model, device."""
    cfg = with_custom_task(cfg).resolved()  # a custom data set's classes, channels and size, read from its files
    cfg = with_pinned_weights(cfg)  # --init-weights: its path absolute, its sha256 checked or filled in
    task_for(cfg)  # the model takes the task's images (--model cifar-cnn on MNIST is refused here)
    images = run_images(cfg)
    indices = data_lib.training_indices(images, cfg.subset, cfg.seed, cfg.validation, cfg.public_first)
    validate(cfg, len(indices))
    # a network Opacus cannot train is refused here, naming the layer; a weights file that does
    # not fit it, naming the keys
    net = model_for(cfg, images.num_classes, weights=True)
    check_fits_task(net, cfg.model, images.num_classes, input_shape_of(cfg))
    if cfg.grad_sample_mode == "bk":
        BookKeepingEngine(net, cfg.clip)  # a layer book-keeping has no rule for is refused, named
    device = resolve_device(cfg.device)
    if cfg.route:  # a given route fits this network (each conv layer's way, the kernel where it takes one)
        routes.given(cfg, images.num_classes, input_shape_of(cfg), device)
    return CentralInputs(cfg, images, indices, device)


def plan_run(cfg: TrainConfig, out: str | Path | None = None,
             overwrite: bool = False) -> tuple[CentralInputs, privacy.PrivacyPlan]:
    """prepare_run, the result folder and the calibrated σ: every check before the first step."""
    inputs = prepare_run(cfg)
    if out is not None:
        check_out_dir(out, overwrite)
    cfg = inputs.cfg
    return inputs, privacy.plan(cfg.epsilon, cfg.delta, len(inputs.train_indices), cfg.batch_size, cfg.epochs,
                             cfg.accountant, prior=privacy_prior(cfg))


def privacy_prior(cfg: TrainConfig) -> tuple:
    """What a run spends before DP-SGD (accountant entries): its private feature normalisation's."""
    return features.normalisation_prior(cfg.feature_norm_noise) if cfg.feature_norm == "private" else ()


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
        raise ResumeError(finished_run_refusal(out, "--epochs"))
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
        saved["config"] = TrainConfig(**renamed_settings(saved["config"], saved["config"].get("method")))  # 0.1's too
    except TypeError as e:
        raise ResumeError(f"--resume: the saved settings do not fit this version of fedsd ({e})") from None
    return saved


class CentralRun:
    """A central run as it goes, beside the server's RoundBook: started or resumed from its
    folder, an epoch at a time (`take_epoch`), saved after each (`save`), finished with its
    result files (`finish`).

    With a folder (`out`), the state after every epoch is saved there (CHECKPOINT), so a run
    stopped at any moment, SIGKILL included, loses at most the epoch under way; resumed, it goes
    on with its own saved settings and ends with the weights of a run that was never stopped."""

    def __init__(self, cfg: TrainConfig | None, out: str | Path | None = None, overwrite: bool = False,
                 resume: bool = False):
        saved = load_checkpoint(out) if resume else None
        self.prepared, self.plan = plan_run(saved["config"] if saved is not None else cfg, None if resume else out,
                                            overwrite)
        self.cfg, self.out, self.resumed = self.prepared.cfg, Path(out) if out is not None else None, saved is not None
        if saved is not None and saved["privacy"] != self.plan.to_dict():
            raise ResumeError(f"--resume: the run was planned as {saved['privacy']}; this code plans "
                              f"{self.plan.to_dict()}")
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.started = time.perf_counter()
        # (mean, variance) the features were normalised by: released under --feature-norm private
        self.feature_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        self.trainer = self._trainer(saved)
        self.validation = self._validation_split()
        if saved is None:
            self.model, self.state, self.epochs, self.before = initial_model(self.cfg, self.trainer.data.num_classes), \
                None, [], 0.0
            if self.out is not None:
                fresh_out_dir(self.out, overwrite)
                self.save()  # from the first moment on, the folder says it is unfinished
        else:
            self.model, self.epochs, self.before = saved["model"], saved["epochs"], saved["wall_seconds"]
            self.state = TrainState.from_state_dict(saved["state"], self.plan) if saved["state"] is not None else None

    def _trainer(self, saved: dict | None) -> DPTrainer:
        inputs, cfg = self.prepared, self.cfg
        route = routes.Route.from_dict(saved["route"]) if saved is not None and saved["route"] else None
        tensors = data_lib.prepare(inputs.data, inputs.train_indices, "cpu", input_stats(cfg), feature_source(cfg))
        if cfg.feature_norm == "private":
            # The same noise on every start of the run (its seed's), so a resumed run normalises
            # as it began; the accountant's history holds its cost from the first step on.
            generator = torch.Generator().manual_seed(derive_seed(cfg.seed, SEED_FEATURE_NORM))
            self.feature_stats = features.private_statistics(tensors.x_train, image_shape_of(cfg)[0],
                                                              cfg.feature_norm_noise, generator)
            tensors = data_lib.TensorData(features.normalise(tensors.x_train, *self.feature_stats), tensors.y_train,
                                          features.normalise(tensors.x_test, *self.feature_stats), tensors.y_test,
                                          tensors.num_classes)
        return planned_trainer(cfg, tensors.to(inputs.device), self.plan, route=route)

    def _validation_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """--validation's held-out samples, normalised and laid out as the training data."""
        x, y = data_lib.validation_split(self.prepared.data, self.cfg.validation, input_stats(self.cfg),
                                         feature_source(self.cfg))
        if self.feature_stats is not None:
            x = features.normalise(x, *self.feature_stats)  # the training set's released statistics
        return (x.to(self.prepared.device).contiguous(memory_format=self.trainer.memory_format),
                y.to(self.prepared.device))

    def remaining_epochs(self) -> range:
        return range(len(self.epochs) + 1, self.cfg.epochs + 1)

    def take_epoch(self, epoch: int) -> dict:
        """Train one epoch, evaluate what it releases, record it, and save the run (a run that
        diverges leaves nothing behind: nothing of it is released, nor kept to resume)."""
        try:
            self.model, self.state, metrics = self.trainer.local_update(self.model, self.state, [epoch])
        except TrainingDiverged:
            if self.out is not None and not self.resumed:
                shutil.rmtree(self.out, ignore_errors=True)
            raise
        net, tensors = self.trainer.model, self.trainer.data
        net.load_state_dict(released(self.model))
        accuracy, loss = evaluate(net, tensors.x_test, tensors.y_test)
        record = dict(epoch=epoch, test_accuracy=accuracy, test_loss=loss, epsilon=metrics["epsilon"],
                      train_loss=metrics["train_loss"], seconds=metrics["seconds"])
        if "clip" in metrics:  # adaptive clipping: the estimate after this epoch
            record["clip"] = metrics["clip"]
        if self.cfg.validation:
            record["validation_accuracy"] = evaluate(net, *self.validation)[0]
        self.epochs.append(record)
        if self.out is not None:
            self.save()
        return record

    def wall_seconds(self) -> float:
        return self.before + time.perf_counter() - self.started

    def save(self) -> None:
        """The run as it stands after a completed epoch: atomically, then the note for people."""
        cfg, plan = self.cfg, self.plan
        save_atomic(self.out / CHECKPOINT, dict(
            format=CHECKPOINT_FORMAT, config=cfg.to_dict(), privacy=plan.to_dict(), epochs=self.epochs,
            model=self.model, state=self.state.state_dict(plan) if self.state is not None else None,
            route=self._route(), wall_seconds=self.wall_seconds()))
        write_json(self.out / PROGRESS, dict(
            finished=False, epochs_done=len(self.epochs), epochs=cfg.epochs,
            test_accuracy=self.epochs[-1]["test_accuracy"] if self.epochs else None,
            resume_with=f"fedsd train --resume {self.out}"))

    def _route(self) -> dict | None:
        return self.trainer.route.to_dict() if self.trainer.route is not None else None

    def finish(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The result, and the folder's files (result.json last: from then on the run is finished)."""
        last, plan, inputs = self.epochs[-1], self.plan, self.prepared
        result = RunResult.of_run(
            self.cfg, epsilon_spent=last["epsilon"], test_accuracy=last["test_accuracy"],
            wall_seconds=self.wall_seconds(), device=inputs.device, data_source=inputs.data.source,
            noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate, steps=self.state.steps,
            num_train=len(inputs.train_indices), validation_accuracy=last.get("validation_accuracy"),
            privacy=plan.to_dict(), route=self._route(), physical_batch_size=self.trainer.physical_batch_size,
            epochs=self.epochs, resumed=True if self.resumed else None,
            pretrained=start_report(self.cfg, self.trainer.data.num_classes),
            feature_statistics=dict(mean=self.feature_stats[0].tolist(), variance=self.feature_stats[1].tolist())
            if self.feature_stats is not None else None)
        weights = {k: v.cpu() for k, v in released(self.model).items()}
        if self.out is not None:
            write_run(self.out, result, weights)
            for name in (CHECKPOINT, PROGRESS):
                (self.out / name).unlink(missing_ok=True)
        return result.to_dict(), weights


def train(cfg: TrainConfig | None, out: str | Path | None = None, overwrite: bool = False,
          progress: bool = True, resume: bool = False,
          log_dir: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train centrally; write result.json, model.pt and curve.png to `out` (when given), and
    the state after every epoch (CentralRun); `resume=True` continues the unfinished run in
    `out` with its own saved settings (`cfg` is then None). `log_dir`: the TensorBoard log's
    folder as --log-dir takes it (fedsd.training.tensorboard.log_dir). Returns (result, released weights)."""
    board = tensorboard.log_dir(log_dir, out)  # refused before any work when TensorBoard is missing
    run = CentralRun(cfg, out, overwrite, resume)
    cfg = run.cfg
    bar = tqdm(range(1, cfg.epochs + 1), initial=len(run.epochs), desc=f"{cfg.dataset} {cfg.method} ε={cfg.epsilon}",
               unit="epoch", disable=not progress)
    with tensorboard.opened(board) as log:
        for epoch in run.remaining_epochs():
            record = run.take_epoch(epoch)
            if log is not None:
                log.scalars(epoch, tensorboard.epoch_scalars(record))
            bar.update(1)
            bar.set_postfix(acc=f"{record['test_accuracy']:.4f}", eps=f"{record['epsilon']:.3f}")
        bar.close()
        result, weights = run.finish()
        if log is not None:
            log.finish(cfg.to_dict(), {"test_accuracy": result["test_accuracy"], "epsilon": result["epsilon_spent"]})
    return result, weights
