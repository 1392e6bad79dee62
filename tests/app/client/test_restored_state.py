"""A restored copy of an owner's state folder no longer rolls its ledger back.

A review against real services copied an owner's state folder mid-run and restored it three
times: 10 masked inputs were released for a 4-round run at ε = max-epsilon, dp_accounting gave
ε 4.630 for what was released while the ledger said 3.000, and a restored folder joined a round
it had joined. The owner's record, kept outside the state folder (fedsd.privacy.owner_record),
is raised at every charge and join: a folder behind it is refused (the server told only
"refused: state"), until the owner accepts the restore, which adds the charges back and spends
nothing twice. Tried with the owners' handlers and real state folders and ledgers, against a
real `fedsd data-service`, and through `fedsd ledger`."""
import json
import math
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from fedsd.app.client.node_config import NodeConfigError, parse
from fedsd.files.state_folder import state_folder
from fedsd.privacy import lifetime_ledger as ledgers
from fedsd.privacy.accounting import SKELLAM, PrivacyFilter

ROOT = Path(__file__).resolve().parents[3]
SERVER_REASON = "refused: state"  # all the server is told of a restored state folder


def accountants_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, integer=False) -> float:
    """dp_accounting's RDP ε of `steps` Poisson-subsampled Gaussian steps (at the ledger's integer
    orders up to 256 for Skellam steps, where their bound is the Gaussian's at z_e)."""
    from dp_accounting import dp_event, rdp

    from fedsd.privacy.accounting import RDP_ORDERS

    orders = [a for a in RDP_ORDERS if float(a).is_integer() and 2 <= a <= 256] if integer else RDP_ORDERS
    accountant = rdp.RdpAccountant(orders=orders)
    accountant.compose(dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier)), steps)
    return accountant.get_epsilon(delta)


def restore(backup: Path, state: Path) -> None:
    """The copy put back in place of the folder, as a restore from a backup does."""
    shutil.rmtree(state)
    shutil.copytree(backup, state)


# -- the ledger and its record, without training -----------------------------------------------
SIGMA, Q, STEPS, MAX_EPSILON, DELTA = 1.2, 0.05, 20, 3.0, 1e-5


def charge(state: Path, records, server_round: int) -> str:
    """One round charged to the owner's ledger as a service does (its record checked before, raised
    after); 'charged' or why not."""
    from fedsd.errors import StateRolledBack

    try:
        with ledgers.opened(state_folder(state), "data", MAX_EPSILON, DELTA, records=records) as ledger:
            ledger.spend(SIGMA, Q, STEPS, run="exp", round=server_round)
    except StateRolledBack:
        return "rolled back"
    except ValueError as e:  # BudgetRefused: the lifetime budget
        return f"refused: {e}"
    return "charged"


def test_a_restored_ledger_is_refused_until_accepted_and_nothing_is_spent_past_max_epsilon(tmp_path, owner_records):
    from fedsd.privacy.owner_record import Records

    state, backup = tmp_path / "state", tmp_path / "backup"
    records = Records.open(owner_records)
    charged = []
    for server_round in (1, 2):
        assert charge(state, records, server_round) == "charged"
        charged.append(server_round)
    shutil.copytree(state, backup)
    server_round = 3
    while charge(state, records, server_round) == "charged":  # the rest of the budget, after the copy
        charged.append(server_round)
        server_round += 1
    for _ in range(3):
        restore(backup, state)
        assert charge(state, records, server_round) == "rolled back"  # refused before anything is charged
        assert len(PrivacyFilter.from_state_dict(json.loads(next(state.glob("ledger-*.json")).read_text()),
                                                 MAX_EPSILON, DELTA).entries) == 2
    ledgers.check_restored(state_folder(state), records, MAX_EPSILON, DELTA, accept=True)  # the owner's word
    assert "accepted a restored state folder" in records.accepted[0]
    assert charge(state, records, server_round).startswith("refused: lifetime budget: spent")  # nothing re-spent
    spent = accountants_epsilon(SIGMA, Q, STEPS * len(charged), DELTA)
    print(f"{len(charged)} rounds charged in all; dp_accounting ε = {spent:.3f}")
    assert spent <= MAX_EPSILON * (1 + 1e-6)
    [report] = ledgers.read_all(state)
    assert report.charges == len(charged) and report.spent == pytest.approx(spent, rel=1e-4)
    ledgers.check_restored(state_folder(state), records, MAX_EPSILON, DELTA)  # raised: no longer behind


