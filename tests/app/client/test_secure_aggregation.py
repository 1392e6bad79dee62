"""Secure aggregation's four stages as the owner's data service answers them
(fedsd/app/client/secure_stages.py), in this process against fedsd.secure.secagg_server's server: an honest round
sums exactly what each service kept as its input; then hostile messages (a replayed stage, a
share from another round, a round never advertised, a client named both survivor and dropped, a
cohort below the owner's minimum, malformed fields) are each refused with their reason, and
nothing in any owner's state folder, its ledger included, changes."""
import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from fedsd.app.client import secure_stages as service
from fedsd.app.client.secure_owner import StageRefused
from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig, client_config, to_flat
from fedsd.secure.secagg_server import SecAggServer
from fedsd.training.loop import initial_model
from fedsd.app import secure_sum
from fedsd.app.records import model_to_record
from tests.conftest import require

IDS = (101, 102, 103)
EXPERIMENT = "secagg-test"


def services(tmp_path, monkeypatch, ids, cfg: TrainConfig, **node) -> tuple:
    """Owners' services for `ids` in this process, each with its shard of `cfg`'s data written to its
    folder, a ledger of ε 3 and `node` in its node config; their contexts, the round's flat settings
    and the initial model."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedsd.simulation.client_folders import write_client_folders

    for name, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 1)):  # as a ServerApp's process has them
        monkeypatch.setattr(TaskIdentity, name, value)
    require("fmnist")
    fed = FedConfig(num_clients=len(ids), rounds=2, client_data="own")
    write_client_folders(cfg, fed, tmp_path / "data", "npz", echo=lambda line: None)
    contexts = {n: Context(run_id=7, node_id=n, state=RecordDict(), run_config={}, node_config={
        "partition-id": k, "num-partitions": len(ids), "data": str(tmp_path / "data" / f"client-{k}"),
        "max-epsilon": 3.0, "state-dir": str(tmp_path / f"state-{k}"), "secagg-keep-inputs": True, **node})
        for k, n in enumerate(ids)}
    service._SESSIONS.clear()
    return contexts, {**to_flat(cfg, fed), "experiment-id": EXPERIMENT}, \
        model_to_record(initial_model(client_config(cfg, fed), 10))


@pytest.fixture
def owners(tmp_path, monkeypatch):
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", batch_size=50, subset=300, threads=1)
    contexts, flat, arrays = services(tmp_path, monkeypatch, IDS, cfg, **{"secagg-min-clients": 3})
    yield contexts, flat, arrays, tmp_path
    service._SESSIONS.clear()


def stage(base: dict, **fields) -> RecordDict:
    return RecordDict({secure_sum.RECORD: ConfigRecord({**base, **fields})})


def with_map(base: dict, **maps) -> RecordDict:
    record = ConfigRecord(dict(base))
    for name, values in maps.items():
        secure_sum.write_map(record, name, values)
    return RecordDict({secure_sum.RECORD: record})


def keys_message(base, server, node) -> RecordDict:
    theirs = server.keys_for(node)
    return with_map(base, **{f"keys-{f}": {j: k[f] for j, k in theirs.items()} for f in secure_sum.KEY_FIELDS})


def masked_message(base, flat, arrays, shares) -> RecordDict:
    content = with_map(base, shares=shares.get("ciphertexts", {}), commits=shares.get("commits", {}))
    content["arrays"], content["config"] = arrays, ConfigRecord({**flat, **base})
    return content


def state_files(tmp_path) -> dict:
    return {p: p.read_bytes() for p in sorted(tmp_path.glob("state-*/**/*")) if p.is_file()}


def up_to_shares(contexts, server_round, flat=None, flats=None):
    """Stages 0 and 1 through the services' handlers. The round's settings go with stage 0 as
    the server sends them (the masked-input message's, `masked_message`): `flat` for every
    client, or `flats` (node → its own); a client advertised none refuses every masked input."""
    base = {"experiment-id": EXPERIMENT, "server-round": server_round}
    server = SecAggServer(secure_sum.round_id(7, EXPERIMENT, server_round), list(IDS), 10)
    flats = flats or {n: flat for n in IDS}

    def advertised(n):
        content = stage(base, **server.setup(n))
        if flats.get(n) is not None:
            content["config"] = ConfigRecord({**flats[n], **base})
        return content
    # relayed as any server may relay them (the services' own checks are under test here)
    server.keys = {n: dict(service.advertise_reply(advertised(n), contexts[n])["secagg"]) for n in IDS}
    server.collect_shares({n: dealt(service.share_reply(keys_message(base, server, n), contexts[n])) for n in IDS})
    return base, server


def dealt(reply) -> dict:
    return {"shares": secure_sum.read_map(reply["secagg"], "shares"),
            "commits": secure_sum.read_map(reply["secagg"], "commits"), "dealing": reply["secagg"]["dealing"],
            "digest": reply["secagg"]["digest"]}


def finish_round(contexts, base, server, nodes=IDS):
    """Stages 3 and 4 through the services' handlers, and the server's sum."""
    signatures = server.route_confirmations({n: service.confirm_reply(stage(base, **server.unmask_request(n)),
                                                                      contexts[n])["secagg"]["sig"] for n in nodes})
    answers = {}
    for n in nodes:
        reply = service.unmask_reply(with_map(base, confirmations=signatures[n]), contexts[n])["secagg"]
        answers[n] = {"b": secure_sum.read_map(reply, "b"), "s": secure_sum.read_map(reply, "s")}
    return server.finish(answers)


@pytest.mark.slow  # trains each owner's round (real data, real ledgers)
def test_the_services_answer_an_honest_round_and_refuse_hostile_messages_without_charging(owners):
    contexts, flat, arrays, tmp_path = owners
    # An honest round: the sum is exactly the inputs each owner kept (mod 2^64).
    base, server = up_to_shares(contexts, 1, flat)
    server.length = secure_sum.vector_length(arrays)
    old_shares = {n: server.shares_for(n) for n in IDS}
    masked = {n: service.masked_reply(masked_message(base, flat, arrays, old_shares[n]), contexts[n])["secagg"]
              ["masked"].numpy() for n in IDS}
    server.collect_masked(masked)
    total = finish_round(contexts, base, server)
    kept = [np.load(tmp_path / f"state-{k}" / "secagg" / f"7-{EXPERIMENT}-1-{IDS[k]}.npy") for k in range(3)]
    assert total.dtype == np.uint64 and len(total) == server.length > 1000
    assert np.array_equal(total, kept[0] + kept[1] + kept[2])
    assert np.count_nonzero(kept[0]) > len(kept[0]) // 2  # a real training update, not zeros
    assert len(list(tmp_path.glob("state-*/ledger-*.json"))) == 3  # each owner charged for its round
    before = state_files(tmp_path)

    def refused(handler, content, node, reason):
        with pytest.raises(StageRefused, match=reason):
            handler(content, contexts[node])
        assert state_files(tmp_path) == before  # the ledger and every other file untouched

    # Round 2: every hostile message refused.
    base2, server2 = up_to_shares(contexts, 2, flat)
    before = state_files(tmp_path)  # round 2 joined (each owner's joined-rounds record moved, legitimately)
    refused(service.advertise_reply, stage(base2, **server2.setup(101)), 101, "advertised to this owner already")
    refused(service.share_reply, keys_message(base2, server2, 101), 101, "was answered already")
    refused(service.masked_reply, masked_message(base2, flat, arrays, old_shares[101]), 101,
            "not for this round and client")
    round_9 = masked_message({**base2, "server-round": 9}, flat, arrays, server2.shares_for(101))
    refused(service.masked_reply, round_9, 101, "round 9 of this run was not advertised")
    refused(service.masked_reply, masked_message({**base2, "experiment-id": "../x"}, flat, arrays, {}), 101,
            "experiment-id")
    bad = with_map(base2, shares=server2.shares_for(101)["ciphertexts"])
    bad["secagg"]["shares-ids"] = [101]
    refused(service.masked_reply, bad, 101, "two lists of one length")
    refused(service.confirm_reply, stage(base2, survivors=list(IDS), dropped=[]), 101, "came before its turn")
    for n in IDS:  # now the honest masked inputs (charged: the ledger moves here, legitimately)
        service.masked_reply(masked_message(base2, flat, arrays, server2.shares_for(n)), contexts[n])
    before = state_files(tmp_path)
    refused(service.masked_reply, masked_message(base2, flat, arrays, server2.shares_for(102)), 102,
            "was answered already")
    refused(service.confirm_reply, stage(base2, survivors=list(IDS), dropped=[102]), 101,
            "both a survivor and dropped")
    service.confirm_reply(stage(base2, survivors=list(IDS), dropped=[]), contexts[102])
    refused(service.unmask_reply, with_map(base2, confirmations={}), 102, "1 neighbours signed")  # none agreed
    # A cohort below the owner's secagg-min-clients=3 (the protocol itself would take 2).
    base3 = {"experiment-id": EXPERIMENT, "server-round": 3}
    refused(service.advertise_reply, stage(base3, cohort=[101, 102], neighbours=[101, 102], threshold=2), 101,
            "below the 3 this owner requires")
    assert not any(k[1:] == (7, EXPERIMENT, 3) for k in service._SESSIONS)  # a refused round leaves nothing
    refused(service.share_reply, keys_message(base3, server2, 101), 101, "round 3 of this run was not advertised")


@pytest.mark.slow  # trains each owner's round (real data, real ledgers)
def test_a_round_asked_again_after_its_update_went_into_a_sum_is_refused(owners):
    """A server that asks a round again (fresh sessions, the same model) would get each client's
    kept update a second time, and the difference of two sums over cohorts one client apart is
    that client's update. A service sends one update into one sum (found by a review playing the
    attacker; without the refusal the second masked input is answered)."""
    contexts, flat, arrays, tmp_path = owners
    base, server = up_to_shares(contexts, 1, flat)
    old_session = {}
    for n in IDS:
        key = next(k for k in service._SESSIONS if k[0].endswith(f"state-{IDS.index(n)}"))
        old_session[n] = (key, service._SESSIONS[key])
        service.masked_reply(masked_message(base, flat, arrays, server.shares_for(n)), contexts[n])
    service._SESSIONS.clear()  # the service restarted
    before = state_files(tmp_path)
    with pytest.raises(StageRefused, match="advertised to this owner already"):  # its joined rounds on disk
        up_to_shares(contexts, 1, flat)
    base = {"experiment-id": EXPERIMENT, "server-round": 1}
    # and were the round's session there again (a service that lost its record), the update is refused
    key, session = old_session[101]
    service._SESSIONS[key] = session
    session.stage = 2
    with pytest.raises(StageRefused, match="went into a sum already|kept an input for this round already"):
        service.masked_reply(masked_message(base, flat, arrays, server.shares_for(101)), contexts[101])
    assert state_files(tmp_path) == before


class ServicesGrid:
    """A Grid whose nodes are the services' handlers in this process; `gone` nodes never answer."""

    def __init__(self, contexts, gone=(), tamper=None):
        self.contexts, self.gone, self.tamper = contexts, set(gone), tamper or (lambda kind, node, reply: reply)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error, Message

        from fedsd.app import rides
        from fedsd.app.client import run_stages

        handlers = {f"query.secagg_{s}": service.HANDLERS[f"secagg-{s}"] for s in secure_sum.STAGES}
        handlers.update({f"query.secagg_{s}": run_stages.HANDLERS[f"secagg-{s}"] for s in secure_sum.RUN_STAGES})
        by_kind = {"secagg-" + t.removeprefix("query.secagg_"): h for t, h in handlers.items()}
        replies = []
        for m in messages:
            node = m.metadata.dst_node_id
            if node in self.gone:
                replies.append(Message(Error(code=0, reason="gone"), reply_to=m))
                continue
            kind = "secagg-" + m.metadata.message_type.removeprefix("query.secagg_")
            # as the ClientApp does: a ride's part goes to the service after the carrier's (fedsd.app.rides)
            reply = rides.answer(kind, m.content, lambda k, c, node=node: by_kind[k](c, self.contexts[node]))
            replies.append(Message(self.tamper(m.metadata.message_type, node, reply), reply_to=m))
        return replies


