"""A client that owns its data and its privacy budget, through the ClientApp called
in-process with real Flower Messages: its own files (image folders or .npz, prepared once and
cached), its lifetime ledger across experiments, and clear errors for bad data."""
import json

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsd.app.client import handler as local
from fedsd.app.client.handler import LEDGER_REFUSED
from fedsd.app.client.client_app import app
from fedsd.app.records import model_to_record, record_to_model
from fedsd.data import client_data
from fedsd.data.client_data import builtin_task, load_holder_data
from fedsd.errors import DataError
from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig, to_flat
from fedsd.privacy.accounting import PrivacyFilter, plan
from fedsd.models.networks import build_model
from fedsd.training.loop import evaluate, initial_model
from fedsd.cli.main import main
from tests.conftest import require

pytestmark = pytest.mark.usefixtures("flower_task")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """Two clients' folders of real Fashion-MNIST images, in both formats (the same images)."""
    require("fmnist")
    root = tmp_path_factory.mktemp("split")
    for fmt in ("imagefolder", "npz"):
        assert main(["split-data", "--dataset", "fmnist", "--clients", "2", "--subset", "600", "--format", fmt,
                     "--out", str(root / fmt)]) == 0
    return root


def run_config(epsilon=3.0, rounds=2, experiment="exp-a", batch_size=60):
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", epsilon=epsilon, batch_size=batch_size, lr=0.8, seed=1,
                      threads=1, distill_warmup_epochs=0)
    fed = FedConfig(num_clients=2, rounds=rounds, client_data="own", experiment_id=experiment)
    return cfg, to_flat(cfg, fed)


def send(flat, node_config, model, server_round, state=None):
    context = Context(run_id=1, node_id=11, node_config=node_config, state=state or RecordDict(), run_config={})
    msg = Message(RecordDict({"arrays": model_to_record(model),
                              "config": ConfigRecord({**flat, "server-round": server_round})}),
                  dst_node_id=11, message_type="train")
    return app(msg, context), context


def _samples(held):
    return sorted((int(y), x.numpy().tobytes()) for x, y in zip(held.x_train, held.y_train))


def test_own_data_trains_and_both_formats_hold_the_same_samples(split, tmp_path):
    cfg, flat = run_config()
    start = initial_model(cfg.resolved(), 10)
    for fmt in ("imagefolder", "npz"):
        node = {"partition-id": 0, "data": str(split / fmt / "client-0"), "state-dir": str(tmp_path / fmt),
                "max-epsilon": 3}
        reply, _ = send(flat, node, start, 1)
        assert reply.content["metrics"]["skipped"] == 0
        assert reply.content["metrics"]["num-examples"] == 300  # its own shard, not the server's idea of it
        trained = record_to_model(reply.content["arrays"])["student"]
        assert max((trained[k] - start["student"][k]).abs().max().item() for k in start["student"]) > 1e-3
    # PNG is lossless: the folder and the arrays hold the same pixels and labels (in another order).
    task = builtin_task("fmnist")
    folder = load_holder_data(split / "imagefolder" / "client-0", task, tmp_path / "c1")
    arrays = load_holder_data(split / "npz" / "client-0", task, tmp_path / "c2")
    assert _samples(folder) == _samples(arrays) and len(_samples(arrays)) == 300


def test_prepared_data_is_cached_by_fingerprint(split, tmp_path, monkeypatch):
    task = builtin_task("fmnist")
    assert client_data.known_holder_data(split / "imagefolder" / "client-1", task, tmp_path) is None  # not prepared
    first = load_holder_data(split / "imagefolder" / "client-1", task, tmp_path)
    assert client_data.known_holder_data(split / "imagefolder" / "client-1", task, tmp_path) == \
        client_data.DataIdentity(first.fingerprint, first.source, first.named_fingerprint, [])
    monkeypatch.setattr(client_data, "_load_folder", lambda *a: pytest.fail("decoded the images again"))
    again = load_holder_data(split / "imagefolder" / "client-1", task, tmp_path)
    assert again.fingerprint == first.fingerprint and torch.equal(again.x_train, first.x_train)
    # The same content elsewhere (a copied folder) is the same data set, so the same ledger:
    # moving the data does not reset its budget.
    import shutil

    shutil.copytree(split / "imagefolder" / "client-1", tmp_path / "copy")
    monkeypatch.undo()
    assert load_holder_data(tmp_path / "copy", task, tmp_path / "other-cache").fingerprint == first.fingerprint
    assert load_holder_data(split / "imagefolder" / "client-0", task, tmp_path).fingerprint != first.fingerprint


