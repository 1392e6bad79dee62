"""Review of the deployed distributed-noise path, as the attacker: a server that
chooses every setting and plan. Each test fails while its attack works."""
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedsd.app.client import node_config as node_configs
from fedsd.app.client import secure_stages as service
from fedsd.app.client.secure_contribution import _checked_plan, distributed_contribution
from fedsd.app.client.secure_owner import Owner, StageRefused
from fedsd.secure import distributed_noise as dn
from tests.deployment.test_distributed_deployment import ROUNDS, federation, fewer_records  # noqa: F401
from tests.app.client.test_secure_aggregation import EXPERIMENT, IDS, masked_message, owners, up_to_shares  # noqa: F401


def _content(f, **changes):
    flat = {**f.flat, **dn.to_settings(f.plan, ROUNDS), "experiment-id": EXPERIMENT, "server-round": 1}
    flat.update(changes)
    return RecordDict({"arrays": f.arrays, "config": ConfigRecord(flat)})


def _owner(f, k):
    context = f.contexts[IDS[k]]
    return context, Owner(node_configs.parse(context.node_config), context)


def _outcome(f, k, **changes):
    context, owner = _owner(f, k)
    try:
        _checked_plan(_content(f, **changes), context, owner)
    except StageRefused as e:
        return str(e)
    return "accepted"


def test_whether_a_plan_is_refused_does_not_tell_the_owners_record_count(federation):
    """δ is the server's. Checked against 1/n, the owner's own record count, the refusal says n
    in its text, and whether it comes at all tells n ≥ 1/δ: a server that binary-searches δ over
    rounds (a refusal costs nothing) reads each owner's n, which no reply under distributed noise
    is meant to carry (clients/README.md: no num-examples)."""
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
        distributed_contribution(_content(f, **below), context, owner)
    assert seen == [2], f"the share was sized by t = {seen}, below the μ / 2 the plan's t = 2 owners count on"
    above = dn.to_settings(dn.NoisePlan(**{**f.plan.to_dict(), "honest": 4}), ROUNDS)
    with pytest.raises(StageRefused, match="t"):
        _checked_plan(_content(f, **above), context, owner)


def test_the_pad_is_the_runs_public_bound_whatever_the_owners_records_and_expected_batch():
    """928191a padded to the plan's bound on any client's batch, but never below the owner's own:
    with E = 1 (the server's number) padding fell back to each owner's own bound, and the masked
    stage's time followed its record count (2,000 against 200 records: +171 ms, Welch t = +2.8).
    The pad is now the public bound alone; an owner whose own batch could pass it draws at a lower
    rate than the q its ledger is charged at (spending less), so its work is the same rows."""
    import dataclasses
    import math

    from fedsd.app.client.step_padding import owner_rate, padded_rows
    from fedsd.secure import sum_bound
    from fedsd.secure.distributed_noise import calibrate

    plan = calibrate(2.0, 1e-5, 1.0, 0.05, 800.0, 4, 1000, 10)
    honest = math.ceil(sum_bound.poisson_tail(800.0, sum_bound.TAIL))
    assert padded_rows(plan) == honest and owner_rate(plan, 4000, honest) == 0.05  # 200 expected: q as planned
    lying = dataclasses.replace(plan, expected_batch=1.0)
    rows = padded_rows(lying)
    assert rows == math.ceil(sum_bound.poisson_tail(1.0, sum_bound.TAIL)) < 200  # the same for any owner
    for records in (200, 2000, 4000):
        rate = owner_rate(lying, records, rows)
        assert rate <= 0.05 and sum_bound.poisson_tail(rate * records, sum_bound.TAIL) <= rows
        assert sum_bound.poisson_tail(rate * records * 1.001, sum_bound.TAIL) > rows or rate == 0.05  # the largest