def test_the_record_is_never_lowered_and_lives_outside_the_state_folder(tmp_path, owner_records):
    """A folder ahead of its record (a record kept elsewhere before) raises the record; a record
    inside the state folder, which a copy would carry, is refused."""
    from fedsd.privacy.owner_record import Records

    state = tmp_path / "state"
    with ledgers.opened(state_folder(state), "data", MAX_EPSILON, DELTA) as ledger:  # before any record
        ledger.spend(SIGMA, Q, STEPS, run="exp", round=1)
    records = Records.open(owner_records)
    ledgers.check_restored(state_folder(state), records, MAX_EPSILON, DELTA)
    assert [spent.charges for spent in records.spent("data").values()] == [1]
    npz = tmp_path / "data.npz"
    npz.write_bytes(b"")
    for inside in (state, state / "records"):
        with pytest.raises(NodeConfigError, match="record-dir.*inside state-dir"):
            parse({"partition-id": 0, "data": str(npz), "max-epsilon": 1.0, "state-dir": str(state),
                   "record-dir": str(inside)})


def test_a_fresh_folder_is_its_own_and_a_copy_without_its_folders_id_is_held_to_the_most_charged(tmp_path,
                                                                                               owner_records):
    """A fresh state folder for the same data keeps a ledger of its own (it holds none when first
    charged); a copy made before its folder had an id (a backup older than the record) holds a
    ledger the record does not know by id: it is held against the most any folder charged."""
    from fedsd.privacy.owner_record import STATE_ID, Records

    records = Records.open(owner_records)
    state, fresh, backup = tmp_path / "state", tmp_path / "fresh", tmp_path / "backup"
    assert charge(state, records, 1) == "charged"
    shutil.copytree(state, backup)
    (backup / STATE_ID).unlink()  # as a copy made before this record existed
    assert [charge(state, records, 2), charge(fresh, records, 1)] == ["charged", "charged"]
    restore(backup, state)
    assert charge(state, records, 2) == "rolled back"
    assert (state / STATE_ID).exists() is False  # refused: nothing written to the folder


def test_fedsd_ledger_shows_the_ledger_and_the_owners_record_and_says_when_they_disagree(tmp_path, owner_records,
                                                                                         capsys):
    from fedsd.cli.main import main
    from fedsd.privacy.owner_record import Records

    state, backup = tmp_path / "state", tmp_path / "backup"
    records = Records.open(owner_records)
    assert charge(state, records, 1) == "charged"
    shutil.copytree(state, backup)
    assert charge(state, records, 2) == "charged"
    assert main(["ledger", "--state-dir", str(state)]) == 0
    agreeing = capsys.readouterr().out
    assert "owner's record  ε = " in agreeing and "in 2 charges" in agreeing and "agrees" in agreeing, agreeing
    restore(backup, state)
    assert main(["ledger", "--state-dir", str(state)]) == 0
    text = capsys.readouterr().out
    assert "over 20 steps" in text and "owner's record  ε = " in text and "in 2 charges (40 steps)" in text
    assert "DISAGREE" in text and "1 charges against 2" in text and "--accept-restored-state" in text
    assert main(["ledger", "--state-dir", str(state), "--json"]) == 0
    [report] = json.loads(capsys.readouterr().out)
    assert report["charges"] == 1 and report["record"]["charges"] == 2 and report["record_agrees"] is False
    assert report["record"]["epsilon"] > report["spent_epsilon"]


# -- the owners' handlers, secure aggregation under distributed noise ----------------------------
from tests.deployment.test_distributed_deployment import EPSILON, federation  # noqa: E402, F401
from tests.deployment.test_deployed_plans_a_server_chooses import _calibrated, _owner, _restarted, _round  # noqa: E402
from tests.app.client.test_secure_aggregation import EXPERIMENT, IDS, owners  # noqa: E402, F401
from tests.app.client.test_server_threat import data_service_process  # noqa: E402

