"""The training methods, one file each, found by name through `METHODS`.

A method says what a run of it carries and computes; the trainer (fedsd.training) runs the
same DP-SGD steps for all of them:
  - its defaults (`defaults`, from the papers' table for the data set) and their checks (`check`);
  - the groups of weights it carries from call to call (`groups`: the student, and where it has
    them the EMA or DPKD's teacher), which one it releases by default (`releases`; --release
    ema gives any method but DPKD dpema's release, `release_of`), and their start
    (`initial_model`);
  - each epoch's per-sample loss with its chance level (`epoch_loss`), and what changes when an
    epoch starts (`on_epoch_start`: DPKD's second stage);
  - the step callbacks a call of it runs (`step_callbacks`; the released EMA's is every method's,
    `release_callbacks`).
A new method is a subclass of `Method` in a file of its own, listed below, with its tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .. import losses
from ..callbacks import ExponentialAverage

if TYPE_CHECKING:
    from ..config import TrainConfig

Weights = dict[str, torch.Tensor]
Model = dict[str, Weights]


@dataclass(frozen=True)
class EpochLoss:
    """An epoch's objective: per_sample(student_logits, teacher_logits, labels) -> one loss a
    sample; whether it reads the teacher's logits; its chance level, the loss of a student that
    knows nothing (uniform outputs), in units of ln K (the divergence check's yardstick)."""

    per_sample: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
    reads_teacher: bool
    chance: float


def cross_entropy(tau: float = 1.0) -> EpochLoss:
    """Cross-entropy at temperature τ: ln K at a uniform student, whatever τ."""
    return EpochLoss(lambda s, t, y: losses.cross_entropy(s, y, tau=tau, reduction="none"), False, 1.0)


class Method:
    name: str = ""
    groups: tuple[str, ...] = ("student",)
    releases: str = "student"
    # whether the teacher is the model itself as it came into the call (self-distillation; a
    # federation may choose another teacher of the same model, fedsd.federation's --teacher)
    self_distilling = False

    def defaults(self, cfg: "TrainConfig", paper: dict) -> dict:
        """This method's settings left unset, from the papers' values for the data set."""
        return dict(paper.get(self.name, {}))

    def check(self, cfg: "TrainConfig") -> None:
        """ConfigError naming the option, for a resolved setting this method cannot take."""

    def initial_model(self, student: Weights) -> Model:
        return {"student": student}

    def on_epoch_start(self, cfg: "TrainConfig", epoch: int, model: Model, trainer) -> None:
        """Before a (1-based, global) epoch's first step: change what the call trains."""

    def epoch_loss(self, cfg: "TrainConfig", epoch: int) -> EpochLoss:
        return cross_entropy()

    def step_callbacks(self, cfg: "TrainConfig", model: Model, steps_so_far: int, device) -> list:
        """This call's step callbacks (fedsd.callbacks); they may add groups to `model`."""
        return []


# What a run releases and evaluates (--release): its last iterate, or an exponential moving
# average of its iterates (De et al. 2022), post-processing of them, so free of privacy cost.
RELEASES = ("student", "ema")


def release_of(cfg: "TrainConfig") -> str:
    """The group a run releases: --release, else its method's."""
    return cfg.release or METHODS[cfg.method].releases


def with_release(cfg: "TrainConfig", model: Model) -> Model:
    """`model` with the EMA group a run that releases one carries (it starts at the student)."""
    if release_of(cfg) == "ema" and "ema" not in model:
        model = {**model, "ema": {k: v.clone() for k, v in model["student"].items()}}
    return model


def release_callbacks(cfg: "TrainConfig", model: Model, steps_so_far: int, device) -> list:
    """The step callback that keeps a released EMA up to date (none for a released student);
    `model["ema"]` becomes this call's average, on `device`."""
    if release_of(cfg) != "ema":
        return []
    model["ema"] = {k: v.detach().clone().to(device) for k, v in model["ema"].items()}
    return [ExponentialAverage(model["ema"], cfg.ema_decay, steps_so_far)]


def warming_up(cfg: "TrainConfig", epoch: int) -> bool:
    """Self-distillation's first epochs train on plain cross-entropy (--distill-warmup-epochs)."""
    return epoch <= cfg.distill_warmup_epochs


DISTILL_SCHEDULES = ("constant", "decay", "ramp")


def distill_weight(cfg: "TrainConfig", epoch: int) -> float:
    """The factor on a self-distillation method's distillation terms in a (1-based, global) epoch
    after the warm-up (--distill-schedule). With n distilling epochs and this the k-th: constant
    1; decay (n − k + 1)/n, the teacher counts less as the model it is a copy of gets better;
    ramp k/n, it counts more as it gets better. A federation counts global epochs, so its weight
    changes by round."""
    n = max(cfg.epochs - cfg.distill_warmup_epochs, 1)
    k = min(max(epoch - cfg.distill_warmup_epochs, 1), n)
    return {"constant": 1.0, "decay": (n - k + 1) / n, "ramp": k / n}[cfg.distill_schedule]


from .dpsgd import DPSGD  # noqa: E402
from .dpema import DPEMA  # noqa: E402
from .dpkd import DPKD  # noqa: E402
from .dp3sd import DP3SD  # noqa: E402
from .dpdsd import DPDSD  # noqa: E402

METHODS: dict[str, Method] = {m.name: m for m in (DPSGD(), DPEMA(), DPKD(), DP3SD(), DPDSD())}
# every group of weights some method carries: what a model on the wire may hold
MODEL_GROUPS = tuple(dict.fromkeys(g for m in METHODS.values() for g in m.groups))


def method_of(cfg: "TrainConfig") -> Method:
    return METHODS[cfg.method]


def released(model: Model) -> Weights:
    """The weights a run releases and evaluates, found by the groups the model holds: the EMA
    where it carries one (dpema, --release ema), else the student."""
    return model.get("ema", model["student"])
