"""A node that holds its own copy of the public weights (node-config init-weights) against a
server that claims the right sha256 and sends other weights: the frozen blocks it is sent are
checked bit for bit against the network it builds from its file, every round, and the whole
student in round 1, before anything is read, trained or charged; the server keeps the frozen
blocks exact through aggregation."""
import shutil

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedsd.app.client.owner_checks import check_init_weights
from fedsd.app.client.node_config import NodeConfigError, parse
from fedsd.app.records import first_difference, model_to_record, with_frozen
from fedsd.models.networks import build_model, with_pinned_weights
from fedsd.settings.federation import client_config, to_flat
from fedsd.training.loop import frozen_part, initial_model
from tests.app.client.test_server_threat import ask, node, one_step_run, own_npz  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("flower_task")


@pytest.fixture
def weights(tmp_path):
    """(the server's file, the owner's own copy of it)."""
    server, owner = tmp_path / "public.pt", tmp_path / "owner" / "public.pt"
    torch.save(build_model("mnist-cnn", 10, seed=123).state_dict(), server)
    owner.parent.mkdir()
    shutil.copy(server, owner)
    return server, owner


def pretrained_run(server_file, round_=1):
    """A run from the weights (last:2 freezes blocks 0 and 3), its flat settings as sent (the
    server's path of the file gone: the node reads its own) and its initial model."""
    cfg, fed, _ = one_step_run(init_weights=str(server_file), train_layers="last:2")
    cfg = with_pinned_weights(cfg)
    flat = {**to_flat(cfg, fed), "init-weights": "/the/servers/own/path.pt"}
    return flat, initial_model(client_config(cfg, fed), 10)


def one_ulp_up(model, key="0.weight"):
    t = model["student"][key]
    t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(float("inf")))
    return model


def files_under(folder):
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_a_frozen_block_off_by_one_ulp_is_refused_before_anything_is_charged(own_npz, weights, tmp_path):
    flat, start = pretrained_run(weights[0])
    owner = node(own_npz, tmp_path / "state", **{"init-weights": str(weights[1])})
    for round_, kind in ((1, "train"), (2, "train"), (2, "evaluate")):
        reply = ask(flat, owner, one_ulp_up(pretrained_run(weights[0])[1]), server_round=round_, kind=kind)
        assert "student/0.weight is not what this node builds" in reply["refusal"]["reason"], (round_, kind)
        assert str(tmp_path) not in reply["refusal"]["reason"]
        assert not files_under(tmp_path / "state")  # no ledger, no state, no prepared data
    reply = ask(flat, owner, start)  # the honest model: trained
    assert reply["metrics"]["skipped"] == 0 and "refusal" not in reply
    assert files_under(tmp_path / "state")


def test_in_round_one_the_whole_student_is_the_files_start(own_npz, weights, tmp_path):
    flat, start = pretrained_run(weights[0])
    owner = node(own_npz, tmp_path / "state", **{"init-weights": str(weights[1])})
    reply = ask(flat, owner, one_ulp_up(start, "9.weight"))  # a trained block: checked in round 1 only
    assert "student/9.weight" in reply["refusal"]["reason"] and not files_under(tmp_path / "state")


def test_the_owners_file_must_be_the_one_its_node_config_and_the_run_name(weights, tmp_path):
    server, owner = weights
    sha = with_pinned_weights(one_step_run(init_weights=str(server))[0]).init_weights_sha256
    mine = parse({"partition-id": 0, "init-weights": str(owner), "init-weights-sha256": sha})
    check_init_weights({"init-weights-sha256": sha}, mine)
    with pytest.raises(NodeConfigError, match="init-weights-sha256=cdcd.*node-config init-weights"):
        check_init_weights({"init-weights-sha256": "cd" * 32}, mine)  # the run claims other weights
    with pytest.raises(NodeConfigError, match="init-weights-sha256=none"):
        check_init_weights({}, mine)  # or none
    other = tmp_path / "other.pt"
    torch.save(build_model("mnist-cnn", 10, seed=7).state_dict(), other)
    theirs = parse({"partition-id": 0, "init-weights": str(other), "init-weights-sha256": sha})
    with pytest.raises(NodeConfigError, match="node-config init-weights: the owner's file is not the one node-config "
                                              "init-weights-sha256"):
        check_init_weights({"init-weights-sha256": sha}, theirs)
    # no sha256 of its own: the run's must be its file's
    unpinned = parse({"partition-id": 0, "init-weights": str(other)})
    with pytest.raises(NodeConfigError, match="not the sha256 of this node's own copy"):
        check_init_weights({"init-weights-sha256": sha}, unpinned)
    with pytest.raises(NodeConfigError, match="node-config init-weights: no such file"):
        parse({"partition-id": 0, "init-weights": str(tmp_path / "absent.pt")})


def test_the_server_keeps_the_frozen_blocks_exact_through_aggregation(weights):
    cfg, fed, _ = one_step_run(init_weights=str(weights[0]), train_layers="last:2")
    cfg = client_config(with_pinned_weights(cfg), fed)
    frozen = frozen_part(cfg, 10)
    assert sorted(frozen) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    record = model_to_record(initial_model(cfg, 10))
    w = [1 / 3, 2 / 3]  # a weighted mean of two equal replies, as Flower's FedAvg computes it
    mean = ArrayRecord({k: Array(a.numpy() * w[0] + a.numpy() * w[1]) for k, a in record.items()})
    assert first_difference(mean, frozen) is not None  # float32: not the values it averaged
    assert first_difference(with_frozen(mean, frozen), frozen) is None
    assert np.array_equal(with_frozen(mean, frozen)["student/9.weight"].numpy(), mean["student/9.weight"].numpy())


def test_backbone_features_come_from_the_owners_file(own_npz, weights, tmp_path, monkeypatch):
    """features=backbone: the node computes its features from its own copy (the run's path for
    the file is one the server named, and absent here)."""
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path / "cache"))
    cfg, fed, _ = one_step_run(init_weights=str(weights[0]), train_layers="head", features="backbone")
    cfg = with_pinned_weights(cfg)
    flat = {**to_flat(cfg, fed), "init-weights": "/the/servers/own/path.pt"}
    start = initial_model(client_config(cfg, fed), 10)
    assert sorted(start["student"]) == ["9.bias", "9.weight"]  # nothing frozen travels: round 1's check only
    owner = node(own_npz, tmp_path / "state", **{"init-weights": str(weights[1])})
    assert ask(flat, owner, start)["metrics"]["skipped"] == 0
    reply = ask(flat, owner, one_ulp_up(initial_model(client_config(cfg, fed), 10), "9.bias"), server_round=1)
    assert "student/9.bias" in reply["refusal"]["reason"]