def test_a_step_is_padded_to_the_runs_public_most_records_of_an_owner_not_to_the_federations_batch():
    """Padded to the federation's E alone, each of the features recipe's ten owners (6,000 records,
    q = 8192 / 60000) computed 8.7k rows a step for a batch of about 820: ten times the work of
    its simulated client. With the run's public secagg-max-records M the pad is the Poisson tail of
    q × M (never above E's): the same for any owner up to M records, and an owner with more draws
    at a lower rate within it."""
    import math

    from fedsd.app.client.step_padding import owner_rate, padded_rows
    from fedsd.secure import sum_bound
    from fedsd.secure.distributed_noise import calibrate

    q = 8192 / 60000
    plan = calibrate(3.0, 1e-5, 0.1, q, 8192.0, 400, 10, 39700)
    whole = padded_rows(plan, 4, 60_000)
    assert whole == padded_rows(plan) == math.ceil(sum_bound.poisson_tail(8192.0, sum_bound.TAIL))  # M ≥ N: E's
    rows = padded_rows(plan, 4, 6000)
    assert rows == math.ceil(sum_bound.poisson_tail(q * 6000, sum_bound.TAIL)) and rows < whole / 8
    assert padded_rows(plan, 4, 0) == padded_rows(plan, 4, 1)  # a server's nonsense M: the least pad, no error
    assert [owner_rate(plan, n, rows) for n in (100, 3000, 6000)] == [q] * 3  # up to M: the plan's q, same rows
    larger = owner_rate(plan, 20_000, rows)
    assert larger < q and sum_bound.poisson_tail(larger * 20_000, sum_bound.TAIL) <= rows  # spends less, same rows


def _restarted():
    """The owner's service started again: nothing it held in memory is left (its trainers, its
    sessions, its calibrations); its state folder is read anew."""
    from fedsd.app.client import handler

    handler._TRAINERS.clear()
    service._SESSIONS.clear()
    dn.calibrated.cache_clear()


def _round(f, server_round, plan=None, rounds=ROUNDS, **flat):
    """A masked-input round's content: the run's settings with `flat` changed and the plan `plan`
    (the run's own by default) for `rounds` rounds."""
    settings = {**f.flat, **flat, **dn.to_settings(plan or f.plan, rounds), "experiment-id": EXPERIMENT,
                "server-round": server_round}
    return RecordDict({"arrays": f.arrays, "config": ConfigRecord(settings)})


def _calibrated(f, epsilon=None, clip=None, q=None, rounds=ROUNDS):
    """The plan an honest server calibrates for these settings (secure_plans.distributed_plan)."""
    p = f.plan
    return dn.calibrated(epsilon or f.cfg.epsilon, f.cfg.delta, clip or p.clip, q or p.sample_rate, p.expected_batch,
                         rounds, p.honest, p.dim)


# A server that changes one of the run's settings after an owner admitted its plan, with a plan
# that an honest server would calibrate for the changed settings (it passes every other check).
CHANGED = {
    "epsilon": lambda f: dict(plan=_calibrated(f, epsilon=3.0), epsilon=3.0),
    "num-server-rounds": lambda f: dict(plan=_calibrated(f, rounds=4), rounds=4, **{"num-server-rounds": 4}),
    "sample-rate": lambda f: dict(plan=_calibrated(f, q=f.plan.sample_rate * 1.2),
                                  **{"sample-rate": f.plan.sample_rate * 1.2}),
    "clip": lambda f: dict(plan=_calibrated(f, clip=f.plan.clip * 2), clip=f.plan.clip * 2),
    "noise-multiplier": lambda f: dict(plan=dn.NoisePlan(**{**f.plan.to_dict(),
                                                            "noise_multiplier": f.plan.noise_multiplier * 1.5})),
}


@pytest.mark.parametrize("setting", sorted(CHANGED))
def test_a_plan_changed_after_the_owner_admitted_it_is_refused_mid_run_and_after_a_restart(federation, monkeypatch,
                                                                                            setting):
    """An owner's ledger admits a run's whole plan (ε over its rounds at q, C and z) on the
    owner's first round, and charges each round at the plan's z after. A server that changes ε,
    the number of rounds, q, C or z for a later round of the same experiment (with a plan
    calibrated for the new settings, which passes every other check) would run the owner past
    the plan it admitted. The admitted plan is pinned in the owner's state folder: a different
    one is refused, naming the setting, before anything is drawn and with the ledger's bytes
    unchanged, in the same service and after it restarts; the admitted plan goes on."""
    from fedsd.training.loop import DPTrainer
    from tests.deployment.test_distributed_deployment import privacy_files

    f = federation
    context, owner = _owner(f, 0)
    distributed_contribution(_round(f, 1), context, owner)  # round 1: the plan admitted, charged
    assert (f.tmp_path / "state-0" / EXPERIMENT / "client-0-plan.json").is_file()
    before = privacy_files(f.tmp_path)
    real = DPTrainer.clipped_sum
    monkeypatch.setattr(DPTrainer, "clipped_sum", lambda *a, **k: pytest.fail("drew a batch"))
    changed = CHANGED[setting](f)
    for restart in (False, True):
        if restart:
            _restarted()
            context, owner = _owner(f, 0)
        with pytest.raises(StageRefused, match=f"{setting}.*admitted"):
            distributed_contribution(_round(f, 2, **changed), context, owner)
        assert privacy_files(f.tmp_path) == before  # the ledger and every privacy file byte for byte
    monkeypatch.setattr(DPTrainer, "clipped_sum", real)
    distributed_contribution(_round(f, 2), context, owner)  # the admitted plan goes on


