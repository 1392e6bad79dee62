"""DP3SD: self-distillation from the model itself, with a sparsified student (τs) and a
smoothed teacher (τt), after --distill-warmup-epochs of sharpened cross-entropy."""
from .. import losses
from ..settings import check_setting
from . import EpochLoss, Method, cross_entropy, distill_weight, warming_up


class DP3SD(Method):
    name = "dp3sd"
    self_distilling = True

    def check(self, cfg):
        check_setting(0 <= cfg.alpha <= 1, "--alpha", f"must be in [0, 1] for {self.name}", cfg.alpha)

    def epoch_loss(self, cfg, epoch):
        if warming_up(cfg, epoch):
            return cross_entropy(cfg.tau_s)
        weight = distill_weight(cfg, epoch)
        # CE is ln K at any temperature, τt²·KL(teacher ‖ uniform) ≤ τt²·ln K
        return EpochLoss(lambda s, t, y: losses.dp3sd_loss(s, t, y, tau_s=cfg.tau_s, tau_t=cfg.tau_t, alpha=cfg.alpha,
                                                           distill_weight=weight, reduction="none"),
                         True, cfg.alpha + weight * (1 - cfg.alpha) * cfg.tau_t ** 2)
