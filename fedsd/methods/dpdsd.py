"""DPDSD: self-distillation decoupled into the target class's term (TCSD, weight α) and the
non-target classes' (NCSD, weight β), after --distill-warmup-epochs of cross-entropy.

Two readings of its loss (--dpdsd-loss): its equations (10)-(11) as written (the papers'
literal reading), or the Decoupled Knowledge Distillation its text cites (Zhao et al., 2022):
binary distillation of the target class and multi-class distillation of the non-target ones,
each a KL at temperature τ scaled by τ². Its cross-entropy is at temperature 1, or at τ as
eq. (5)-(6) and Algorithm 1's f(θ_S, x_i, τ) can be read (--dpdsd-ce)."""
import math
from dataclasses import dataclass
from typing import Protocol

from fedsd.methods import losses
from fedsd.settings.declared import setting
from fedsd.methods.base import (POSITIVE, EpochLoss, SelfDistillationConfig, SelfDistilling, SelfDistillingRun,
                                cross_entropy, distill_weight, register, warming_up)

PAPERS = "the paper's"
# DPDSD's (τ, α, β) per data set, its paper's §4.1 (docs/algorithms.md)
PAPER = {"mnist": dict(tau=2.0, alpha=0.1, beta=0.5), "fmnist": dict(tau=5.0, alpha=0.1, beta=0.3),
         "cifar10": dict(tau=5.0, alpha=0.1, beta=0.3)}
NON_NEGATIVE = (lambda v: v >= 0, "must be >= 0")
LOSSES = ("equations", "dkd")
CE_TEMPERATURES = ("one", "tau")


def paper(key: str) -> dict:
    return {d: values[key] for d, values in PAPER.items()}


@dataclass
class DPDSDConfig(SelfDistillationConfig):
    dpdsd_tau: float | None = setting(None, "the distillation temperature τ", resolve=paper("tau"), source=PAPERS,
                                check=POSITIVE)
    dpdsd_alpha: float | None = setting(None, "weight α of the target class's term (TCSD)", resolve=paper("alpha"),
                                  source=PAPERS, check=NON_NEGATIVE)
    dpdsd_beta: float | None = setting(None, "weight β of the non-target classes' term (NCSD)",
                                 resolve=paper("beta"), source=PAPERS, check=NON_NEGATIVE)
    dpdsd_loss: str = setting("equations", "its loss as its equations (10)-(11) write it (equations), or in "
                                           "Decoupled KD's form (dkd: α·τ²·KL of the target/rest split + "
                                           "β·τ²·KL over the non-target classes)", choices=LOSSES)
    dpdsd_ce: str = setting("one", "the temperature of its cross-entropy term: one, or tau, its --dpdsd-tau (eq. 5-6)",
                            choices=CE_TEMPERATURES)


class DPDSDRun(SelfDistillingRun, Protocol):
    """What DPDSD reads of a run's resolved settings (declared in DPDSDConfig)."""
    dpdsd_tau: float
    dpdsd_alpha: float
    dpdsd_beta: float
    dpdsd_loss: str
    dpdsd_ce: str


@register
class DPDSD(SelfDistilling[DPDSDRun]):
    name = "dpdsd"
    Settings = DPDSDConfig

    def epoch_loss(self, cfg: DPDSDRun, epoch: int) -> EpochLoss:
        ce_tau = cfg.dpdsd_tau if cfg.dpdsd_ce == "tau" else 1.0
        if warming_up(cfg, epoch):
            return cross_entropy(ce_tau)
        alpha, beta = (distill_weight(cfg, epoch) * w for w in (cfg.dpdsd_alpha, cfg.dpdsd_beta))
        if cfg.dpdsd_loss == "dkd":
            # α·τ²·KL(b_T ‖ b_S) + β·τ²·KL(T̂ ‖ Ŝ) ≤ (α + β)·τ²·ln K at a uniform student
            return EpochLoss(lambda s, t, y: losses.dkd_loss(s, t, y, tau=cfg.dpdsd_tau, alpha=alpha, beta=beta,
                                                             ce_tau=ce_tau, reduction="none"),
                             True, 1 + (alpha + beta) * cfg.dpdsd_tau ** 2)
        # α·TCSD + β·NCSD ≤ e·max(α, β)·ln K: its gate e^γ < e weighs teacher probabilities that sum to 1
        return EpochLoss(lambda s, t, y: losses.dpdsd_loss(s, t, y, tau=cfg.dpdsd_tau, alpha=alpha, beta=beta,
                                                           ce_tau=ce_tau, reduction="none"),
                         True, 1 + math.e * max(alpha, beta))
