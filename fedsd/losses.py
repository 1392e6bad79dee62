"""Per-sample losses of the five methods (SPEC §3, §4, §6).

Every loss is computed per sample and then averaged over the batch (never over classes), so
Opacus' per-sample gradients are the gradients of each sample's own loss. Teacher logits are
constants: they are detached here, whatever the caller passed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "none")


def _reduce(per_sample: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return per_sample.mean()
    if reduction == "none":
        return per_sample
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")


def cross_entropy(student_logits, target, *, tau: float = 1.0, reduction: str = "mean"):
    """CE(softmax_τ(z_s), y) per sample."""
    _check_positive(tau=tau)
    return _reduce(F.cross_entropy(student_logits / tau, target, reduction="none"), reduction)


def kl_distillation(student_logits, teacher_logits, *, tau: float, reduction: str = "mean"):
    """τ² · KL(softmax_τ(z_t) ‖ softmax_τ(z_s)) per sample: Σ_j p_t,j (log p_t,j − log p_s,j)."""
    _check_positive(tau=tau)
    log_p_s = F.log_softmax(student_logits / tau, dim=1)
    log_p_t = F.log_softmax(teacher_logits.detach() / tau, dim=1)
    per_sample = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=1)
    return _reduce(tau * tau * per_sample, reduction)


def dp3sd_loss(student_logits, teacher_logits, target, *, tau_s, tau_t, alpha, distill_weight=1.0,
               reduction="mean"):
    """DP3SD: α·CE(softmax_τs(z_s), y) + w·(1−α)·τt²·KL(softmax_τt(z_t) ‖ softmax_τt(z_s)); w = 1 is
    the papers' loss (w: --distill-schedule)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] for dp3sd, got {alpha}")
    ce = cross_entropy(student_logits, target, tau=tau_s, reduction="none")
    kd = kl_distillation(student_logits, teacher_logits, tau=tau_t, reduction="none")
    return _reduce(alpha * ce + distill_weight * (1.0 - alpha) * kd, reduction)


def dpdsd_loss(student_logits, teacher_logits, target, *, tau, alpha, beta, reduction="mean"):
    """DPDSD: CE(softmax(z_s), y) + α·TCSD + β·NCSD, with the per-sample gate e^γ, γ = T_t − 1/K.

    TCSD = −e^γ·T_t·log S_t and NCSD = −e^γ·Σ_{i≠t} T_i·log S_i, with T, S at temperature τ.
    """
    _check_positive(tau=tau)
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    num_classes = student_logits.shape[1]
    teacher_probs = F.softmax(teacher_logits.detach() / tau, dim=1)
    log_s = F.log_softmax(student_logits / tau, dim=1)
    target_mask = F.one_hot(target, num_classes).to(log_s.dtype)
    t_target = (teacher_probs * target_mask).sum(dim=1)
    gate = torch.exp(t_target - 1.0 / num_classes)
    tcsd = -gate * t_target * (log_s * target_mask).sum(dim=1)
    ncsd = -gate * (teacher_probs * (1.0 - target_mask) * log_s).sum(dim=1)
    ce = F.cross_entropy(student_logits, target, reduction="none")
    return _reduce(ce + alpha * tcsd + beta * ncsd, reduction)


def kd_loss(student_logits, teacher_logits, target, *, tau, alpha, reduction="mean"):
    """DPKD's student loss: α·CE + (1−α)·τ²·KL(teacher ‖ student) at temperature τ (CE at τ=1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] for dpkd, got {alpha}")
    ce = cross_entropy(student_logits, target, reduction="none")
    kd = kl_distillation(student_logits, teacher_logits, tau=tau, reduction="none")
    return _reduce(alpha * ce + (1.0 - alpha) * kd, reduction)