def test_a_later_round_reads_none_of_the_data_its_process_trains_from(split, tmp_path, monkeypatch):
    """A data service answers every message of a run: after its first round it takes the data's
    fingerprint from its cache's index and trains from what it prepared, without loading the
    prepared images again (they were read, 6,000 images a message, at every round)."""
    cfg, flat = run_config(rounds=3)
    node = {"partition-id": 0, "data": str(split / "npz" / "client-0"), "state-dir": str(tmp_path), "max-epsilon": 3}
    local._TRAINERS.clear()
    model = initial_model(cfg.resolved(), 10)
    reply, _ = send(flat, node, model, 1)
    assert reply.content["metrics"]["num-examples"] == 300
    trainer = next(iter(local._TRAINERS.values()))
    loads = []
    flower_load = torch.load
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: loads.append(str(path)) or flower_load(path, *a, **k))
    reply, _ = send(flat, node, record_to_model(reply.content["arrays"]), 2)
    assert reply.content["metrics"]["num-examples"] == 300 and "refusal" not in reply.content
    assert [p for p in loads if "prepared-" in p] == [] and next(iter(local._TRAINERS.values())) is trainer
    local._TRAINERS.clear()  # a fresh process: the prepared images are read from the cache once
    send(flat, node, record_to_model(reply.content["arrays"]), 3)
    assert len([p for p in loads if "prepared-" in p]) == 1


def test_run_asking_more_than_the_owner_allows_is_refused_before_any_step(split, tmp_path):
    cfg, flat = run_config(epsilon=50)
    node = {"partition-id": 0, "data": str(split / "npz" / "client-0"), "state-dir": str(tmp_path),
            "max-epsilon": 3.0}
    reply, context = send(flat, node, initial_model(cfg.resolved(), 10), 1)
    assert not reply.content.array_records  # no model: nothing was trained
    assert reply.content["metrics"]["refused"] == 1 and reply.content["metrics"]["epsilon"] == 0.0
    assert reply.content["refusal"]["reason"] == "run asks ε=50, this client allows at most 3"
    ledgers = list(tmp_path.glob("ledger-*.json"))
    assert not ledgers or json.loads(ledgers[0].read_text())["entries"] == []


def test_lifetime_budget_spans_experiments(split, tmp_path, caplog):
    """A fresh experiment id (a fresh accountant) does not reset what the data has spent."""
    node = {"partition-id": 1, "data": str(split / "npz" / "client-1"), "state-dir": str(tmp_path),
            "max-epsilon": 3.0, "max-delta": 1e-5}
    cfg, flat = run_config(epsilon=2.5, experiment="exp-1")
    model, state = initial_model(cfg.resolved(), 10), None
    for server_round in (1, 2):
        reply, context = send(flat, node, model, server_round, state)
        assert reply.content["metrics"]["skipped"] == 0
        model, state = record_to_model(reply.content["arrays"]), context.state
    ledger = json.loads(next(tmp_path.glob("ledger-*.json")).read_text())
    assert [e["run"] for e in ledger["entries"]] == ["exp-1", "exp-1"]
    spent = PrivacyFilter.from_state_dict(ledger, 3.0, 1e-5).epsilon()
    assert 2.0 < spent <= 2.5 + 1e-6
    # A second experiment over the same data, asking 2.5 again: it does not fit what is left.
    _, flat2 = run_config(epsilon=2.5, experiment="exp-2")
    reply, _ = send(flat2, node, model, 1)
    assert reply.content["metrics"]["refused"] == 1
    # The server is told "budget" and no figure of the ledger (it counts what other federations spent)
    assert reply.content["refusal"]["reason"] == LEDGER_REFUSED
    assert f"lifetime budget: spent ε={spent:.3g} of the owner's ε=3" in caplog.text  # in full in the owner's log
    # ...and a small run that fits what is left is admitted.
    _, flat3 = run_config(epsilon=0.3, rounds=1, experiment="exp-3")
    reply, _ = send(flat3, node, model, 1)
    assert reply.content["metrics"]["skipped"] == 0


