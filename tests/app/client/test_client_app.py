"""The ClientApp called in-process with real Flower Messages and Context (no Ray): the teacher
modes, what a reply carries, and a client that has spent its budget."""
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsd.app.client.client_app import app
from fedsd.app.simulated_shards import build_federation
from fedsd.app.records import model_to_record, record_to_model
from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig, to_flat
from fedsd.training.loop import initial_model
from tests.conftest import require


pytestmark = pytest.mark.usefixtures("flower_task")


def make(teacher: str, budget_rounds: int = 0):
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", epsilon=3, batch_size=100, subset=1000, seed=4,
                      distill_warmup_epochs=0, threads=1)
    fed = FedConfig(num_clients=2, rounds=3, teacher=teacher, budget_rounds=budget_rounds)
    federation = build_federation(cfg, fed)
    flat = to_flat(federation.cfg, fed)
    context = Context(run_id=1, node_id=11, node_config={"partition-id": 1, "num-partitions": 2},
                      state=RecordDict(), run_config={})
    return federation, flat, context


def send(flat, context, model, server_round):
    msg = Message(RecordDict({"arrays": model_to_record(model),
                              "config": ConfigRecord({**flat, "server-round": server_round})}),
                  dst_node_id=11, message_type="train")
    return app(msg, context)


def against_round_start(teacher: str):
    """Rounds 1 and 2 of one client under `teacher` and under round-start, from the same global
    models: round 1 from the initial model, round 2 from another one (NOT the client's round-1
    model). Returns the two global models, the replies' students [(teacher's, round-start's)]
    per round, and the `teacher` client's Context."""
    federation, flat, ctx = make(teacher)
    _, flat_start, ctx_start = make("round-start")
    start = initial_model(federation.cfg, 10)
    other = initial_model(TrainConfig(**{**federation.cfg.__dict__, "seed": 99}), 10)
    rounds = [tuple(record_to_model(send(f, c, model, r).content["arrays"])["student"]
                    for f, c in ((flat, ctx), (flat_start, ctx_start)))
              for r, model in ((1, start), (2, other))]
    return start, other, rounds, ctx


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def test_local_previous_teacher_is_the_clients_own_last_model():
    require("fmnist")
    start, _, (round1, round2), _ = against_round_start("local-previous")
    # Round 1: no previous local model yet, so local-previous falls back to round-start.
    assert same(*round1)
    # Round 2 from a global model that is NOT this client's round-1 model: the teachers differ.
    assert not same(*round2)
    # ...and when the global model is the client's own last model, the two modes agree.
    _, flat_a, ctx_a = make("local-previous")
    _, flat_b, ctx_b = make("round-start")
    own_a = record_to_model(send(flat_a, ctx_a, start, 1).content["arrays"])
    own_b = record_to_model(send(flat_b, ctx_b, start, 1).content["arrays"])
    a = record_to_model(send(flat_a, ctx_a, own_a, 2).content["arrays"])
    b = record_to_model(send(flat_b, ctx_b, own_b, 2).content["arrays"])
    assert all(torch.equal(a["student"][k], b["student"][k]) for k in b["student"])


def test_global_ema_teacher_averages_the_global_models_the_client_received():
    """teacher=global-ema: round 1's teacher is the global model itself (as round-start); from
    then on the client's state holds θ̄ = d·θ̄ + (1 − d)·θ_global over what it received, and its
    round trains against that average."""
    require("fmnist")
    from fedsd.app.records import STATE_ARRAYS

    start, other, (round1, round2), ctx_ema = against_round_start("global-ema")
    assert same(*round1)
    assert not same(*round2)
    kept = ctx_ema.state[STATE_ARRAYS]  # the client's own state: 0.9·round 1's model + 0.1·round 2's
    for k, v in start["student"].items():
        torch.testing.assert_close(torch.from_numpy(kept[f"teacher_average/{k}"].numpy()),
                                   0.9 * v + 0.1 * other["student"][k], rtol=0, atol=1e-6)