@pytest.mark.slow  # trains each owner's round (real data, real ledgers)
def test_the_servers_stages_sum_the_survivors_and_drop_a_node_that_does_not_answer(owners):
    from fedsd.app.server.stage_exchange import Exchange, identify, protocol

    contexts, flat, arrays, tmp_path = owners
    base = {"experiment-id": EXPERIMENT, "server-round": 1}
    server = SecAggServer(secure_sum.round_id(7, EXPERIMENT, 1), list(IDS) + [104], secure_sum.vector_length(arrays))
    exchange = Exchange(ServicesGrid(contexts, gone={104}), 1, timeout=60, nodes=list(IDS) + [104])
    identify(exchange, base, None, secure_sum.round_id(7, EXPERIMENT, 1))
    exchange.identified({**{n: n for n in IDS}, 104: 104})  # the server asks the gone node anyway
    train = RecordDict({"arrays": arrays, "config": ConfigRecord({**flat, **base})})
    total, replies = protocol(exchange, server, base, train)
    kept = [np.load(tmp_path / f"state-{k}" / "secagg" / f"7-{EXPERIMENT}-1-{IDS[k]}.npy") for k in range(3)]
    assert np.array_equal(total, kept[0] + kept[1] + kept[2])
    assert sorted(server.masked) == list(IDS) and len(replies) == 3
    assert exchange.stages["advertise"]["answered"] == list(IDS) and "104" in exchange.stages["advertise"]["failed"]
    assert all(exchange.stages[s]["bytes_sent"] > 0 and exchange.stages[s]["bytes_received"] > 0
               for s in secure_sum.STAGES)
    moved = secure_sum.apply_sum(arrays, total, 3)
    key = secure_sum.float_keys(arrays)[0]
    first = sum(k[:arrays[key].numpy().size].view(np.int64) for k in kept) / secure_sum.SCALE / 3
    assert np.allclose(moved[key].numpy().ravel() - arrays[key].numpy().ravel(), first, atol=1e-6)


