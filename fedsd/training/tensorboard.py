"""A run's TensorBoard log: per epoch (central) or round (federated) its test and validation
accuracy and loss and its ε (a federation's: the largest, and each client's), and the resolved
settings as hyper-parameters with the final numbers, so runs compare in TensorBoard's HParams tab.

TensorBoard is an optional extra (`pip install fedsd[tensorboard]`): by default a run writes
its log to OUT/tensorboard when TensorBoard is installed, and none otherwise; `--log-dir DIR`
asks for one (and refuses to start without TensorBoard), `--log-dir off` for none. A resumed
run appends to its log: TensorBoard shows each step once, with the values of its latest file.
"""
from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

from fedsd.errors import ConfigError

OFF = "off"
DEFAULT_FOLDER = "tensorboard"


def installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def log_dir(option: str | None, out: str | Path | None) -> Path | None:
    """Where a run logs: --log-dir as given ('off': nowhere), else OUT/tensorboard when
    TensorBoard is installed. ConfigError when a log is asked for and TensorBoard is missing."""
    if option == OFF:
        return None
    if option:
        if not installed():
            raise ConfigError(f"--log-dir {option}: TensorBoard is not installed (pip install 'fedsd[tensorboard]', "
                              f"or leave --log-dir out)")
        return Path(option)
    if out is None or not installed():
        return None
    return Path(out) / DEFAULT_FOLDER


@contextlib.contextmanager
def opened(folder: Path | None):
    """A TensorBoardLog in `folder` for the `with` block, closed when it ends however it ends
    (None, and no log, for no folder)."""
    if folder is None:
        yield None
        return
    log = TensorBoardLog(folder)
    try:
        yield log
    finally:
        log.close()


class TensorBoardLog:
    """Scalars per epoch or round, and the settings as hyper-parameters (`finish`)."""

    def __init__(self, folder: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.folder = Path(folder)
        self.writer = SummaryWriter(str(self.folder))

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """Each value under its tag at `step` (the epoch or round); None is left out."""
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, float(value), step)
        self.writer.flush()

    def finish(self, settings: dict, final: dict[str, float | None]) -> None:
        """The run's resolved settings as hyper-parameters, beside its final numbers."""
        hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in settings.items()}
        metrics = {f"hparam/{k}": float(v) for k, v in final.items() if v is not None}
        self.writer.add_hparams(hparams, metrics, run_name=".")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def epoch_scalars(record: dict) -> dict[str, float | None]:
    """A central epoch's record (fedsd.training.central) as tags."""
    return {"test/accuracy": record["test_accuracy"], "test/loss": record["test_loss"],
            "validation/accuracy": record.get("validation_accuracy"), "privacy/epsilon": record["epsilon"],
            "train/loss": record.get("train_loss")}


def round_scalars(record: dict) -> dict[str, float | None]:
    """A federated round's record (fedsd.app.server.rounds) as tags: the largest ε, and each client's."""
    values = {"test/accuracy": record.get("test_accuracy"), "test/loss": record.get("test_loss"),
              "validation/accuracy": record.get("validation_accuracy"),
              "privacy/epsilon": max(record.get("client_epsilon", {}).values(), default=None)}
    if record.get("federated_evaluation"):  # the clients' own test splits, weighted by their size
        values["federated/accuracy"] = record["federated_evaluation"]["test_accuracy"]
    for client, epsilon in sorted(record.get("client_epsilon", {}).items(), key=lambda kv: int(kv[0])):
        values[f"privacy/epsilon_client/{client}"] = epsilon
    return values
