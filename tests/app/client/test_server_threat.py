"""A client with its own data against a server it does not trust, through the ClientApp
called in-process with real Flower Messages: the server plays every trick it can with what it
knows (the run config, the code, the initial weights, the replies) and learns no more than the
noise allows; nothing a reply carries is an unnoised function of the records; a request carries
data, never paths or code; and what the client keeps is its owner's alone."""
import json
import os
import pickle
import stat
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsd.app.client import handler as local, owner_checks
from fedsd.app.client.client_app import app
from fedsd.app.client.node_config import NodeConfigError, parse, private_folder
from fedsd.data import datasets as data_lib
from fedsd.data.client_data import builtin_task, normalised
from fedsd.settings.run import TrainConfig
from fedsd.errors import DataError
from fedsd.settings.federation import FedConfig, client_config, to_flat
from fedsd.models.networks import build_model
from fedsd.training.seeds import SEED_CLIENT_RNG, derive_seed
from fedsd.training.loop import initial_model
from fedsd.app.records import model_to_record, record_to_model
from tests.conftest import require
from tests.app.client.test_data_service import wait_for

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
    fed = FedConfig(num_clients=1, rounds=1, local_epochs=local_epochs, client_data="own", experiment_id=experiment)
    return cfg, fed, to_flat(cfg, fed)


