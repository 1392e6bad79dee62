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

Under local noise the bound takes the run's public numbers only (`public_local_bound`), never
what a client reports: σ above any honest client's and the steps of the largest client the run
admits (secagg-max-records). Each owner scales an update above it down to it before the update
enters the sum (a post-processing of its DP release), so an honest sum never fails the check and a
member's report cannot loosen it.

TAIL = 1e-9: an honest round is refused once in a billion rounds at most. A member can still send
any update within the bound (docs/algorithms.md, "What it assumes"); robust aggregation under
secure aggregation is beyond this check.
"""
from __future__ import annotations

import math

from fedsd.privacy import accounting

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


def public_noise_multiplier(*, epsilon: float, delta: float, batch_size: int, epochs: int,
                            accountant: str = "rdp") -> float:
    """The largest σ an honest client calibrates for `epochs` epochs at (ε, δ), whatever its number
    of records n ≥ B (a client with fewer is refused): ⌈n/B⌉ steps an epoch at q = B/n. At
    ⌈n/B⌉ = 2 (q → 1) it is two full-batch Gaussian steps an epoch, √2 times the σ of one (a
    Gaussian's Rényi divergence adds up over steps: σ² ∝ steps at q = 1); more steps an epoch come
    with q ≤ 1/2, whose amplification outweighs them (tests/app/client/test_secure_aggregation.py checks
    n from B to 60,000)."""
    one = accounting.plan(epsilon, delta, batch_size, batch_size, epochs, accountant).noise_multiplier
    return math.sqrt(2) * one


def public_local_bound(cfg, fed, dim: int, tail: float = TAIL) -> float:
    """The L2 norm of an honest local-noise update of the run `cfg`, `fed` (its training and
    federation settings), from public numbers only: σ from `public_noise_multiplier` over the
    run's planned epochs, the steps a round of a client holding secagg-max-records records."""
    epochs = fed.planned_rounds * fed.local_epochs
    sigma = public_noise_multiplier(epsilon=cfg.epsilon, delta=cfg.delta, batch_size=cfg.batch_size, epochs=epochs,
                                    accountant=cfg.accountant)
    steps = fed.local_epochs * accounting.steps_per_epoch(max(fed.secagg_max_records, cfg.batch_size), cfg.batch_size)
    return local_update_bound(lr=cfg.lr, clip=cfg.clip, batch_size=cfg.batch_size, noise_multiplier=sigma,
                              steps=steps, momentum=cfg.momentum, dim=dim, tail=tail)
