"""What every method is made of (fedsd.methods' package documentation says how a method is
written): the Method base class and its registry, the settings every method has (what a run
releases) and those of the self-distilling methods, each epoch's objective, the released EMA,
and the distillation schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Protocol, TypeVar

import torch

from fedsd.methods import losses
from fedsd.training.callbacks import ExponentialAverage, TeacherEveryStep
from fedsd.settings.declared import setting

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


# What a run releases and evaluates (--release): its last iterate, or an exponential moving
# average of its iterates (De et al. 2022), post-processing of them, so free of privacy cost.
RELEASES = ("student", "ema")
# The released EMA's decay: open in the papers; chosen on FMNIST's validation split at the full
# 60 epochs (results/sweeps/fmnist-dpema-decay-60, results/README.md).
EMA_DECAY = 0.995
UNIT_INTERVAL = (lambda v: 0 <= v <= 1, "must be in [0, 1]")
POSITIVE = (lambda v: v > 0, "a temperature must be > 0")


@dataclass
class MethodConfig:
    """Every method's settings: what a run releases (any method but DPKD may release an EMA)."""
    release: str | None = setting(None, "the weights a run releases and evaluates: student (the last iterate) "
                                  "or ema (an exponential moving average of the iterates, post-processing: no "
                                  "privacy cost; not for dpkd)", choices=RELEASES,
                                  default_text="ema for dpema, student for the others")
    ema_decay: float | None = setting(None, "the released EMA's decay (dpema, --release ema)",
                                      resolve=lambda c: EMA_DECAY if release_of(c) == "ema" else None,
                                      default_text=f"{EMA_DECAY}, open in the papers, chosen on validation",
                                      check=(lambda v: 0 <= v < 1, "must be in [0, 1)"))
    ema_warmup: str = setting("on", "the released EMA's warm-up (dpema, --release ema): on, the decay is "
                                    "min(d, (1 + t)/(10 + t)) at step t (De et al. 2022); off, d from the first step",
                              choices=("on", "off"))


class MethodRun(Protocol):
    """What a method's code reads of a run's (resolved) settings: its `method` and `epochs`
    (fedsd.settings.run.RunConfig) and what every method declares (MethodConfig). At run time a
    method's `cfg` is a TrainConfig, which holds every registered method's settings; for an editor
    and a type checker, a method types it by a Protocol like this one, naming what it reads (its
    own settings added: DP3SDRun in fedsd/methods/dp3sd.py). Settings are declared in the
    method's settings class only."""
    method: str
    epochs: int
    release: str | None
    ema_decay: float | None
    ema_warmup: str


Run = TypeVar("Run")  # what a method reads of a run's settings (a Protocol such as MethodRun)


class Method(Generic[Run]):
    """A training method; `Method[DP3SDRun]`'s hooks read a `cfg` of type DP3SDRun."""

    name: str = ""
    Settings: type = MethodConfig  # this method's settings (a dataclass of setting() fields)
    groups: tuple[str, ...] = ("student",)
    releases: str = "student"
    # whether the teacher is the model itself as it came into the call (self-distillation; a
    # federation may choose another teacher of the same model, fedsd.settings.federation's --teacher)
    self_distilling = False

    def check(self, cfg: Run) -> None:
        """ConfigError naming the option, for resolved settings this method cannot take together
        (each setting's own check is its declaration's)."""

    def initial_model(self, student: Weights) -> Model:
        return {"student": student}

    def on_epoch_start(self, cfg: Run, epoch: int, model: Model, trainer) -> None:
        """Before a (1-based, global) epoch's first step: change what the call trains."""

    def epoch_loss(self, cfg: Run, epoch: int) -> EpochLoss:
        return cross_entropy()

    def step_callbacks(self, cfg: Run, model: Model, steps_so_far: int, device) -> list:
        """This call's step callbacks (fedsd.training.callbacks); they may add groups to `model`."""
        return []


METHODS: dict[str, Method[Any]] = {}
MethodClass = TypeVar("MethodClass", bound=type[Method[Any]])


def register(cls: MethodClass) -> MethodClass:
    """Class decorator: `cls` becomes the method of its `name` (`--method name`)."""
    if not (isinstance(cls, type) and issubclass(cls, Method)) or not cls.name:
        raise TypeError(f"{cls!r}: a method is a subclass of fedsd.methods.Method with a name")
    if cls.name in METHODS and type(METHODS[cls.name]) is not cls:
        raise ValueError(f"method {cls.name!r} is registered twice ({type(METHODS[cls.name]).__module__} and "
                         f"{cls.__module__})")
    METHODS[cls.name] = cls()
    return cls


