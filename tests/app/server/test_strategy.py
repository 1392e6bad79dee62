"""The server sets aside replies whose arrays do not fit the model, logs why, and aggregates
the rest (the recording wrapper, driven in-process with real Flower Messages)."""
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from fedsd.settings.federation import FedConfig
from fedsd.models.networks import build_model
from fedsd.app.server.strategy import RecordingStrategy, base_strategy, evaluation_metrics, reply_problem, train_metrics

pytestmark = pytest.mark.usefixtures("flower_task")
SHAPES = {k: tuple(v.shape) for k, v in build_model("mnist-cnn").state_dict().items()}


def reply(pid: int, arrays: dict, n: int = 100, epsilon: float = 1.0, **metrics) -> Message:
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "metrics": MetricRecord({"num-examples": n, "partition-id": pid, "skipped": 0,
                                                   "epsilon": epsilon, **metrics})})
    return Message(content, dst_node_id=1, message_type="train")


def good(value: float = 1.0) -> dict:
    return {f"student/{k}": np.full(s, value, dtype=np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("break_it,needle", [
    (lambda a: a.update({"student/0.weight": np.zeros((3, 3), np.float32)}), "shape"),
    (lambda a: a["student/0.bias"].__setitem__(0, np.nan), "NaN"),
    (lambda a: a["student/9.weight"].__setitem__((0, 0), np.inf), "NaN or Inf"),
    (lambda a: a.pop("student/0.bias"), "missing"),
    (lambda a: a.update({"secrets/x": np.zeros(3, np.float32)}), "unknown"),
])
def test_bad_reply_is_rejected_and_the_round_goes_on(break_it, needle):
    bad = good(5.0)
    break_it(bad)
    assert needle in reply_problem(ArrayRecord({k: Array(v) for k, v in bad.items()}), SHAPES)
    fed = FedConfig(num_clients=3)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    arrays, _ = strategy.aggregate_train(1, [reply(0, good(1.0)), reply(1, bad), reply(2, good(3.0), n=300)])
    assert needle in strategy.round_clients[1][1]["rejected"]
    # Only clients 0 and 2 are averaged, weighted 100 : 300.
    assert np.allclose(arrays["student/0.weight"].numpy(), 2.5)


def test_a_client_whose_epsilon_falls_is_named_and_a_refusal_keeps_what_was_spent(caplog):
    """A client reporting less ε than before has lost its privacy state: the round records it,
    the log says so, and the server keeps the larger ε (what the client has spent at least, and
    what it is told next). A refusal (its node's limits; nothing spent) keeps the client's ε."""
    fed = FedConfig(num_clients=2)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    strategy.aggregate_train(1, [reply(0, good(), epsilon=1.0), reply(1, good(), epsilon=1.0)])
    strategy.aggregate_train(2, [reply(0, good(), epsilon=0.6), reply(1, good(), epsilon=1.4)])
    assert strategy.round_clients[2][0]["epsilon-fell-from"] == 1.0
    assert "epsilon-fell-from" not in strategy.round_clients[2][1]
    assert "client 0 reports ε = 0.600, below the 1.000 it reported before" in caplog.text
    assert strategy.client_epsilon == {0: 1.0, 1: 1.4}
    strategy.aggregate_train(3, [reply(0, good(), epsilon=1.2), reply(1, {}, epsilon=0.0, refused=1)])
    assert strategy.client_epsilon == {0: 1.2, 1: 1.4}
    assert "epsilon-fell-from" not in strategy.round_clients[3][1]


class Nodes:
    """The part of a Grid a strategy's configure_train reads: the connected nodes."""

    def __init__(self, *node_ids: int):
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return self.node_ids


def test_a_train_request_carries_what_its_client_has_reported_spending():
    """From a client's first reply on, each train request to it says what ε it has reported,
    so that a client whose own state is behind can refuse; each client hears only its own, a
    client not heard from hears nothing, and a refusal's reply does not lower it."""
    from flwr.app import ConfigRecord

    from fedsd.app.records import SPENT_EPSILON

    fed = FedConfig(num_clients=3)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    grid, arrays = Nodes(11, 12, 13), ArrayRecord({k: Array(v) for k, v in good().items()})
    first = list(strategy.configure_train(1, arrays, ConfigRecord({"lr": 0.1}), grid))
    assert len(first) == 3 and all(SPENT_EPSILON not in m.content["config"] for m in first)
    strategy.aggregate_train(1, [reply(0, good(), epsilon=0.5), reply(2, good(), epsilon=0.75)])
    strategy.aggregate_train(2, [reply(0, {}, epsilon=0.0, refused=1)])
    strategy.node_partition = {11: 0, 12: 1, 13: 2}  # as the replies' node ids would have told it
    later = {m.metadata.dst_node_id: m.content["config"]
             for m in strategy.configure_train(3, arrays, ConfigRecord({"lr": 0.1}), grid)}
    assert {node: config.get(SPENT_EPSILON) for node, config in later.items()} == {11: 0.5, 12: None, 13: 0.75}
    assert all(config["lr"] == 0.1 and config["server-round"] == 3 for config in later.values())


def test_replies_whose_metrics_differ_in_their_keys_are_aggregated():
    """A replayed round (replayed = 1) beside a freshly trained one, and a client whose owner set
    limits (max-epsilon) beside one without: Flower's FedAvg refuses replies whose metrics differ
    in their keys, and the round must still aggregate; each client's own metrics stay recorded."""
    fed = FedConfig(num_clients=2)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    fresh = reply(0, good(1.0), steps=10, **{"train-loss": 0.5})
    replayed = reply(1, good(3.0), steps=10, replayed=1, **{"train-loss": 0.7, "max-epsilon": 3.0})
    arrays, metrics = strategy.aggregate_train(1, [fresh, replayed])
    assert np.allclose(arrays["student/0.weight"].numpy(), 2.0)
    assert metrics["clients"] == 2 and metrics["steps"] == 20 and metrics["train-loss"] == pytest.approx(0.6)
    assert strategy.round_clients[1][1]["replayed"] == 1 and strategy.round_clients[1][1]["max-epsilon"] == 3.0


def test_checkpoint_restores_strategy_state_recorder_and_settings(tmp_path):
    """What --resume needs from checkpoint.pt: FedAdam's moments (inside Flower's DP wrapper),
    the node-sampling RNG, the per-client records, the round book and the run's settings; the
    file loads with weights_only=True."""
    import random

    import torch

    from fedsd.settings.run import TrainConfig
    from fedsd.app.server import checkpoint

    fed = FedConfig(num_clients=2, strategy="fedadam", server_dp_noise=0.5, rounds=4)
    cfg = TrainConfig(dataset="fmnist", method="dpdsd", epsilon=2.0, subset=500).resolved()
    first = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    first.inner.strategy.m_t = {"student/0.weight": np.full((2, 2), 0.5)}
    first.inner.strategy.v_t = {"student/0.weight": np.full((2, 2), 0.25)}
    first.client_epsilon = {0: 1.25, 1: 1.5}
    first.missed = {2: [{"client": 1, "node_id": 7, "reason": "not connected"}]}
    random.seed(11)
    checkpoint.save(tmp_path, round=2, model={"student": {"0.weight": torch.ones(2, 2)}},
                    settings=checkpoint.settings(cfg, fed), experiment_id="abc",
                    book={"rounds": [{"round": 1}, {"round": 2}]}, strategy=first.state_dict())
    next_draw = random.random()

    random.seed(0)
    again = RecordingStrategy(base_strategy(fed), fed, SHAPES, round_offset=2)
    saved = checkpoint.load(tmp_path)
    again.load_state_dict(saved["strategy"])
    assert np.array_equal(again.inner.strategy.m_t["student/0.weight"], np.full((2, 2), 0.5))
    assert np.array_equal(again.inner.strategy.v_t["student/0.weight"], np.full((2, 2), 0.25))
    assert again.client_epsilon == {0: 1.25, 1: 1.5} and again.missed[2][0]["client"] == 1
    assert random.random() == next_draw
    assert saved["book"]["rounds"] == [{"round": 1}, {"round": 2}] and saved["round"] == 2
    assert torch.equal(saved["model"]["student"]["0.weight"], torch.ones(2, 2))
    cfg2, fed2 = checkpoint.resumed_settings(tmp_path)
    assert (cfg2.method, cfg2.epsilon, cfg2.subset, fed2.strategy, fed2.rounds) == ("dpdsd", 2.0, 500, "fedadam", 4)
    assert fed2.resume_dir == fed2.out_dir == str(tmp_path.absolute())


def test_an_old_or_foreign_checkpoint_is_refused_with_the_reason(tmp_path):
    """No code runs from a checkpoint (weights_only): fedsd's old pickles, which held numpy
    arrays and Flower objects, and files of another format are refused, naming --resume."""
    import torch

    from fedsd.errors import ResumeError
    from fedsd.app.server import checkpoint

    with pytest.raises(ResumeError, match="--resume: no checkpoint.pt"):
        checkpoint.load(tmp_path / "nothing-here")
    torch.save({"round": 1, "strategy": {"m_t": np.zeros(2)}}, tmp_path / "checkpoint.pt")  # the old layout
    with pytest.raises(ResumeError, match="not a fedsd server checkpoint this version can read"):
        checkpoint.load(tmp_path)
    torch.save({"round": 1, "model": {}}, tmp_path / "checkpoint.pt")  # plain values, no format
    with pytest.raises(ResumeError, match="format 1; this version of fedsd continues format 2"):
        checkpoint.load(tmp_path)
    (tmp_path / "checkpoint.pt").write_text("not a checkpoint")
    with pytest.raises(ResumeError, match="cannot|not a fedsd server checkpoint"):
        checkpoint.load(tmp_path)


def test_aggregated_metrics_mean_something():
    """Federated evaluation weighs each client by the samples it evaluated (a client without a
    test split adds nothing); training metrics keep the largest ε; no partition id is averaged."""
    def reply(**m):
        return RecordDict({"metrics": MetricRecord(m)})
    evaluations = [reply(**{"num-examples": 30, "test-accuracy": 0.5, "test-loss": 1.0, "partition-id": 0}),
                   reply(**{"num-examples": 10, "test-accuracy": 0.9, "test-loss": 3.0, "partition-id": 1}),
                   reply(**{"num-examples": 0, "test-accuracy": 0.0, "test-loss": 0.0, "partition-id": 2})]
    agg = evaluation_metrics(evaluations, "num-examples")
    assert agg["test-accuracy"] == pytest.approx(0.6) and agg["test-loss"] == pytest.approx(1.5)
    assert agg["clients"] == 2 and agg["num-examples"] == 40 and "partition-id" not in agg
    trained = [reply(**{"num-examples": 30, "train-loss": 1.0, "epsilon": 2.5, "steps": 3, "partition-id": 0}),
               reply(**{"num-examples": 10, "train-loss": 2.0, "epsilon": 2.9, "steps": 1, "partition-id": 1})]
    agg = train_metrics(trained, "num-examples")
    assert agg["max-epsilon"] == 2.9 and agg["train-loss"] == pytest.approx(1.25) and agg["steps"] == 4
    assert "partition-id" not in agg


class NextFlowerGrid:
    """A Grid as Flower 1.43 behaves (flwr-nightly 1.43.0.dev20261026, http_grid.py): every
    message gets its object id as its message id, push_messages returns "" for one the SuperLink
    did not take, and pull_messages logs "Message <id> objects unavailable" and leaves out a reply
    whose objects cannot be pulled. Node 12's push fails; node 13's reply is dropped."""

    def __init__(self):
        self.pulls = 0

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            ids.append("" if m.metadata.dst_node_id == 12 else m.metadata.message_id)
        self.sent = {m.metadata.message_id: m for m in messages}
        return ids

    def pull_messages(self, message_ids):
        import logging

        self.pulls += 1
        replies = []
        for i in message_ids:
            node = self.sent[i].metadata.dst_node_id
            if node == 13:
                logging.getLogger("flwr").error("Message %s objects unavailable: %s", "reply-of-13", "gone")
                continue
            answer = reply({11: 0, 14: 3}[node], good(float(node)))
            replies.append(Message(answer.content, reply_to=self.sent[i]))
        return replies


def test_a_failed_push_and_a_dropped_reply_are_missing_at_once_and_the_round_goes_on():
    """Flower 1.43's grid: a message the SuperLink did not take, and a reply it dropped, each
    become the node's error reply at once (not after the round's timeout); the strategy records
    both nodes as missing the round, with the reason, and averages the two that trained."""
    import time

    from flwr.app import ConfigRecord

    from fedsd.app.server.grid import PollingGrid

    fed = FedConfig(num_clients=4)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    grid, arrays = Nodes(11, 12, 13, 14), ArrayRecord({k: Array(v) for k, v in good().items()})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))
    flower = NextFlowerGrid()
    started = time.monotonic()
    replies = PollingGrid(flower, poll_seconds=0.05).send_and_receive(messages, timeout=30)
    assert time.monotonic() - started < 5 and flower.pulls == 1
    arrays, _ = strategy.aggregate_train(1, replies)
    missed = {m["node_id"]: m["reason"] for m in strategy.missed[1]}
    assert missed == {12: "node 12: the SuperLink did not take the message for it",
                      13: "node 13: its reply reached the SuperLink but could not be pulled from it"}
    assert np.allclose(arrays["student/0.weight"].numpy(), 12.5)  # nodes 11 and 14, 100 samples each


