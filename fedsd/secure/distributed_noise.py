"""Distributed noise for secure aggregation: each client quantises its clipped sum to integers
and adds a share of Skellam noise, so that the sum the server unmasks carries all the noise
central DP-SGD would add, and no single update carries it alone (docs/algorithms.md).

- **Skellam** (Agarwal, Kairouz & Liu, NeurIPS 2021): Sk(μ) = Poisson(μ/2) − Poisson(μ/2), of
  variance μ, and a sum of independent Skellams is a Skellam: t honest clients that each add
  Sk(μ/t) give the sum Sk(μ) whatever the others add. Each coordinate's two Poissons are drawn
  by numpy's sampler fed from AES-128-CTR (randomgen's AESCounter, a numpy bit generator by
  numpy's random's author), keyed by 128 bits of the client's secret stream, or, in a seeded
  simulation, by the run's seed.
- **Quantisation, and what it does to the sensitivity** (a stated bound, no rotation): the
  clipped sum x is scaled by γ and rounded stochastically, ⌊γx + u⌋ with u uniform on [0, 1)
  per coordinate. Two neighbouring data sets' sums differ by at most γC in L2; rounded with the
  same u, they differ by less than 1 more in each coordinate, so the integer vectors differ by
  Δ2 ≤ γC + √d in L2 and Δ1 ≤ √d·γC + d in L1. The output is a mixture over u of integer
  shifts each within these bounds, and Rényi divergence is jointly quasi-convex, so the bound
  holds for the mechanism. γ = 2^20 / C makes √d a rounding cost of √d / 2^20 (0.02 % at
  d = 40,000).
- **Modulus**: 2^64 (uint64; secure aggregation sums modulo 2^64). The sum does not wrap while
  |Σ| < 2^63 in every coordinate: each sampled record adds at most 2^20, so a round may hold up
  to 2^42 records with room for the noise (at most about z·2^20·√n·10).
- **Accounting**: the Skellam mechanism's RDP at integer order α (Agarwal et al., Corollary 3.6),
  with μ the variance of the honest sum: ε(α) ≤ αΔ2²/(2μ) + min(((2α−1)Δ2² + 6Δ1)/(4μ²),
  3Δ1/(2μ)). That is the Gaussian's α/(2z²) (z = √μ/Δ2) plus a term c(α); it is at most the
  Gaussian's with z_e, 1/z_e² = 1/z² + max_α 2c(α)/α. Poisson subsampling at integer orders is
  the binomial sum Σ_k C(α,k)(1−q)^(α−k) q^k e^((k−1)ε(k)) for the removal of a record (exact),
  which Opacus computes for the Gaussian; so the run is accounted as the subsampled Gaussian at
  z_e over integer orders only. That the addition of a record costs no more than its removal is
  Mironov, Talwar & Zhang's result for the Gaussian; for Skellam it is checked numerically, in
  both directions against dp_accounting's PLD (tests/secure/test_distributed_noise.py).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from scipy import optimize

from fedsd.errors import ConfigError

QUANTISED_CLIP = float(1 << 20)  # γC: the clip norm in integer units
INTEGER_ORDERS = list(range(2, 257))  # the Skellam bound and the binomial sum hold at integer orders


def skellam_excess(order: int, l2: float, l1: float, variance: float) -> float:
    """c(α): what Skellam's RDP bound adds to the Gaussian's α·Δ2²/(2μ)."""
    return min(((2 * order - 1) * l2 ** 2 + 6 * l1) / (4 * variance ** 2), 3 * l1 / (2 * variance))


def skellam_rdp(order: int, l2: float, l1: float, variance: float) -> float:
    """Agarwal, Kairouz & Liu's bound on the Skellam mechanism's RDP at an integer order."""
    return order * l2 ** 2 / (2 * variance) + skellam_excess(order, l2, l1, variance)


def gaussian_equivalent(l2: float, l1: float, variance: float) -> float:
    """z_e with α/(2z_e²) ≥ the Skellam bound at every integer order: 1/z_e² = Δ2²/μ + max 2c(α)/α."""
    worst = max(2 * skellam_excess(a, l2, l1, variance) / a for a in INTEGER_ORDERS)
    return 1.0 / math.sqrt(l2 ** 2 / variance + worst)


@dataclass(frozen=True)
class NoisePlan:
    """What every client and the server agree on for a run with distributed noise.

    noise_multiplier: z, the honest sum's noise std over its sensitivity Δ2 (the central σ's
    counterpart); honest: t, the fewest clients whose shares are assumed in the sum; dim: d."""

    noise_multiplier: float
    clip: float
    sample_rate: float
    expected_batch: float
    honest: int
    dim: int

    @property
    def scale(self) -> float:
        return QUANTISED_CLIP / self.clip

    @property
    def l2(self) -> float:
        return QUANTISED_CLIP + math.sqrt(self.dim)

    @property
    def l1(self) -> float:
        return math.sqrt(self.dim) * QUANTISED_CLIP + self.dim

    @property
    def variance(self) -> float:
        """μ: the honest sum's Skellam variance per coordinate, in integer units."""
        return (self.noise_multiplier * self.l2) ** 2

    def share_variance(self) -> float:
        return self.variance / self.honest

    def gaussian_equivalent(self) -> float:
        """z_e: the Gaussian noise multiplier whose RDP is at least this mechanism's at every
        integer order (module docstring)."""
        if self.noise_multiplier == 0:
            return 0.0
        return gaussian_equivalent(self.l2, self.l1, self.variance)

    def epsilon(self, steps: int, delta: float) -> float:
        return integer_order_epsilon(self.gaussian_equivalent(), self.sample_rate, steps, delta)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> "NoisePlan":
        return cls(**{k: saved[k] for k in ("noise_multiplier", "clip", "sample_rate", "expected_batch",
                                              "honest", "dim")})

    def check(self) -> None:
        for name, ok in (("noise_multiplier", math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0),
                         ("clip", math.isfinite(self.clip) and self.clip > 0),
                         ("sample_rate", 0 < self.sample_rate <= 1),
                         ("expected_batch", math.isfinite(self.expected_batch) and self.expected_batch > 0),
                         ("honest", isinstance(self.honest, int) and self.honest >= 1),
                         ("dim", isinstance(self.dim, int) and self.dim >= 1)):
            if not ok:
                raise ConfigError(f"distributed noise: {name} = {getattr(self, name)!r} is out of range")


