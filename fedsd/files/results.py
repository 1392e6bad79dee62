"""Result folders: result.json, model.pt and curve.png, written whole or not at all; and
`RunResult`, the one type that writes result.json and reads it back. (Atomic writes are
fedsd.files.atomic's; loading a released model, fedsd.models.released's.)"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedsd.files.atomic import atomic_path, save_atomic, write_json  # noqa: F401  (result files are written atomically)
from fedsd.errors import DataError, OutputExistsError

# result.json's format. 0: the files written before it carried one (they read the same).
RESULT_FORMAT = 1


def gpu_name(device) -> str | None:
    """The GPU a device is (its card's name), or None for the CPU or where CUDA is absent."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else None


@dataclass
class RunResult:
    """What a finished run says about itself, in result.json: a central run (`fedsd train`,
    its `epochs`) or a federation (`fedsd simulate`, a deployment: its `rounds`). Fields a kind
    does not have stay None and are left out of the file; keys this version does not declare
    (a deployment's `tls`, ...) are kept in `extra` and written back as they were."""

    dataset: str
    method: str
    epsilon_target: float
    epsilon_spent: float
    delta: float
    test_accuracy: float | None
    seed: int
    wall_seconds: float
    device: str
    data_source: str
    config: dict  # the resolved TrainConfig; TrainConfig.from_dict reads it back, old runs too
    noise_multiplier: float | dict | None = None  # federated: by client
    sample_rate: float | dict | None = None
    steps: int = 0
    # a central run
    num_train: int | None = None
    validation_accuracy: float | None = None
    privacy: dict | None = None
    route: dict | None = None
    physical_batch_size: int | None = None  # the most samples one pass took (fedsd.training.physical_batches)
    # the card where the run went to a GPU (torch.cuda.get_device_name): a GPU's seconds are
    # not a CPU's, and a table that reports them says on which
    device_name: str | None = None
    # --feature-norm private: the released per-channel statistics the features were normalised
    # with (a DP release, part of what the run publishes: load_model needs them)
    feature_statistics: dict | None = None
    epochs: list | None = None
    resumed: bool | None = None
    # --init-weights / --train-layers: the file and its sha256 (a public input), the blocks
    # trained and frozen, a new head, frozen BatchNorms (fedsd.models.networks.start_report)
    pretrained: dict | None = None
    # a federation
    evaluated_by: str | None = None
    num_clients: int | None = None
    shard_sizes: list | None = None
    federation: dict | None = None
    experiment_id: str | None = None
    resumed_after_round: int | None = None
    missed: dict | None = None
    rounds: list | None = None
    format: int = RESULT_FORMAT
    extra: dict = field(default_factory=dict)

    @classmethod
    def of_run(cls, cfg, *, epsilon_spent: float, test_accuracy: float | None, wall_seconds: float, device,
               data_source: str, **facts) -> "RunResult":
        """The one place a result is made, central or federated: the run's settings (a resolved
        TrainConfig) fill what every result has, `facts` the kind's own fields."""
        return cls(dataset=cfg.dataset, method=cfg.method, epsilon_target=cfg.epsilon, epsilon_spent=epsilon_spent,
                   delta=cfg.delta, test_accuracy=test_accuracy, seed=cfg.seed, wall_seconds=wall_seconds,
                   device=str(device), device_name=gpu_name(device), data_source=data_source, config=cfg.to_dict(),
                   **facts)

    @property
    def federated(self) -> bool:
        return self.rounds is not None

    @property
    def curve(self) -> list[dict]:
        """Test accuracy (and more) by epoch, or by round for a federation."""
        return self.rounds if self.federated else self.epochs

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out = {k: v for k, v in out.items() if v is not None}
        return {**out, **self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> "RunResult":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        return cls(**{"format": 0, **known}, extra={k: v for k, v in d.items() if k not in names})

    @classmethod
    def read(cls, path: str | os.PathLike) -> "RunResult":
        """A result.json; DataError naming the file when it is not one this version reads."""
        try:
            d = json.loads(Path(path).read_text())
            result = cls.from_dict(d)
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"{path}: not a readable fedsd result ({e})") from None
        if result.format > RESULT_FORMAT:
            raise DataError(f"{path}: result format {result.format}; this version of fedsd reads up to "
                            f"{RESULT_FORMAT}")
        return result

    def write(self, path: str | os.PathLike) -> None:
        write_json(Path(path), self.to_dict())


def check_out_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse, before any work, an --out that exists and is not empty (unless overwrite)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"--out: {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"--out: {out} exists and is not empty; choose a new folder or pass --overwrite")
    return out


def fresh_out_dir(out: Path, overwrite: bool) -> None:
    """A run's folder that fills up as it goes (checkpoints, then result.json last): new, or
    emptied with overwrite (check_out_dir has already refused a non-empty one without it)."""
    if overwrite and out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


@contextmanager
def staged_out_dir(out: str | os.PathLike, overwrite: bool = False):
    """Yield a scratch folder beside `out`; on success it replaces `out` in one rename, on failure
    it is removed, so `out` never holds half a result."""
    out = check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(scratch, out)


def save_model(path: Path, weights: dict[str, torch.Tensor]) -> None:
    save_atomic(path, {k: v.detach().cpu() for k, v in weights.items()})


def plot_curve(path: Path, points: list[dict], x_key: str, title: str) -> None:
    """Test accuracy, test loss and the ε spent so far against epoch (or round), one panel each,
    ticked at whole epochs or rounds; with adaptive clipping, the clip too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xs = [p[x_key] for p in points]
    spent = [p.get("epsilon", max((p.get("client_epsilon") or {"": 0.0}).values())) for p in points]
    panels = [("test accuracy (%)", [100 * p["test_accuracy"] if p["test_accuracy"] is not None else float("nan")
                                    for p in points]),
              ("test loss", [p["test_loss"] if p.get("test_loss") is not None else float("nan") for p in points]),
              ("ε spent" + (" (largest client's)" if x_key == "round" else ""), spent)]
    if any("clip" in p or p.get("client_clip") for p in points):  # adaptive clipping: where the estimate stood
        panels.append(("clip C (adaptive" + (", clients' median)" if x_key == "round" else ")"), [
            p["clip"] if "clip" in p else statistics.median(p["client_clip"].values()) if p.get("client_clip")
            else float("nan") for p in points]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (label, ys) in zip(axes, panels):
        ax.plot(xs, ys, marker="o", ms=3)
        ax.set_xlabel(x_key)
        ax.set_ylabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def write_run(out: Path, result: RunResult, weights: dict[str, torch.Tensor]) -> None:
    """The three files of a run, each written atomically, result.json last: a folder with a
    result.json holds a finished run."""
    save_model(out / "model.pt", weights)
    plot_curve(out / "curve.png", result.curve, "round" if result.federated else "epoch",
               f"{result.dataset} {result.method} ε={result.epsilon_target}")
    result.write(out / "result.json")


def finished_run_refusal(run_dir, length: str) -> str:
    """Why `--resume` does not extend a finished run (`length`: "--epochs" or "--rounds"). Its
    σ was calibrated for exactly its planned length, so its ε is spent: more steps would spend
    more than the ε its result reports, under the same release."""
    return (f"--resume: {run_dir} is a finished run (it has result.json); nothing to resume. Its σ was calibrated "
            f"so that its planned {length.lstrip('-')} spend exactly its ε, so training on would spend more than the ε "
            f"it reports: a longer run is a new run with a larger {length} (README: extending a finished run)")