class RefusedBatchGrid(NextFlowerGrid):
    """Flower's Grid where the SuperLink refuses the objects of one push (its push session expired or
    was replaced, as under a hundred nodes' polls): the push with node 12's message raises Flower's
    ObjectPushError. Nodes 13 and 14 reply; node 11 would, had its message gone."""

    def push_messages(self, messages):
        from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

        if any(m.metadata.dst_node_id == 12 for m in messages):
            raise ObjectPushError("an-object", 1, "a-session")
        sent = getattr(self, "sent", {})
        ids = super().push_messages(messages)
        self.sent.update(sent)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        return [Message(reply(0, good(float(self.sent[i].metadata.dst_node_id))).content, reply_to=self.sent[i])
                for i in message_ids]


def test_a_push_the_superlink_refuses_costs_its_batch_of_nodes_and_the_round_goes_on(monkeypatch):
    """A stage's messages go PUSH_BATCH at a time; a batch whose objects the SuperLink refuses is
    answered as missing, naming why, and the others' replies come in (where the ServerApp stopped)."""
    from flwr.app import ConfigRecord

    import fedsd.app.server.grid
    from fedsd.app.server.grid import PollingGrid

    monkeypatch.setattr(fedsd.app.server.grid, "PUSH_BATCH", 2)
    fed = FedConfig(num_clients=4)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    grid, arrays = Nodes(11, 12, 13, 14), ArrayRecord({k: Array(v) for k, v in good().items()})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))
    replies = PollingGrid(RefusedBatchGrid(), poll_seconds=0.05).send_and_receive(messages, timeout=30)
    arrays, _ = strategy.aggregate_train(1, replies)
    batches = [{m.metadata.dst_node_id for m in messages[i:i + 2]} for i in (0, 2)]
    refused = next(batch for batch in batches if 12 in batch)
    missed = {m["node_id"]: m["reason"] for m in strategy.missed[1]}
    assert set(missed) == refused
    assert all("the SuperLink refused the message's objects (Failed to push object with ID 'an-object'" in why
               for why in missed.values())
    others = {11, 12, 13, 14} - refused
    assert np.allclose(arrays["student/0.weight"].numpy(), sum(others) / 2)  # the other batch's two nodes alone


