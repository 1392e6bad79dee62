"""The server sets aside replies whose arrays do not fit the model, logs why, and aggregates
the rest (the recording wrapper, driven in-process with real Flower Messages)."""
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from fedsd.federation import FedOptions
from fedsd.models import build_model
from server.strategy import RecordingStrategy, base_strategy, reply_problem

pytestmark = pytest.mark.usefixtures("flower_task")
SHAPES = {k: tuple(v.shape) for k, v in build_model("mnist-cnn").state_dict().items()}


def reply(pid: int, arrays: dict, n: int = 100) -> Message:
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "metrics": MetricRecord({"num-examples": n, "partition-id": pid, "skipped": 0,
                                                   "epsilon": 1.0})})
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
    fed = FedOptions(num_clients=3)
    strategy = RecordingStrategy(base_strategy(fed), fed, SHAPES)
    arrays, _ = strategy.aggregate_train(1, [reply(0, good(1.0)), reply(1, bad), reply(2, good(3.0), n=300)])
    assert needle in strategy.round_clients[1][1]["rejected"]
    # Only clients 0 and 2 are averaged, weighted 100 : 300.
    assert np.allclose(arrays["student/0.weight"].numpy(), 2.5)
