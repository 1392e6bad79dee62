"""DP3SD: self-distillation from the model itself, with a sparsified student (τs) and a
smoothed teacher (τt), after --distill-warmup-epochs of cross-entropy: sharpened at τs by
default (CE_τs, the student's term of its loss), or plain (τ = 1, the papers' DP-SGD warm-up)
with --dp3sd-warmup plain."""
from dataclasses import dataclass
from typing import Protocol

from fedsd.methods import losses
from fedsd.settings.declared import setting
from fedsd.methods.base import (POSITIVE, UNIT_INTERVAL, EpochLoss, SelfDistillationConfig, SelfDistilling,
                                SelfDistillingRun, cross_entropy, distill_weight, register, warming_up)

PAPERS = "the paper's"
# DP3SD's (τs, τt, α) per data set, its paper's §4.1 (docs/algorithms.md)
PAPER = {"mnist": dict(tau_s=0.1, tau_t=5.0, alpha=0.1), "fmnist": dict(tau_s=0.3, tau_t=5.0, alpha=0.3),
         "cifar10": dict(tau_s=0.1, tau_t=5.0, alpha=0.3)}
KL_REDUCTIONS = ("batchmean", "mean")
# the warm-up's cross-entropy: at τs (this code's default, CE_τs) or at 1 (the papers' plain DP-SGD)
WARMUPS = ("sharpened", "plain")


def paper(key: str) -> dict:
    return {d: values[key] for d, values in PAPER.items()}


@dataclass
class DP3SDConfig(SelfDistillationConfig):
    dp3sd_tau_s: float | None = setting(None, "the student's sparsifying temperature τs", resolve=paper("tau_s"),
                                  source=PAPERS, check=POSITIVE)
    dp3sd_tau_t: float | None = setting(None, "the teacher's smoothing temperature τt", resolve=paper("tau_t"),
                                  source=PAPERS, check=POSITIVE)
    dp3sd_alpha: float | None = setting(None, "weight α of the cross-entropy term (1 − α: the distillation's)",
                                  resolve=paper("alpha"), source=PAPERS, check=UNIT_INTERVAL)
    dp3sd_kl_reduction: str = setting("batchmean", "the KL term per sample, summed over the classes (batchmean, "
                                             "the KL itself) or averaged over them too (mean, ÷K: PyTorch's "
                                             "KLDivLoss(reduction='mean'), a common implementation)",
                                choices=KL_REDUCTIONS)
    dp3sd_warmup: str = setting("sharpened", "DP3SD: the warm-up's loss (--distill-warmup-epochs): sharpened, "
                                             "cross-entropy at τs (CE_τs, its loss's student term); plain, at 1 "
                                             "(the papers' DP-SGD warm-up)", choices=WARMUPS)


class DP3SDRun(SelfDistillingRun, Protocol):
    """What DP3SD reads of a run's resolved settings (declared in DP3SDConfig)."""
    dp3sd_tau_s: float
    dp3sd_tau_t: float
    dp3sd_alpha: float
    dp3sd_kl_reduction: str
    dp3sd_warmup: str


@register
class DP3SD(SelfDistilling[DP3SDRun]):
    name = "dp3sd"
    Settings = DP3SDConfig

    def epoch_loss(self, cfg: DP3SDRun, epoch: int) -> EpochLoss:
        if warming_up(cfg, epoch):
            return cross_entropy(cfg.dp3sd_tau_s if cfg.dp3sd_warmup == "sharpened" else 1.0)
        weight = distill_weight(cfg, epoch)
        class_mean = cfg.dp3sd_kl_reduction == "mean"
        # CE is ln K at any temperature, τt²·KL(teacher ‖ uniform) ≤ τt²·ln K
        return EpochLoss(lambda s, t, y: losses.dp3sd_loss(s, t, y, tau_s=cfg.dp3sd_tau_s,
                                                           tau_t=cfg.dp3sd_tau_t, alpha=cfg.dp3sd_alpha,
                                                           distill_weight=weight, class_mean=class_mean,
                                                           reduction="none"),
                         True, cfg.dp3sd_alpha + weight * (1 - cfg.dp3sd_alpha) * cfg.dp3sd_tau_t ** 2)
