"""DPDSD: self-distillation decoupled into the target class's term (TCSD, weight α) and the
non-target classes' (NCSD, weight β), after --distill-warmup-epochs of cross-entropy."""
import math

from .. import losses
from . import EpochLoss, Method, distill_weight, warming_up


class DPDSD(Method):
    name = "dpdsd"
    self_distilling = True

    def epoch_loss(self, cfg, epoch):
        if warming_up(cfg, epoch):
            return super().epoch_loss(cfg, epoch)
        alpha, beta = (distill_weight(cfg, epoch) * w for w in (cfg.alpha, cfg.beta))
        # α·TCSD + β·NCSD ≤ e·max(α, β)·ln K: its gate e^γ < e weighs teacher probabilities that sum to 1
        return EpochLoss(lambda s, t, y: losses.dpdsd_loss(s, t, y, tau=cfg.tau, alpha=alpha, beta=beta,
                                                           reduction="none"),
                         True, 1 + math.e * max(alpha, beta))