class OfflineNodeGrid(NextFlowerGrid):
    """Flower 1.43's SuperLink with a node that went offline mid-round: the error reply it makes
    for node 13 is cancelled on its side (no objects in its store), so the ServerApp never sees
    it; node 13 drops out of the online nodes. Nodes 11 and 14 reply on the third pull."""

    def get_node_ids(self):
        return [11, 14] if self.pulls else [11, 13, 14]

    def pull_messages(self, message_ids):
        self.pulls += 1
        if self.pulls < 3:
            return []
        return [Message(reply({11: 0, 14: 3}[self.sent[i].metadata.dst_node_id],
                              good(float(self.sent[i].metadata.dst_node_id))).content, reply_to=self.sent[i])
                for i in message_ids if self.sent[i].metadata.dst_node_id != 13]


def test_a_node_gone_offline_is_missing_without_waiting_for_the_rounds_timeout(monkeypatch):
    import time

    from flwr.app import ConfigRecord

    import fedsd.app.server.grid
    from fedsd.app.server.grid import PollingGrid

    monkeypatch.setattr(fedsd.app.server.grid, "OFFLINE_CHECK_SECONDS", 0.2)
    fed = FedConfig(num_clients=3)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    grid, arrays = Nodes(11, 13, 14), ArrayRecord({k: Array(v) for k, v in good().items()})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))
    started = time.monotonic()
    replies = PollingGrid(OfflineNodeGrid(), poll_seconds=0.05).send_and_receive(messages, timeout=30)
    assert time.monotonic() - started < 5
    strategy.aggregate_train(1, replies)
    assert {m["node_id"]: m["reason"] for m in strategy.missed[1]} == {
        13: "node 13: it went offline (its heartbeat lapsed) before replying"}


