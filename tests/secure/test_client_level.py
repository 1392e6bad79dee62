"""Client-level DP by the clients (fedsd.secure.client_level): each clips its own update and adds its
share, so the sum the server unmasks carries the whole client-level noise and no update
reaches it unclipped or unnoised; the accountant against dp_accounting; the options refused."""
import math

import numpy as np
import pytest

from fedsd.secure import client_level as cl
from fedsd.secure import distributed_noise as dn
from fedsd.settings.run import TrainConfig
from fedsd.secure.distributed_step import secure_round
from fedsd.errors import ConfigError
from fedsd.settings.federation import FedConfig
from fedsd.simulation.secure_federation import check_options


def test_an_update_is_clipped_to_the_norm_a_small_one_is_left_alone_and_a_diverged_one_is_zero():
    rng = np.random.default_rng(0)
    big, small = rng.normal(size=1000) * 10, rng.normal(size=1000) * 1e-4
    assert np.linalg.norm(cl.clipped_update(big, 0.5)) == pytest.approx(0.5)
    assert np.allclose(cl.clipped_update(big, 0.5) / 0.5, big / np.linalg.norm(big))  # the direction kept
    assert np.array_equal(cl.clipped_update(small, 0.5), small)
    assert np.array_equal(cl.clipped_update(np.array([1.0, np.inf, np.nan]), 0.5), np.zeros(3))


def test_the_sum_the_server_unmasks_is_the_clipped_updates_plus_exactly_the_planned_noise():
    """Four clients with updates far beyond the clip; the server's sum, decoded, is the sum of the
    clipped updates plus noise whose variance is n/t times the honest sum's (z·Δ2)², no more and
    no less: without the clients' shares (or their clipping) this fails."""
    clients, dim, honest, clip = 4, 40_000, 2, 0.5
    plan = cl.calibrate(3.0, 1e-5, clip, clients, 20, honest, dim)
    rng = np.random.default_rng(1)
    updates = {k: rng.normal(size=dim) * (k + 1) for k in range(clients)}
    vectors = {k: (lambda u=u, k=k: cl.update_contribution(u, plan, plan, bytes([k]) * 16))
               for k, u in updates.items()}
    total, _ = secure_round(b"client-level-test", vectors, dim, min_cohort=clients)
    clipped = sum(cl.clipped_update(u, clip) for u in updates.values())
    residual = dn.decode(total, plan) - clipped
    expected = math.sqrt(clients / honest * plan.variance) / plan.scale  # in update units
    assert np.std(residual) == pytest.approx(expected, rel=0.02)
    assert abs(np.mean(residual)) < 4 * expected / math.sqrt(dim)
    assert expected > 5 * clip / math.sqrt(dim)  # the noise dwarfs any one clipped update's coordinates


