"""A client with its own data against a server it does not trust (issue 45), through the ClientApp
called in-process with real Flower Messages: the server plays every trick it can with what it
knows (the run config, the code, the initial weights, the replies) and learns no more than the
noise allows; nothing a reply carries is an unnoised function of the records; a request carries
data, never paths or code; and what the client keeps is its owner's alone."""
import json
import os
import pickle
import stat

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from clients.app import app
from clients.node_config import NodeConfigError, parse, private_folder
from fedsd import data as data_lib
from fedsd.client_data import builtin_task, normalised
from fedsd.config import TrainConfig
from fedsd.errors import DataError
from fedsd.fed_settings import FedOptions, client_config, to_flat
from fedsd.models import build_model
from fedsd.seeds import SEED_CLIENT_RNG, derive_seed
from fedsd.training import initial_model
from task.records import model_to_record, record_to_model
from tests.conftest import require

pytestmark = pytest.mark.usefixtures("flower_task")
N = B = 64  # one step of the whole data set: the batch the server would have to guess is known to it


@pytest.fixture(scope="module")
def own_npz(tmp_path_factory):
    """A client's own data: 64 real Fashion-MNIST training images (and 200 test images)."""
    require("fmnist")
    images = data_lib.load("fmnist")
    path = tmp_path_factory.mktemp("own") / "data.npz"
    np.savez(path, x_train=images.x_train[:N, 0].numpy(), y_train=images.y_train[:N].numpy(),
             x_test=images.x_test[:200, 0].numpy(), y_test=images.y_test[:200].numpy())
    return path


def one_step_run(experiment="attack", local_epochs=1, **train):
    cfg = TrainConfig(**{**dict(dataset="fmnist", method="dpsgd", epsilon=3.0, batch_size=B, lr=1.0, momentum=0.0,
                                seed=1, threads=1), **train})
    fed = FedOptions(num_clients=1, rounds=1, local_epochs=local_epochs, client_data="own", experiment_id=experiment)
    return cfg, fed, to_flat(cfg, fed)


def ask(flat, node_config, model, server_round=1, kind="train"):
    context = Context(run_id=1, node_id=11, node_config=node_config, state=RecordDict(), run_config={})
    msg = Message(RecordDict({"arrays": model_to_record(model), "config": ConfigRecord({**flat, "server-round": server_round})}),
                  dst_node_id=11, message_type=kind)
    return app(msg, context).content


def node(npz, state, **more):
    return {"partition-id": 0, "data": str(npz), "max-epsilon": float("inf"), "state-dir": str(state), **more}


def flat_parameters(weights: dict, names) -> torch.Tensor:
    return torch.cat([weights[n].flatten() for n in names])


def clipped_sum(cfg, npz, start, clip: float) -> torch.Tensor:
    """What the server must not learn: the sum of the 64 per-sample gradients, each clipped to C."""
    task = builtin_task("fmnist")
    with np.load(npz) as z:
        x = normalised(torch.from_numpy(z["x_train"]).unsqueeze(1), task)
        y = torch.from_numpy(z["y_train"]).long()
    net = build_model(cfg.model, 10)
    net.load_state_dict(start)
    total = None
    for i in range(len(y)):
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(x[i:i + 1]), y[i:i + 1]).backward()
        g = torch.cat([p.grad.flatten() for p in net.parameters()])
        g = g * min(1.0, clip / (g.norm().item() + 1e-6))
        total = g if total is None else total + g
    return total


def servers_estimate(cfg, fed, reply, start) -> tuple[torch.Tensor, float, int]:
    """The malicious server's attack: replay the client's generator from the run's seed and the
    client's number (what it knows), subtract the noise it predicts from the update, and call
    the rest the clipped sum. Returns (estimate, σC, d)."""
    c = client_config(cfg, fed)
    metrics = reply["metrics"]
    sigma, q = float(metrics["noise-multiplier"]), float(metrics["sample-rate"])
    net = build_model(c.model, 10)
    names = [n for n, _ in net.named_parameters()]
    trained = record_to_model(reply["arrays"])["student"]
    update = (flat_parameters(start, names) - flat_parameters(trained, names)) * B / c.lr  # = clipped sum + noise
    generator = torch.Generator().manual_seed(derive_seed(c.seed, SEED_CLIENT_RNG, 0))
    torch.rand(N, generator=generator) < q  # the Poisson mask, drawn first (q = 1: every sample)
    noise = torch.cat([torch.normal(0.0, sigma * c.clip, p.shape, generator=generator).flatten()
                       for p in net.parameters()])
    return update - noise, sigma * c.clip, len(update)