def test_global_ema_teacher_is_the_average_of_the_global_models():
    from fedsd.training.loop import round_teacher

    fed = FedConfig(teacher="global-ema", teacher_ema_decay=0.75)
    models = [{"w": torch.full((2,), float(v))} for v in (4.0, 8.0, 0.0)]
    teacher, state = round_teacher(fed, None, models[0])
    assert torch.equal(teacher["w"], models[0]["w"]) and teacher["w"] is not models[0]["w"]
    teacher, state = round_teacher(fed, state, models[1])
    assert torch.equal(teacher["w"], torch.full((2,), 5.0))  # 0.75·4 + 0.25·8
    teacher, state = round_teacher(fed, state, models[2])
    assert torch.equal(teacher["w"], torch.full((2,), 3.75)) and torch.equal(state.teacher_average["w"], teacher["w"])
    assert round_teacher(FedConfig(teacher="round-start"), state, models[0])[0] is None


def test_reply_carries_model_arrays_and_metrics_only():
    require("fmnist")
    federation, flat, context = make("round-start")
    reply = send(flat, context, initial_model(federation.cfg, 10), 1)
    content = reply.content
    assert set(content.array_records) == {"arrays"} and set(content.metric_records) == {"metrics"}
    assert set(content.config_records) == set()
    model_shapes = {f"student/{k}": tuple(v.shape) for k, v in initial_model(federation.cfg, 10)["student"].items()}
    assert {k: tuple(a.shape) for k, a in content["arrays"].items()} == model_shapes
    metrics = dict(content["metrics"])
    # sample-rate is q = B/n: it says no more than num-examples does
    assert set(metrics) == {"num-examples", "partition-id", "skipped", "epsilon", "noise-multiplier", "sample-rate",
                            "train-loss", "seconds", "steps"}
    assert metrics["num-examples"] == 500 and metrics["skipped"] == 0 and 0 < metrics["epsilon"] < 3


def test_a_packed_message_is_answered_packed_and_a_plain_one_plain():
    """The grid packs a message's records into one Flower object (fedsd.app.packing): the ClientApp
    reads them and answers packed; a plain message (another server's) gets a plain reply."""
    require("fmnist")
    from fedsd.app import packing

    federation, flat, context = make("round-start", budget_rounds=1)
    records = RecordDict({"arrays": model_to_record(initial_model(federation.cfg, 10)),
                          "config": ConfigRecord({**flat, "server-round": 1})})
    reply = app(Message(packing.pack(records), dst_node_id=11, message_type="train"), context)
    assert packing.is_packed(reply.content)
    content = packing.unpack(reply.content)
    assert set(content.array_records) == {"arrays"} and content["metrics"]["num-examples"] == 500
    plain = send(flat, context, record_to_model(content["arrays"]), 2)  # its budget spent: skipped
    assert not packing.is_packed(plain.content) and plain.content["metrics"]["skipped"] == 1


def test_spent_client_replies_skipped_without_arrays():
    require("fmnist")
    federation, flat, context = make("round-start", budget_rounds=1)
    model = initial_model(federation.cfg, 10)
    first = send(flat, context, model, 1)
    spent = first.content["metrics"]["epsilon"]
    assert 0.99 * 3 <= spent <= 3.0
    second = send(flat, context, record_to_model(first.content["arrays"]), 2)
    assert second.content["metrics"]["skipped"] == 1
    assert second.content["metrics"]["epsilon"] == pytest.approx(spent)
    assert len(second.content.array_records) == 0