def test_a_round_an_owner_was_charged_for_is_never_charged_again(federation):
    """The SuperLink killed after the owners' masked inputs of round 2 and before the server's
    checkpoint of it: the run resumes from round 1's checkpoint, in a new Flower run, and asks
    round 2 again (a hostile server may ask any round again, with any model). Answered again
    with a fresh batch and fresh noise, one step of the federation would be released twice and
    charged twice (one of the run's planned rounds spent on it). The owner's ledger keys its
    charges by experiment and round: a round it was charged for is refused with the reason,
    before anything is drawn, the ledger's bytes unchanged, whatever model is sent (its kept
    reply catches only the last request, the same model for the same round), in whatever
    Flower run and after a restart of the service."""
    import json

    from tests.deployment.test_distributed_deployment import privacy_files

    f = federation
    long_run = dict(plan=_calibrated(f, rounds=4), rounds=4, **{"num-server-rounds": 4})  # rounds left to charge
    first = next(k for k, a in f.arrays.items() if a.numpy().dtype.kind == "f")
    moved = ArrayRecord({k: Array(a.numpy() + 1e-3 if k == first else a.numpy()) for k, a in f.arrays.items()})
    context, owner = _owner(f, 0)
    sent = {1: f.arrays, 2: moved}  # the global model of each round
    for server_round, arrays in sent.items():
        content = _round(f, server_round, **long_run)
        content["arrays"] = arrays
        distributed_contribution(content, context, owner)
    before = privacy_files(f.tmp_path)
    _restarted()  # the service too
    context.run_id = 8  # the resumed run: another Flower run, the same experiment
    context, owner = _owner(f, 0)
    for server_round, arrays, why in ((2, moved, "went into a sum already"), (2, f.arrays, "round 2 .*charged"),
                                      (1, f.arrays, "round 1 .*charged")):
        content = _round(f, server_round, **long_run)
        content["arrays"] = arrays
        with pytest.raises(StageRefused, match=why):
            distributed_contribution(content, context, owner)
        assert privacy_files(f.tmp_path) == before
    ledger = json.loads(next((f.tmp_path / "state-0").glob("ledger-*.json")).read_text())
    assert [(e["run"], e["round"]) for e in ledger["entries"]] == [(EXPERIMENT, 1), (EXPERIMENT, 2)]


# A second review playing the attacker against the deployed distributed-noise path.

def test_a_client_given_other_settings_fails_every_other_clients_check_at_share_keys():
    """The protocol alone (no data): three owners on one roster; the server tells client 3 other
    settings (its digest) at stage 0. Every client's check of its neighbours' signed keys fails
    at stage 1, before anything is drawn: no one deals a share. Without the settings in the
    signature all three go on."""
    from fedsd.secure.identity import Identity, Member, Roster
    from fedsd.secure.secagg import SecAggClient
    from fedsd.secure.secagg_primitives import ProtocolError
    from fedsd.secure.secagg_server import SecAggServer

    keys = [Identity() for _ in range(3)]
    roster = Roster([Member(f"owner-{k}", key.public) for k, key in enumerate(keys)])
    ids = sorted(key.id for key in keys)
    clients = {key.id: SecAggClient(key.id, b"round", min_cohort=3, identity=key, roster=roster) for key in keys}
    server = SecAggServer(b"round", ids, 10)
    told = {i: (b"A" * 32 if i == ids[-1] else b"B" * 32) for i in ids}
    # relayed as a server that tells clients other settings relays them (an honest one leaves such adverts out)
    server.keys = {i: c.advertise(**server.setup(i), context=told[i]) for i, c in clients.items()}
    for i, client in clients.items():
        with pytest.raises(ProtocolError, match="cohort, threshold, graph and settings"):
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
    from fedsd.secure.secagg_server import SecAggServer
    from fedsd.training.loop import DPTrainer
    from tests.deployment.test_distributed_deployment import privacy_files
    from tests.app.client.test_secure_aggregation import keys_message, stage

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
    # relayed as the server that sent two plans relays them (an honest one leaves such adverts out)
    server.keys = {n: dict(service.advertise_reply(advertised(n), f.contexts[n])["secagg"]) for n in IDS}
    before = privacy_files(f.tmp_path)  # (each owner's record of the rounds it joined moved, legitimately)
    for n in IDS:  # each owner finds a neighbour's keys signed for other settings
        with pytest.raises(StageRefused, match="cohort, threshold, graph and settings"):
            service.share_reply(keys_message(base, server, n), f.contexts[n])
    assert privacy_files(f.tmp_path) == before


