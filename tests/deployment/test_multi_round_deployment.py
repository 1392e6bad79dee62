"""Multi-round secure aggregation driven by the server's SecureRounds (run config `secure-sum =
multi-round`; fedsd.app.server.run_exchange) over the owners' data services' handlers in this
process, with their rosters, records, state folders and ledgers: the run is set up once, a steady
round is two exchanges with each owner, a round someone drops out of is three, the sum is what the
owners kept, and each owner's ledger is charged once a round."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Error, Message

from fedsd.secure.secagg_runs import BATCH
from fedsd.settings.federation import FedConfig, client_config
from fedsd.settings.run import TrainConfig
from tests.app.client.test_run_stages import run_owners  # noqa: F401
from tests.app.client.test_secure_aggregation import EXPERIMENT, IDS, owners  # noqa: F401

pytestmark = pytest.mark.slow  # each owner trains its rounds (real data, real ledgers)
ROUNDS = 3 * BATCH + 1  # the run's rounds: four batches
SETUP = ["mr_setup", "mr_deal", "mr_deliver"]


class _Grid:
    """The owners' handlers as a ServerApp's grid sees them; `gone`: nodes that answer nothing, by round."""

    def __init__(self, contexts):
        from tests.app.client.test_secure_aggregation import ServicesGrid

        self.inner, self.run, self.contexts = ServicesGrid(contexts), SimpleNamespace(run_id=7), contexts
        self.gone: dict[str, set] = {}  # message type → nodes that do not answer it

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        kept = [m for m in messages if m.metadata.dst_node_id not in self.gone.get(m.metadata.message_type, ())]
        lost = [Message(Error(code=0, reason="gone"), reply_to=m) for m in messages if m not in kept]
        return self.inner.send_and_receive(kept, timeout=timeout) + lost


@pytest.fixture
def rounds(run_owners):  # noqa: F811
    from fedsd.app.server.secure_rounds import SecureRounds

    contexts, flat, arrays, tmp_path, ids = run_owners
    for context in contexts.values():
        context.node_config["max-epsilon"] = 10.0
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", batch_size=50, subset=300, threads=1, epsilon=3.0)
    fed = FedConfig(num_clients=3, rounds=ROUNDS, client_data="own", secure_aggregation=True, noise="distributed",
                    sample_rate=50 / 100, honest_clients=2, secure_sum="multi-round",
                    secagg_roster=str(tmp_path / "roster"), secagg_threshold=2)
    flat = {**flat, "noise": "distributed", "secure-aggregation": True, "sample-rate": 0.5, "epsilon": 3.0,
            "honest-clients": 2, "num-server-rounds": ROUNDS, "secure-sum": "multi-round"}
    side = SimpleNamespace(strategy=SimpleNamespace(settings=flat, round_clients={}, client_epsilon={}),
                           cfg=client_config(cfg, FedConfig(num_clients=3, rounds=ROUNDS)), num_classes=10)
    grid = _Grid(contexts)
    launch = SimpleNamespace(fed=fed, experiment_id=EXPERIMENT, round=0, out=tmp_path, optimizer=None)
    return SimpleNamespace(rounds=SecureRounds(grid, side, launch), grid=grid, arrays=arrays, tmp_path=tmp_path,
                           ids=ids)


def _kept(tmp_path, r):
    return [np.load(p) for p in sorted(tmp_path.glob(f"state-*/secagg/*-{r}-*.npy"))]


def test_a_run_is_set_up_once_a_steady_round_is_two_exchanges_and_an_owner_comes_back_after_a_drop(rounds):
    f, arrays = rounds, rounds.arrays
    for r in (1, 2):
        arrays = f.rounds.one_round(r, arrays)
    f.grid.gone["query.secagg_mr_masked"] = {IDS[2]}  # one owner drops at its masked input: below T = 3 of 3
    # (E2' and E3, the view after a drop, need four owners: tests/secure/test_secagg_runs.py plays them)
    arrays = f.rounds.one_round(3, arrays)
    f.grid.gone.clear()
    arrays = f.rounds.one_round(4, arrays)  # back, with nothing to do but answer
    records = f.rounds.records
    assert [list(rec["stages"]) for rec in records] == [
        ["identify"] + SETUP + ["mr_masked", "mr_unmask"], ["mr_masked", "mr_unmask"], ["mr_masked"],
        ["identify", "mr_masked", "mr_unmask"]], [rec.get("abandoned") for rec in records]
    assert [len(rec["survivors"]) for rec in records] == [3, 3, 0, 3]
    assert "below the threshold 3; nothing was unmasked" in records[2]["abandoned"]
    for r in (1, 2, 4):
        total, kept = np.load(f.tmp_path / f"secagg-sum-{r}.npy"), _kept(f.tmp_path, r)
        assert len(kept) == 3 and np.array_equal(total, sum(kept[1:], kept[0]))
    charged = []
    for k in range(3):
        ledger = json.loads(next((f.tmp_path / f"state-{k}").glob("ledger-*.json")).read_text())
        charged.append([e["round"] for e in ledger["entries"] if e.get("run")])
    assert charged == [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 4]]


def test_a_run_resumed_past_its_first_batch_sets_up_there_and_each_batch_is_dealt_at_its_first_round(rounds):
    """A checkpoint's run goes on at round 17 (a new Flower run: set up at its first round, batch 3; the
    owners refused it as dealing two batches ahead); the next batch is dealt at its first round, three
    exchanges before its masked input, none after."""
    f, arrays = rounds, rounds.arrays
    for r in (2 * BATCH + 1, 3 * BATCH, 3 * BATCH + 1):
        arrays = f.rounds.one_round(r, arrays)
    assert [list(rec["stages"]) for rec in f.rounds.records] == [
        ["identify"] + SETUP + ["mr_masked", "mr_unmask"], ["mr_masked", "mr_unmask"],
        SETUP + ["mr_masked", "mr_unmask"]], [rec.get("abandoned") for rec in f.rounds.records]
    assert [len(rec["survivors"]) for rec in f.rounds.records] == [3, 3, 3]


def test_the_next_batch_is_dealt_riding_on_the_two_rounds_before_it_through_the_owners_handlers(rounds):
    """The owners' own handlers (fedsd.app.client.run_stages, with their records, state folders and ledgers)
    answer the rides as the ClientApp hands them over: batch 2's channel keys ride on round 7's unmask, its
    dealing on round 8's masked input, its delivery on round 8's unmask; round 9 is two exchanges."""
    f, arrays = rounds, rounds.arrays
    for r in (BATCH - 1, BATCH, BATCH + 1):
        arrays = f.rounds.one_round(r, arrays)
    records = f.rounds.records
    assert [list(rec["stages"]) for rec in records] == [
        ["identify"] + SETUP + ["mr_masked", "mr_unmask"], ["mr_masked", "mr_unmask"], ["mr_masked", "mr_unmask"]]
    rides = [(stage, rec["stages"][stage]["ride"]) for rec in records for stage in rec["stages"]
             if "ride" in rec["stages"][stage]]
    assert [(stage, ride["stage"], len(ride["answered"]), ride["failed"]) for stage, ride in rides] == [
        ("mr_unmask", "mr_setup", 3, {}), ("mr_masked", "mr_deal", 3, {}), ("mr_unmask", "mr_deliver", 3, {})]
    for r in (BATCH - 1, BATCH, BATCH + 1):
        total, kept = np.load(f.tmp_path / f"secagg-sum-{r}.npy"), _kept(f.tmp_path, r)
        assert len(kept) == 3 and np.array_equal(total, sum(kept[1:], kept[0]))
