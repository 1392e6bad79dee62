"""Client level in a deployment (privacy-unit=client): the owners' data services'
handlers in this process, with real state folders and ledgers, driven by the server's
SecureRounds. Each owner trains its local epochs without noise, clips its update to S, adds its
Skellam share and masks; its ledger charges each round as the Skellam step it is for one of its
records (z_e / 2 at q = 1); the server applies the decoded sum over n with learning rate 1, as
`fedsd simulate --privacy-unit client` does; the plan is the simulation's for the same settings;
every bad plan is refused before anything is drawn, the ledger's bytes unchanged."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedsd.app.client import secure_stages as service
from fedsd.app.client.secure_owner import StageRefused
from fedsd.app.records import record_to_model
from fedsd.privacy.accounting import SKELLAM, PrivacyFilter
from fedsd.secure import client_level
from fedsd.secure import distributed_noise as dn
from fedsd.settings.federation import FedConfig, client_config
from fedsd.settings.run import TrainConfig
from tests.deployment.test_distributed_deployment import kept_inputs, privacy_files, server_side
from tests.app.client.test_secure_aggregation import EXPERIMENT, IDS, masked_message, owners, up_to_shares  # noqa: F401

EPSILON, ROUNDS, CLIP, DELTA, STEPS = 4.0, 2, 0.5, 1e-5, 3
LIFETIME = 20.0  # each owner's max-epsilon: above each record's ε of the run (9.06 at client-level ε 4)


def _settings():
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", batch_size=50, subset=300, threads=1, epsilon=EPSILON,
                      lr=0.1, momentum=0.0)
    fed = FedConfig(num_clients=3, rounds=ROUNDS, client_data="own", secure_aggregation=True, noise="distributed",
                    privacy_unit="client", update_clip=CLIP, honest_clients=3, local_steps=STEPS)
    return cfg, fed


@pytest.fixture
def federation(owners):
    contexts, flat, arrays, tmp_path = owners
    for context in contexts.values():  # no roster here (tests/deployment/test_secure_aggregation_deploy.py has one)
        context.node_config.update({"secagg-trust": "honest-but-curious", "max-epsilon": LIFETIME})
    cfg, fed = _settings()
    flat = {**flat, "method": "dpsgd", "noise": "distributed", "secure-aggregation": True, "epsilon": EPSILON,
            "privacy-unit": "client", "update-clip": CLIP, "honest-clients": 3, "lr": 0.1, "momentum": 0.0,
            "local-steps": STEPS}
    return server_side(contexts, flat, arrays, tmp_path, cfg, fed)


def test_the_deployed_plan_is_the_simulations_and_the_server_refuses_what_is_not_client_level():
    from fedsd.app.server.secure_plans import distributed_plan
    from fedsd.errors import ConfigError
    from fedsd.models.networks import model_for
    from fedsd.secure.distributed_step import dimension

    cfg, fed = _settings()
    cfg = client_config(cfg, FedConfig(num_clients=3, rounds=ROUNDS))
    plan, optimizer = distributed_plan(cfg, fed, 10)
    dim = dimension(model_for(cfg, 10))
    # what SecureFederation (fedsd simulate --privacy-unit client) calibrates for the same settings
    assert plan == client_level.calibrate(EPSILON, DELTA, CLIP, 3, ROUNDS, 3, dim)
    assert plan.sample_rate == 1.0 and plan.expected_batch == 3.0 and plan.clip == CLIP
    assert abs(plan.epsilon(ROUNDS, DELTA) - EPSILON) < 0.01 * EPSILON
    group = optimizer.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"]) == (1.0, 0.0)  # FedAvg of the clipped updates
    with pytest.raises(ConfigError, match="method=dp3sd: privacy-unit=client"):
        distributed_plan(TrainConfig(**{**cfg.to_dict(), "method": "dp3sd"}), fed, 10)
    with pytest.raises(ConfigError, match="honest-clients=5"):
        distributed_plan(cfg, FedConfig(**{**fed.__dict__, "honest_clients": 5}), 10)


@pytest.mark.slow  # three owners' local training (real data, real ledgers)
def test_a_client_level_round_sums_each_owners_clipped_update_and_its_ledger_charges_each_record(federation,
                                                                                               monkeypatch):
    from fedsd.models.networks import model_for
    from fedsd.secure.distributed_step import ServerOptimizer
    from tests.deployment.test_distributed_deployment import fewer_records

    f = federation
    fewer_records(f.tmp_path, 2, 40)  # owner 2 holds 40 records, the others 100
    work, batches = [], client_level._batches

    def spy(n, *args):  # each owner's local steps: how many, of how many rows, from how many records
        drawn = list(batches(n, *args))
        work.append((n, [len(b) for b in drawn]))
        return iter(drawn)

    monkeypatch.setattr(client_level, "_batches", spy)
    moved = f.rounds.one_round(1, f.arrays)
    # The work does not follow the owner's records: STEPS steps of batch-size rows each, for 100 and 40.
    assert sorted(n for n, _ in work) == [40, 100, 100] and {tuple(b) for _, b in work} == {(50,) * STEPS}, work
    record = f.rounds.records[0]
    assert record["abandoned"] is None and sorted(record["survivors"]) == list(IDS), record
    total, kept = np.load(f.tmp_path / "secagg-sum-1.npy"), kept_inputs(f.tmp_path, 1)
    assert np.array_equal(total, kept[0] + kept[1] + kept[2])  # exact, modulo 2^64
    decoded = dn.decode(total, f.plan)
    start = record_to_model(f.arrays)["student"]
    expected = ServerOptimizer(model_for(f.cfg, 10), 1.0, 0.0).step(start, decoded, f.plan)
    got = record_to_model(moved)["student"]
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # The signal is three updates clipped to S (norm ≤ 3S) under the plan's noise, z·Δ2/γ a coordinate.
    noise_std = f.plan.noise_multiplier * f.plan.l2 / f.plan.scale
    assert 0.8 < decoded.std() / noise_std < 1.3, (decoded.std(), noise_std)
    # Each ledger: one Skellam step for a record at z_e / 2, q = 1; its ε the reply's record ε.
    z_e = f.plan.gaussian_equivalent()
    for k in range(3):
        saved = json.loads(next((f.tmp_path / f"state-{k}").glob("ledger-*.json")).read_text())
        ledger = PrivacyFilter.from_state_dict(saved, LIFETIME, DELTA)
        assert [(e["mechanism"], e["noise_multiplier"], e["sample_rate"], e["steps"], e["round"])
                for e in ledger.entries] == [(SKELLAM, z_e / 2, 1.0, 1, 1)]
    metrics = [dict(f.replies[n]["metrics"]) for n in IDS]
    expect = {"epsilon": f.plan.epsilon(1, DELTA), "record-epsilon": client_level.record_epsilon(f.plan, 1, DELTA)}
    assert metrics == [expect] * 3, metrics
    assert abs(ledger.epsilon() - expect["record-epsilon"]) <= 1e-6 * expect["record-epsilon"]
    assert record["record_epsilon"] == expect["record-epsilon"] and record["epsilon"] == expect["epsilon"]
    assert all(set(f.replies[n]["secagg"].keys()) == {"masked"} for n in IDS)
    print("client ε", expect["epsilon"], "record ε", expect["record-epsilon"], "z", f.plan.noise_multiplier)


def _plan(**changes):
    def change(flat):
        for field, how in changes.items():
            flat[dn.PLAN_PREFIX + field] = how(flat[dn.PLAN_PREFIX + field])
        return flat
    return change


BAD = {
    "less noise than the owner's own": (_plan(**{"noise-multiplier": lambda z: z * 0.99}), {},
                                       "below this client's own"),
    "a q below 1 (an amplification that does not happen)": (_plan(**{"sample-rate": lambda q: 0.5}), {},
                                                            "sample_rate"),
    "another clip than the run's S": (_plan(clip=lambda c: c * 2), {}, "clip"),
    "a method with a teacher": (lambda flat: {**flat, "method": "dp3sd"}, {}, "privacy-unit=client trains"),
    # 8 is above the run's client-level ε of 4, below each record's 9.06: the ledger counts records
    "local epochs (a time that would tell the owner's records)": (lambda flat: {**flat, "local-steps": 0}, {},
                                                                  "local-steps=0"),
    "more local steps than the owner allows": (None, {"max-local-steps": STEPS - 1},
                                               f"local-steps={STEPS}: above this owner's max-local-steps={STEPS - 1}"),
    "a plan's t above the owner's": (_plan(honest=lambda t: 4), {}, "the plan's t is 4"),
    "a batch past the inputs a step may hold": (lambda flat: {**flat, "batch-size": 2 * 10 ** 6, "delta": 1e-10,
                                                              **dn.to_settings(client_level.calibrate(
                                                                  EPSILON, 1e-10, CLIP, 3, ROUNDS, 3,
                                                                  int(flat[dn.PLAN_PREFIX + "dim"])), ROUNDS)},
                                                {}, "batch-size=2000000: a local step would hold more than"),
    "a run over the lifetime budget (each record's ε)": (None, {"max-epsilon": 8.0}, "run asks ε=9.0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_client_level_plan_is_refused_before_anything_is_drawn(federation, monkeypatch, case):
    from fedsd.app.client import handler as local

    f = federation
    change, node, why = BAD[case]
    monkeypatch.setattr(client_level, "local_update", lambda *a, **k: pytest.fail("trained"))
    monkeypatch.setattr(local.SecretStream, "fresh", staticmethod(lambda: pytest.fail("drew a secret key")))
    for context in f.contexts.values():
        context.node_config.update(node)
    flat = {**f.flat, **dn.to_settings(f.plan, ROUNDS)}
    flat = change(flat) if change else flat
    before = privacy_files(f.tmp_path)
    with pytest.raises(StageRefused, match=why):  # at stage 0 now, where the plan and budget are tried,
        base, server = up_to_shares(f.contexts, 1, flat)  # or at the masked stage
        before = privacy_files(f.tmp_path)
        service.masked_reply(masked_message(base, flat, f.arrays, server.shares_for(IDS[0])), f.contexts[IDS[0]])
    assert privacy_files(f.tmp_path) == before
    assert not list(f.tmp_path.glob("state-*/ledger-*.json"))


def test_a_model_that_is_not_the_runs_network_is_refused_before_the_charge(federation, monkeypatch):
    """A student with a tensor the network does not have would fail in the local steps, after
    the charge (a review playing the attacker drained a ledger so): it is loaded first."""
    from flwr.app import Array, ArrayRecord

    from fedsd.app.client import handler as local

    f = federation
    monkeypatch.setattr(local.SecretStream, "fresh", staticmethod(lambda: pytest.fail("drew a secret key")))
    arrays = ArrayRecord({**{k: f.arrays[k] for k in f.arrays}, "student/extra": Array(np.zeros(3, np.float32))})
    flat = {**f.flat, **dn.to_settings(f.plan, ROUNDS)}
    base, server = up_to_shares(f.contexts, 1, flat)
    before = privacy_files(f.tmp_path)
    with pytest.raises(StageRefused, match="the round's model is not this run's network"):
        service.masked_reply(masked_message(base, flat, arrays, server.shares_for(IDS[0])), f.contexts[IDS[0]])
    assert privacy_files(f.tmp_path) == before


@pytest.mark.slow  # one owner's local steps
def test_each_share_is_sized_by_the_plans_t(federation):
    """A plan whose t (2) is below the owner's own (3): the owner's share is μ / 2, the plan's, as
    every owner's is. Sized by its own t (μ / 3), an owner of a larger t would leave the t honest
    shares another owner counts on short of μ (a review playing the attacker found so)."""
    f = federation
    flat = _plan(honest=lambda t: 2)({**f.flat, **dn.to_settings(f.plan, ROUNDS)})
    base, server = up_to_shares(f.contexts, 1, flat)
    service.masked_reply(masked_message(base, flat, f.arrays, server.shares_for(IDS[0])), f.contexts[IDS[0]])
    kept = np.load(f.tmp_path / "state-0" / "secagg" / f"7-{EXPERIMENT}-1-{IDS[0]}.npy")
    std = kept.view(np.int64).astype(np.float64).std()  # the clipped update is ≤ γS in all: the noise's
    ratio = std / np.sqrt(f.plan.variance / 2)
    assert 0.97 < ratio < 1.03, ratio  # μ / 3 would be 0.82


@pytest.fixture
def adaptive_federation(owners):
    contexts, flat, arrays, tmp_path = owners
    for context in contexts.values():
        context.node_config.update({"secagg-trust": "honest-but-curious", "max-epsilon": LIFETIME})
    cfg, fed = _settings()
    fed = FedConfig(**{**fed.__dict__, "update_clip_quantile": 0.5, "update_clip_lr": 1.0})
    flat = {**flat, "method": "dpsgd", "noise": "distributed", "secure-aggregation": True, "epsilon": EPSILON,
            "privacy-unit": "client", "update-clip": CLIP, "honest-clients": 3, "lr": 0.1, "momentum": 0.0,
            "local-steps": STEPS, "update-clip-quantile": 0.5, "update-clip-lr": 1.0}
    return server_side(contexts, flat, arrays, tmp_path, cfg, fed)


@pytest.mark.slow  # three owners' local training, two rounds (real data, real ledgers)
def test_an_adaptive_update_clip_moves_from_the_secure_sum_with_nothing_per_owner_beside_the_masked_vector(
        adaptive_federation):
    """--update-clip-quantile deployed: each round's plan is one coordinate longer and its clip is
    the server's S' for the S it moved; every owner accepts the moved plan (pinned at the run's S),
    sends its masked vector and nothing else of its own (every field of its reply read), and its
    ledger charges each round once, the same Skellam step as with S fixed: the count's cost is in it."""
    f = adaptive_federation
    assert f.plan.dim == f.rounds.noise.dim and f.rounds.adaptive is not None
    clips, arrays = [], f.arrays
    for r in (1, 2):
        clips.append(f.rounds.optimizer.update_clip)
        arrays = f.rounds.one_round(r, arrays)
        record = f.rounds.records[-1]
        assert record["abandoned"] is None and sorted(record["survivors"]) == list(IDS), record
        assert record["update_clip"] == clips[-1]
        metrics = [dict(f.replies[n]["metrics"]) for n in IDS]
        expect = {"epsilon": f.plan.epsilon(r, DELTA), "record-epsilon": client_level.record_epsilon(f.plan, r, DELTA)}
        assert metrics == [expect] * 3, metrics  # the fixed clip's public numbers: no bit, no norm, no clip
        assert all(set(f.replies[n]["secagg"].keys()) == {"masked"} for n in IDS)
        assert all(len(f.replies[n]["secagg"]["masked"].numpy()) == f.plan.dim for n in IDS)
    assert clips[0] == CLIP and f.rounds.optimizer.update_clip not in clips  # moved after each round
    z_e = f.plan.gaussian_equivalent()
    for k in range(3):
        saved = json.loads(next((f.tmp_path / f"state-{k}").glob("ledger-*.json")).read_text())
        assert [(e["mechanism"], e["noise_multiplier"], e["round"]) for e in saved["entries"]] == \
            [(SKELLAM, z_e / 2, 1), (SKELLAM, z_e / 2, 2)]


@pytest.mark.parametrize("clip", [1.7e308, float("inf"), 1e-9])
def test_an_adaptive_round_plan_whose_clip_leaves_no_finite_bit_is_refused_before_the_charge(
        adaptive_federation, monkeypatch, clip):
    """S' is the server's each round, but one whose λ overflows (1.7e308: a review playing the
    attacker had it pass every check, the owner charged, then fail), or that is not a number or
    below 1/√d, is refused before anything is drawn, the ledger's bytes unchanged."""
    import dataclasses

    from fedsd.app.client import handler as local

    f = adaptive_federation
    monkeypatch.setattr(client_level, "local_update", lambda *a, **k: pytest.fail("trained"))
    monkeypatch.setattr(local.SecretStream, "fresh", staticmethod(lambda: pytest.fail("drew a secret key")))
    flat = {**f.flat, **dn.to_settings(dataclasses.replace(f.rounds.round_plan(), clip=clip), ROUNDS)}
    before = privacy_files(f.tmp_path)
    with pytest.raises(StageRefused, match="clip"):
        base, server = up_to_shares(f.contexts, 1, flat)
        before = privacy_files(f.tmp_path)
        service.masked_reply(masked_message(base, flat, f.arrays, server.shares_for(IDS[0])), f.contexts[IDS[0]])
    assert privacy_files(f.tmp_path) == before
    assert not list(f.tmp_path.glob("state-*/ledger-*.json"))


def test_a_deployed_normalized_update_clip_steps_per_unit_of_the_rounds_clip(adaptive_federation):
    """update-clip-normalize deployed: the server steps by server-lr × the decoded mean over the
    round's S (SecureRounds._step), as the simulation does: at server-lr S the step is the plain
    one, and after the clip moved, S₀ / S₁ of the plain step from the same model and sum."""
    import dataclasses

    from fedsd.app.server.secure_rounds import SecureRounds

    f = adaptive_federation
    normalized = SecureRounds(f.rounds.grid, f.rounds.side, SimpleNamespace(**{**vars(f.rounds.launch), "fed": (
        dataclasses.replace(f.fed, update_clip_normalize=True, server_lr=CLIP))}))
    rng = np.random.default_rng(0)
    total = dn.encode(rng.normal(0, 0.01, f.plan.dim), f.plan, dn.generator(bytes(16)))  # a sum in the plan's units
    steps = []
    for rounds in (f.rounds, normalized):
        rounds.optimizer.update_clip = 2 * CLIP  # the clip has moved: S₁ = 2 S₀
        moved, _ = rounds._step(f.arrays, total.copy(), 3, SimpleNamespace(culprits={}), 1)
        before, after = record_to_model(f.arrays)["student"], record_to_model(moved)["student"]
        steps.append(torch.cat([(after[k] - before[k]).flatten().double() for k in before]))
    assert float(steps[1].norm() / steps[0].norm()) == pytest.approx(CLIP / (2 * CLIP), rel=1e-4)
