"""Per-sample losses of the five methods (docs/algorithms.md, "The methods").

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


def one_hot(target: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The labels as one-hot rows shaped and typed as `like` (N, K): F.one_hot's values, written so
    that torch.func.vmap can take per-sample gradients through it (F.one_hot reads the labels'
    maximum, data-dependent control flow that vmap refuses)."""
    return torch.zeros_like(like).scatter(1, target[:, None], 1.0)


def cross_entropy(student_logits, target, *, tau: float = 1.0, reduction: str = "mean"):
    """CE(softmax_τ(z_s), y) per sample."""
    _check_positive(tau=tau)
    return _reduce(F.cross_entropy(student_logits / tau, target, reduction="none"), reduction)


def kl_distillation(student_logits, teacher_logits, *, tau: float, class_mean: bool = False,
                    reduction: str = "mean"):
    """τ² · KL(softmax_τ(z_t) ‖ softmax_τ(z_s)) per sample: Σ_j p_t,j (log p_t,j − log p_s,j);
    with `class_mean`, averaged over the K classes instead (÷K), as PyTorch's
    KLDivLoss(reduction='mean') averages over every element."""
    _check_positive(tau=tau)
    log_p_s = F.log_softmax(student_logits / tau, dim=1)
    log_p_t = F.log_softmax(teacher_logits.detach() / tau, dim=1)
    per_sample = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=1)
    if class_mean:
        per_sample = per_sample / student_logits.shape[1]
    return _reduce(tau * tau * per_sample, reduction)


def dp3sd_loss(student_logits, teacher_logits, target, *, tau_s, tau_t, alpha, distill_weight=1.0,
               class_mean: bool = False, reduction="mean"):
    """DP3SD: α·CE(softmax_τs(z_s), y) + w·(1−α)·τt²·KL(softmax_τt(z_t) ‖ softmax_τt(z_s)); w = 1 is
    the papers' loss (w: --distill-schedule; `class_mean`: the KL ÷K, --dp3sd-kl-reduction mean)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] for dp3sd, got {alpha}")
    ce = cross_entropy(student_logits, target, tau=tau_s, reduction="none")
    kd = kl_distillation(student_logits, teacher_logits, tau=tau_t, class_mean=class_mean, reduction="none")
    return _reduce(alpha * ce + distill_weight * (1.0 - alpha) * kd, reduction)


def dpdsd_loss(student_logits, teacher_logits, target, *, tau, alpha, beta, ce_tau: float = 1.0, reduction="mean"):
    """DPDSD as its equations write it: CE(softmax_{ce_tau}(z_s), y) + α·TCSD + β·NCSD, with the
    per-sample gate e^γ, γ = T_t − 1/K (ce_tau = 1: the papers' CE; τ: eq. 5-6's).

    TCSD = −e^γ·T_t·log S_t and NCSD = −e^γ·Σ_{i≠t} T_i·log S_i, with T, S at temperature τ.
    """
    _check_positive(tau=tau, ce_tau=ce_tau)
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    num_classes = student_logits.shape[1]
    teacher_probs = F.softmax(teacher_logits.detach() / tau, dim=1)
    log_s = F.log_softmax(student_logits / tau, dim=1)
    target_mask = one_hot(target, log_s)
    t_target = (teacher_probs * target_mask).sum(dim=1)
    gate = torch.exp(t_target - 1.0 / num_classes)
    tcsd = -gate * t_target * (log_s * target_mask).sum(dim=1)
    ncsd = -gate * (teacher_probs * (1.0 - target_mask) * log_s).sum(dim=1)
    ce = F.cross_entropy(student_logits / ce_tau, target, reduction="none")
    return _reduce(ce + alpha * tcsd + beta * ncsd, reduction)


def dkd_loss(student_logits, teacher_logits, target, *, tau, alpha, beta, ce_tau: float = 1.0, reduction="mean"):
    """DPDSD in Decoupled Knowledge Distillation's form (Zhao et al., CVPR 2022), which its text
    cites: CE(softmax_{ce_tau}(z_s), y) + α·τ²·KL(b_T ‖ b_S) + β·τ²·KL(T̂ ‖ Ŝ), where b = (p_t,
    1 − p_t) splits a distribution at temperature τ into the target class and the rest, and
    T̂, Ŝ are the teacher's and the student's distributions over the non-target classes alone,
    renormalised. Its minimiser is the teacher's distribution; the equations' is not."""
    _check_positive(tau=tau, ce_tau=ce_tau)
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    target_mask = one_hot(target, student_logits).bool()

    def split(logits):
        """log b = (log p_t, log(1 − p_t)), and the log-probabilities over the non-target classes."""
        z = logits / tau
        log_all = torch.logsumexp(z, dim=1)
        rest = z.masked_fill(target_mask, -1e4)  # exp(−1e4) = 0, and finite: no NaN in any gradient
        log_rest = torch.logsumexp(rest, dim=1)
        log_b = torch.stack([z.gather(1, target[:, None])[:, 0] - log_all, log_rest - log_all], dim=1)
        return log_b, rest - log_rest[:, None]

    log_b_s, log_nt_s = split(student_logits)
    log_b_t, log_nt_t = split(teacher_logits.detach())
    tckd = (log_b_t.exp() * (log_b_t - log_b_s)).sum(dim=1)
    nckd = (log_nt_t.exp() * (log_nt_t - log_nt_s)).sum(dim=1)  # the target's entry: probability 0
    ce = F.cross_entropy(student_logits / ce_tau, target, reduction="none")
    return _reduce(ce + tau * tau * (alpha * tckd + beta * nckd), reduction)


def kd_loss(student_logits, teacher_logits, target, *, tau, alpha, reduction="mean"):
    """DPKD's student loss: α·CE + (1−α)·τ²·KL(teacher ‖ student) at temperature τ (CE at τ=1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] for dpkd, got {alpha}")
    ce = cross_entropy(student_logits, target, reduction="none")
    kd = kl_distillation(student_logits, teacher_logits, tau=tau, reduction="none")
    return _reduce(alpha * ce + (1.0 - alpha) * kd, reduction)