def test_an_owner_that_takes_part_only_through_secure_aggregation_refuses_a_plain_round(owners):
    """secagg-only: a plain train message (the update would reach the server alone) is refused
    with the reason, nothing trained, nothing in the owner's folder (its ledger) changed."""
    from fedsd.app.client import handler as local

    contexts, flat, arrays, tmp_path = owners
    context = contexts[101]
    context.node_config["secagg-only"] = True
    before = state_files(tmp_path)
    reply = local.train_reply(RecordDict({"arrays": arrays, "config": ConfigRecord({**flat, "server-round": 1})}),
                              context)
    assert "arrays" not in reply and "secure aggregation" in reply["refusal"]["reason"]
    assert state_files(tmp_path) == before


def test_a_service_keeps_a_few_rounds_and_a_clientapp_without_one_refuses_the_stages(tmp_path):
    from fedsd.app.client import client_app as app

    service._SESSIONS.clear()
    context = Context(run_id=7, node_id=101, state=RecordDict(), run_config={},
                      node_config={"partition-id": 0, "state-dir": str(tmp_path / "state"),
                                   "secagg-max-colluders": 1})
    for server_round in range(1, 11):
        base = {"experiment-id": EXPERIMENT, "server-round": server_round}
        reply = service.advertise_reply(stage(base, cohort=[101, 102, 103, 104], neighbours=[101, 102, 103, 104],
                                              threshold=3), context)  # min 2 + f 1; 2·3 > 4 + 1 and 3 ≤ 4 − 1
        assert len(reply["secagg"]["c"]) == len(reply["secagg"]["s"]) == 32
    assert len(service._SESSIONS) == service.MAX_SESSIONS == 8
    assert all(c.max_colluders == 1 and c.min_cohort == 2 for c in service._SESSIONS.values())  # the owner's
    with pytest.raises(StageRefused, match="round 2 of this run was not advertised"):
        service.share_reply(with_map({"experiment-id": EXPERIMENT, "server-round": 2}), context)
    service._SESSIONS.clear()
    with pytest.raises(ValueError, match="no owner's data service"):
        app.reply_content("secagg-advertise", stage({}), context)
    assert not service._SESSIONS


