"""DPKD: two stages in one run. Stage 1 trains a teacher with DP-SGD; stage 2 trains a fresh
student on cross-entropy plus the KL to that fixed teacher, with DP-SGD again. The budget is
the run's, over both stages."""
from .. import losses
from ..models import build_model
from ..seeds import SEED_KD_STUDENT, derive_seed
from ..settings import check_setting
from . import EpochLoss, Method, release_of

# Open in the papers; chosen on FMNIST's validation split: τ and α
# (results/sweeps/fmnist-dpkd-tau-alpha), the stage split (results/sweeps/fmnist-dpkd-stage-split:
# the half); results/README.md has the numbers.
DEFAULTS = dict(tau=5.0, alpha=0.7)
TEACHER_FRACTION = 0.5


class DPKD(Method):
    name = "dpkd"
    groups = ("student", "kd_teacher")

    def defaults(self, cfg, paper):
        return dict(DEFAULTS, kd_teacher_epochs=max(1, round(cfg.epochs * TEACHER_FRACTION)))

    def check(self, cfg):
        check_setting(0 <= cfg.alpha <= 1, "--alpha", f"must be in [0, 1] for {self.name}", cfg.alpha)
        check_setting(1 <= cfg.kd_teacher_epochs < cfg.epochs, "--kd-teacher-epochs",
                      f"must be in [1, epochs) = [1, {cfg.epochs}) so both stages train", cfg.kd_teacher_epochs)
        check_setting(release_of(cfg) == "student", "--release", "dpkd releases its student: its second stage "
                      "starts a fresh one, which an average over both stages would mix with its teacher", cfg.release)

    def on_epoch_start(self, cfg, epoch, model, trainer):
        if epoch <= cfg.kd_teacher_epochs:
            return
        if "kd_teacher" not in model:
            # Stage 2 begins: the stage-1 model becomes the fixed teacher, the student starts afresh.
            model["kd_teacher"] = trainer.student_weights()
            fresh = build_model(cfg.model, trainer.data.num_classes, seed=derive_seed(cfg.seed, SEED_KD_STUDENT),
                                activation=cfg.activation)
            trainer.load_student(fresh.state_dict())
        trainer.load_teacher(model["kd_teacher"])

    def epoch_loss(self, cfg, epoch):
        if epoch <= cfg.kd_teacher_epochs:
            return super().epoch_loss(cfg, epoch)
        # τ²·KL(teacher ‖ uniform) ≤ τ²·ln K
        return EpochLoss(lambda s, t, y: losses.kd_loss(s, t, y, tau=cfg.tau, alpha=cfg.alpha, reduction="none"),
                         True, cfg.alpha + (1 - cfg.alpha) * cfg.tau ** 2)