def test_the_client_level_accountant_is_dp_accountings_gaussian_composition():
    """q = 1 (every client every round): the run is R Gaussian steps at z_e; dp_accounting's own
    RDP accountant for the composed Gaussian gives the same ε, and the calibrated plan spends ε."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    plan = cl.calibrate(3.0, 1e-5, 0.1, 100, 50, 100, 30_000)
    accountant = rdp.RdpAccountant(orders=dn.INTEGER_ORDERS)
    accountant.compose(dp_event.GaussianDpEvent(plan.gaussian_equivalent()), 50)
    assert plan.epsilon(50, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)
    assert 2.99 < plan.epsilon(50, 1e-5) <= 3.0
    assert plan.sample_rate == 1.0 and plan.expected_batch == 100.0


@pytest.mark.parametrize("field,value", [("clip", 0.05), ("clip", 1e6), ("sample_rate", 0.5),
                                         ("expected_batch", 20.0), ("dim", 99), ("noise_multiplier", 0.0),
                                         ("noise_multiplier", float("nan"))])
def test_a_plan_that_is_not_the_clients_own_is_refused_before_anything_is_sent(field, value):
    """Another clip would not bound the update by the noise's sensitivity (a smaller one scales a
    unit of the update past it; a larger one is refused too: the plan is not this run's); q < 1 claims an amplification that does not happen; another n or length is not
    this run; less noise than the client's own calibration (z = 0: the update in the clear)
    would spend more than its ε."""  # noqa: E501
    import dataclasses

    own = cl.calibrate(3.0, 1e-5, 0.1, 10, 20, 10, 100)
    cl.check_plan(own, own)
    cl.check_plan(dataclasses.replace(own, noise_multiplier=2 * own.noise_multiplier), own)  # more noise: fine
    hostile = dataclasses.replace(own, **{field: value})
    with pytest.raises((ValueError, ConfigError), match=field):
        cl.update_contribution(np.ones(100) * 10, hostile, own, bytes(16))


def test_one_record_gets_the_guarantee_at_twice_the_clip():
    """A record can turn a client's clipped update from S·u to −S·u (found by a review playing the
    attacker): the record-level ε is that of sensitivity 2S, well above the client-level ε."""
    plan = cl.calibrate(3.0, 1e-5, 0.5, 100, 30, 100, 30_000)
    assert 6.5 < cl.record_epsilon(plan, 30, 1e-5) < 7.0 and plan.epsilon(30, 1e-5) <= 3.0


def test_client_level_options_are_checked_before_any_work():
    with pytest.raises(ConfigError, match="--privacy-unit client: needs --noise distributed"):
        FedConfig(privacy_unit="client").validate()
    with pytest.raises(ConfigError, match="needs --secure-aggregation"):
        FedConfig(privacy_unit="client", noise="distributed", secure_aggregation=False).validate()  # a deployment's
    with pytest.raises(ConfigError, match="--noise distributed: needs --secure-aggregation"):
        FedConfig(noise="distributed").validate()
    with pytest.raises(ConfigError, match="--update-clip"):
        FedConfig(privacy_unit="client", noise="distributed", secure_aggregation=True, update_clip=0).validate()
    fed = FedConfig(privacy_unit="client", noise="distributed", secure_aggregation=True, local_epochs=3)
    fed.validate()
    check_options(TrainConfig(method="dpsgd"), fed)  # several local epochs: the unit is the whole update
    with pytest.raises(ConfigError, match="--method dp3sd: --privacy-unit client"):
        check_options(TrainConfig(method="dp3sd"), fed)
    with pytest.raises(ConfigError, match="--local-epochs 3"):  # record level keeps one step a round
        check_options(TrainConfig(method="dpsgd"), FedConfig(noise="distributed", secure_aggregation=True,
                                                               local_epochs=3))


def _adaptive(clients=10, rounds=20, dim=5_000, clip=0.5, quantile=0.5, **fed):
    plan = cl.calibrate(3.0, 1e-5, clip, clients, rounds, clients, dim + 1)
    settings = FedConfig(num_clients=clients, rounds=rounds, secure_aggregation=True, noise="distributed",
                         privacy_unit="client", update_clip=clip, update_clip_quantile=quantile, **fed)
    settings.validate()
    return plan, cl.AdaptiveUpdateClip.of(settings, plan)


def test_an_adaptive_clip_puts_each_clients_bit_inside_its_vector_within_the_plans_bound():
    """--update-clip-quantile: a client's vector is its update clipped to S and one coordinate
    (b − ½)·λ; the whole stays within the round plan's clip S' = √(S² + λ²/4), so the plan's ε
    covers the update and the count at once, whatever S the server sends (a Skellam plan's ε does
    not depend on its clip); the count's noise is σ_b (λ·σ_b = z·S')."""
    plan, adaptive = _adaptive()
    z, sigma_b = plan.noise_multiplier, adaptive.rule.count_noise
    assert sigma_b == max(10 / 20, 4 * z)  # the paper's m/20, raised to 4z in a small federation
    rng = np.random.default_rng(0)
    for update_clip in (0.5, 0.05, 5.0):
        round_plan = cl.round_plan(plan, adaptive, update_clip)
        lam = adaptive.count_scale_within(round_plan.clip)
        assert adaptive.update_clip_within(round_plan.clip) == pytest.approx(update_clip, rel=1e-12)
        assert round_plan.clip ** 2 == pytest.approx(update_clip ** 2 + lam ** 2 / 4, rel=1e-12)
        assert lam * sigma_b == pytest.approx(z * round_plan.clip, rel=1e-12)
        assert round_plan.epsilon(20, 1e-5) == plan.epsilon(20, 1e-5)
        for scale in (1e-4, 1.0, 100.0, float("nan")):
            update = rng.normal(size=5_000) * scale
            v = adaptive.vector(update, round_plan.clip)
            assert len(v) == plan.dim and np.linalg.norm(v) <= round_plan.clip * (1 + 1e-12)
            below = not np.isfinite(scale) or np.linalg.norm(update) <= update_clip
            assert v[-1] == (lam / 2 if below else -lam / 2)


def test_the_server_reads_only_the_noised_count_off_the_secure_sum_and_moves_the_clip_by_it():
    """Ten clients, four of whose updates are below S: the unmasked sum's last coordinate over λ is
    the centred count Σ(b − ½) = −1 plus noise of std σ_b (the honest sum's, t = n), and the next S
    follows the paper's rule from it."""
    plan, adaptive = _adaptive()
    update_clip, rng = 0.5, np.random.default_rng(3)
    updates = {k: rng.normal(size=5_000) / np.sqrt(5_000) * (0.3 if k < 4 else 3.0) for k in range(10)}
    round_plan = cl.round_plan(plan, adaptive, update_clip)
    vectors = {k: (lambda u=u, k=k: cl.adaptive_contribution(u, round_plan, plan, bytes([k]) * 16, adaptive))
               for k, u in updates.items()}
    total, _ = secure_round(b"adaptive-client-level", vectors, plan.dim, min_cohort=10)
    noisy_sum = dn.decode(total, round_plan)
    count = noisy_sum[-1] / adaptive.count_scale_within(round_plan.clip)
    assert abs(count - (4 - 5)) < 4 * adaptive.rule.count_noise * 1.01
    assert adaptive.next_clip(update_clip, noisy_sum) == pytest.approx(
        update_clip * math.exp(-0.2 * (count / 10 + 0.5 - 0.5)), rel=1e-12)
    updates_part = sum(cl.clipped_update(u, update_clip) for u in updates.values())
    assert np.std(noisy_sum[:-1] - updates_part) == pytest.approx(
        math.sqrt(plan.variance) / round_plan.scale, rel=0.05)  # the update's noise: z·S' (times Δ2's rounding)


def test_a_round_plan_is_the_clients_own_but_for_its_clip_which_the_vector_fits_whatever_it_is():
    """The server moves S, sending S' as the round plan's clip: any S' the client accepts (its ε
    does not depend on it), deriving S and λ with its own numbers, so its vector stays within S';
    every other field must be its own (less noise, another d: refused), and an S' below 1/√d too."""
    import dataclasses

    plan, adaptive = _adaptive()
    for clip in (0.02, 0.7, 30.0):
        cl.adaptive_contribution(np.ones(5_000) * 10, dataclasses.replace(plan, clip=clip), plan, bytes(16), adaptive)
        v = adaptive.vector(np.ones(5_000) * 10, clip)
        assert np.linalg.norm(v) == pytest.approx(clip, rel=1e-12) and v[-1] < 0  # clipped to S, bit 0
    for field, value in (("noise_multiplier", plan.noise_multiplier / 2), ("dim", 5_000), ("clip", 1e-3)):
        with pytest.raises(ValueError, match=field.split("_")[0]):
            cl.adaptive_contribution(np.ones(5_000), dataclasses.replace(plan, **{field: value}), plan, bytes(16),
                                     adaptive)


def test_adaptive_client_level_options_are_refused_naming_the_flag():
    base = dict(secure_aggregation=True, noise="distributed", privacy_unit="client")
    for changes, flag in [(dict(update_clip_quantile=1.5), "--update-clip-quantile"),
                          (dict(update_clip_quantile=0.5, update_clip_lr=0.0), "--update-clip-lr"),
                          (dict(update_clip_quantile=0.5, update_clip_count_noise=-1.0), "--update-clip-count-noise")]:
        with pytest.raises(ConfigError, match=flag):
            FedConfig(**base, **changes).validate()
    with pytest.raises(ConfigError, match="--update-clip-quantile"):  # records have --clip-quantile
        FedConfig(update_clip_quantile=0.5).validate()
    with pytest.raises(ConfigError, match="--update-clip-count-noise"):  # σ_b ≤ z/2 leaves the update nothing
        _adaptive(update_clip_count_noise=0.01)
    with pytest.raises(ConfigError, match="--clip-quantile"):
        check_options(TrainConfig(method="dpsgd", clip_quantile=0.5), FedConfig(**base))
