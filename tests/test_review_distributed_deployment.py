"""Review of the deployed distributed-noise path (issue 69), as the attacker: a server that
chooses every setting and plan. Each test fails while its attack works."""
import pytest
from flwr.app import ConfigRecord, RecordDict

from fedsd.app.client import node_config as node_configs
from fedsd.app.client import secure_stages as service
from fedsd.secure import distributed_noise as dn
from tests.test_distributed_deployment import ROUNDS, federation, fewer_records  # noqa: F401
from tests.test_secure_aggregation import EXPERIMENT, IDS, masked_message, owners, up_to_shares  # noqa: F401


def _content(f, **changes):
    flat = {**f.flat, **dn.to_settings(f.plan, ROUNDS), "experiment-id": EXPERIMENT, "server-round": 1}
    flat.update(changes)
    return RecordDict({"arrays": f.arrays, "config": ConfigRecord(flat)})


def _owner(f, k):
    context = f.contexts[IDS[k]]
    return context, service.Owner(node_configs.parse(context.node_config), context)


def _outcome(f, k, **changes):
    context, owner = _owner(f, k)
    try:
        service._checked_plan(_content(f, **changes), context, owner)
    except service.StageRefused as e:
        return str(e)
    return "accepted"


def test_whether_a_plan_is_refused_does_not_tell_the_owners_record_count(federation):
    """δ is the server's. Checked against 1/n, the owner's own record count, the refusal says n
    in its text, and whether it comes at all tells n ≥ 1/δ: a server that binary-searches δ over
    rounds (a refusal costs nothing) reads each owner's n, which no reply under distributed noise
    is meant to carry (deploy/README.md: no num-examples)."""
    f = federation
    fewer_records(f.tmp_path, 2, 40)  # owner 2 holds 40 records, owner 0 100
    for delta in (0.015, 0.5):  # 1/100 < 0.015 < 1/40
        said = {k: _outcome(f, k, delta=delta) for k in (0, 2)}
        assert said[0] == said[2], said
        assert not any(f"n = {n}" in why for n in (40, 100) for why in said.values()), said


def test_every_honest_share_is_sized_by_the_plans_common_t(federation, monkeypatch):
    """Each owner sized its share by its own t (μ / t_own). An owner A that counts on t_A honest
    shares in a sum is then under-noised by honest owners whose own t is larger (their shares
    μ / t_J < μ / t_A): the guarantee 'any t honest shares give μ' holds only for a common t.
    With the plan's t the federation's common one, an owner refuses a plan whose t is above its
    own (others would size their shares below what its t counts on) and sizes its share by the
    plan's t (at least its own share, never less)."""
    import fedsd.secure.distributed_step as distributed

    f = federation
    seen = []

    class Drawn(Exception):
        pass

    def spy(*args, **kwargs):
        seen.append(kwargs["honest"])
        raise Drawn

    monkeypatch.setattr(distributed, "contribution", spy)
    context, owner = _owner(f, 0)  # its own t: 3 (secagg-min-clients)
    below = dn.to_settings(dn.NoisePlan(**{**f.plan.to_dict(), "honest": 2}), ROUNDS)
    with pytest.raises(Drawn):
        service.distributed_contribution(_content(f, **below), context, owner)
    assert seen == [2], f"the share was sized by t = {seen}, below the μ / 2 the plan's t = 2 owners count on"
    above = dn.to_settings(dn.NoisePlan(**{**f.plan.to_dict(), "honest": 4}), ROUNDS)
    with pytest.raises(service.StageRefused, match="t"):
        service._checked_plan(_content(f, **above), context, owner)


def test_the_pad_is_never_below_the_owners_own_bound_whatever_expected_batch_the_plan_says():
    """The plan's expected batch is the server's number: with a small one, an owner's padded
    work still covers its own Poisson batch at the plan's q (to the 1e-9 tail), so its time does
    not tell the batch; with an honest one (the federation's, above the owner's) the plan's bound."""
    import dataclasses
    import math

    from fedsd.app.client.secure_stages import padded_rows
    from fedsd.secure import sum_bound
    from fedsd.secure.distributed_noise import calibrate

    plan = calibrate(2.0, 1e-5, 1.0, 0.05, 800.0, 4, 1000, 10)
    own = math.ceil(sum_bound.poisson_tail(0.05 * 4000, sum_bound.TAIL))
    assert padded_rows(plan, 4000) == math.ceil(sum_bound.poisson_tail(800.0, sum_bound.TAIL)) > own
    lying = dataclasses.replace(plan, expected_batch=1.0)
    assert padded_rows(lying, 4000) == own > 200  # the owner's 4,000 records at q = 0.05: a batch near 200


# A second review playing the attacker against the deployed distributed-noise path (issue 69).

def test_a_client_given_other_settings_fails_every_other_clients_check_at_share_keys():
    """The protocol alone (no data): three owners on one roster; the server tells client 3 other
    settings (its digest) at stage 0. Every client's check of its neighbours' signed keys fails
    at stage 1, before anything is drawn: no one deals a share. Without the settings in the
    signature all three go on."""
    from fedsd.secure.identity import Identity, Member, Roster
    from fedsd.secure.secagg import ProtocolError, SecAggClient, SecAggServer

    keys = [Identity() for _ in range(3)]
    roster = Roster([Member(f"owner-{k}", key.public) for k, key in enumerate(keys)])
    ids = sorted(key.id for key in keys)
    clients = {key.id: SecAggClient(key.id, b"round", min_cohort=3, identity=key, roster=roster) for key in keys}
    server = SecAggServer(b"round", ids, 10)
    told = {i: (b"A" * 32 if i == ids[-1] else b"B" * 32) for i in ids}
    server.collect_keys({i: c.advertise(**server.setup(i), context=told[i]) for i, c in clients.items()})
    for i, client in clients.items():
        with pytest.raises(ProtocolError, match="cohort, threshold and settings"):
            client.share_keys(server.keys_for(i))


