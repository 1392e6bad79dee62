"""`fedsd check-privacy`, on a run's files as a deployment leaves them: it passes
only when every aggregated update is charged on its client's disk within the owner's limit,
and fails loudly, naming the file, when it cannot read a ledger."""
import json

import pytest

from fedsd.errors import DataError
from fedsd.cli.main import main
from fedsd.privacy.independent_check import check_run, rdp_epsilon

CHARGE = dict(noise_multiplier=1.2, sample_rate=0.1, steps=10)


def deployment(tmp_path, charged: dict[int, list[int]], max_epsilon: float = 3.0, reported: float | None = None):
    """A finished 2-client, 2-round run (both trained every round) and the clients' ledgers,
    each charging the rounds `charged[k]` of the run's experiment."""
    rounds = [dict(round=r, trained=[0, 1], client_epsilon={
        str(k): reported if reported is not None else rdp_epsilon([CHARGE] * r, 1e-5) for k in (0, 1)})
        for r in (1, 2)]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "result.json").write_text(json.dumps(dict(
        rounds=rounds, experiment_id="exp", federation=dict(rounds=2), num_clients=2, delta=1e-5)))
    for k in (0, 1):
        state = tmp_path / "work" / "client-state" / str(k)
        state.mkdir(parents=True)
        entries = [dict(CHARGE, run="exp", round=r) for r in charged[k]]
        (state / "ledger-abc.json").write_text(json.dumps(dict(max_epsilon=max_epsilon, max_delta=1e-5,
                                                               entries=entries)))
    return tmp_path / "run", tmp_path / "work"


def run_check(run, work, capsys) -> tuple[int, dict]:
    code = main(["check-privacy", "--run", str(run), "--work", str(work)])
    return code, json.loads(capsys.readouterr().out)


def test_every_aggregated_update_charged_within_the_limit_passes(tmp_path, capsys):
    code, report = run_check(*deployment(tmp_path, {0: [1, 2], 1: [1, 2]}), capsys)
    assert code == 0 and report["passed"] and report["problems"] == []
    assert report["clients"]["0"]["epsilon_released"] == pytest.approx(rdp_epsilon([CHARGE] * 2, 1e-5))


def test_an_update_aggregated_but_never_charged_fails_naming_client_and_round(tmp_path, capsys):
    code, report = run_check(*deployment(tmp_path, {0: [1, 2], 1: [1]}), capsys)
    assert code == 1 and not report["passed"]
    assert report["problems"][0].startswith("client 1, round 2: the server aggregated an update that is not charged")
    assert any("reported ε" in p and "a charge is missing from its disk" in p for p in report["problems"])


def test_a_ledger_above_its_owners_limit_fails(tmp_path, capsys):
    code, report = run_check(*deployment(tmp_path, {0: [1, 2], 1: [1, 2]}, max_epsilon=0.5), capsys)
    assert code == 1 and "above its owner's max-epsilon 0.5" in report["problems"][0]


def test_an_unreadable_ledger_fails_loudly_naming_the_file(tmp_path, capsys):
    run, work = deployment(tmp_path, {0: [1, 2], 1: [1, 2]})
    (work / "client-state" / "1" / "ledger-abc.json").write_text("{not json")
    assert main(["check-privacy", "--run", str(run), "--work", str(work)]) == 2
    assert f"{work / 'client-state' / '1' / 'ledger-abc.json'}: not a readable ledger" in capsys.readouterr().err
    (work / "client-state" / "1" / "ledger-abc.json").unlink()
    with pytest.raises(DataError, match="no ledger"):
        check_run(run, {0: work / "client-state" / "0", 1: work / "client-state" / "1"})