def test_a_launch_whose_node_is_down_goes_on_without_it_after_a_bounded_wait(monkeypatch):
    """A resumed server's first round waits for the whole federation, but not forever: a client
    whose machine is down (churn) would otherwise hold the run for good (Flower's sample_nodes
    waits without a limit). After LAUNCH_WAIT_SECONDS it goes on with the nodes there."""
    import threading
    import time

    from flwr.app import ConfigRecord

    import fedsd.app.server.strategy

    monkeypatch.setattr(fedsd.app.server.strategy, "LAUNCH_WAIT_SECONDS", 0.5)
    fed = FedConfig(num_clients=3)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES, round_offset=4)
    arrays, sent = ArrayRecord({k: Array(v) for k, v in good().items()}), []
    started = time.monotonic()
    worker = threading.Thread(target=lambda: sent.extend(strategy.configure_train(1, arrays, ConfigRecord({}),
                                                                                  Nodes(11, 13))), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the launch waited for the node that is down"
    assert 0.5 <= time.monotonic() - started < 10
    assert sorted(m.metadata.dst_node_id for m in sent) == [11, 13]


def test_a_launch_with_its_whole_federation_does_not_wait():
    import time

    from flwr.app import ConfigRecord

    fed = FedConfig(num_clients=3)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    started = time.monotonic()
    sent = list(strategy.configure_train(1, ArrayRecord({k: Array(v) for k, v in good().items()}), ConfigRecord({}),
                                         Nodes(11, 12, 13)))
    assert len(sent) == 3 and time.monotonic() - started < 2


def test_the_aggregate_does_not_depend_on_the_order_the_replies_arrive_in():
    """Float sums depend on their order, and replies arrive in whatever order the clients
    finish: the server sums them by partition, so the same run gives the same weights."""
    rng = np.random.default_rng(0)
    updates = [{f"student/{k}": rng.standard_normal(s).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 3)
                for k, s in SHAPES.items()} for _ in range(6)]
    results = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 4, 2], [2, 0, 5, 4, 1, 3]):
        fed = FedConfig(num_clients=6)
        strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
        arrays, _ = strategy.aggregate_train(1, [reply(pid, updates[pid], n=97 + 13 * pid) for pid in order])
        results.append({k: v.numpy() for k, v in arrays.items()})
    assert any(not np.array_equal(sum(u[k] for u in updates), sum(updates[i][k] for i in (5, 3, 1, 0, 4, 2)))
               for k in updates[0])  # the orders do round differently
    for other in results[1:]:
        assert all(np.array_equal(results[0][k], other[k]) for k in results[0])


def test_a_gone_nodes_message_answered_twice_misses_the_round_once():
    """The SuperLink may make a gone node's error reply on two pulls of one round (a deployment's
    killed SuperNode was listed missing twice in round 2): the round lists it once, with the first
    reason, and the others' replies are averaged."""
    from flwr.app import ConfigRecord, Error

    fed = FedConfig(num_clients=3)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    arrays = ArrayRecord({k: Array(v) for k, v in good().items()})
    sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, arrays, ConfigRecord({}), Nodes(11, 12, 13))}
    gone = [Message(Error(code=0, reason=f"Error: Node Unavailable ({k})"), reply_to=sent[12]) for k in (1, 2)]
    replies = [Message(reply(pid, good(float(pid + 1))).content, reply_to=sent[node])
               for pid, node in ((0, 11), (2, 13))]
    arrays, _ = strategy.aggregate_train(1, replies[:1] + gone + replies[1:])
    assert [(m["node_id"], m["reason"]) for m in strategy.missed[1]] == [(12, "Error: Node Unavailable (1)")]
    assert np.allclose(arrays["student/0.weight"].numpy(), 2.0)  # partitions 0 and 2, 100 samples each