def test_privacy_filter_matches_opacus_rdp_and_refuses_what_does_not_fit():
    from opacus.accountants import RDPAccountant

    p = plan(3.0, 1e-5, 30000, 256, 5)
    f = PrivacyFilter(3.0, 1e-5)
    f.spend(p.noise_multiplier, p.sample_rate, p.planned_steps)
    accountant = RDPAccountant()
    accountant.history = [(p.noise_multiplier, p.sample_rate, p.planned_steps)]
    assert f.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=0.02)  # more orders: as tight or tighter
    assert f.epsilon() <= accountant.get_epsilon(1e-5) + 1e-9
    with pytest.raises(Exception, match="lifetime budget: spent ε="):
        f.spend(p.noise_multiplier, p.sample_rate, p.planned_steps)
    restored = PrivacyFilter.from_state_dict(json.loads(json.dumps(f.state_dict())), 3.0, 1e-5)
    assert restored.epsilon() == f.epsilon() and len(restored.entries) == 1


def _png(path, array):
    from torchvision.io import write_png

    path.parent.mkdir(parents=True, exist_ok=True)
    write_png(torch.from_numpy(array), str(path))


def test_custom_task_from_an_image_folder_of_any_size(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        for i in range(3):
            _png(tmp_path / "pets" / "train" / cls / f"{i}.png", rng.integers(0, 255, (3, 40 + i, 50), dtype=np.uint8))
    cfg = TrainConfig(dataset="custom", classes="cat,dog", channels=3, image_size=32).resolved()
    held = load_holder_data(tmp_path / "pets", client_data.task_for(cfg), tmp_path / "cache")
    assert held.x_train.shape == (6, 3, 32, 32) and held.y_train.tolist() == [0, 0, 0, 1, 1, 1]
    assert cfg.model == "cifar-cnn" and len(held.y_test) == 0


def _file(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("make,needle", [
    (lambda d: _npz(d / "a.npz", x_train=np.zeros((4, 28, 28), np.float32), y_train=np.zeros(4, int)),
     r"a.npz x_train: dtype float32; expected uint8"),
    (lambda d: _npz(d / "b.npz", x_train=np.zeros((4, 28), np.uint8), y_train=np.zeros(4, int)),
     r"b.npz x_train: shape \(4, 28\); expected N×H×W or N×H×W×C"),
    (lambda d: _npz(d / "c.npz", x_train=np.zeros((4, 28, 28), np.uint8), y_train=np.array([0, 1, 2, 10])),
     r"c.npz y_train: label 10 is out of range: the task has 10 classes"),
    (lambda d: _npz(d / "d.npz", x_train=np.zeros((0, 28, 28), np.uint8), y_train=np.zeros(0, int)),
     r"d.npz: the training split is empty"),
    (lambda d: _npz(d / "e.npz", images=np.zeros((4, 28, 28), np.uint8)),
     r"e.npz: no array 'x_train'; it holds images"),
    (lambda d: (d / "f.npz").write_bytes(b"not a zip") and d / "f.npz", r"f.npz: not a readable .npz file"),
    (lambda d: _file(d / "g" / "train" / "3" / "x.png", b"junk") and d / "g",
     r"x.png: not a readable PNG or JPEG image"),
    (lambda d: (d / "h" / "train" / "eleven").mkdir(parents=True) or d / "h",
     r"class folder 'eleven' is not one of the task's classes"),
    (lambda d: (d / "i").mkdir() or d / "i", r"i: no train/ folder"),
    (lambda d: d / "missing", r"missing: no such file or folder"),
])
def test_bad_data_is_named_with_its_problem(tmp_path, make, needle):
    path = make(tmp_path)
    with pytest.raises(DataError, match=needle):
        load_holder_data(path, builtin_task("fmnist"), tmp_path / "cache")


def test_fewer_samples_than_the_batch_size_is_refused_before_any_step(split, tmp_path):
    cfg, flat = run_config(batch_size=1000)
    node = {"partition-id": 0, "data": str(split / "npz" / "client-0"), "state-dir": str(tmp_path), "max-epsilon": 3}
    reply, _ = send(flat, node, initial_model(cfg.resolved(), 10), 1)  # refused, named, for the server's summary
    assert reply.content["metrics"]["refused"] == 1 and not reply.content.array_records
    assert reply.content["refusal"]["reason"] == "batch-size=1000: more than this client's training samples"


def test_own_data_run_without_data_says_how_to_start_the_node(tmp_path):
    cfg, flat = run_config()
    reply, _ = send(flat, {"partition-id": 0, "state-dir": str(tmp_path)}, initial_model(cfg.resolved(), 10), 1)
    assert reply.content["metrics"]["refused"] == 1 and not reply.content.array_records
    assert "start the SuperNode with --node-config" in reply.content["refusal"]["reason"]


def evaluate_on_client(flat, node_config, model):
    context = Context(run_id=1, node_id=11, node_config=node_config, state=RecordDict(), run_config={})
    msg = Message(RecordDict({"arrays": model_to_record(model), "config": ConfigRecord({**flat, "server-round": 1})}),
                  dst_node_id=11, message_type="evaluate")
    return next(iter(app(msg, context).content.metric_records.values()))


def test_federated_evaluation_uses_the_clients_own_test_split_and_spends_nothing(split, tmp_path):
    """Allowed by its owner, a client evaluates the model it last received for training, once."""
    cfg, flat = run_config()
    data = split / "npz" / "client-1"
    node = {"partition-id": 1, "data": str(data), "state-dir": str(tmp_path), "max-epsilon": 3,
            "federated-evaluation": True}
    seeded = {"randomness": "seeded", "trust-server-with-noise": True}  # a model that has learned, every time
    trained, _ = send(flat, {**node, **seeded, "state-dir": str(tmp_path / "trained")},
                      initial_model(cfg.resolved(), 10), 1)
    model = record_to_model(trained.content["arrays"])
    send(flat, node, model, 1)  # the model this client now last received for training
    metrics = evaluate_on_client(flat, node, model)
    held = load_holder_data(data, builtin_task("fmnist"), tmp_path / "check")
    net = build_model("mnist-cnn", 10)
    net.load_state_dict(model["student"])
    accuracy, loss = evaluate(net, client_data.normalised(held.x_test, builtin_task("fmnist")), held.y_test)
    assert metrics["num-examples"] == len(held.y_test) == 5000 and metrics["partition-id"] == 1
    assert metrics["test-accuracy"] == pytest.approx(accuracy, abs=1e-9) and accuracy > 0.15  # chance: 0.1
    assert metrics["test-loss"] == pytest.approx(loss, rel=1e-5)
    ledger = json.loads(next(tmp_path.glob("ledger-*.json")).read_text())
    assert len(ledger["entries"]) == 1  # the training round's charge: evaluation is no training step


def test_a_client_without_a_test_split_evaluates_with_weight_zero(split, tmp_path):
    cfg, flat = run_config()
    with np.load(split / "npz" / "client-0" / "data.npz") as z:
        np.savez(tmp_path / "train-only.npz", x_train=z["x_train"], y_train=z["y_train"])
    node = {"partition-id": 0, "data": str(tmp_path / "train-only.npz"), "state-dir": str(tmp_path), "max-epsilon": 3,
            "federated-evaluation": True, "min-evaluation-samples": 1}
    send(flat, node, initial_model(cfg.resolved(), 10), 1)
    metrics = evaluate_on_client(flat, node, initial_model(cfg.resolved(), 10))
    assert metrics["num-examples"] == 0


def test_the_server_normalises_its_public_test_split_as_the_clients_normalise_theirs():
    """With client-data=own and mean/std set in the run config, the server evaluates on the
    public test split normalised with those same constants, not the data set's standard ones."""
    require("fmnist")
    from fedsd.data import datasets as data_lib
    from fedsd.app.server.server_app import public_side

    cfg = TrainConfig(dataset="fmnist", method="dp3sd", epsilon=3, mean="0.5", std="0.25")
    _, classes, (x_test, y_test), _, _ = public_side(cfg, FedConfig(num_clients=2, rounds=1, client_data="own"))
    images = data_lib.load("fmnist", None, False)
    assert classes == 10 and torch.equal(y_test, images.y_test)
    assert torch.allclose(x_test, (images.x_test.float() / 255 - 0.5) / 0.25)


def test_mean_and_std_reach_every_party_on_a_built_in_data_set():
    """--mean / --std on a built-in data set: a central run's training, test and validation
    images, a simulated client's shard and the server's test and validation splits are all
    normalised with them (here raw [0, 1] inputs, Tramèr & Boneh's variant); without them, the
    data set's fixed constants."""
    require("fmnist")
    from fedsd.data import datasets as data_lib
    from fedsd.training.central import prepare_run
    from fedsd.data.client_data import input_stats
    from fedsd.app.server.server_app import public_side
    from fedsd.app.simulated_shards import build_federation

    images = data_lib.load("fmnist", None, False)
    raw = lambda x: x.float() / 255  # noqa: E731
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=100, subset=2000, validation=500,
                      mean="0", std="1").resolved()
    inputs = prepare_run(cfg)
    central = data_lib.prepare(inputs.data, inputs.train_indices, "cpu", input_stats(cfg))
    assert torch.equal(central.x_train, raw(images.x_train[inputs.train_indices]))
    assert torch.equal(central.x_test, raw(images.x_test))
    held_out = data_lib.validation_indices(images, 500)
    assert torch.equal(data_lib.validation_split(images, 500, input_stats(cfg))[0], raw(images.x_train[held_out]))
    fed = FedConfig(num_clients=2, rounds=1)
    federation = build_federation(cfg, fed)
    shard = federation.client_data(0, "cpu")
    assert torch.equal(shard.x_train, raw(images.x_train[federation.train_indices[federation.shards[0]]]))
    _, _, (x_test, _), _, (x_val, _) = public_side(cfg, fed)
    assert torch.equal(x_test, raw(images.x_test)) and torch.equal(x_val, raw(images.x_train[held_out]))
    standard = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=100, subset=2000).resolved()
    assert input_stats(standard) == data_lib.STANDARD_STATS["fmnist"]
    assert data_lib.prepare(images, inputs.train_indices, "cpu", input_stats(standard)).x_test \
        is images.normalised_x_test