def test_owners_given_different_plans_in_one_round_refuse_before_anything_is_drawn(federation, monkeypatch):
    """The server sends owner A (secagg-min-clients 3, max-epsilon 3) the plan for ε = 2 and
    owners B and C, whose own lifetime budgets are looser (max-epsilon 100, their own choice), a
    plan for ε = 20 with less than half the noise. Each plan passes its owner's checks; had all
    three answered, the honest shares in the sum would hold 0.42 of the noise A's ledger counts
    on. The plan goes with stage 0 and each owner signs its digest: A's neighbours' keys fail its
    check at share-keys, and theirs fail on A's; no share is dealt, nothing drawn or charged."""
    from fedsd.app import secure_sum
    from fedsd.app.client import handler as local
    from fedsd.secure.secagg import SecAggServer
    from fedsd.training.loop import DPTrainer
    from tests.test_distributed_deployment import privacy_files
    from tests.test_secure_aggregation import keys_message, stage

    f = federation
    monkeypatch.setattr(DPTrainer, "clipped_sum", lambda *a, **k: pytest.fail("drew a batch"))
    monkeypatch.setattr(local.SecretStream, "fresh", staticmethod(lambda: pytest.fail("drew a secret key")))
    for k in (1, 2):
        f.contexts[IDS[k]].node_config["max-epsilon"] = 100.0
    plan = f.plan
    loose = dn.calibrate(20.0, 1e-10, plan.clip, plan.sample_rate, plan.expected_batch, ROUNDS, plan.honest, plan.dim)
    assert loose.noise_multiplier < plan.noise_multiplier / 2
    flats = {IDS[0]: {**f.flat, **dn.to_settings(plan, ROUNDS)}}
    flats.update({n: {**f.flat, "epsilon": 20.0, **dn.to_settings(loose, ROUNDS)} for n in IDS[1:]})
    base = {"experiment-id": EXPERIMENT, "server-round": 1}
    server = SecAggServer(secure_sum.round_id(7, EXPERIMENT, 1), list(IDS), 10)

    def advertised(n):
        content = stage(base, **server.setup(n))
        content["config"] = ConfigRecord({**flats[n], **base})
        return content
    server.collect_keys({n: dict(service.advertise_reply(advertised(n), f.contexts[n])["secagg"]) for n in IDS})
    before = privacy_files(f.tmp_path)  # (each owner's record of the rounds it joined moved, legitimately)
    for n in IDS:  # each owner finds a neighbour's keys signed for other settings
        with pytest.raises(service.StageRefused, match="cohort, threshold and settings"):
            service.share_reply(keys_message(base, server, n), f.contexts[n])
    assert privacy_files(f.tmp_path) == before


def test_a_masked_input_under_other_settings_than_advertised_is_refused(federation, monkeypatch):
    """Every owner was advertised the same plan; the server then sends one of them a weaker
    plan with the masked-input stage (its neighbours would still be summed under the first):
    refused before anything is drawn."""
    from fedsd.app.client import handler as local
    from fedsd.training.loop import DPTrainer
    from tests.test_distributed_deployment import privacy_files

    f = federation
    monkeypatch.setattr(DPTrainer, "clipped_sum", lambda *a, **k: pytest.fail("drew a batch"))
    monkeypatch.setattr(local.SecretStream, "fresh", staticmethod(lambda: pytest.fail("drew a secret key")))
    f.contexts[IDS[0]].node_config["max-epsilon"] = 100.0
    flat = {**f.flat, **dn.to_settings(f.plan, ROUNDS)}
    base, server = up_to_shares(f.contexts, 1, flat)
    loose = dn.calibrate(20.0, 1e-10, f.plan.clip, f.plan.sample_rate, f.plan.expected_batch, ROUNDS,
                         f.plan.honest, f.plan.dim)
    other = {**f.flat, "epsilon": 20.0, **dn.to_settings(loose, ROUNDS)}
    before = privacy_files(f.tmp_path)
    with pytest.raises(service.StageRefused, match="not those it was advertised with"):
        service.masked_reply(masked_message(base, other, f.arrays, server.shares_for(IDS[0])), f.contexts[IDS[0]])
    assert privacy_files(f.tmp_path) == before


def test_a_clip_float32_cannot_keep_is_refused(federation):
    """The server sets the run's clip and the plan's to 1e-43 (the owner's own z does not depend
    on C): the per-sample clip factors fall among float32's subnormals and one record moved the
    clipped sum by 2.1 C, twice the sensitivity the noise and the ledger count on. Refused below
    1/√d (fedsd.secure.distributed_noise.least_clip); the paper's C = 0.1 is accepted."""
    f = federation
    tiny = {"clip": 1e-43, dn.PLAN_PREFIX + "clip": 1e-43}
    assert "below 1/√d" in _outcome(f, 0, **tiny)
    assert dn.least_clip(f.plan.dim) < 0.1 and _outcome(f, 0) == "accepted"
