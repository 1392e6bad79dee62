"""Bring your own network (fedsd.models.networks): a torchvision model by name or a user's factory,
made private-trainable by Opacus' ModuleValidator (the fix said once), refused with the path,
the layer or both shapes named; and memory bounded by physical batches (fedsd.training.physical_batches)."""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fedsd.models.networks import build_model, check_fits_task
from fedsd.training.physical_batches import sample_bytes
from fedsd.cli.main import main
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]

# A user's own network, as a team would write it: BatchNorm (Opacus replaces it), its own layer sizes.
USER_NET = '''
from torch import nn


def make(num_classes, channels, image_size):
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (image_size // 4) ** 2, num_classes))


def wrong_output(num_classes, channels, image_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size ** 2, num_classes + 1))


def wrong_input(num_classes, channels, image_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))


def not_a_module(num_classes, channels, image_size):
    return "a network"


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The user's module in their working directory, named for this test (a fresh import)."""
    name = f"user_net_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(USER_NET)
    monkeypatch.chdir(tmp_path)
    return name


@pytest.mark.slow
def test_a_users_factory_with_batchnorm_trains_centrally_fixed_and_said_once(user_module, tmp_path, capsys):
    require("fmnist")
    out = tmp_path / "run"
    assert main(["train", "--dataset", "fmnist", "--model", f"{user_module}:make", "--subset", "3000", "--epochs", "4",
                 "--batch-size", "300", "--lr", "2", "--epsilon", "8", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("ModuleValidator replaced 2 layer(s) (BatchNorm2d → GroupNorm: 1, 5)") == 1, err
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["model"] == f"{user_module}:make" and result["epsilon_spent"] <= 8
    assert result["test_accuracy"] >= 0.65, result["test_accuracy"]
    net = build_model(f"{user_module}:make", 10, channels=1, image_size=28)  # the released weights load into it
    net.load_state_dict(torch.load(out / "model.pt", weights_only=True))


@pytest.mark.slow
def test_a_users_factory_trains_in_a_simulated_federation(user_module, tmp_path):
    """Ray's workers import the user's module from the directory the run was started in."""
    require("fmnist")
    proc = subprocess.run([sys.executable, "-m", "fedsd.cli.main", "simulate", "--dataset", "fmnist",
                           "--model", f"{user_module}:make", "--subset", "2000", "--clients", "2", "--rounds", "2",
                           "--batch-size", "200", "--lr", "2", "--epsilon", "8", "--quiet",
                           "--out", str(tmp_path / "fed")],
                          cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "fed" / "result.json").read_text())
    assert result["num_clients"] == 2 and result["test_accuracy"] >= 0.5, result["test_accuracy"]


@pytest.mark.parametrize("attribute,says", [
    ("nowhere", "has no 'nowhere'"),
    ("NOT_CALLABLE", "is not callable"),
    ("not_a_module", "returned str, not a torch.nn.Module"),
    ("wrong_output", "returns (1, 11); expected logits of shape (1, 10)"),
    ("wrong_input", "does not take the task's input (1, 1, 28, 28)"),
])
def test_a_factory_that_does_not_fit_is_refused_with_the_path_named(user_module, tmp_path, capsys, attribute, says):
    require("fmnist")
    assert main(["train", "--dataset", "fmnist", "--model", f"{user_module}:{attribute}", "--epsilon", "3",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--model {user_module}:{attribute}" in err and says in err, err
    assert not (tmp_path / "run").exists()  # refused before any work


@pytest.mark.parametrize("model,says", [
    ("no_such_module_anywhere:make", "module 'no_such_module_anywhere' does not import"),
    ("torchvision:resnet1000", "torchvision has no classification model 'resnet1000'"),
    ("two words", "unknown model 'two words'; give mnist-cnn, cifar-cnn, scatter-linear"),
])
def test_an_unknown_model_is_refused(tmp_path, capsys, model, says):
    require("fmnist")
    assert main(["train", "--dataset", "fmnist", "--model", model, "--epsilon", "3", "--out", str(tmp_path / "r")]) == 2
    assert says in capsys.readouterr().err


def test_options_that_do_not_apply_to_the_network_are_refused(tmp_path, capsys):
    require("fmnist")
    assert main(["train", "--dataset", "fmnist", "--model", "torchvision:resnet18", "--activation", "tanh",
                 "--epsilon", "3", "--out", str(tmp_path / "r")]) == 2
    assert "--activation tanh: applies to the papers' networks" in capsys.readouterr().err
    # book-keeping has no rule for GroupNorm: forced, it is refused before any work (auto leaves it out)
    assert main(["train", "--dataset", "fmnist", "--model", "torchvision:resnet18", "--grad-sample-mode", "bk",
                 "--epsilon", "3", "--out", str(tmp_path / "r")]) == 2
    assert "no book-keeping rule for GroupNorm" in capsys.readouterr().err


def test_a_torchvision_model_is_built_for_the_tasks_channels_and_classes():
    net = build_model("torchvision:resnet18", 7, seed=0, channels=1, image_size=28)
    assert net.conv1.in_channels == 1 and net.fc.out_features == 7
    assert not any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    assert not any(getattr(m, "inplace", False) for m in net.modules())  # Opacus' hooks cannot follow in-place ops
    check_fits_task(net, "torchvision:resnet18", 7, (1, 28, 28))
    again = build_model("torchvision:resnet18", 7, seed=0, channels=1, image_size=28)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), again.state_dict().values()))


def test_the_papers_networks_fit_their_whole_batches():
    """The memory estimate splits only what must be split: the papers' CNNs take a few hundred kB
    a sample (their batches of 1000–1600 at once), resnet18 tens of MB."""
    assert sample_bytes(build_model("mnist-cnn"), (1, 28, 28)) < 1e6
    assert sample_bytes(build_model("cifar-cnn"), (3, 32, 32)) < 4e6
    assert sample_bytes(build_model("torchvision:resnet18", 10, channels=3, image_size=32), (3, 32, 32)) > 40e6


@pytest.mark.slow
def test_resnet18_trains_privately_on_cifar10_in_bounded_memory(tmp_path):
    """The issue's command: resnet18 at B = 1000 would need about 44 GB of per-sample gradients at
    once; in physical batches it stays under 8 GB, with the BatchNorm → GroupNorm fix reported.
    Where CIFAR-10 is not on this machine, on a CIFAR-10-shaped set the test makes: the memory is
    the point, not the pixels."""
    from fedsd.data import datasets as data_lib
    from tests.conftest import write_cifar_shaped

    stand_in = {} if data_lib.locate("cifar10") else \
        {"FEDSD_DATA_DIR": str(write_cifar_shaped(tmp_path / "data", n_train=2500, n_test=500))}
    env = {**os.environ, **stand_in}
    proc = subprocess.run([sys.executable, "-m", "fedsd.cli.main", "train", "--model", "torchvision:resnet18",
                           "--dataset", "cifar10", "--epochs", "1", "--subset", "2000", "--epsilon", "3",
                           "--threads", "1", "--quiet", "--out", str(tmp_path / "r18")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert peak_bytes < 8e9, peak_bytes
    assert proc.stderr.count("replaced 20 layer(s) (BatchNorm2d → GroupNorm") == 1
    result = json.loads((tmp_path / "r18" / "result.json").read_text())
    assert result["config"]["batch_size"] == 1000 and result["physical_batch_size"] < 1000
    assert result["epsilon_spent"] <= 3 and result["steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpsgd", "dp3sd", "dpdsd", "dpema", "dpkd"])
def test_every_method_trains_a_users_network(user_module, tmp_path, method):
    """Each method's extra weights (the teacher, the EMA, DPKD's fresh student) are copies of the
    user's network, built by its factory: two epochs (DPKD: one of each stage) learn."""
    require("fmnist")
    out = tmp_path / "run"
    assert main(["train", "--dataset", "fmnist", "--model", f"{user_module}:make", "--method", method, "--subset",
                 "2000", "--epochs", "2", "--batch-size", "200", "--lr", "2", "--epsilon", "8", "--threads", "1",
                 "--quiet", "--out", str(out), *(["--dpkd-teacher-epochs", "1"] if method == "dpkd" else [])]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["method"] == method and result["test_accuracy"] > 0.3, result["test_accuracy"]


def test_a_residual_network_is_traced_so_that_opacus_hooks_follow_it():
    """resnet's `out += identity` on a hooked layer's output is refused by autograd under Opacus'
    hooks; the network fedsd builds is the same function, traced, which the hooks follow."""
    import torchvision
    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator

    net = build_model("torchvision:resnet18", 10, seed=0, channels=3, image_size=32)
    plain = ModuleValidator.fix(torchvision.models.resnet18(num_classes=10))
    plain.load_state_dict(net.state_dict())  # the same weights under the same names
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(net.eval()(x), plain.eval()(x), atol=1e-5)
    net.train(), plain.train()
    with pytest.raises(RuntimeError, match="modified inplace"):
        GradSampleModule(plain)(x)
    hooked = GradSampleModule(net, loss_reduction="sum")
    hooked(x).sum().backward()
    assert all(p.grad_sample.shape[0] == 3 for p in net.parameters() if p.requires_grad)


class _BranchesOnTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 3), nn.Linear(4 * 26 * 26, 10)

    def forward(self, x):
        out = self.conv(x)
        out += 1.0 if self.training else 0.0  # in place on a hooked output, and unlike in evaluation
        return self.fc(out.flatten(1))


def test_a_network_whose_trace_would_differ_in_evaluation_is_left_as_it_is():
    from fedsd.models.networks import followable_by_hooks

    net = _BranchesOnTraining()
    assert followable_by_hooks(net, "branches", (1, 28, 28)) is net
    assert followable_by_hooks(nn.Sequential(nn.Conv2d(1, 2, 3)), "plain", (1, 28, 28)).__class__ is nn.Sequential
