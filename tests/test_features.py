"""ScatterNet features (`--features scatter`, fedsd.features): the transform's shape on real
images, its cache (reused only for the same images and settings), the networks it trains, what
is refused, and that DP-SGD on the features learns, central and federated."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedsd import data as data_lib, features
from fedsd.config import TrainConfig, validate
from fedsd.errors import ConfigError
from fedsd.models import model_for
from simulations.cli import main
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "features"


def test_scattering_of_real_images_is_cached_for_those_images_only(cache, monkeypatch):
    require("fmnist")
    images = data_lib.load("fmnist")
    x = images.normalised(images.x_test[:300])
    out = features.scattered(x)
    assert out.shape == (300, 81, 7, 7) and out.dtype == torch.float16
    # the zeroth-order channel is the image's local average (a Gaussian low-pass): brighter
    # garments, larger values; the averaged wavelet moduli are non-negative (to the low-pass
    # filter's ringing)
    assert out[:, 1:].min() > -1e-2 and out[:, 1:].float().mean() > 0.01
    assert torch.corrcoef(torch.stack([out[:, 0].float().mean((1, 2)), x.mean((1, 2, 3))]))[0, 1] > 0.9
    assert len(list(cache.glob("*.npy"))) == 1

    def no_transform(*args, **kwargs):
        raise AssertionError("computed again")
    monkeypatch.setattr(features, "scattering_class", no_transform)
    assert torch.equal(features.scattered(x), out)  # the same images: read back
    changed = x.clone()
    changed[0, 0, 0, 0] += 1
    with pytest.raises(AssertionError, match="computed again"):  # one pixel changed: never reused
        features.scattered(changed)


def test_the_feature_networks_take_the_features_of_every_data_set():
    for dataset, shape in (("mnist", (81, 7, 7)), ("cifar10", (243, 8, 8))):
        for model in ("scatter-linear", "scatter-cnn"):
            cfg = TrainConfig(dataset=dataset, features="scatter", model=model).resolved()
            net = model_for(cfg, 10)
            assert net(torch.zeros(2, *shape, dtype=torch.float16)).shape == (2, 10)
    assert TrainConfig(dataset="mnist", features="scatter").resolved().model == "scatter-linear"
    assert TrainConfig(dataset="cifar10", features="scatter").resolved().model == "scatter-cnn"


@pytest.mark.parametrize("settings,says", [
    (dict(dataset="mnist", features="scatter", model="mnist-cnn"), "--features: scatter trains scatter-linear or"),
    (dict(dataset="mnist", model="scatter-linear"), "--features: scatter trains scatter-linear or scatter-cnn"),
    (dict(dataset="custom", features="scatter", classes="a,b", channels=1, image_size=12),
     "--features scatter: needs images of at least 2^J · 4 = 16 pixels a side (J = 2), got 12"),
])
def test_features_that_do_not_fit_are_refused(settings, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)").replace("^", r"\^")):
        validate(TrainConfig(epsilon=3, **settings).resolved(), 1000)


@pytest.mark.slow
def test_dp_sgd_on_scatternet_features_learns_mnist_from_few_samples(tmp_path, cache):
    """5000 MNIST images, ε = 3: the linear model on ScatterNet features reaches 93 % (95.8 % here)."""
    require("mnist")
    out = tmp_path / "run"
    assert main(["train", "--dataset", "mnist", "--features", "scatter", "--method", "dpsgd", "--subset", "5000",
                 "--epochs", "5", "--batch-size", "500", "--lr", "4", "--epsilon", "3", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["model"] == "scatter-linear" and result["epsilon_spent"] <= 3
    assert result["test_accuracy"] >= 0.93, result["test_accuracy"]


@pytest.mark.slow
def test_each_federated_client_trains_on_the_features_of_its_own_shard(tmp_path):
    require("fmnist")
    proc = subprocess.run([sys.executable, "-m", "simulations.cli", "simulate", "--dataset", "fmnist", "--features",
                           "scatter", "--method", "dpsgd", "--subset", "4000", "--clients", "2", "--rounds", "3",
                           "--batch-size", "400", "--lr", "4", "--epsilon", "3", "--quiet", "--out",
                           str(tmp_path / "fed")], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "FEDSD_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "fed" / "result.json").read_text())
    assert result["config"]["features"] == "scatter" and result["test_accuracy"] >= 0.7, result["test_accuracy"]
    # each client's shard (2000 images) and the server's test split, each scattered once
    assert len(list((tmp_path / "cache" / "features").glob("scatter-*.npy"))) == 3