def test_a_round_charged_twice_is_listed_and_a_soak_fails_it_unless_a_fault_stopped_that_client(tmp_path, capsys):
    """A second charge for a round is the safe side for privacy (the check passes), but it is
    listed; fedsd bench soak fails it unless that client's node or worker was stopped in that
    round (it then trained the round again), as a replayed round once was charged twice."""
    from fedsd.benchmarks.soak import Absence, Fault, charged_again_unexplained

    code, report = run_check(*deployment(tmp_path, {0: [1, 2], 1: [1, 2, 2]}, max_epsilon=5.0), capsys)
    assert code == 0 and report["passed"]
    assert report["clients"]["1"]["charged_again"] == {"2": 2} and report["clients"]["0"]["charged_again"] == {}
    # the released update's cost counts once; the ledger holds both
    assert report["clients"]["1"]["epsilon_released"] < report["clients"]["1"]["epsilon_ledger"]
    server_killed = Fault(2, 0.5, "serverapp", None, 1.0, landed_round=2)
    assert charged_again_unexplained(report, [server_killed], []) == ["client 1, round 2: charged 2 times"]
    other_client = Fault(2, 0.5, "worker", 0, 1.0, landed_round=2)
    assert charged_again_unexplained(report, [other_client], []) == ["client 1, round 2: charged 2 times"]
    assert charged_again_unexplained(report, [Fault(2, 0.5, "worker", 1, 1.0, landed_round=2)], []) == []
    assert charged_again_unexplained(report, [Fault(2, 0.5, "supernode", 1, 1.0, landed_round=1)], []) != []
    assert charged_again_unexplained(report, [], [Absence(1, leaves_after=1, rounds=1)]) == []


def distributed_deployment(tmp_path, charged: dict[int, list[int]], z_scale: float = 1.0, noise_field: bool = True,
                           plan=None):
    """A finished 2-owner, 2-round client-level distributed-noise run, whose record names each
    owner by its protocol id (its identity key's), the owners' ledgers of Skellam charges (at
    z_e / 2 of the plan, times z_scale) and the plan each pinned when it admitted the run."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from fedsd.secure import client_level
    from fedsd.secure import distributed_noise as dn
    from fedsd.secure.identity import protocol_id

    plan = plan or client_level.calibrate(3.0, 1e-5, 0.5, 2, 2, 2, 100)
    keys = [Ed25519PrivateKey.generate() for _ in (0, 1)]
    ids = [protocol_id(k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)) for k in keys]
    charge = dict(noise_multiplier=plan.gaussian_equivalent() / 2 * z_scale, sample_rate=1.0, steps=1,
                  mechanism="skellam")
    rounds = [dict(round=r, trained=ids, client_epsilon={str(i): plan.epsilon(r, 1e-5) for i in ids}) for r in (1, 2)]
    (tmp_path / "run").mkdir()
    federation = dict(rounds=2, noise="distributed") if noise_field else dict(rounds=2)
    federation["privacy_unit"] = "client"
    (tmp_path / "run" / "result.json").write_text(json.dumps(dict(
        rounds=rounds, experiment_id="exp", federation=federation, num_clients=2, delta=1e-5)))
    for k in (0, 1):
        state = tmp_path / "work" / "client-state" / str(k)
        (state / "exp").mkdir(parents=True)
        (state / "identity.key").write_bytes(keys[k].private_bytes_raw())
        (state / "exp" / f"client-{k}-plan.json").write_text(json.dumps(
            {"privacy-unit": "client", **dn.to_settings(plan, 2)}))
        entries = [dict(charge, run="exp", round=r) for r in charged[k]]
        (state / "ledger-abc.json").write_text(json.dumps(dict(max_epsilon=30.0, max_delta=1e-5, entries=entries)))
    return tmp_path / "run", tmp_path / "work", ids


@pytest.mark.parametrize("noise_field", [True, False])
def test_a_distributed_run_is_checked_by_each_owners_protocol_id(tmp_path, capsys, noise_field):
    """Under distributed noise the record names owners by protocol id: the check finds each
    owner's id from its identity key (also where the server's result does not say the noise was
    distributed: its ledgers' Skellam charges do), so a summed round missing from a ledger
    fails (matched by partition id, no round would be found released, and the check would pass
    on nothing)."""
    run, work, ids = distributed_deployment(tmp_path, {0: [1, 2], 1: [1]}, noise_field=noise_field)
    code, report = run_check(run, work, capsys)
    assert code == 1 and report["clients"]["0"]["named"] == ids[0]
    assert report["clients"]["0"]["released_rounds"] == [1, 2] and report["clients"]["1"]["released_rounds"] == [1, 2]
    assert report["problems"][0].startswith("client 1, round 2: the server aggregated an update that is not charged")
    (work / "client-state" / "1" / "identity.key").unlink()
    assert main(["check-privacy", "--run", str(run), "--work", str(work)]) == 2
    assert "identity.key: not the owner's identity key" in capsys.readouterr().err


def test_a_record_naming_no_given_owner_fails(tmp_path, capsys):
    """Names that match no owner (a replaced identity key) would leave every round unchecked."""
    run, work, ids = distributed_deployment(tmp_path, {0: [], 1: []})
    result = json.loads((run / "result.json").read_text())
    for r in result["rounds"]:
        r["trained"] = [ids[0] + 1, ids[1] + 1]
        r["client_epsilon"] = {}
    (run / "result.json").write_text(json.dumps(result))
    code, report = run_check(run, work, capsys)
    assert code == 1 and any(f"names client {ids[0] + 1}, none of the given owners" in p for p in report["problems"])


def test_a_charge_below_the_admitted_plan_fails(tmp_path, capsys):
    """A client-level round charged at z_e (the client's unit) instead of z_e / 2 (one record's)
    under-counts each record's cost: checked against the plan the owner pinned."""
    run, work, _ = distributed_deployment(tmp_path, {0: [1, 2], 1: [1, 2]}, z_scale=2.0)
    code, report = run_check(run, work, capsys)
    assert code == 1 and any("charged at z" in p and "its admitted plan costs" in p for p in report["problems"])