def test_client_state_survives_on_its_own_disk(tmp_path):
    """A new Flower run (empty context.state) of the same experiment, as after a server
    restart, finds the client's accountant on its disk: ε goes on, exactly as if the client had
    kept its context.state; another experiment starts fresh. A node-config that disagrees with
    the run is refused."""
    require("fmnist")
    federation, flat, kept = make("round-start")
    flat = {**flat, "experiment-id": "exp-1"}
    start = initial_model(federation.cfg, 10)
    node_config = {"partition-id": 1, "num-partitions": 2, "state-dir": str(tmp_path)}

    def context():
        return Context(run_id=1, node_id=11, node_config=node_config, state=RecordDict(), run_config={})
    first = context()
    eps = lambda reply: reply.content["metrics"]["epsilon"]  # noqa: E731
    e1 = eps(send(flat, first, start, 1))
    assert (tmp_path / "exp-1" / "client-1.pt").is_file()
    e2_restarted = send(flat, context(), start, 2)
    (tmp_path / "exp-1" / "client-1-last-reply.pt").unlink()  # else round 2 is answered with the reply kept
    e2_kept = send(flat, first, start, 2)
    assert eps(e2_restarted) == eps(e2_kept) > e1
    assert all(torch.equal(torch.from_numpy(a.numpy()), torch.from_numpy(b.numpy()))
               for a, b in zip(e2_restarted.content["arrays"].values(), e2_kept.content["arrays"].values()))
    assert eps(send({**flat, "experiment-id": "exp-2"}, context(), start, 1)) == e1
    wrong = Context(run_id=1, node_id=11, node_config={"partition-id": 1, "num-partitions": 5}, state=RecordDict(),
                    run_config={})
    refused = send(flat, wrong, start, 1)  # refused with the key named, for the server's summary
    assert refused.content["metrics"]["refused"] == 1 and not refused.content.array_records
    assert refused.content["refusal"]["reason"] == "node-config num-partitions=5 but the run has num-clients=2"


def test_a_round_asked_again_after_a_restart_gets_the_reply_already_released_at_no_charge(tmp_path):
    """A resumed server asks again for the round it had not checkpointed, which this client had
    already trained, charged and answered. The client sends the same reply again (no new
    release), so a run planned to its last round still has that round: here a budget of one
    round, where training the round again would find it spent. A request with another global
    model is a new release, trained and charged."""
    require("fmnist")
    federation, flat, _ = make("round-start", budget_rounds=1)
    flat = {**flat, "experiment-id": "exp-1"}
    start = initial_model(federation.cfg, 10)
    other = initial_model(TrainConfig(**{**federation.cfg.__dict__, "seed": 99}), 10)
    node_config = {"partition-id": 1, "num-partitions": 2, "state-dir": str(tmp_path)}

    def restarted():
        return Context(run_id=2, node_id=11, node_config=node_config, state=RecordDict(), run_config={})

    def history():
        return torch.load(tmp_path / "exp-1" / "client-1.pt", weights_only=True)["history"]

    first = send(flat, restarted(), start, 1).content
    charged = history()
    again = send(flat, restarted(), start, 1).content
    assert again["metrics"]["skipped"] == 0 and again["metrics"]["replayed"] == 1
    assert again["metrics"]["epsilon"] == first["metrics"]["epsilon"] and history() == charged
    assert all(torch.equal(torch.from_numpy(a.numpy()), torch.from_numpy(b.numpy()))
               for a, b in zip(again["arrays"].values(), first["arrays"].values()))
    new_model = send(flat, restarted(), other, 1).content  # not the request answered: a second release
    assert new_model["metrics"]["skipped"] == 1 and history() == charged


def test_a_client_whose_privacy_state_was_lost_refuses_before_spending(tmp_path):
    """The server sends each client the ε it reported before (fedsd.app.records.SPENT_EPSILON). A
    client whose state-dir was deleted between rounds finds less than that in its own state: it
    refuses, with the reason, and charges nothing. With its state restored, or with the server's
    record equal to its own, it trains on."""
    import shutil

    from fedsd.app.records import SPENT_EPSILON

    require("fmnist")
    federation, flat, _ = make("round-start")
    flat = {**flat, "experiment-id": "exp-1"}
    start = initial_model(federation.cfg, 10)
    node_config = {"partition-id": 1, "num-partitions": 2, "state-dir": str(tmp_path / "state")}

    def restarted():
        return Context(run_id=2, node_id=11, node_config=node_config, state=RecordDict(), run_config={})

    first = send(flat, restarted(), start, 1).content["metrics"]
    recorded = {**flat, SPENT_EPSILON: first["epsilon"]}
    shutil.copytree(tmp_path / "state", tmp_path / "kept")
    shutil.rmtree(tmp_path / "state")
    lost = send(recorded, restarted(), start, 2).content
    assert lost["metrics"]["refused"] == 1 and lost["metrics"]["epsilon"] == 0.0 and not lost.array_records
    reason = lost["refusal"]["reason"]
    assert f"the server recorded ε = {first['epsilon']:.4f} spent by client 1" in reason \
        and "holds ε = 0.0000" in reason
    assert not (tmp_path / "state" / "exp-1" / "client-1.pt").exists()  # nothing charged, nothing written
    shutil.copytree(tmp_path / "kept", tmp_path / "state", dirs_exist_ok=True)
    second = send(recorded, restarted(), start, 2).content["metrics"]
    assert second["skipped"] == 0 and second["epsilon"] > first["epsilon"]