# -- own data never trains without its owner's budget ---------------------------------
def test_own_data_without_a_budget_is_refused_before_its_data_is_read(split, tmp_path):
    cfg, flat = run_config()
    node = {"partition-id": 0, "data": str(split / "npz" / "client-0"), "state-dir": str(tmp_path)}
    reply, _ = send(flat, node, initial_model(cfg.resolved(), 10), 1)
    assert not reply.content.array_records
    metrics = reply.content["metrics"]
    assert metrics["refused"] == 1 and metrics["skipped"] == 1 and metrics["partition-id"] == 0
    assert reply.content["refusal"]["reason"] == ('this client has no lifetime budget: start its SuperNode with '
                                                  '--node-config "max-epsilon=…"')
    assert list(tmp_path.iterdir()) == []  # nothing decoded, cached, calibrated, charged or saved


@pytest.mark.parametrize("extra,needle", [
    ({"max-epsilon": "three"}, "node-config max-epsilon='three' is not a number"),
    ({"max-epsilon": True}, "node-config max-epsilon=True is not a number"),
    ({"max-epsilon": -1.0}, "node-config max-epsilon=-1: must be > 0 (or inf for no limit)"),
    ({"max-epsilon": 3, "max-delta": 1.5}, "node-config max-delta=1.5: must be in (0, 1)"),
    ({"max-epsilon": 3, "max-epsilom": 3}, "node-config max-epsilom: not a key fedsd reads; the keys are partition-id"),
    ({"max-epsilon": 3, "data": "/no/such/folder"}, "node-config data='<data>': no such file or folder"),  # no path
    ({"max-epsilon": 3, "partition-id": 5}, "node-config partition-id=5 is outside [0, 2)"),
])
def test_a_bad_node_config_is_refused_with_the_key_named(split, tmp_path, extra, needle):
    cfg, flat = run_config()
    node = {"partition-id": 0, "data": str(split / "npz" / "client-0"), "state-dir": str(tmp_path), **extra}
    reply, _ = send(flat, node, initial_model(cfg.resolved(), 10), 1)
    assert reply.content["metrics"]["refused"] == 1 and not reply.content.array_records
    assert reply.content["refusal"]["reason"].startswith(needle), reply.content["refusal"]["reason"]
    assert list(tmp_path.iterdir()) == []


