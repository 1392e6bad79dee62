"""ScatterNet features (`--features scatter`, fedsd.data.features): the transform's shape on real
images, its cache (reused only for the same images and settings), the networks it trains, what
is refused, and that DP-SGD on the features learns, central and federated."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fedsd
from fedsd.data import datasets as data_lib, features
from fedsd.privacy import accounting as privacy
from fedsd.settings.run import TrainConfig, validate
from fedsd.errors import ConfigError
from fedsd.models.networks import model_for
from fedsd.cli.main import main
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("settings,says", [
    (dict(dataset="mnist", feature_norm="private"), "--feature-norm: applies to --features scatter, got 'private'"),
    (dict(dataset="mnist", features="scatter", feature_norm="private", feature_norm_noise=0.0),
     "--feature-norm-noise: must be > 0, got 0.0"),
    (dict(dataset="mnist", features="scatter", feature_norm="batch"), "--feature-norm: unknown value 'batch'"),
])
def test_a_private_normalisation_that_does_not_fit_is_refused(settings, says):
    with pytest.raises(ConfigError, match=says):
        validate(TrainConfig(epsilon=3, **settings).resolved(), 1000)


def test_a_federation_refuses_the_private_normalisation_before_any_work():
    from fedsd.settings.federation import FedConfig, client_config

    cfg = TrainConfig(dataset="fmnist", features="scatter", feature_norm="private", epsilon=3)
    with pytest.raises(ConfigError, match="--feature-norm private: central runs only"):
        client_config(cfg, FedConfig())


def test_private_statistics_of_real_features_are_the_data_sets_own_plus_noise_of_the_stated_scale(cache):
    """Fashion-MNIST's features: with almost no noise the released mean and variance are the
    data's (the bounds clip almost nothing); with σ = 8 the noise on each channel's mean has std
    √3 · σ · its order's bound / n, what the accountant is told; one sample, however large, moves
    the sums by at most √3 in units of the bounds."""
    require("fmnist")
    images = data_lib.load("fmnist")
    f = features.scattered(images.normalised(images.x_test[:2000]))
    n = len(f)
    true_mean = f.float().flatten(2).mean(-1).mean(0)
    true_var = f.float().flatten(2).square().mean(-1).mean(0) - true_mean.square()
    mean, var = features.private_statistics(f, 1, 1e-9, torch.Generator().manual_seed(0))
    assert torch.allclose(mean, true_mean, rtol=0.01, atol=1e-5) and torch.allclose(var, true_var, rtol=0.02, atol=1e-6)
    draws = torch.stack([features.private_statistics(f, 1, 8.0, torch.Generator().manual_seed(s))[0] - mean
                         for s in range(20)])
    bounds, _ = features.norm_bounds(1)
    for order in range(3):  # each order's noise at its own scale: 81 channels, 20 draws
        channels = features.SCATTER_ORDER == order
        expected = 3 ** 0.5 * 8.0 * features.MEAN_BOUNDS[order] / n
        assert draws[:, channels].std().item() == pytest.approx(expected, rel=0.35 if order == 0 else 0.15)
    # on a training set of 60,000, the noise on the second-order channels' mean squares is a
    # twentieth of their variance; one bound of 2 for every channel, four times it
    second = true_var[features.SCATTER_ORDER == 2].median()
    assert 3 ** 0.5 * 8.0 * features.SQUARE_BOUNDS[2] / 60_000 < second / 20 and 2 * 8.0 / 60_000 > 4 * second
    # one outlier sample: its clipped contribution is at most √3 in units of the bounds
    outlier = torch.full((1, *f.shape[1:]), 100.0, dtype=torch.float16)
    with_outlier, _ = features.private_statistics(torch.cat([f, outlier]), 1, 1e-9, torch.Generator().manual_seed(0))
    assert (((n + 1) * with_outlier - n * mean) / bounds).norm().item() <= 3 ** 0.5 * 1.001
    # normalised with the data's statistics, each channel has mean 0 and variance 1, less BatchNorm's
    # ε against the channels of tiny variance, as a frozen BatchNorm would give
    z = features.normalise(f, mean, var).float()
    assert z.flatten(2).mean((0, 2)).abs().max() < 0.01
    assert torch.allclose(z.transpose(0, 1).flatten(1).var(1), var / (var + features.NORM_EPS), rtol=0.02)


@pytest.mark.slow
def test_dp_sgd_on_privately_normalised_features_spends_the_runs_epsilon_with_the_normalisation(tmp_path, cache):
    """--feature-norm private: the network has no GroupNorm, the normalisation's two releases
    open the accountant's history, σ is calibrated to what they leave, and it learns."""
    require("fmnist")
    out = tmp_path / "run"
    assert main(["train", "--dataset", "fmnist", "--features", "scatter", "--feature-norm", "private", "--method",
                 "dpsgd", "--subset", "5000", "--epochs", "5", "--batch-size", "500", "--lr", "4", "--epsilon", "3",
                 "--threads", "1", "--quiet", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["privacy"]["prior"] == [[8.0, 1.0, 2]]
    assert 2.99 <= result["epsilon_spent"] <= 3
    free = privacy.plan(3.0, 1e-5, 5000, 500, 5)
    assert result["noise_multiplier"] > free.noise_multiplier  # the normalisation's ε is not DP-SGD's to spend
    assert result["test_accuracy"] >= 0.78, result["test_accuracy"]  # 82.5 % here
    cfg = TrainConfig(dataset="fmnist", features="scatter", feature_norm="private").resolved()
    assert not any(isinstance(m, torch.nn.GroupNorm) for m in model_for(cfg, 10).modules())
    # what it released is usable on raw images: the features made on the fly, normalised by the
    # statistics result.json publishes, give the run's test accuracy
    assert len(result["feature_statistics"]["mean"]) == len(result["feature_statistics"]["variance"]) == 81
    images = data_lib.load("fmnist")
    model = fedsd.load_model(out)
    with torch.no_grad():
        predicted = torch.cat([model(x).argmax(1) for x in images.x_test.split(1000)])
    assert (predicted == images.y_test).float().mean().item() == pytest.approx(result["test_accuracy"], abs=0.002)


@pytest.mark.slow
def test_dp_sgd_on_scatternet_features_learns_fashion_mnist_from_few_samples(tmp_path, cache):
    """5000 Fashion-MNIST images, ε = 3: the linear model on ScatterNet features reaches 78 % (83.5 % here)."""
    require("fmnist")
    out = tmp_path / "run"
    assert main(["train", "--dataset", "fmnist", "--features", "scatter", "--method", "dpsgd", "--subset", "5000",
                 "--epochs", "5", "--batch-size", "500", "--lr", "4", "--epsilon", "3", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["model"] == "scatter-linear" and result["epsilon_spent"] <= 3
    assert result["test_accuracy"] >= 0.78, result["test_accuracy"]
    images = data_lib.load("fmnist")  # released: fedsd.load_model makes the features of raw images itself
    with torch.no_grad():
        predicted = fedsd.load_model(out)(images.x_test[:2000]).argmax(1)
    assert (predicted == images.y_test[:2000]).float().mean().item() >= 0.78


@pytest.mark.slow
def test_each_federated_client_trains_on_the_features_of_its_own_shard(tmp_path):
    require("fmnist")
    proc = subprocess.run([sys.executable, "-m", "fedsd.cli.main", "simulate", "--dataset", "fmnist", "--features",
                           "scatter", "--method", "dpsgd", "--subset", "4000", "--clients", "2", "--rounds", "3",
                           "--batch-size", "400", "--lr", "4", "--epsilon", "3", "--quiet", "--out",
                           str(tmp_path / "fed")], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "FEDSD_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "fed" / "result.json").read_text())
    assert result["config"]["features"] == "scatter" and result["test_accuracy"] >= 0.7, result["test_accuracy"]
    # each client's shard (2000 images) and the server's test split, each scattered once
    assert len(list((tmp_path / "cache" / "features").glob("scatter-*.npy"))) == 3


def test_the_summary_says_what_the_private_normalisation_spent():
    from fedsd.training.summary import run_summary

    result = dict(dataset="cifar10", method="dpsgd", test_accuracy=0.68, wall_seconds=60.0, epsilon_spent=2.995,
                  epsilon_target=3.0, delta=1e-5, noise_multiplier=6.29, privacy=dict(prior=[[8.0, 1.0, 2]]),
                  config=dict(features="scatter", batch_size=8192, lr=4.0, momentum=0.9, epochs=85))
    text = run_summary(result, "/tmp/run")
    assert ("  features       scatter, normalised by released statistics (σ = 8; alone they spend ε 0.69, "
            "composed into the total)") in text
    assert "features" not in run_summary({**result, "privacy": {}}, "/tmp/run")
