"""DPKD: two stages in one run. Stage 1 trains a teacher with DP-SGD; stage 2 trains a fresh
student on cross-entropy plus the KL to that fixed teacher, with DP-SGD again. The budget is
the run's, over both stages."""
from dataclasses import dataclass
from typing import Protocol

from fedsd.methods import losses
from fedsd.models.networks import model_for
from fedsd.training.seeds import SEED_KD_STUDENT, derive_seed
from fedsd.settings.declared import check_setting, setting
from fedsd.methods.base import (POSITIVE, UNIT_INTERVAL, EpochLoss, Method, MethodConfig, MethodRun, Model, register,
                                release_of)

# Open in the papers; chosen on FMNIST's validation split: τ and α
# (results/sweeps/fmnist-dpkd-tau-alpha), the stage split (results/sweeps/fmnist-dpkd-stage-split:
# the half); results/README.md has the numbers.
CHOSEN = "open in the papers, chosen on validation"
TEACHER_FRACTION = 0.5


@dataclass
class DPKDConfig(MethodConfig):
    dpkd_tau: float | None = setting(None, "the distillation temperature τ", resolve=5.0, source=CHOSEN, check=POSITIVE)
    dpkd_alpha: float | None = setting(None, "weight α of the cross-entropy term (1 − α: the distillation's)",
                                  resolve=0.7, source=CHOSEN, check=UNIT_INTERVAL)
    dpkd_teacher_epochs: int | None = setting(None, "epochs of stage 1 (the teacher); the rest train the student",
                                            resolve=lambda c: max(1, round(c.epochs * TEACHER_FRACTION)),
                                            default_text="half the epochs")


class DPKDRun(MethodRun, Protocol):
    """What DPKD reads of a run's resolved settings: its seed (fedsd.settings.run.RunConfig; the
    fresh student's network is the run's, fedsd.models.networks.model_for) and its own (DPKDConfig)."""
    seed: int
    dpkd_tau: float
    dpkd_alpha: float
    dpkd_teacher_epochs: int


@register
class DPKD(Method[DPKDRun]):
    name = "dpkd"
    Settings = DPKDConfig
    groups = ("student", "kd_teacher")

    def check(self, cfg: DPKDRun) -> None:
        check_setting(1 <= cfg.dpkd_teacher_epochs < cfg.epochs, "--dpkd-teacher-epochs",
                      f"must be in [1, epochs) = [1, {cfg.epochs}) so both stages train", cfg.dpkd_teacher_epochs)
        check_setting(release_of(cfg) == "student", "--release", "dpkd releases its student: its second stage "
                      "starts a fresh one, which an average over both stages would mix with its teacher", cfg.release)

    def on_epoch_start(self, cfg: DPKDRun, epoch: int, model: Model, trainer) -> None:
        if epoch <= cfg.dpkd_teacher_epochs:
            return
        if "kd_teacher" not in model:
            # Stage 2 begins: the stage-1 model becomes the fixed teacher, the student starts afresh
            # (from --init-weights' public weights where the run has them, as stage 1 did).
            model["kd_teacher"] = trainer.student_weights()
            fresh = model_for(cfg, trainer.data.num_classes, seed=derive_seed(cfg.seed, SEED_KD_STUDENT), weights=True)
            trainer.load_student(fresh.state_dict())
        trainer.load_teacher(model["kd_teacher"])

    def epoch_loss(self, cfg: DPKDRun, epoch: int) -> EpochLoss:
        if epoch <= cfg.dpkd_teacher_epochs:
            return super().epoch_loss(cfg, epoch)
        # τ²·KL(teacher ‖ uniform) ≤ τ²·ln K
        return EpochLoss(lambda s, t, y: losses.kd_loss(s, t, y, tau=cfg.dpkd_tau, alpha=cfg.dpkd_alpha,
                                                        reduction="none"),
                         True, cfg.dpkd_alpha + (1 - cfg.dpkd_alpha) * cfg.dpkd_tau ** 2)
