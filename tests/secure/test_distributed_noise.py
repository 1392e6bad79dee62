"""Distributed noise (fedsd.secure.distributed_noise): the Skellam accountant against independent
numerical computations, and the quantisation's round trip."""
import math

import numpy as np
import pytest
from scipy import special, stats

from fedsd.secure import distributed_noise as dn


def skellam_log_pmf(variance: float, shift: int, support: np.ndarray) -> np.ndarray:
    return stats.skellam(variance / 2, variance / 2).logpmf(support - shift)


@pytest.mark.parametrize("delta_int,z", [(2, 5.0), (4, 2.5), (16, 1.5)])
def test_the_skellam_bound_holds_against_the_exact_renyi_divergence(delta_int, z):
    """Agarwal et al.'s bound, as coded, is at least the Rényi divergence summed from the pmfs."""
    variance = (z * delta_int) ** 2
    half = int(delta_int + 25 * math.sqrt(variance) + 25)
    x = np.arange(-half, half + 1)
    p, q = skellam_log_pmf(variance, 0, x), skellam_log_pmf(variance, delta_int, x)
    finite = np.isfinite(p) & np.isfinite(q)
    p, q = p[finite], q[finite]
    for order in (2, 3, 5, 10, 20):
        exact = special.logsumexp(order * q + (1 - order) * p) / (order - 1)
        bound = dn.skellam_rdp(order, delta_int, delta_int, variance)
        assert exact <= bound + 1e-9, (order, exact, bound)
        assert bound <= exact * 1.5 + 1e-3  # and not vacuous


def pld_epsilon(variance: float, shift: int, q: float, steps: int, delta: float) -> float:
    """ε of `steps` Poisson-subsampled 1-D Skellam steps, both neighbouring directions, by
    dp_accounting's privacy loss distributions from the two probability mass functions."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    half = int(shift + 30 * math.sqrt(variance) + 30)
    x = np.arange(-half, half + 1)
    base, moved = np.exp(skellam_log_pmf(variance, 0, x)), np.exp(skellam_log_pmf(variance, shift, x))
    mixture = (1 - q) * base + q * moved
    as_map = lambda pmf: {int(k): float(np.log(v)) for k, v in zip(x, pmf) if v > 0}
    remove = pld.from_two_probability_mass_functions(as_map(base), as_map(mixture),
                                                     value_discretization_interval=1e-3)
    add = pld.from_two_probability_mass_functions(as_map(mixture), as_map(base), value_discretization_interval=1e-3)
    return max(d.self_compose(steps).get_epsilon_for_delta(delta) for d in (remove, add))


@pytest.mark.parametrize("shift,z,q,steps,slack", [(4, 1.0, 0.1, 50, 1.5), (16, 2.0, 0.2, 200, 1.25),
                                                   (64, 1.2, 0.02, 300, 1.25)])
def test_the_accountant_matches_dp_accountings_pld(shift, z, q, steps, slack):
    """The run's accountant (Skellam bound → Gaussian equivalent → subsampled RDP at integer
    orders) is an upper bound on the exact ε dp_accounting computes for 1-D Skellam, in both
    directions, and close to it (RDP's conversion, and at a small variance Skellam's own term,
    cost the rest)."""
    variance, delta = (z * shift) ** 2, 1e-5
    ours = dn.integer_order_epsilon(dn.gaussian_equivalent(shift, shift, variance), q, steps, delta)
    exact = pld_epsilon(variance, shift, q, steps, delta)
    assert exact <= ours <= slack * exact, (exact, ours)


def test_calibration_spends_the_target_and_matches_the_central_sigma():
    """At the features recipe's q and length, z is the central run's σ (Opacus' RDP) to 0.2 %:
    quantisation and Skellam cost almost nothing at 2^20 units per clip norm."""
    from opacus.accountants.utils import get_noise_multiplier

    from fedsd.privacy.accounting import RDP_ORDERS

    q, steps = 8192 / 60000, 400
    plan = dn.calibrate(3.0, 1e-5, 0.1, q, 8192, steps, honest=10, dim=39_700)
    assert plan.epsilon(steps, 1e-5) <= 3.0
    assert plan.epsilon(steps, 1e-5) > 2.999
    central = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, steps=steps,
                                   accountant="rdp", alphas=RDP_ORDERS, epsilon_tolerance=1e-4)
    assert abs(plan.noise_multiplier / central - 1) < 2e-3
    assert plan.gaussian_equivalent() / plan.noise_multiplier > 0.9999


def test_shares_sum_to_the_planned_noise_and_decode_to_the_sum():
    """n clients' encodings, summed modulo 2^64 and decoded: the sum of their vectors plus noise of
    std z·(C + √d/γ)·√(n/t) per coordinate, and each rounding within 1/γ."""
    rng = np.random.default_rng(0)
    d, n, t = 20_000, 10, 5
    plan = dn.NoisePlan(noise_multiplier=1.5, clip=0.1, sample_rate=0.1, expected_batch=100.0, honest=t, dim=d)
    xs = [rng.normal(0, 0.05, d) for _ in range(n)]
    total = np.zeros(d, dtype=np.uint64)
    for k, x in enumerate(xs):
        total += dn.encode(x, plan, dn.generator(bytes([k]) * 16))
    noise = dn.decode(total, plan) - np.sum(xs, axis=0)
    expected = plan.noise_multiplier * plan.l2 / plan.scale * math.sqrt(n / t)
    assert abs(noise.std() / expected - 1) < 0.03
    assert abs(noise.mean()) < 4 * expected / math.sqrt(d)
    quiet = dn.NoisePlan(0.0, 0.1, 0.1, 100.0, 1, d)
    rounded = dn.decode(dn.encode(xs[0], quiet, dn.generator(bytes(16))), quiet)
    assert np.abs(rounded - xs[0]).max() <= 1 / quiet.scale


def test_a_vector_beyond_the_modulus_is_refused():
    plan = dn.NoisePlan(1.0, 0.1, 0.1, 100.0, 1, 3)
    with pytest.raises(ValueError, match="beyond the modulus"):
        dn.encode(np.array([0.0, np.inf, 1.0]), plan, dn.generator(bytes(16)))
    with pytest.raises(ValueError, match="beyond the modulus"):
        dn.encode(np.array([0.0, 1e20, 1.0]), plan, dn.generator(bytes(16)))