LONG = 4  # the run's rounds


@pytest.mark.slow  # one DP-SGD step a round, on an owner's real data, real ledger and state folder
def test_a_state_folder_restored_three_times_spends_nothing_twice_and_joins_no_round_again(federation):
    """Owner 0 takes part in rounds 1–4 of a 4-round run whose plan its max-epsilon admits whole;
    its state folder is copied after round 2 and restored three times (once while its service
    runs, twice across a restart). Each restore is refused, on joining round 3 again and on its
    charge, the server told only "refused: state"; accepted, the ledger holds the 4 rounds and
    nothing more is charged. Everything charged, by dp_accounting, stays within max-epsilon."""
    from fedsd.app.client.secure_contribution import distributed_contribution
    from fedsd.app.client.secure_owner import StageRefused
    from fedsd.secure.secagg_primitives import ProtocolError

    f = federation
    plan = _calibrated(f, rounds=LONG)
    z_e, delta = plan.gaussian_equivalent(), f.cfg.delta
    max_epsilon = PrivacyFilter(math.inf, delta).epsilon([(z_e, plan.sample_rate, LONG, SKELLAM)]) * (1 + 1e-6)
    assert max_epsilon < EPSILON * 1.01  # the run's own ε, at the ledger's orders
    f.contexts[IDS[0]].node_config["max-epsilon"] = max_epsilon
    long_run = dict(plan=plan, rounds=LONG, **{"num-server-rounds": LONG})
    state, backup = f.tmp_path / "state-0", f.tmp_path / "backup"
    charged = []

    def join(server_round):
        context, owner = _owner(f, 0)
        try:
            owner.join((owner.node.state_dir, int(context.run_id), EXPERIMENT, server_round))
        except (StageRefused, ProtocolError) as e:
            return str(e)
        return "joined"

    def contribute(server_round):
        context, owner = _owner(f, 0)
        try:
            distributed_contribution(_round(f, server_round, **long_run), context, owner)
        except StageRefused as e:
            return str(e)
        charged.append(server_round)
        return "released"

    for server_round in (1, 2):
        assert (join(server_round), contribute(server_round)) == ("joined", "released")
    shutil.copytree(state, backup)
    for server_round in (3, 4):
        assert (join(server_round), contribute(server_round)) == ("joined", "released")
    outcomes = []
    for restart in (False, True, True):
        restore(backup, state)
        if restart:
            _restarted()
        outcomes += [join(3), contribute(3), join(4), contribute(4)]
    spent = accountants_epsilon(z_e, plan.sample_rate, len(charged), delta, integer=True)
    print(f"{len(charged)} masked inputs released; dp_accounting ε = {spent:.3f}, max-epsilon {max_epsilon:.3f}")
    assert spent <= max_epsilon, f"{len(charged)} masked inputs: ε = {spent:.3f} > max-epsilon {max_epsilon:.3f}"
    assert outcomes == [f"secure aggregation {SERVER_REASON}"] * 12, outcomes  # nothing more to the server
    from fedsd.app.client.restored_state import check_on_start

    node = parse(f.contexts[IDS[0]].node_config)
    check_on_start(node, node.state(), accept=True)  # the owner's --accept-restored-state
    after = [join(3), contribute(3), join(5)]
    assert "advertised to this owner already" in after[0] and "budget" in after[1], after
    assert charged == [1, 2, 3, 4]
    [report] = ledgers.read_all(state)
    assert report.charges == LONG and report.spent == pytest.approx(
        PrivacyFilter(math.inf, delta).epsilon([(z_e, plan.sample_rate, LONG, SKELLAM)]), rel=1e-6)


