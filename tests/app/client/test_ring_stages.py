"""Secure aggregation on a ring as a deployment runs it: the server's stages
(fedsd.app.server.stage_exchange.protocol) against the owners' data services' handlers
(fedsd/app/client/secure_stages.py) in this process. The ring's numbers go with stage 0, each
survivor's signed M with its masked input and to its neighbours at unmask; the graph a deployed
round runs on is chosen from the run config (fedsd.app.server.secure_plans.round_graph)."""
import dataclasses

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from fedsd.app import secure_sum
from fedsd.app.client import secure_stages as service
from fedsd.app.client.secure_owner import StageRefused
from fedsd.app.server.secure_plans import round_graph
from fedsd.errors import ConfigError
from fedsd.secure.ring import neighbourhoods
from fedsd.secure.secagg_server import SecAggServer
from fedsd.settings.federation import FedConfig
from tests.app.client.test_secure_aggregation import EXPERIMENT, ServicesGrid, services, stage

IDS = tuple(range(201, 208))  # seven owners: a ring of k = 4, threshold 4 (one dropout tolerated)
GRAPH = {"k": 4, "honest": 2, "colluders": 0}


@pytest.fixture
def ring_owners(tmp_path, monkeypatch):
    from fedsd.settings.run import TrainConfig

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", batch_size=20, subset=140, threads=1)
    contexts, flat, arrays = services(tmp_path, monkeypatch, IDS, cfg)
    yield contexts, flat, arrays, tmp_path
    service._SESSIONS.clear()


def ring_round(ring_owners, tamper=None):
    from fedsd.app.server.stage_exchange import Exchange, protocol

    contexts, flat, arrays, tmp_path = ring_owners
    base = {"experiment-id": EXPERIMENT, "server-round": 1}
    server = SecAggServer(secure_sum.round_id(7, EXPERIMENT, 1), list(IDS), secure_sum.vector_length(arrays),
                          threshold=4, graph=GRAPH)
    exchange = Exchange(ServicesGrid(contexts, tamper=tamper), 1, timeout=60, nodes=list(IDS))
    train = RecordDict({"arrays": arrays, "config": ConfigRecord({**flat, **base})})
    total, replies = protocol(exchange, server, base, train)
    kept = {n: np.load(tmp_path / f"state-{k}" / "secagg" / f"7-{EXPERIMENT}-1-{n}.npy") for k, n in enumerate(IDS)}
    return total, server, exchange, kept


@pytest.mark.slow  # trains seven owners' rounds (real data, real ledgers)
def test_a_deployed_ring_round_sums_its_owners_inputs_exactly(ring_owners):
    """Every owner masks with its 4 ring neighbours only, and reveals a survivor's b only where
    that survivor's signed M, relayed by the server, names it: the honest round unmasks to exactly
    the inputs the owners kept (without M relayed, each owner would reveal only its own b and the
    round could not be unmasked)."""
    total, server, exchange, kept = ring_round(ring_owners)
    assert np.array_equal(total, sum(kept.values())) and sorted(server.masked) == list(IDS)
    assert all(len(server.neighbours[n]) == 5 for n in IDS)
    assert all(len(server.inbox[n]) == 5 for n in IDS)  # shares from its neighbourhood only, not the cohort
    assert exchange.stages["unmask"]["answered"] == list(IDS)


@pytest.mark.slow  # trains seven owners' rounds (real data, real ledgers)
def test_a_ring_member_that_sends_its_masked_input_without_its_signed_M_is_named_and_dropped(ring_owners):
    """A member whose masked reply carries no signed M (its neighbours would then reveal no share of
    its b, and the round die after everyone paid) is named and its input removed as a dropout's:
    the round sums the other six exactly."""
    def tamper(kind, node, reply):
        if kind == "query.secagg_masked" and node == 203:
            del reply[secure_sum.MASKED_SET]
        return reply

    total, server, exchange, kept = ring_round(ring_owners, tamper)
    assert "signed set" in server.culprits[203] and 203 not in server.masked
    assert np.array_equal(total, sum(v for n, v in kept.items() if n != 203))


def test_a_service_refuses_a_ring_neighbourhood_it_does_not_derive_and_numbers_below_its_own(tmp_path):
    """Stage 0 on a ring: a neighbourhood other than the one the owner derives from the round and
    cohort, a t below the owner's secagg-min-clients, and a graph that is not [k, t, F] are each
    refused before anything is kept."""
    service._SESSIONS.clear()
    context = Context(run_id=7, node_id=201, state=RecordDict(), run_config={},
                      node_config={"partition-id": 0, "state-dir": str(tmp_path / "state"), "secagg-min-clients": 3})
    base = {"experiment-id": EXPERIMENT, "server-round": 1}
    ring = neighbourhoods(secure_sum.round_id(7, EXPERIMENT, 1), list(IDS), 4)
    other = sorted(set(IDS) - set(ring[201]))[:2]
    chosen = sorted([201, *other, *[n for n in ring[201] if n != 201][:2]])
    for graph, neighbours, reason in (([4, 3, 0], chosen, "not this client's neighbourhood"),
                                      ([4, 2, 0], ring[201], "requires at least t = 3"),
                                      ([4, 3], ring[201], r"a ring's \[k, t, F\]")):
        with pytest.raises(StageRefused, match=reason):
            service.advertise_reply(stage(base, cohort=list(IDS), neighbours=neighbours, threshold=4, graph=graph),
                                    context)
    assert not service._SESSIONS and not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())
    reply = service.advertise_reply(stage(base, cohort=list(IDS), neighbours=ring[201], threshold=4, graph=[4, 3, 0]),
                                    context)
    assert len(reply["secagg"]["sig"]) == 64


def test_a_deployed_round_takes_the_ring_above_forty_owners_and_refuses_what_fits_no_graph():
    """secagg-graph as `fedsd simulate` takes it, spelled as the run config: auto is the complete
    graph at 40 owners and the ring at 100 (t honest-clients, F secagg-max-colluders); the multi-round
    protocol is set up on the complete graph, so a ring there, or 200 owners on the complete graph,
    is refused naming the setting."""
    base = FedConfig(secure_aggregation=True, noise="distributed", num_clients=40, honest_clients=10)
    assert round_graph(base, 40) is None
    assert (round_graph(base, 100).k, round_graph(base, 100).threshold) == (16, 12)  # as the simulation's
    assert round_graph(dataclasses.replace(base, honest_clients=0), 1000).k == 42  # t: the owners' default, 2
    with pytest.raises(ConfigError, match="num-clients=200: on the complete graph"):
        round_graph(dataclasses.replace(base, secagg_graph="complete"), 200)
    with pytest.raises(ConfigError, match="secagg-graph=ring: secure-sum=multi-round"):
        round_graph(dataclasses.replace(base, secagg_graph="ring", secure_sum="multi-round"), 100)
    assert round_graph(dataclasses.replace(base, secure_sum="multi-round"), 100) is None  # auto: complete there
    with pytest.raises(ConfigError, match="num-clients=1000: with honest-clients=1000"):
        round_graph(dataclasses.replace(base, honest_clients=1000, num_clients=1000), 1000)
    with pytest.raises(ConfigError, match="secagg-max-colluders=60"):
        round_graph(dataclasses.replace(base, secagg_max_colluders=60), 100)