def least_clip(dim: int) -> float:
    """The smallest clip C whose clipped sum float32 computes within the sensitivity the noise
    covers, Δ2 = γC + √d (γ = 2^20 / C; the √d is quantisation's rounding allowance, in integer
    units). A per-sample clip factor C / ‖g‖, with ‖g‖ up to float32's largest finite value
    (< 2^128), can fall among float32's subnormals, whose step is 2^-149: a sample's clipped
    gradient can then be off by 2^-149 · 2^128 = 2^-21, that is 1 / (2C) integer units, on top of
    the rounding the allowance covers. At C ≥ 1 / √d that is at most √d / 2: the sensitivity is at
    most γC + 1.5√d (0.05 % above Δ2 at d = 10^6, which ε does not count), where a server's
    C = 1e-43 moved one record's part of the sum by 2.1 C (a review playing the attacker). Nor
    does Δ2 cover float32's relative rounding of the sum itself (2^-24 of it; clients/README.md)."""
    return 1.0 / math.sqrt(dim)


def check_own(plan: NoisePlan, what: str, least_noise: float = 0.0, **own) -> None:
    """A plan (from the server) refused unless it is in range, each named field is this client's
    own, its clip is one float32 clips within the sensitivity (`least_clip`), and its noise is at
    least the client's own calibration's (`least_noise`): what a client checks before it draws
    or sends anything (fedsd.secure.distributed_step, fedsd.secure.client_level)."""
    plan.check()
    for name, actual in own.items():
        if getattr(plan, name) != actual:
            raise ValueError(f"{what}: the plan's {name} is {getattr(plan, name)!r}, this client's is {actual!r}")
    if not plan.clip >= least_clip(plan.dim):
        raise ValueError(f"{what}: the plan's clip {plan.clip!r} is below 1/√d = {least_clip(plan.dim):.3g} for its "
                         f"{plan.dim} parameters, where float32's rounding of the clip factor could exceed the "
                         f"sensitivity the noise covers")
    if not plan.noise_multiplier >= least_noise:
        raise ValueError(f"{what}: the plan's noise_multiplier {plan.noise_multiplier!r} is below this client's own "
                         f"{least_noise!r} (its ε over its rounds)")