@pytest.mark.parametrize("plan_z", [None, 400.0])
def test_a_skellam_charge_is_recomputed_at_the_integer_orders_the_ledger_uses(tmp_path, capsys, plan_z):
    """A Skellam charge's Gaussian equivalent bounds its RDP at integer orders 2..256 only: the
    check's ε is the ledger's own, above what Opacus' fractional orders would give; and at a
    large z (a small ε, whose best order would be above 256) no higher order lowers it."""
    from dataclasses import replace

    from fedsd.privacy.independent_check import ORDERS
    from fedsd.privacy.accounting import SKELLAM, PrivacyFilter
    from fedsd.secure import client_level
    from opacus.accountants import RDPAccountant

    plan = client_level.calibrate(3.0, 1e-5, 0.5, 2, 2, 2, 100)
    plan = replace(plan, noise_multiplier=plan_z) if plan_z else plan
    run, work, _ = distributed_deployment(tmp_path, {0: [1, 2], 1: [1, 2]}, plan=plan)
    code, report = run_check(run, work, capsys)
    ours = report["clients"]["0"]["epsilon_ledger"]
    z = plan.gaussian_equivalent() / 2
    ledger = PrivacyFilter(30.0, 1e-5)
    for _ in (1, 2):
        ledger.spend(z, 1.0, 1, mechanism=SKELLAM)
    accountant = RDPAccountant()
    accountant.history = [(z, 1.0, 2)]
    fractional = accountant.get_epsilon(delta=1e-5, alphas=ORDERS)
    assert ours == pytest.approx(ledger.epsilon(), rel=1e-3) and ours > fractional * 1.001, (ours, fractional)


def test_owners_run_by_hand_give_their_state_folders_and_a_missing_one_says_how(tmp_path, capsys):
    """Owners started by hand keep their state folders where each chose (their node config's
    state-dir), not in deploy-local's layout: --state K=DIR names each. A client without one was
    "client k: no state folder given; the check fails", with nothing of what was looked for."""
    run, work = deployment(tmp_path, {0: [1, 2], 1: [1, 2]})
    elsewhere = tmp_path / "owner-1-state"
    (work / "client-state" / "1").rename(elsewhere)
    assert main(["check-privacy", "--run", str(run), "--work", str(work)]) == 2
    err = capsys.readouterr().err
    assert f"client 1 (of the run's 2): no state folder; --work {work} has neither {work / 'client-state' / '1'} " \
           f"nor {work / 'nodes' / '1' / 'state'}" in err
    assert "--state 0=/srv/owner-0/state" in err and "its owner's state-dir" in err and "ledger-*.json" in err
    assert main(["check-privacy", "--run", str(run)]) == 2
    assert "the clients' state folders: none given" in capsys.readouterr().err
    code = main(["check-privacy", "--run", str(run), "--state", f"0={work / 'client-state' / '0'}",
                 "--state", f"1={elsewhere}"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["clients"]["1"]["ledger"] == str(elsewhere / "ledger-abc.json")
    assert main(["check-privacy", "--run", str(run), "--work", str(work), "--state", f"1={elsewhere}"]) == 0
    capsys.readouterr()
    with pytest.raises(DataError, match="client 1: no state folder given; the check fails. Each client's state "
                                        "folder is its owner's state-dir"):
        check_run(run, {0: work / "client-state" / "0"})
