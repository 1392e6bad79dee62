"""Adaptive clipping for records (Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021): the clip norm C follows the γ-th quantile of the
per-sample gradient norms instead of staying where it started.

Each step, besides the clipped gradient sum, the trainer releases how many of the batch's samples
had a gradient norm at most C, centred: Σ_i (b_i − ½) + N(0, σ_b²), b_i ∈ {0, 1}. Centred, one
record added or removed moves it by ½ (the paper's §3). With b̄ = that / B + ½, B the expected
batch size (public; never the size of the batch drawn, which Poisson sampling keeps private), the
next step's clip is C · exp(−η (b̄ − γ)): the paper's geometric update (its Algorithm 1, η_C).

Accounting (the paper's Theorem 1): the gradient sum at noise σ_Δ·C (sensitivity C) and the count
at σ_b (sensitivity ½), on the same Poisson sample, are together one Gaussian mechanism of noise
multiplier z with z⁻² = σ_Δ⁻² + (2σ_b)⁻². So the accountant plans z for the whole run as it does
without adaptation (fedsd.privacy.accounting), and the gradient takes σ_Δ = (z⁻² − (2σ_b)⁻²)^−½,
which needs σ_b > z/2. dp_accounting's composition of the two gives the same ε (a test checks it).

Written here rather than taken from Opacus' AdaClipDPOptimizer, which serves only its per-sample
route (not book-keeping, the fused kernel or ghost clipping), divides the count by the size of the
batch drawn, and counts Σ b_i (sensitivity 1) while it takes Theorem 1's σ_Δ, made for the
centred count's ½.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedsd.errors import ConfigError

# The paper's defaults: η_C = 0.2 (its geometric update's rate) and σ_b = m/20 (m the expected
# number of contributions a step: here the expected batch size B).
DEFAULT_LR = 0.2
COUNT_NOISE_PER_RECORD = 1 / 20
# Bounds on what a server's settings can make of the clip (a review playing the attacker overflowed
# the update with --clip-lr 1e4, and drove the clip to float32's subnormals): a step moves the clip
# by at most e^(2 MAX_LR) (the rate is refused above it, the noised fraction below the clip is taken
# in [−1, 2], post-processing), and the clip stays within [start / SPAN, start × SPAN], at or above the least
# one (LEAST_CLIP for records, a plan's 1/√d for whole clients), and the start at most MAX_START.
MAX_LR = 10.0
SPAN = 1e6
MAX_START = 1e6
# Records: a clip factor C / ‖g‖ rounds to float32's subnormals once ‖g‖ / C exceeds 2^126; its
# rounding then adds up to 2^-149 ‖g‖ ≤ 4.8e-7 to a clipped norm, 0.5 % of C = 1e-4 (and less above).
LEAST_CLIP = 1e-4


@dataclass(frozen=True)
class QuantileClip:
    """A run's clip estimate rule: its quantile γ, rate η, count noise σ_b and expected batch B."""

    quantile: float
    lr: float
    count_noise: float
    expected_batch: float
    start: float  # the clip it starts from (--clip, --update-clip)
    least: float = LEAST_CLIP
    flag: str = "--clip-count-noise"  # the setting σ_b came from, named where it does not fit

    @classmethod
    def of(cls, cfg) -> "QuantileClip | None":
        """The rule a run's settings ask for (--clip-quantile, --clip-lr, --clip-count-noise); None: C fixed."""
        if not cfg.clip_quantile:
            return None
        return cls(cfg.clip_quantile, cfg.clip_lr, cfg.clip_count_noise or cfg.batch_size * COUNT_NOISE_PER_RECORD,
                   float(cfg.batch_size), float(cfg.clip))

    def gradient_noise_multiplier(self, z: float) -> float:
        """σ_Δ, the gradient's noise multiplier that, with the count's σ_b, spends what one Gaussian
        step at z does (Theorem 1). ConfigError, naming the flag, where σ_b ≤ z/2."""
        if z == 0:
            return 0.0
        if not 2 * self.count_noise > z:
            raise ConfigError(f"{self.flag}: {self.count_noise:g} leaves nothing of the run's noise multiplier "
                              f"z = {z:.4g} for the gradient; it must be above z/2 = {z / 2:.4g}")
        return (z ** -2 - (2 * self.count_noise) ** -2) ** -0.5

    def next_clip(self, clip: float, released_count: float) -> float:
        """The clip after a step whose centred count was released as `released_count` (noised):
        the noised fraction below taken in [−1, 2] (far outside what the paper's noise, 1/20 of
        it, moves it to; a noise a server sets at 1e12 no further) and the clip kept within its
        bounds: post-processing."""
        below = min(2.0, max(-1.0, released_count / self.expected_batch + 0.5))
        moved = clip * math.exp(-min(self.lr, MAX_LR) * (below - self.quantile))
        return min(max(moved, self.start / SPAN, self.least), self.start * SPAN)


def centred_count(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """Σ_i (b_i − ½), b_i = 1 where sample i's gradient norm is at most `clip`. A sample whose
    gradient is not finite joins the clipped sum as zero (a trainer with secret draws), so it
    counts as at most the clip; the same work for any data."""
    below = torch.where(torch.isfinite(norms), norms <= clip, torch.ones((), dtype=torch.bool, device=norms.device))
    return below.sum(dtype=torch.float64) - 0.5 * len(norms)