def integer_order_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of `steps` Poisson-subsampled Gaussian steps, over integer Rényi orders only."""
    if noise_multiplier == 0:
        return math.inf
    rdp = _integer_rdp_of_one_step(sample_rate, noise_multiplier) * steps  # what compute_rdp(steps=steps) returns
    with warnings.catch_warnings():  # the best order at an edge: a valid, looser bound (calibration's far ends)
        warnings.simplefilter("ignore", UserWarning)
        return float(get_privacy_spent(orders=INTEGER_ORDERS, rdp=rdp, delta=delta)[0])


@functools.lru_cache(maxsize=1024)
def _integer_rdp_of_one_step(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """Opacus' RDP of one subsampled Gaussian step at INTEGER_ORDERS (compute_rdp multiplies it
    by the steps, as above). Cached: an owner's every round asks ε of the same plan two to four
    times (its charge, its budget's checks, its reply's metrics), each 0.1-0.2 s of its CPU at
    the features recipe's q, which on a machine of ten owners was a third of their round's work."""
    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=INTEGER_ORDERS)
    rdp.flags.writeable = False
    return rdp


def calibrate(epsilon: float, delta: float, clip: float, sample_rate: float, expected_batch: float,
              steps: int, honest: int, dim: int) -> NoisePlan:
    """The smallest z whose `steps` steps spend at most ε."""
    def plan(z: float) -> NoisePlan:
        return NoisePlan(z, clip, sample_rate, expected_batch, honest, dim)

    def excess(log_z: float) -> float:
        return plan(math.exp(log_z)).epsilon(steps, delta) - epsilon

    if excess(math.log(200.0)) > 0:
        raise ConfigError(f"distributed noise: ε = {epsilon} is out of reach at q = {sample_rate:.4g} over "
                          f"{steps} steps (z > 200)")
    z = math.exp(optimize.brentq(excess, math.log(0.05), math.log(200.0), xtol=1e-6))
    while plan(z).epsilon(steps, delta) > epsilon:  # brentq's root may sit a hair on the wrong side
        z *= 1 + 1e-6
    result = plan(z)
    result.check()
    return result


def generator(key: bytes) -> np.random.Generator:
    """numpy's samplers over AES-128-CTR under a 16-byte key (randomgen's AESCounter)."""
    from randomgen import AESCounter

    if len(key) != 16:
        raise ValueError("the noise generator's key is 16 bytes")
    return np.random.Generator(AESCounter(key=int.from_bytes(key, "little")))


def encode(clipped_sum: np.ndarray, plan: NoisePlan, rng: np.random.Generator) -> np.ndarray:
    """A client's contribution: ⌊γx + u⌋ plus its Skellam share, as uint64 (two's complement)."""
    x = np.asarray(clipped_sum, dtype=np.float64)
    if x.shape != (plan.dim,):
        raise ValueError(f"encode: a vector of {plan.dim} values was expected, got shape {x.shape}")
    scaled = np.floor(x * plan.scale + rng.random(plan.dim))
    if not np.all(np.abs(scaled) < 2.0 ** 62):
        raise ValueError("encode: a clipped sum beyond the modulus' range (not finite or too large)")
    values = scaled.astype(np.int64)
    half = plan.share_variance() / 2
    if half > 0:
        values += rng.poisson(half, plan.dim) - rng.poisson(half, plan.dim)
    return values.view(np.uint64)


def decode(total: np.ndarray, plan: NoisePlan) -> np.ndarray:
    """The noisy sum of the clipped sums, in gradient units (float64), from the unmasked total."""
    return np.asarray(total, dtype=np.uint64).view(np.int64).astype(np.float64) / plan.scale


# -- the plan as run settings: what a server sends a deployment's services each round --------
PLAN_PREFIX = "noise-plan-"
PLAN_FIELDS = {"noise-multiplier": float, "clip": float, "sample-rate": float, "expected-batch": float,
               "honest": int, "dim": int, "rounds": int}


def to_settings(plan: NoisePlan, rounds: int) -> dict:
    """The plan and the run's length as flat settings (a round's ConfigRecord)."""
    values = {**{k.replace("_", "-"): v for k, v in plan.to_dict().items()}, "rounds": int(rounds)}
    return {PLAN_PREFIX + k: PLAN_FIELDS[k](values[k]) for k in PLAN_FIELDS}


def from_settings(flat: dict) -> tuple[NoisePlan, int]:
    """The plan and its length, taken out of `flat` (a server's, hostile until the service checks
    it against its own calibration): ConfigError naming a missing or mistyped field."""
    values = {}
    for name, kind in PLAN_FIELDS.items():
        key = PLAN_PREFIX + name
        value = flat.pop(key, None)
        if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{key}: an integer was expected, got {value!r}")
        if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)
                              or not math.isfinite(value)):
            raise ConfigError(f"{key}: a finite number was expected, got {value!r}")
        values[name.replace("-", "_")] = kind(value)
    rounds = values.pop("rounds")
    plan = NoisePlan(**values)
    plan.check()
    if rounds < 1:
        raise ConfigError(f"{PLAN_PREFIX}rounds = {rounds}: at least 1")
    return plan, rounds


@functools.lru_cache(maxsize=256)
def calibrated(epsilon: float, delta: float, clip: float, sample_rate: float, expected_batch: float, steps: int,
               honest: int, dim: int) -> NoisePlan:
    """`calibrate`, kept in memory: a service calibrates its own plan once a run, not once a round."""
    return calibrate(epsilon, delta, clip, sample_rate, expected_batch, steps, honest, dim)