@pytest.mark.slow  # trains each owner's round (real data, real ledgers)
def test_a_client_that_answers_the_unmask_stage_with_garbage_is_dropped_and_the_round_abandoned(owners):
    from fedsd.secure.secagg_server import RoundAbandoned
    from fedsd.app.server.stage_exchange import Exchange, protocol

    contexts, flat, arrays, tmp_path = owners

    def tamper(kind, node, reply):
        if kind == "query.secagg_unmask" and node == 103:
            secure_sum.write_map(reply["secagg"], "b", {101: b"short"})
        return reply

    base = {"experiment-id": EXPERIMENT, "server-round": 1}
    server = SecAggServer(secure_sum.round_id(7, EXPERIMENT, 1), list(IDS), secure_sum.vector_length(arrays))
    exchange = Exchange(ServicesGrid(contexts, tamper=tamper), 1, timeout=60, nodes=list(IDS))
    train = RecordDict({"arrays": arrays, "config": ConfigRecord({**flat, **base})})
    with pytest.raises(RoundAbandoned, match="2 clients answered the unmask request, below the threshold 3"):
        protocol(exchange, server, base, train)
    assert sorted(server.masked) == list(IDS)  # all three sent masked inputs; nothing was unmasked


def test_secagg_only_fails_closed_when_the_node_config_does_not_parse(tmp_path, monkeypatch):
    """A node config that fails to parse when secagg-only is read is a refusal, never a plain
    round that a later parse lets through (found by a review playing the attacker)."""
    from fedsd.app.client import handler as local
    from fedsd.app.client import node_config as node_configs
    from fedsd.errors import ConfigError

    real, calls = node_configs.parse, []

    def flaky(node_config):
        calls.append(1)
        if len(calls) == 1:
            raise ConfigError("node-config data: not there right now")
        return real(node_config)

    monkeypatch.setattr(node_configs, "parse", flaky)
    for reader in ("trainer_for", "own_trainer"):  # what reads the data, after the node config
        monkeypatch.setattr(local, reader, lambda *a: pytest.fail("a plain round went on to read the data"))
    context = Context(run_id=7, node_id=101, state=RecordDict(), run_config={},
                      node_config={"partition-id": 0, "state-dir": str(tmp_path / "state"), "secagg-only": True})
    reply = local.train_reply(RecordDict({"config": ConfigRecord({"server-round": 1})}), context)
    assert "arrays" not in reply and "not there right now" in reply["refusal"]["reason"]