@pytest.mark.parametrize("noise", ["secret", "seeded"])
def test_a_malicious_server_cannot_remove_an_own_data_clients_noise(own_npz, tmp_path, noise):
    """The attack of issue 45 against the client as it stands (secret noise, the default) and
    against a client whose owner chose seeded noise: there the same attack recovers the clipped
    sum to float error, so this test can fail."""
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)["student"]
    extra = {} if noise == "secret" else {"noise": "seeded", "trust-server-with-noise": True}
    reply = ask(flat, node(own_npz, tmp_path, **extra), {"student": start})
    assert reply["metrics"]["skipped"] == 0 and reply["metrics"]["steps"] == 1
    estimate, sigma_c, d = servers_estimate(cfg, fed, reply, start)
    error = (estimate - clipped_sum(client_config(cfg, fed), own_npz, start, sigma_c / float(
        reply["metrics"]["noise-multiplier"]))).norm().item()
    noise_scale = sigma_c * d ** 0.5
    if noise == "secret":
        assert error >= 0.5 * noise_scale  # the noise is all there: ≈ √2·σC√d, two independent draws
    else:
        assert error < 1e-3 * noise_scale  # recovered: the unnoised sum of clipped gradients


def test_two_deployments_differ_and_two_simulations_are_identical(own_npz, tmp_path):
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)
    first = ask(flat, node(own_npz, tmp_path / "a"), start)
    second = ask(flat, node(own_npz, tmp_path / "b"), start)
    a, b = (record_to_model(r["arrays"])["student"] for r in (first, second))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # same data, settings and seed: other noise
    # A simulation: a shard of a built-in data set, seeded from the run's seed, bit for bit.
    sim_cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3.0, batch_size=64, subset=256, seed=1, threads=1)
    sim_fed = FedOptions(num_clients=2, rounds=1, experiment_id="sim")
    sim_flat = to_flat(sim_cfg, sim_fed)
    sim_start = initial_model(client_config(sim_cfg, sim_fed), 10)
    replies = [ask(sim_flat, {"partition-id": 0, "state-dir": str(tmp_path / f"sim{k}")}, sim_start) for k in (0, 1)]
    a, b = (record_to_model(r["arrays"])["student"] for r in replies)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_seeded_noise_on_own_data_needs_the_owners_word(own_npz, tmp_path):
    with pytest.raises(NodeConfigError, match="trust-server-with-noise=true"):
        parse(node(own_npz, tmp_path, noise="seeded"))
    cfg, fed, flat = one_step_run()
    reply = ask(flat, node(own_npz, tmp_path, noise="seeded"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and not reply.array_records
    assert "can predict this client's noise" in reply["refusal"]["reason"]
    assert not list(tmp_path.glob("ledger-*"))  # refused before anything was read or spent


def test_an_own_data_reply_carries_nothing_unnoised(own_npz, tmp_path):
    """No training loss, and a divergence says that it diverged, not at what loss."""
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)
    metrics = ask(flat, node(own_npz, tmp_path / "ok"), start)["metrics"]
    assert set(metrics) == {"num-examples", "partition-id", "noise-multiplier", "sample-rate", "max-epsilon",
                            "max-delta", "skipped", "epsilon", "seconds", "steps"}
    cfg, fed, flat = one_step_run(experiment="diverge", local_epochs=3, lr=1e30)
    reply = ask(flat, node(own_npz, tmp_path / "diverged"), start)
    assert reply["metrics"]["diverged"] == 1
    reason = reply["divergence"]["reason"]
    assert reason.startswith("training diverged") and not any(ch.isdigit() for ch in reason)


def evaluate(flat, node_config, model):
    reply = ask(flat, node_config, model, kind="evaluate")
    return reply["metrics"], (reply["refusal"]["reason"] if "refusal" in reply.config_records else None)


def test_federated_evaluation_of_own_data_is_the_owners_once_and_only_of_the_trained_model(own_npz, tmp_path):
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)
    default = node(own_npz, tmp_path / "default")
    ask(flat, default, start)
    metrics, why = evaluate(flat, default, start)
    assert metrics["num-examples"] == 0 and "has not allowed federated evaluation" in why
    allowed = node(own_npz, tmp_path / "allowed", **{"federated-evaluation": True})
    trained = record_to_model(ask(flat, allowed, start)["arrays"])
    bias_only = {"student": {k: torch.zeros_like(v) for k, v in start["student"].items()}}
    metrics, why = evaluate(flat, allowed, bias_only)  # a model of the server's choosing, not trained from
    assert metrics["num-examples"] == 0 and why == "it evaluates only the model it last received for training"
    metrics, why = evaluate(flat, allowed, trained)
    assert metrics["num-examples"] == 0 and why is not None
    metrics, why = evaluate(flat, allowed, start)
    assert why is None and metrics["num-examples"] == 200 and 0 <= metrics["test-accuracy"] <= 1
    metrics, why = evaluate(flat, allowed, start)  # again, the same round
    assert metrics["num-examples"] == 0 and why == "it has already evaluated the model of round 1"
    few = node(own_npz, tmp_path / "few", **{"federated-evaluation": True, "min-evaluation-samples": 500})
    ask(flat, few, start)
    metrics, why = evaluate(flat, few, start)
    assert metrics["num-examples"] == 0 and "fewer than the owner's min-evaluation-samples=500" in why


