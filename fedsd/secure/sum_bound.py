"""How large an honest client's update can be: the bound a server checks a decoded secure sum
against before it applies it (fedsd.secure.secagg hides each update, so a member that sends 2^62 in
every coordinate is seen only in the sum). Everything here is from the run's public settings
and the round's public plan; nothing from any client's data.

Local noise (each client adds all of its noise; docs/algorithms.md, "DP-SGD"). One local step
moves the weights by lr · (g + σC·ξ) / B, g the sum of at most b clipped gradients (‖g‖ ≤ C·b),
ξ ~ N(0, I_d), B the expected batch. With momentum μ the step's velocity is a sum of past
steps weighted by μ^i, at most 1/(1 − μ) times the largest one. So over S steps

    ‖Δ‖ ≤ S · lr · (C · b_max + σC · (√d + z)) / (B · (1 − μ)),

with b_max the Poisson batch's tail (Bernstein's inequality, P(b ≥ B + t) ≤ exp(−t²/(2(B + t/3))))
and z the Gaussian norm's (P(‖ξ‖ ≥ √d + z) ≤ exp(−z²/2), Laurent–Massart), each at TAIL / S per
step. A released EMA of the iterates is a convex combination of them: the same bound holds.

Distributed noise (one DP-SGD step a round, fedsd.secure.distributed_noise): the decoded sum is the
clients' quantised clipped sums plus Skellam noise of variance μ a coordinate; its norm is at
most γ·C·b_max + √d (stochastic rounding, one unit a coordinate at most, from each client) plus
√d times the largest coordinate of the noise, P1 − P2 with P1, P2 ~ Poisson(μ/2), each within
Bernstein's deviation of μ/2 (a loose bound, √(log d) times the noise's typical norm, and proven).

TAIL = 1e-9: an honest round is refused once in a billion rounds at most. A member can still send
any update within the bound (docs/algorithms.md, "What it assumes"); robust aggregation under
secure aggregation is beyond this check.
"""
from __future__ import annotations

import math

TAIL = 1e-9


def poisson_tail(mean: float, p: float) -> float:
    """b_max: P(b ≥ b_max) ≤ p for b ~ Poisson(mean) (or a binomial of that mean), by Bernstein."""
    log = math.log(1 / p)
    t = log / 3 + math.sqrt((log / 3) ** 2 + 2 * mean * log)
    return mean + t


def gaussian_norm_tail(dim: int, p: float) -> float:
    """r: P(‖ξ‖ ≥ r) ≤ p for ξ ~ N(0, I_dim) (Laurent & Massart's bound, Lipschitz form)."""
    return math.sqrt(dim) + math.sqrt(2 * math.log(1 / p))


def local_update_bound(*, lr: float, clip: float, batch_size: float, noise_multiplier: float, steps: int,
                       momentum: float, dim: int, tail: float = TAIL) -> float:
    """The L2 norm an honest client's update (local DP-SGD, local noise) stays below, but with
    probability `tail`."""
    steps = max(1, int(steps))
    p = tail / (2 * steps)
    step = (clip * poisson_tail(batch_size, p) + noise_multiplier * clip * gaussian_norm_tail(dim, p)) / batch_size
    return steps * lr * step / (1 - min(max(momentum, 0.0), 0.999))


def distributed_sum_bound(*, clip_units: float, expected_batch: float, variance: float, dim: int, clients: int,
                          tail: float = TAIL) -> float:
    """The L2 norm of an honest decoded sum under distributed noise, in quantisation units:
    clip_units = γ·C, the clipped sum's norm per sample; variance = μ, the total Skellam
    variance a coordinate; `clients` quantise (one rounding unit a coordinate each)."""
    half = variance / 2
    coordinate = 2 * (poisson_tail(half, tail / (4 * dim)) - half)  # |P1 − μ/2| + |P2 − μ/2|, both tails
    return clip_units * poisson_tail(expected_batch, tail / 2) + clients * math.sqrt(dim) + math.sqrt(dim) * coordinate
