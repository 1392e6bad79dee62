"""`fedsd check-privacy`, on a run's files as a deployment leaves them: it passes
only when every aggregated update is charged on its client's disk within the owner's limit,
and fails loudly, naming the file, when it cannot read a ledger."""
import json

import pytest

from fedsd.errors import DataError
from fedsd.cli.main import main
from fedsd.cli.check_privacy import check_run, rdp_epsilon

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
        (state / "ledger-abc.json").write_text(json.dumps(dict(max_epsilon=max_epsilon, max_delta=1e-5, entries=entries)))
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