def ask(flat, node_config, model, server_round=1, kind="train"):
    context = Context(run_id=1, node_id=11, node_config=node_config, state=RecordDict(), run_config={})
    msg = Message(RecordDict({"arrays": model_to_record(model),
                              "config": ConfigRecord({**flat, "server-round": server_round})}),
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
    """The replay attack against the client as it stands (secret noise, the default) and
    against a client whose owner chose seeded noise: there the same attack recovers the clipped
    sum to float error, so this test can fail."""
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)["student"]
    extra = {} if noise == "secret" else {"randomness": "seeded", "trust-server-with-noise": True}
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
    sim_fed = FedConfig(num_clients=2, rounds=1, experiment_id="sim")
    sim_flat = to_flat(sim_cfg, sim_fed)
    sim_start = initial_model(client_config(sim_cfg, sim_fed), 10)
    replies = [ask(sim_flat, {"partition-id": 0, "state-dir": str(tmp_path / f"sim{k}")}, sim_start) for k in (0, 1)]
    a, b = (record_to_model(r["arrays"])["student"] for r in replies)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_seeded_noise_on_own_data_needs_the_owners_word(own_npz, tmp_path):
    with pytest.raises(NodeConfigError, match="trust-server-with-noise=true"):
        parse(node(own_npz, tmp_path, randomness="seeded"))
    cfg, fed, flat = one_step_run()
    reply = ask(flat, node(own_npz, tmp_path, randomness="seeded"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and not reply.array_records
    assert "can predict this client's noise" in reply["refusal"]["reason"]
    assert not list(tmp_path.glob("ledger-*"))  # refused before anything was read or spent


def test_an_own_data_reply_carries_nothing_unnoised(own_npz, tmp_path):
    """No training loss, and no word on divergence: a huge lr trains, noised, like any other."""
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)
    metrics = ask(flat, node(own_npz, tmp_path / "ok"), start)["metrics"]
    keys = {"num-examples", "partition-id", "noise-multiplier", "sample-rate", "max-epsilon", "max-delta", "skipped",
            "epsilon", "seconds", "steps"}
    assert set(metrics) == keys
    cfg, fed, flat = one_step_run(experiment="diverge", local_epochs=3, lr=1e30)
    reply = ask(flat, node(own_npz, tmp_path / "diverged"), start)
    assert set(reply["metrics"]) == keys and reply["metrics"]["skipped"] == 0 and reply.array_records


def with_and_without_a_seven(own_npz, folder):
    """Two data sets that differ in one record: the first 64 training images with exactly one 7,
    and the same with that 7 replaced by another image of another class."""
    images = data_lib.load("fmnist")
    x, y = images.x_train[:, 0].numpy(), images.y_train.numpy()
    sevens, others = np.flatnonzero(y == 7), np.flatnonzero(y != 7)
    with_seven = np.concatenate([others[:N - 1], sevens[:1]])
    without = np.concatenate([others[:N - 1], others[N - 1:N]])
    paths = []
    for name, rows in (("with", with_seven), ("without", without)):
        path = folder / f"{name}.npz"
        np.savez(path, x_train=x[rows], y_train=y[rows], x_test=x[:200], y_test=y[:200])
        paths.append(path)
    return paths


def test_a_crafted_model_learns_no_unnoised_bit_of_one_record(own_npz, tmp_path):
    """The server crafts a model whose loss is enormous on class 7 alone (its last bias −1e38):
    a stop on divergence would say exactly whether the data holds a 7. The two data sets, with
    and without that one record, give replies of the same keys and status, each with a model."""
    cfg, fed, flat = one_step_run(experiment="crafted")
    start = initial_model(client_config(cfg, fed), 10)
    crafted = {k: v.clone() for k, v in start["student"].items()}
    last_bias = [k for k in crafted if k.endswith("bias")][-1]
    crafted[last_bias][7] = -1e38
    replies = [ask(flat, node(path, tmp_path / path.stem), {"student": crafted})
               for path in with_and_without_a_seven(own_npz, tmp_path)]
    first, second = replies
    assert set(first["metrics"]) == set(second["metrics"]) and set(first) == set(second)
    assert first["metrics"]["skipped"] == second["metrics"]["skipped"] == 0
    assert "diverged" not in first["metrics"] and first.array_records and second.array_records
    for reply in replies:  # finite, and noised: the record's gradient joins the sum as any other
        trained = record_to_model(reply["arrays"])["student"]
        assert all(torch.isfinite(v).all() for k, v in trained.items() if k != last_bias)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bk"])
def test_a_sample_whose_gradient_is_not_finite_joins_the_sum_as_zero(own_npz, mode):
    """The per-sample rule behind it: with secret draws, a sample whose gradient overflows joins
    the clipped sum with a zero gradient, the others are summed as ever, and the noise is the
    noise: the same draws give the same update as the batch whose sample is a zero gradient's.
    And in the same work: as many forward and backward passes with the sample as without (a
    second pass only where a sample overflowed would tell the server so in the reply's time)."""
    import dataclasses

    from fedsd.privacy.accounting import PrivacyPlan
    from fedsd.privacy.secret_random import SecretStream
    from fedsd.training.loop import DPTrainer

    cfg, fed, _ = one_step_run()
    c = dataclasses.replace(client_config(cfg, fed), grad_sample_mode=mode)
    with np.load(own_npz) as z:
        x = normalised(torch.from_numpy(z["x_train"]).unsqueeze(1), builtin_task("fmnist"))
        y = torch.from_numpy(z["y_train"]).long()
    poisoned = x.clone()
    poisoned[0] = 3e38  # its activations overflow: a loss and gradient that are not finite, sample 0's alone
    start = initial_model(c, 10)["student"]
    plan = PrivacyPlan(noise_multiplier=1.0, sample_rate=1.0, planned_steps=1, epsilon=3.0, delta=1e-5,
                       accountant="rdp")
    updates, passes = [], []
    for xs, ys in ((poisoned, y), (x[1:], y[1:])):
        trainer = DPTrainer(c, data_lib.TensorData(xs, ys, x[:8], y[:8], 10), plan)
        trainer.load_student(start)
        trainer.secret = trainer.optimizer.noise_source = SecretStream(b"s" * 32)  # as local_update sets them
        trainer.clipper.zero_nonfinite = True
        calls = []
        trainer.model.register_forward_hook(lambda *_: calls.append(1))
        trainer.train_on_batch(trainer.data.x_train, trainer.data.y_train, trainer.method.epoch_loss(c, 1))
        updates.append(torch.cat([v.flatten() for v in trainer.student_weights().values()]))
        passes.append(len(calls))
    assert torch.isfinite(updates[0]).all() and passes[0] == passes[1] == 1
    assert torch.allclose(updates[0], updates[1], atol=1e-5), (updates[0] - updates[1]).abs().max()


def test_ghost_clipping_is_refused_with_secret_draws(own_npz, tmp_path):
    """Ghost clipping sums the samples inside autograd, where one sample's gradient that is not
    finite poisons the sum: an own-data client refuses it, naming the setting."""
    cfg, fed, flat = one_step_run(grad_sample_mode="ghost")
    reply = ask(flat, node(own_npz, tmp_path / "state"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and "grad-sample-mode" in reply["refusal"]["reason"]
    assert not list((tmp_path / "state").glob("ledger-*"))


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
    assert metrics["num-examples"] == 0 and "smaller than the owner's min-evaluation-samples=500" in why


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
    fed = FedConfig(num_clients=1, rounds=1, client_data="own", experiment_id="big")
    reply = ask(to_flat(cfg, fed), node(tmp_path / "d.npz", tmp_path / "state"),
                {"student": build_model("cifar-cnn", 2).state_dict()})
    assert reply["metrics"]["refused"] == 1 and "image-size" in reply["refusal"]["reason"]
    assert not list((tmp_path / "state").rglob("prepared-*"))  # refused before the data was prepared


def test_refusals_name_no_file_class_label_or_path(tmp_path, caplog):
    """What a refusal tells the server is the owner's fixed reason: never a file's name, a class
    folder's name, a label or a path; the owner's log has the details."""
    from fedsd.cli.main import main

    require("fmnist")
    assert main(["split-data", "--dataset", "fmnist", "--clients", "1", "--subset", "100", "--format", "imagefolder",
                 "--out", str(tmp_path / "parts")]) == 0
    folder = tmp_path / "parts" / "client-0"
    bad = next((folder / "train" / "3").iterdir())
    bad.write_bytes(b"not an image")
    (folder / "train" / "diagnosis-positive").mkdir()  # a class folder the task does not have
    labels = tmp_path / "labels.npz"
    np.savez(labels, x_train=np.zeros((70, 28, 28), np.uint8), y_train=np.full(70, 9))
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)
    custom = {**flat, "dataset": "custom", "classes": "cat,dog", "channels": 1, "image-size": 28, "batch-size": 10}
    for data, request in ((folder, {**flat, "batch-size": 10}), (labels, custom)):
        caplog.clear()
        reply = ask(request, node(data, tmp_path / f"state-{data.name}"), start)
        reason = reply["refusal"]["reason"]
        assert reply["metrics"]["refused"] == 1 and reason == local.DATA_REFUSED
        for secret in (bad.name, "diagnosis-positive", "label 9", "9", str(tmp_path), "/"):
            assert secret not in reason.replace("image-size", "")
        assert bad.name in caplog.text or "label 9" in caplog.text  # the owner is told in full


def test_whether_the_data_fits_a_task_is_told_once_not_once_a_query(own_npz, tmp_path):
    """The first task a node is asked to fit is kept; a run of another task (another list of
    class names, a guess at a folder's name or a label's range) is refused as a setting, before
    a record is read and before anything is charged."""
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)
    state = tmp_path / "state"
    assert ask(flat, node(own_npz, state), start)["metrics"]["skipped"] == 0
    custom = {**flat, "experiment-id": "probe", "dataset": "custom", "classes": "a,b,c,d,e,f,g,h,i,j", "channels": 1,
              "image-size": 28}
    for _ in range(2):
        reply = ask(custom, node(own_npz, state), start)
        assert reply["metrics"]["refused"] == 1 and reply["refusal"]["reason"].startswith("dataset, classes")
    assert len(json.loads(next(state.glob("ledger-*.json")).read_text())["entries"]) == 1


@pytest.mark.parametrize("change, key", [
    ({"clip": float("inf")}, "clip"), ({"lr": float("inf")}, "lr"), ({"momentum": float("nan")}, "momentum"),
    ({"lr": float("nan")}, "lr"), ({"momentum": 1.5}, "momentum"), ({"epsilon": float("inf")}, "epsilon"),
])
def test_settings_a_server_sends_are_finite_and_in_range(own_npz, tmp_path, change, key):
    cfg, fed, flat = one_step_run()
    reply = ask({**flat, **change}, node(own_npz, tmp_path / "state"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and not reply.array_records
    assert key in reply["refusal"]["reason"].split(":")[0]
    assert not list((tmp_path / "state").glob("ledger-*"))  # nothing read, nothing charged


def test_a_model_with_weights_that_are_not_finite_is_refused_before_the_data_is_read(own_npz, tmp_path):
    cfg, fed, flat = one_step_run()
    start = initial_model(client_config(cfg, fed), 10)
    start["student"][next(iter(start["student"]))][0] = float("-inf")
    reply = ask(flat, node(own_npz, tmp_path / "state"), start)
    assert reply["metrics"]["refused"] == 1 and "not finite" in reply["refusal"]["reason"]
    assert not list((tmp_path / "state").rglob("prepared-*")) and not list((tmp_path / "state").glob("ledger-*"))


PLANTED = """
import pathlib
pathlib.Path({marker!r}).write_text("ran as the owner")
def make(num_classes, channels, image_size):
    import torch
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(channels * image_size * image_size, num_classes))
"""


@pytest.mark.parametrize("model", ["unittest.__main__:main", "planted_net_for_the_test:make", "os:system"])
def test_a_model_the_server_names_is_data_never_code(own_npz, tmp_path, monkeypatch, model):
    """A name the server sends is never imported on a node with its own data: not a module that
    ends the process, not one planted in its working directory, not any callable."""
    import sys

    marker = tmp_path / "ran"
    (tmp_path / "planted_net_for_the_test.py").write_text(PLANTED.format(marker=str(marker)))
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    cfg, fed, flat = one_step_run()
    reply = ask({**flat, "model": model}, node(own_npz, tmp_path / "state"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and "allow-model" in reply["refusal"]["reason"]
    assert not marker.exists() and "planted_net_for_the_test" not in sys.modules and sys.path == path_before
    assert not list((tmp_path / "state").glob("ledger-*"))


def test_the_owner_may_name_the_one_factory_a_server_may_ask_for(own_npz, tmp_path, monkeypatch):
    """The owner's node config names a user's network installed on its machine: that one trains."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "owners_net_for_the_test.py").write_text(PLANTED.format(marker=str(tmp_path / "imported")))
    monkeypatch.syspath_prepend(str(site))  # the owner's installation
    cfg, fed, flat = one_step_run()
    name = "owners_net_for_the_test:make"
    c = client_config(cfg, fed)
    start = {"student": build_model(name, 10, seed=0, channels=1, image_size=28).state_dict()}
    reply = ask({**flat, "model": name}, node(own_npz, tmp_path / "state", **{"allow-model": name}), start)
    assert reply["metrics"]["skipped"] == 0 and reply.array_records and c.model != name


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


def test_a_state_folder_others_can_write_to_is_refused(own_npz, tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # group and others may write, no sticky bit: they could swap the ledger
    with pytest.raises(NodeConfigError, match="can be written by other users"):
        private_folder(shared / "state")
    cfg, fed, flat = one_step_run()
    reply = ask(flat, node(own_npz, shared / "state"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and reply["refusal"]["reason"] == owner_checks.STATE_REFUSED
    assert str(tmp_path) not in reply["refusal"]["reason"] and "can be written by other users" in caplog.text
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others cannot rename or remove what is ours in it
    assert private_folder(sticky / "state").is_dir()
    if os.geteuid() == 0:  # a folder of another user's (only root can make one here)
        (tmp_path / "other").mkdir()
        os.chown(tmp_path / "other", 12345, 12345)
        with pytest.raises(NodeConfigError, match="belongs to another user"):
            private_folder(tmp_path / "other" / "state")


def test_an_owners_own_state_folder_others_can_write_is_refused_not_repaired(own_npz, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)  # the owner's own folder, opened to everyone
    cfg, fed, flat = one_step_run()
    reply = ask(flat, node(own_npz, state), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and reply["refusal"]["reason"] == owner_checks.STATE_REFUSED
    assert stat.S_IMODE(state.stat().st_mode) == 0o777 and not list(state.iterdir())  # refused, not chmodded


def test_a_link_on_the_way_to_the_state_folder_is_refused_and_its_target_judged(own_npz, tmp_path):
    """good/link/state: refused, whoever owns the link, with the resolved path to pass instead (a
    link is looked up again at every use, and could be re-pointed between uses); that path,
    open/inner/state with open/ writable by anyone, is refused as anyone could swap open/inner."""
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    (open_to_all / "inner").mkdir(mode=0o700)
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    (good / "link").symlink_to(open_to_all / "inner")
    with pytest.raises(NodeConfigError, match=f"link is a symbolic link; pass the folder's resolved path "
                                              f"\\({open_to_all / 'inner' / 'state'}\\)"):
        private_folder(good / "link" / "state")
    with pytest.raises(NodeConfigError, match="can be written by other users"):
        private_folder(open_to_all / "inner" / "state")
    cfg, fed, flat = one_step_run()
    reply = ask(flat, node(own_npz, good / "link" / "state"), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and not list((open_to_all / "inner").iterdir())


def test_a_planted_link_inside_the_state_folder_is_refused_not_followed(own_npz, tmp_path):
    """state/<experiment> planted as a link to an attacker's folder, holding a generator state of
    a known seed: refused before anything is read from it or written to it."""
    state = private_folder(tmp_path / "state")
    attacker = tmp_path / "attacker"
    attacker.mkdir()
    torch.save({"rng_state": torch.Generator().manual_seed(7).get_state()}, attacker / "client-0.pt")
    (state / "attack").symlink_to(attacker)
    cfg, fed, flat = one_step_run(experiment="attack")
    reply = ask(flat, node(own_npz, state), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1 and reply["refusal"]["reason"] == owner_checks.STATE_REFUSED
    assert sorted(p.name for p in attacker.iterdir()) == ["client-0.pt"]
    assert not list(state.glob("ledger-*"))  # refused before it was charged


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

    from fedsd.data.client_data import _named_fingerprint, load_holder_data
    from fedsd.privacy import lifetime_ledger as ledgers

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


# -- against the owner's real data service ------------------------------------------------------
WIDE_NET = """
import torch
def make(num_classes, channels, image_size):  # 101,770 weights: a reply of 400 kB, more than a socket buffers
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(channels * image_size ** 2, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, num_classes))
"""


@contextmanager
def owner_service(npz, tmp_path, state, name="owner", more="", wait=True, flags=()):
    """The owner's `fedsd data-service` as a real process (secret noise, the default; one network
    of its own, allowed by name; `flags` on its command line): yields (address, log, process) once
    it listens, or at once with wait=False; stopped after."""
    from pathlib import Path

    site = tmp_path / "owners-site"  # the owner's installation: one network of its own, allowed by name
    site.mkdir(exist_ok=True)
    (site / "owners_wide_net.py").write_text(WIDE_NET)
    config = f"partition-id=0 data='{npz}' max-epsilon=inf state-dir='{state}' federated-evaluation=true " \
             f"min-evaluation-samples=10 allow-model='owners_wide_net:make' {more}"
    with data_service_process(config, tmp_path, tmp_path / f"{name}.log",
                              f"{Path(__file__).resolve().parents[3]}:{site}", flags, wait) as running:
        yield running


@contextmanager
def data_service_process(config: str, cwd, log, pythonpath: str, flags=(), wait=True):
    """A real `fedsd data-service` process on node config `config`, its socket in a short /tmp folder
    and its output in `log`, the code on `pythonpath`: yields (address, log, process) once it
    listens, or at once with wait=False; killed after, and its folder removed."""
    import shutil
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="fedsd-service-", dir="/tmp"))  # a short socket path
    address = folder / "service.sock"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "fedsd.cli.main", "data-service", "--socket", str(address),
                                 "--node-config", config, *flags], stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, "PYTHONPATH": pythonpath})
    deadline = time.monotonic() + 120
    while wait and not address.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    try:
        yield address, log, proc
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def service(own_npz, tmp_path):
    """The owner's `fedsd data-service` as a real process: its socket, its state folder, its
    node config (secret noise, the default) and its log (the owner's)."""
    state = tmp_path / "owner-state"
    with owner_service(own_npz, tmp_path, state) as (address, log, proc):
        yield address, state, log, proc


def via_service(address, flat, model, server_round=1, kind="train"):
    from fedsd.app.client import owner_service as data_service

    supernode = {"partition-id": 0, "service": str(address)}
    context = Context(run_id=1, node_id=11, node_config=supernode, state=RecordDict(), run_config={})
    content = RecordDict({"arrays": model_to_record(model),
                          "config": ConfigRecord({**flat, "server-round": server_round})})
    return data_service.ask_service(parse(supernode), kind, content, context)


def candidate_seeds(state_file, cfg) -> set[int]:
    """Where a search over 32- and 64-bit seeds would find the client's generator if it had one:
    the seed of any torch generator state the client keeps (read here from the owner's disk, in
    place of the 2^32 search a server would run on a cluster), every 4- and 8-byte word of any
    key it keeps, the run's own derived seed, and the first few hundred integers."""
    kept = torch.load(state_file, weights_only=True)
    seeds = set(range(256)) | {derive_seed(cfg.seed, SEED_CLIENT_RNG, 0)}
    if "rng_state" in kept:
        generator = torch.Generator()
        generator.set_state(kept["rng_state"])
        seeds.add(generator.initial_seed())
    if "secret/key" in kept:
        key = bytes(kept["secret/key"].tolist())
        seeds |= {int.from_bytes(key[i:i + w], "little") for w in (4, 8) for i in range(0, len(key) - w + 1, w)}
    return seeds | {s & 0xFFFFFFFF for s in seeds}


def replayed_noise(seed: int, net, sigma_c: float, secure: bool) -> torch.Tensor:
    """The noise a client whose generator is seeded with `seed` adds (the Poisson mask drawn
    first; Opacus' draws, plain or secure_mode's throw-away and four-draw sum)."""
    generator = torch.Generator().manual_seed(seed)
    torch.rand(N, generator=generator)
    parts = []
    for p in net.parameters():
        if secure:
            torch.normal(0.0, sigma_c, (1, 1), generator=generator)
            parts.append(sum(torch.normal(0.0, sigma_c, p.shape, generator=generator) for _ in range(4)) / 2)
        else:
            parts.append(torch.normal(0.0, sigma_c, p.shape, generator=generator))
    return torch.cat([t.flatten() for t in parts])


@pytest.mark.slow
def test_a_seed_search_does_not_find_a_real_services_noise(own_npz, service):
    """The search of a server with a cluster, against a real service: every candidate seed's
    noise subtracted from the update leaves an error at the noise's own scale (σC√d), never the
    clipped sum; with the right seed it would be left to float error (about 1e-5)."""
    address, state, _, _ = service
    cfg, fed, flat = one_step_run(experiment="search")
    start = initial_model(client_config(cfg, fed), 10)["student"]
    reply = via_service(address, flat, {"student": start})
    assert reply["metrics"]["skipped"] == 0
    c = client_config(cfg, fed)
    sigma_c = float(reply["metrics"]["noise-multiplier"]) * c.clip
    net = build_model(c.model, 10)
    names = [n for n, _ in net.named_parameters()]
    update = (flat_parameters(start, names) - flat_parameters(record_to_model(reply["arrays"])["student"], names)) \
        * B / c.lr
    truth = clipped_sum(c, own_npz, start, c.clip)
    noise_scale = sigma_c * len(update) ** 0.5
    best = min((update - replayed_noise(seed, net, sigma_c, secure) - truth).norm().item()
               for seed in candidate_seeds(state / "search" / "client-0.pt", c) for secure in (False, True))
    assert best >= 0.5 * noise_scale, (best, noise_scale)


def raw_exchange(address, *frames: bytes, read: bool = True) -> dict | None:
    import socket
    import struct

    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(address))
        sock.settimeout(60)
        for frame in frames:
            sock.sendall(struct.pack("!Q", len(frame)) + frame)
        if not read:
            return None
        size = struct.unpack("!Q", sock.recv(8))[0]
        return json.loads(sock.recv(size))


@pytest.mark.slow
def test_no_message_stops_or_blocks_a_real_service(own_npz, service):
    """Deep JSON, garbage protobuf, an oversized frame, a kind that is not one, and a model that
    would end the process if imported: each refused with a reply, in full in the owner's log,
    and the service goes on. A half-sent frame held open blocks no one: another client is
    answered within a second."""
    import socket
    import struct
    import time

    from fedsd.app.client import owner_service as data_service

    address, state, log, proc = service
    cfg, fed, flat = one_step_run(experiment="robust")
    start = initial_model(client_config(cfg, fed), 10)
    header = json.dumps({"kind": "evaluate", "run_id": 1, "node_id": 11, "node_config": {}}).encode()

    def charges() -> int:
        return sum(len(json.loads(p.read_text())["entries"]) for p in state.glob("ledger-*.json"))

    assert via_service(address, flat, start)["metrics"]["skipped"] == 0 and charges() == 1
    deep = b"[" * 30_000 + b"]" * 30_000  # within the header's size: a parser's recursion would end the process
    assert raw_exchange(address, deep)["status"] == "refused"
    assert raw_exchange(address, header, b"\xff\x00garbage" * 10)["status"] == "refused"
    assert raw_exchange(address, json.dumps({"kind": "shell"}).encode(), b"")["status"] == "refused"
    with socket.socket(socket.AF_UNIX) as big:
        big.connect(str(address))
        big.sendall(struct.pack("!Q", 1 << 40))  # a terabyte announced: refused before any is read
        assert b"refused" in big.recv(4096)
    refused = via_service(address, {**flat, "model": "unittest.__main__:main"}, start)
    assert refused["metrics"]["refused"] == 1 and "allow-model" in refused["refusal"]["reason"]
    assert proc.poll() is None
    assert charges() == 1  # nothing refused was charged
    with socket.socket(socket.AF_UNIX) as stalled:  # half a frame, then nothing
        stalled.connect(str(address))
        stalled.sendall(struct.pack("!Q", 1000) + b"{")
        began = time.monotonic()
        reply = via_service(address, flat, start, kind="evaluate")
        assert time.monotonic() - began < 1.0 and "metrics" in reply
    assert proc.poll() is None
    second = via_service(address, {**flat, "experiment-id": "next"}, start)  # the next legitimate round: charged once
    assert second["metrics"]["skipped"] == 0 and charges() == 2
    # A peer that asks for a reply larger than a socket holds (400 kB) and never reads it holds no one up.
    import threading

    from flwr.common.serde import recorddict_to_proto

    hog_header = json.dumps({"kind": "train", "run_id": 1, "node_id": 11, "node_config": {}}).encode()
    wide_flat = {**flat, "experiment-id": "hog", "model": "owners_wide_net:make", "server-round": 1}
    weights = {"1.weight": torch.zeros(128, 784), "1.bias": torch.zeros(128), "3.weight": torch.zeros(10, 128),
               "3.bias": torch.zeros(10)}  # Flatten, Linear, ReLU, Linear
    hog_records = recorddict_to_proto(RecordDict({"arrays": model_to_record({"student": weights}),
                                                 "config": ConfigRecord(wide_flat)})).SerializeToString()
    hog = socket.socket(socket.AF_UNIX)
    hog.connect(str(address))
    hog.sendall(struct.pack("!Q", len(hog_header)) + hog_header + struct.pack("!Q", len(hog_records)) + hog_records)
    assert wait_for(lambda: (state / "hog" / "client-0-last-reply.pt").exists(), 120)  # trained; its reply unread
    answered = []
    asker = threading.Thread(target=lambda: answered.append(via_service(address, flat, start, kind="evaluate")))
    asker.start()
    asker.join(timeout=10)
    hog.close()
    assert answered and "metrics" in answered[0] and charges() == 3
    wrong = {"student": {"not-a-layer": torch.zeros(3)}}  # a round that fails after it was taken
    with pytest.raises(Exception) as failed:
        via_service(address, {**flat, "experiment-id": "fails"}, wrong)
    said = str(failed.value)
    assert said.endswith(data_service.FAILED) and str(own_npz) not in said and proc.poll() is None
    text = log.read_text()
    assert text.count("refused a message") >= 4 and "nested over" in text and "allow-model" in text


@pytest.mark.slow
def test_cached_native_code_another_user_could_write_is_not_loaded(tmp_path, monkeypatch):
    """The conv kernel's cached library runs as whoever loads it, the data owner included: one
    that another user could have replaced is refused (and the step takes PyTorch's route)."""
    import shutil

    from fedsd.clipping import conv_kernel

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: nothing is built or loaded")
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path / "cache"))
    path = conv_kernel.compiled(load=False)  # built here: ours
    assert conv_kernel.compiled().isa
    path.chmod(0o666)
    with pytest.raises(OSError, match="another user could have written it"):
        conv_kernel.compiled()
    path.chmod(0o755)
    path.parent.chmod(0o777)
    with pytest.raises(OSError, match="can be written by another user"):
        conv_kernel.compiled()
    path.parent.chmod(0o755)
    planted = tmp_path / "elsewhere.so"
    shutil.copy(path, planted)
    path.unlink()
    path.symlink_to(planted)
    with pytest.raises(OSError, match="another user could have written it"):
        conv_kernel.compiled()


def test_a_state_an_earlier_version_kept_goes_on_with_a_new_key(own_npz, tmp_path):
    """A privacy state written before the secret stream (a generator seeded with a 64-bit secret,
    32 bits of which torch keeps) is not trained from: its accounting goes on, its draws from a
    new key, so two machines holding the same old state release different updates."""
    import shutil

    import dataclasses

    cfg, fed, _ = one_step_run(experiment="old")
    fed = dataclasses.replace(fed, rounds=2)
    flat2 = to_flat(cfg, fed)
    start = initial_model(client_config(cfg, fed), 10)
    first = ask(flat2, node(own_npz, tmp_path / "a"), start)
    assert first["metrics"]["skipped"] == 0
    state_file = tmp_path / "a" / "old" / "client-0.pt"
    kept = torch.load(state_file, weights_only=True)
    old = {k: v for k, v in kept.items() if not k.startswith("secret/")}
    old["rng_state"] = torch.Generator().manual_seed(7).get_state()
    torch.save(old, state_file)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # to a second machine: its owner's record is its own
    machine = {"a": {}, "b": {"record-dir": str(tmp_path / "b-machine-records")}}
    replies = [ask(flat2, node(own_npz, tmp_path / m, **machine[m]), record_to_model(first["arrays"]), server_round=2)
               for m in "ab"]
    a, b = (record_to_model(r["arrays"])["student"] for r in replies)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    for m in "ab":  # secret draws from now on, and no key on the disk (each call draws its own)
        kept = torch.load(tmp_path / m / "old" / "client-0.pt", weights_only=True)
        assert kept["secret"] == 1 and not any(k.startswith("secret/") for k in kept) and "rng_state" not in kept


GROUPNORM_NET = """
import torch
def make(num_classes, channels, image_size):  # GroupNorm with weights: no book-keeping rule for it
    return torch.nn.Sequential(torch.nn.Conv2d(channels, 4, 3), torch.nn.GroupNorm(2, 4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * (image_size - 2) ** 2, num_classes))
"""


def test_an_own_data_clients_route_can_keep_a_sample_out_of_the_sum(own_npz, tmp_path, monkeypatch):
    """Where book-keeping cannot take a network, the rule's first other route is ghost clipping,
    which cannot train with secret draws: an own-data client takes the next one instead."""
    from fedsd.clipping import routes

    site = tmp_path / "site"
    site.mkdir()
    (site / "owners_groupnorm_net.py").write_text(GROUPNORM_NET)
    monkeypatch.syspath_prepend(str(site))
    name = "owners_groupnorm_net:make"
    cfg, fed, flat = one_step_run(model=name)
    c = client_config(cfg, fed)
    assert routes.rule(c, 10, (1, 28, 28), torch.device("cpu")).mode == "ghost"  # the rule, unguarded
    start = {"student": build_model(name, 10, seed=0, channels=1, image_size=28).state_dict()}
    reply = ask({**flat, "model": name}, node(own_npz, tmp_path / "state", **{"allow-model": name}), start)
    assert reply["metrics"]["skipped"] == 0 and reply.array_records
    assert [t.clipper.mode for t in local._TRAINERS.values()] == ["ew"]