def test_a_masked_input_under_other_settings_than_advertised_is_refused(federation, monkeypatch):
    """Every owner was advertised the same plan; the server then sends one of them a weaker
    plan with the masked-input stage (its neighbours would still be summed under the first):
    refused before anything is drawn."""
    from fedsd.app.client import handler as local
    from fedsd.training.loop import DPTrainer
    from tests.deployment.test_distributed_deployment import privacy_files

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
    with pytest.raises(StageRefused, match="not those it was advertised with"):
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


def test_a_plan_whose_padding_could_not_be_computed_is_refused_before_the_charge(federation):
    """The plan's expected batch is the server's: at 1e13 the padded step cannot be allocated and
    failed after the ledger was charged (a review playing the attacker): a round paid for and
    nothing released. Refused before the charge, the privacy files byte for byte."""
    from tests.deployment.test_distributed_deployment import privacy_files

    f = federation
    huge = dn.NoisePlan(**{**f.plan.to_dict(), "expected_batch": 1e13})
    context, owner = _owner(f, 0)
    before = privacy_files(f.tmp_path)
    with pytest.raises(StageRefused, match="pads each step|not the run.s batch-size"):
        distributed_contribution(_round(f, 1, plan=huge), context, owner)
    assert privacy_files(f.tmp_path) == before


def test_a_round_that_fails_after_its_charge_counts_as_taken_part_in(federation, monkeypatch):
    """Anything that fails after the charge (nothing released) still counts the round in the
    run's own state, as the ledger does: the next round's ε is that of two rounds taken part in,
    never one (the run's cap and the ledger tell one story)."""
    import fedsd.secure.distributed_step as distributed

    f = federation
    context, owner = _owner(f, 0)
    real = distributed.contribution

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(distributed, "contribution", fails)
    with pytest.raises(RuntimeError):
        distributed_contribution(_round(f, 1), context, owner)
    monkeypatch.setattr(distributed, "contribution", real)
    _, metrics = distributed_contribution(_round(f, 2), context, owner)
    assert metrics["epsilon"] == pytest.approx(f.plan.epsilon(2, f.cfg.delta)), metrics


def test_whether_a_plans_padding_is_refused_does_not_depend_on_the_owners_records(federation):
    """The padding refused before the charge by the plan's bound and the owner's own together:
    with q = 1 the refusal came for an owner with more than ~4M records only, and its text gave
    the owner's bound, so a server read n over q for free (a second review playing the attacker).
    The refusal now follows the plan alone, and says only the plan's numbers."""
    from fedsd.app.client.step_padding import MAX_PADDED_BYTES, padded_rows

    plan = dn.NoisePlan(**{**federation.plan.to_dict(), "sample_rate": 1.0, "expected_batch": 1.0})
    assert padded_rows(plan, 4 * 784) < 100  # the plan's bound alone: no record count enters it
    huge = dn.NoisePlan(**{**plan.to_dict(), "expected_batch": MAX_PADDED_BYTES / 3136 * 1.1})
    with pytest.raises(StageRefused) as refused:
        padded_rows(huge, 4 * 784)
    assert "expected batch" in str(refused.value)


def test_a_state_with_rounds_but_no_admitted_plan_is_refused(federation):
    """The pinned plan missing (a state folder restored without it) while the run's state holds
    rounds: any plan would be admitted as a first round's and the whole-plan check skipped.
    Refused, nothing drawn."""
    from tests.deployment.test_distributed_deployment import privacy_files

    f = federation
    context, owner = _owner(f, 0)
    distributed_contribution(_round(f, 1), context, owner)
    (f.tmp_path / "state-0" / EXPERIMENT / "client-0-plan.json").unlink()
    before = privacy_files(f.tmp_path)
    with pytest.raises(StageRefused, match="no plan it admitted"):
        distributed_contribution(_round(f, 2), context, owner)
    assert privacy_files(f.tmp_path) == before