def release_of(cfg: MethodRun) -> str:
    """The group a run releases: --release, else its method's."""
    return cfg.release or METHODS[cfg.method].releases


def with_release(cfg: MethodRun, model: Model) -> Model:
    """`model` with the EMA group a run that releases one carries (it starts at the student)."""
    if release_of(cfg) == "ema" and "ema" not in model:
        model = {**model, "ema": {k: v.clone() for k, v in model["student"].items()}}
    return model


def release_callbacks(cfg: MethodRun, model: Model, steps_so_far: int, device) -> list:
    """The step callback that keeps a released EMA up to date (none for a released student);
    `model["ema"]` becomes this call's average, on `device`."""
    if release_of(cfg) != "ema":
        return []
    model["ema"] = {k: v.detach().clone().to(device) for k, v in model["ema"].items()}
    return [ExponentialAverage(model["ema"], cfg.ema_decay, steps_so_far, warmup=cfg.ema_warmup == "on")]


def warming_up(cfg: SelfDistillingRun, epoch: int) -> bool:
    """Self-distillation's first epochs train on cross-entropy alone, no teacher
    (--distill-warmup-epochs; its temperature is the method's: --dp3sd-warmup, --dpdsd-ce)."""
    return epoch <= cfg.distill_warmup_epochs


DISTILL_SCHEDULES = ("constant", "decay", "ramp")
TEACHER_EVERY = ("epoch", "step")


@dataclass
class SelfDistillationConfig(MethodConfig):
    """The settings of a method whose teacher is the model itself (DP3SD, DPDSD)."""
    distill_warmup_epochs: int = setting(1, "epochs of cross-entropy alone before the teacher is used "
                                         "(dp3sd: at τs, or 1 with --dp3sd-warmup plain; dpdsd: at its --dpdsd-ce; "
                                         "federated: global epochs, rounds × local epochs)",
                                         check=(lambda v: v >= 0, "must be >= 0"))
    distill_schedule: str = setting("constant", "self-distillation: how the distillation terms' weight changes "
                                    "after the warm-up: constant; decay = from 1 in the first distilling epoch "
                                    "linearly to 1/n in the last of n; ramp = from 1/n up to 1 (federated: "
                                    "counted in global epochs, so by round)", choices=DISTILL_SCHEDULES)
    teacher_every: str = setting("epoch", "self-distillation: how often the teacher is refreshed. epoch: a copy of "
                                          "the student as each epoch (federated: each round) starts, both papers' "
                                          "Algorithm 1 and DPDSD's §3.2 (\"the previous epoch\"); step: the "
                                          "student's previous iterate, both papers' prose (DP3SD §3.2, DPDSD §2.3: "
                                          "\"the previous iteration\") read per step (post-processing of private "
                                          "iterates: no privacy cost)", choices=TEACHER_EVERY)


class SelfDistillingRun(MethodRun, Protocol):
    """What a self-distilling method reads of a run's settings: MethodRun's and those of
    SelfDistillationConfig."""
    distill_warmup_epochs: int
    distill_schedule: str
    teacher_every: str


SelfRun = TypeVar("SelfRun", bound=SelfDistillingRun)


class SelfDistilling(Method[SelfRun]):
    """A method whose teacher is the model itself (DP3SD, DPDSD): its teacher is refreshed every
    epoch (the trainer loads it as a call starts) or, with --teacher-every step, after every step."""
    Settings = SelfDistillationConfig
    self_distilling = True

    def step_callbacks(self, cfg: SelfRun, model: Model, steps_so_far: int, device) -> list:
        return [TeacherEveryStep()] if cfg.teacher_every == "step" else []


def distill_weight(cfg: SelfDistillingRun, epoch: int) -> float:
    """The factor on a self-distillation method's distillation terms in a (1-based, global) epoch
    after the warm-up (--distill-schedule). With n distilling epochs and this the k-th: constant
    1; decay (n − k + 1)/n, the teacher counts less as the model it is a copy of gets better;
    ramp k/n, it counts more as it gets better. A federation counts global epochs, so its weight
    changes by round."""
    n = max(cfg.epochs - cfg.distill_warmup_epochs, 1)
    k = min(max(epoch - cfg.distill_warmup_epochs, 1), n)
    return {"constant": 1.0, "decay": (n - k + 1) / n, "ramp": k / n}[cfg.distill_schedule]