# -- a real `fedsd data-service` -----------------------------------------------------------------
@contextmanager
def data_service(npz: Path, tmp_path: Path, state: Path, *flags: str, wait: bool = True):
    """The owner's `fedsd data-service` as a real process, at the run's ε for max-epsilon: yields
    (address, log, process) once it listens (or at once with wait=False); stopped after."""
    config = f"partition-id=0 data='{npz}' max-epsilon={SERVICE_EPSILON} state-dir='{state}'"
    with data_service_process(config, tmp_path, tmp_path / f"service-{time.monotonic_ns()}.log", str(ROOT), flags,
                              wait) as running:
        yield running


SERVICE_EPSILON = 3.0  # tests.app.client.test_server_threat.one_step_run's ε: the owner's whole budget


@pytest.mark.slow  # three starts of a real service, four rounds of one DP-SGD step
def test_a_real_data_service_refuses_a_restored_state_folder_until_its_owner_accepts_it(tmp_path, capsys):
    """Rounds 1–4 of a 4-round run at ε = the owner's max-epsilon through a real service; the
    state folder copied after round 2. Restored while the service runs: round 3 again is refused,
    the server told only "refused: state", the owner's log why. Restored again, the service
    refuses to start, saying what it found, by how much and which flag accepts it; started with
    --accept-restored-state, it raises the ledger to the record and refuses round 3 again for the
    budget. Four rounds were released, within max-epsilon by dp_accounting."""
    import numpy as np

    from fedsd.cli.main import main
    from fedsd.data import datasets as data_lib
    from tests.conftest import require
    from tests.app.client.test_service_processes_under_slips import run_of
    from tests.app.client.test_server_threat import N, via_service

    require("fmnist")
    images = data_lib.load("fmnist")  # the owner's data: 64 Fashion-MNIST images, one step a round (q = 1)
    npz = tmp_path / "data.npz"
    np.savez(npz, x_train=images.x_train[:N, 0].numpy(), y_train=images.y_train[:N].numpy(),
             x_test=images.x_test[:200, 0].numpy(), y_test=images.y_test[:200].numpy())
    state, backup = tmp_path / "owner-state", tmp_path / "backup"
    _, _, flat, start = run_of("restored", rounds=LONG)
    released = []

    def ask(address, server_round):
        reply = via_service(address, flat, start, server_round=server_round)
        if not reply["metrics"]["skipped"]:
            released.append((server_round, float(reply["metrics"]["noise-multiplier"])))
        return reply

    with data_service(npz, tmp_path, state) as (address, log, _):
        for server_round in (1, 2):
            assert ask(address, server_round)["metrics"]["skipped"] == 0
        shutil.copytree(state, backup, ignore=shutil.ignore_patterns("service.lock"))
        for server_round in (3, 4):
            assert ask(address, server_round)["metrics"]["skipped"] == 0
        shutil.copytree(backup, state, dirs_exist_ok=True)  # restored in place, the service running
        again = ask(address, 3)
        assert again["metrics"]["skipped"] == 1 and again["refusal"]["reason"] == SERVER_REASON, again
        said = log.read_text()
        assert "older than the owner's record" in said and "--accept-restored-state" in said, said[-3000:]
    restore(backup, state)
    with data_service(npz, tmp_path, state, wait=False) as (address, log, proc):
        assert proc.wait(timeout=300) != 0 and not address.exists()
        said = log.read_text()
    print(said[-2000:])
    assert "older than the owner's record" in said and "in 2 charges" in said and "in 4 charges" in said
    assert "would be spent again: ε = " in said and "fedsd data-service --accept-restored-state" in said
    restore(backup, state)
    with data_service(npz, tmp_path, state, "--accept-restored-state") as (address, log, _):
        again = ask(address, 3)
        assert again["metrics"]["skipped"] == 1 and "budget" in again["refusal"]["reason"], again
        assert "accepted a restored state folder" in log.read_text()
    assert [r for r, _ in released] == [1, 2, 3, 4]
    spent = accountants_epsilon(released[0][1], 1.0, len(released), 1e-5)
    print(f"{len(released)} rounds released; dp_accounting ε = {spent:.3f}")
    assert spent <= SERVICE_EPSILON * (1 + 1e-6)
    assert main(["ledger", "--state-dir", str(state)]) == 0
    text = capsys.readouterr().out
    assert "in 4 charges" in text and "agrees" in text and "DISAGREE" not in text, text