def test_an_unlimited_budget_is_explicit_recorded_and_reported(split, tmp_path):
    cfg, flat = run_config(epsilon=50, rounds=1)  # more than any finite owner's limit in these tests
    node = {"partition-id": 0, "data": str(split / "npz" / "client-0"), "state-dir": str(tmp_path),
            "max-epsilon": float("inf")}
    reply, _ = send(flat, node, initial_model(cfg.resolved(), 10), 1)
    metrics = reply.content["metrics"]
    assert metrics["skipped"] == 0 and metrics["max-epsilon"] == float("inf") and metrics["max-delta"] == 1e-5
    state = json.loads(next(tmp_path.glob("ledger-*.json")).read_text())
    assert state["max_epsilon"] == "inf" and len(state["entries"]) == 1  # still recorded, in plain JSON
    assert state["entries"][0]["run"] == "exp-a" and state["entries"][0]["round"] == 1


def test_fedsd_ledger_shows_what_two_experiments_spent(split, tmp_path, capsys):
    node = {"partition-id": 1, "data": str(split / "npz" / "client-1"), "state-dir": str(tmp_path),
            "max-epsilon": 5.0}
    reported = {}
    for experiment, epsilon in (("exp-1", 1.5), ("exp-2", 2.0)):
        cfg, flat = run_config(epsilon=epsilon, rounds=2, experiment=experiment)
        model, state = initial_model(cfg.resolved(), 10), None
        for server_round in (1, 2):
            reply, context = send(flat, node, model, server_round, state)
            model, state = record_to_model(reply.content["arrays"]), context.state
        reported[experiment] = reply.content["metrics"]["epsilon"]  # the run's own accountant, after its last round
    assert main(["ledger", "--state-dir", str(tmp_path), "--json"]) == 0
    [ledger] = json.loads(capsys.readouterr().out)
    by_id = {e["experiment"]: e for e in ledger["experiments"]}
    assert set(by_id) == {"exp-1", "exp-2"} and all(e["charges"] == 2 for e in by_id.values())
    for experiment, epsilon in reported.items():  # each experiment's charges are what its run reported
        assert by_id[experiment]["epsilon"] == pytest.approx(epsilon, rel=1e-6)
    assert ledger["sum_of_experiments_epsilon"] == pytest.approx(sum(reported.values()), rel=1e-6)
    # Composed (RDP) the two spend less than their sum; no "ε left" (max − spent) is said, as a run
    # fits by composing, not by subtracting.
    assert max(reported.values()) < ledger["spent_epsilon"] < sum(reported.values())
    assert "left_epsilon" not in ledger and "composed" in ledger["admits"]
    assert ledger["steps"] == 2 * 2 * 5  # two rounds of ⌈300 / 60⌉ steps, twice
    assert by_id["exp-1"]["first"] <= by_id["exp-2"]["last"]
    assert main(["ledger", "--state-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"spent           ε = {ledger['spent_epsilon']:.3f} of the owner's 5 over 20 steps" in text
    assert "left" not in text and "composed (RDP) with those spent, stay within ε ≤ 5" in text
    assert "owner's budget  ε ≤ 5, δ ≤ 1e-05" in text and "exp-1: ε = " in text and "exp-2: ε = " in text


def test_skip_bad_files_trains_on_the_readable_images_and_keeps_their_ledger(split, tmp_path, caplog):
    """One unreadable image refuses the data set, naming it to the owner alone (the server is told
    that the data does not fit, no file name); with skip-bad-files it is left out
    and reported, and the data set's fingerprint (its ledger) is that of the readable images:
    the same as the folder without the bad file."""
    import shutil

    folder = tmp_path / "folder"
    shutil.copytree(split / "imagefolder" / "client-0", folder)
    cfg, flat = run_config()
    node = {"partition-id": 0, "data": str(folder), "state-dir": str(tmp_path / "state"), "max-epsilon": 3}
    clean = load_holder_data(folder, builtin_task("fmnist"), tmp_path / "clean-cache")
    (folder / "train" / "3" / "bad.png").write_bytes(b"junk")
    reply, _ = send(flat, node, initial_model(cfg.resolved(), 10), 1)
    assert reply.content["metrics"]["refused"] == 1
    assert reply.content["refusal"]["reason"] == local.DATA_REFUSED
    assert "bad.png: not a readable PNG or JPEG image" in caplog.text  # the owner's log has it in full
    assert "skip-bad-files=true" in caplog.text  # and says what the owner can do
    reply, _ = send(flat, {**node, "skip-bad-files": True}, initial_model(cfg.resolved(), 10), 1)
    assert reply.content["metrics"]["skipped"] == 0 and reply.content["metrics"]["num-examples"] == 300
    assert reply.content["skipped-files"]["count"] == 1
    assert list(reply.content["skipped-files"]["first"]) == ["train/3/bad.png"]
    held = load_holder_data(folder, builtin_task("fmnist"), tmp_path / "skip-cache", skip_bad_files=True)
    assert held.fingerprint == clean.fingerprint and held.skipped == ["train/3/bad.png"]
    assert [p.name for p in (tmp_path / "state").glob("ledger-*.json")] == [f"ledger-{clean.fingerprint}.json"]