def test_train_state_has_one_form_for_both_stores_and_is_checked_on_load(tmp_path):
    """context.state and the client's disk hold the same state_dict, with the mechanism (σ, q,
    accountant) it was accounted under; a load under another mechanism is refused."""
    import dataclasses

    from flwr.app import RecordDict

    from fedsd.privacy.accounting import PrivacyPlan
    from fedsd.training.loop import TrainState, load_train_state, save_train_state
    from fedsd.errors import StateMismatch
    from fedsd.app.records import load_state, save_state

    plan = PrivacyPlan(1.1, 0.01, 100, 3.0, 1e-5, "rdp")
    state = TrainState(history=[[1.1, 0.01, 7]], rng_state=torch.Generator().get_state(), steps=7,
                       local_model={"conv.weight": torch.randn(3, 2)}, momentum=[torch.randn(2), torch.randn(4)])
    store = RecordDict()
    save_state(store, state, plan)
    save_train_state(tmp_path / "state.pt", state, plan)
    for loaded in (load_state(store, plan), load_train_state(tmp_path / "state.pt", plan)):
        assert loaded.history == state.history and loaded.steps == 7
        assert torch.equal(loaded.rng_state, state.rng_state)
        assert torch.equal(loaded.local_model["conv.weight"], state.local_model["conv.weight"])
        assert all(torch.equal(a, b) for a, b in zip(loaded.momentum, state.momentum, strict=True))
    with pytest.raises(StateMismatch, match="σ=1.1"):
        load_train_state(tmp_path / "state.pt", dataclasses.replace(plan, noise_multiplier=1.2))
    with pytest.raises(StateMismatch, match="q=0.01"):
        load_state(store, dataclasses.replace(plan, sample_rate=0.02))


def test_a_task_with_an_owners_service_imports_only_the_forwarding_of_fedsd():
    """On a deployed SuperNode every message is a new ClientApp task, which pays every import:
    with a service it loads the forwarding alone, not the node's settings or the service's code
    (32 ms a task before, twenty tasks a secure round of ten owners)."""
    import subprocess
    import sys

    code = ("import sys, fedsd.app.client.client_app; "
            "print(sorted(m for m in sys.modules if m.startswith('fedsd.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "fedsd.app.client.forward" in loaded
    for heavy in ("fedsd.app.client.node_config", "fedsd.app.client.owner_service", "fedsd.settings"):
        assert f"'{heavy}'" not in loaded, heavy


@pytest.mark.parametrize("node_config,service", [
    ({"partition-id": 0, "service": "/run/owner.sock"}, "/run/owner.sock"),
    ({"partition-id": 0, "num-partitions": 3, "service": "/s"}, "/s"),
    ({"partition-id": 0, "service": ""}, None),  # no service: the node config is read whole
    ({"partition-id": 0, "service": 5}, None),
    ({"partition-id": 0, "service": "/s", "max-epsilon": 3.0}, None),  # an owner's key: refused by the parse
    ({"partition-id": 0}, None),
    ({"service": "/s"}, None),  # no partition-id: the reading refuses it ("required"); the service would not
    ({"partition-id": -1, "service": "/s"}, None),
    ({"partition-id": True, "service": "/s"}, None),  # True == 1 to the service's check: not a number here
    ({"partition-id": 0, "num-partitions": "x", "service": "/s"}, None),
])
def test_only_a_node_config_in_a_service_nodes_form_is_forwarded_without_reading_it_whole(node_config, service):
    from fedsd.app.client import forward
    from fedsd.app.client.node_config import NodeConfigError, parse

    assert forward.service_of(node_config) == service
    if node_config.get("max-epsilon"):  # what the whole reading says of it
        with pytest.raises(NodeConfigError, match="belongs in the data service's own"):
            parse(node_config)