@pytest.mark.parametrize("change, key", [
    ({"client-data": "partition", "data-dir": "/srv/planted"}, "client-data=partition"),
    ({"experiment-id": "../../etc"}, "experiment-id"),
    ({"experiment-id": "/tmp/elsewhere"}, "experiment-id"),
])
def test_a_request_carries_data_never_paths(own_npz, tmp_path, change, key):
    cfg, fed, flat = one_step_run()
    reply = ask({**flat, **change}, node(own_npz, tmp_path / "state"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and key in reply["refusal"]["reason"]
    assert not list((tmp_path / "state").rglob("*.pt")) and not (tmp_path / "etc").exists()


def test_sizes_a_server_asks_for_are_bounded(tmp_path):
    x = np.zeros((20, 8, 8, 3), np.uint8)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=np.arange(20) % 2)
    cfg = TrainConfig(dataset="custom", classes="a,b", channels=3, image_size=100_000, method="dpsgd", epsilon=3.0,
                      batch_size=10)
    fed = FedOptions(num_clients=1, rounds=1, client_data="own", experiment_id="big")
    reply = ask(to_flat(cfg, fed), node(tmp_path / "d.npz", tmp_path / "state"),
                {"student": build_model("cifar-cnn", 2).state_dict()})
    assert reply["metrics"]["refused"] == 1 and "image-size" in reply["refusal"]["reason"]
    assert not list((tmp_path / "state").rglob("prepared-*"))  # refused before the data was prepared


def test_refusals_name_files_relative_to_the_data_folder(tmp_path):
    from simulations.cli import main

    require("fmnist")
    assert main(["split-data", "--dataset", "fmnist", "--clients", "1", "--subset", "100", "--format", "imagefolder",
                 "--out", str(tmp_path / "parts")]) == 0
    folder = tmp_path / "parts" / "client-0"
    bad = next((folder / "train" / "3").iterdir())
    bad.write_bytes(b"not an image")
    cfg, fed, flat = one_step_run()
    reply = ask({**flat, "batch-size": 10}, node(folder, tmp_path / "state"), initial_model(client_config(cfg, fed), 10))
    reason = reply["refusal"]["reason"]
    assert f"data=train/3/{bad.name}: not a readable" in reason and str(tmp_path) not in reason


def modes_under(root):
    return {p: stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_what_a_client_keeps_is_its_owners_alone(own_npz, tmp_path):
    old = os.umask(0o022)  # a usual login umask: the client must not depend on it
    try:
        cfg, fed, flat = one_step_run()
        state = tmp_path / "state"
        ask(flat, node(own_npz, state), initial_model(client_config(cfg, fed), 10))
    finally:
        assert os.umask(old) == 0o022  # and the process's own umask is back after the message
    modes = modes_under(state)
    assert any(p.name.startswith("prepared-") for p in modes) and any(p.name.startswith("ledger-") for p in modes)
    assert all(mode & 0o077 == 0 for mode in modes.values()), {str(p): oct(m) for p, m in modes.items() if m & 0o077}


def test_a_state_folder_others_can_write_to_is_refused(own_npz, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # group and others may write, no sticky bit: they could swap the ledger
    with pytest.raises(NodeConfigError, match="can be written by other users"):
        private_folder(shared / "state")
    cfg, fed, flat = one_step_run()
    reply = ask(flat, node(own_npz, shared / "state"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and "can be written by other users" in reply["refusal"]["reason"]
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others cannot rename or remove what is ours in it
    assert private_folder(sticky / "state").is_dir()
    if os.geteuid() == 0:  # a folder of another user's (only root can make one here)
        (tmp_path / "other").mkdir()
        os.chown(tmp_path / "other", 12345, 12345)
        with pytest.raises(NodeConfigError, match="belongs to another user"):
            private_folder(tmp_path / "other" / "state")


def test_a_state_folder_is_made_closed_with_every_folder_on_the_way(tmp_path):
    deep = private_folder(tmp_path / "a" / "b" / "state")
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in (deep, deep.parent, deep.parent.parent))


def test_a_relative_state_dir_is_one_absolute_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse({"partition-id": 0, "state-dir": "state"}).state_root == tmp_path / "state"


def test_a_planted_cifar_pickle_is_refused_not_run(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps(Planted()))
    with pytest.raises(DataError, match="posix.system is not part of a data set"):
        data_lib._load_cifar(folder)
    assert not (tmp_path / "ran").exists()


def test_renaming_files_keeps_the_data_sets_ledger(own_npz, tmp_path):
    """The ledger's key is the data's content: a renamed image or .npz is the same data set, and a
    ledger an older version kept under a name-dependent key is taken over, not started again."""
    import shutil

    from fedsd.client_data import _named_fingerprint, load_holder_data
    from fedsd import ledger as ledgers

    task = builtin_task("fmnist")
    moved = tmp_path / "renamed.npz"
    shutil.copy(own_npz, moved)
    assert (load_holder_data(moved, task, tmp_path / "c1").fingerprint
            == load_holder_data(own_npz, task, tmp_path / "c2").fingerprint)
    folder = tmp_path / "folder" / "train" / "3"
    folder.mkdir(parents=True)
    import torchvision.io as tio

    for i in range(3):
        tio.write_png(torch.full((1, 28, 28), 40 * i, dtype=torch.uint8), str(folder / f"{i}.png"))
    before = load_holder_data(tmp_path / "folder", task, tmp_path / "c3").fingerprint
    (folder / "0.png").rename(folder / "renamed.png")
    after = load_holder_data(tmp_path / "folder", task, tmp_path / "c4")
    assert after.fingerprint == before
    # a ledger written under the old, name-dependent key moves to the content's key
    state = tmp_path / "state"
    state.mkdir()
    old = _named_fingerprint(own_npz, [own_npz])
    ledgers.ledger_path(state, old).write_text(json.dumps({"entries": [1]}))
    held = load_holder_data(own_npz, task, tmp_path / "c5")
    ledgers.adopt(state, held.named_fingerprint, held.fingerprint)
    assert json.loads(ledgers.ledger_path(state, held.fingerprint).read_text()) == {"entries": [1]}
    assert not ledgers.ledger_path(state, old).exists()
