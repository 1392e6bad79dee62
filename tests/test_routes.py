"""--grad-sample-mode auto: the clipping route measured on this machine, once, and cached; every
run and process on the machine then takes the same one. Every way book-keeping can take a conv
layer gives the same clipped sum."""
import json

import pytest
import torch

from fedsd import routes
from fedsd.bookkeeping import CONV_ROUTES
from fedsd.config import TrainConfig
from fedsd.data import TensorData
from fedsd.privacy import plan
from fedsd.training import DPTrainer
from tests.conftest import bookkeeping_clipped_sum

CPU = torch.device("cpu")


def small(**kw):
    return TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=48, threads=1, **kw).resolved()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_route_is_measured_once_then_read(cache, monkeypatch):
    first = routes.choose(small(), 10, (1, 28, 28), CPU)
    assert first.mode in routes.STEP_CANDIDATES and set(first.step_ms) == set(routes.STEP_CANDIDATES)
    assert first.memory_format == routes.STEP_CANDIDATES[first.mode]
    assert set(first.layer_ms) == {0, 1}  # mnist-cnn's two convs, each with every way it can take
    assert all({"ghost", "patches"} <= set(ways) and set(ways) <= set(CONV_ROUTES) for ways in first.layer_ms.values())
    assert all(min(first.layer_ms[i], key=first.layer_ms[i].get) == r for i, r in first.conv_routes.items())
    [saved] = list((cache / "routes").glob("*.json"))
    assert json.loads(saved.read_text())["key"]["batch_size"] == 48
    monkeypatch.setattr(routes, "measure", lambda *a: pytest.fail("measured again"))
    assert routes.choose(small(), 10, (1, 28, 28), CPU) == first
    assert routes.choose(small(seed=5), 10, (1, 28, 28), CPU) == first  # the seed does not change the work


def test_measuring_leaves_the_runs_random_state_alone(cache):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    routes.choose(small(), 10, (1, 28, 28), CPU)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("chosen", [routes.Route("ew", "contiguous"),
                                    routes.Route("bk", "channels-last", {0: "ghost", 1: "patches"})])
def test_an_auto_trainer_takes_the_cached_choice(cache, monkeypatch, chosen):
    monkeypatch.setattr(routes, "measure", lambda *a: chosen)
    x, y = torch.zeros(96, 1, 28, 28), torch.arange(96) % 10
    trainer = DPTrainer(small(), TensorData(x, y, x[:1], y[:1], 10), plan(3.0, 1e-5, 96, 48, 1))
    assert trainer.route == chosen
    assert trainer.memory_format == routes.LAYOUTS[chosen.memory_format]
    assert trainer.data.x_train.is_contiguous(memory_format=trainer.memory_format)
    assert trainer.clipper.mode == chosen.mode
    if chosen.mode == "bk":
        assert trainer.clipper.conv_routes == chosen.conv_routes


def test_a_forced_mode_measures_nothing(cache, monkeypatch):
    monkeypatch.setattr(routes, "measure", lambda *a: pytest.fail("measured"))
    x, y = torch.zeros(96, 1, 28, 28), torch.arange(96) % 10
    trainer = DPTrainer(small(grad_sample_mode="bk"), TensorData(x, y, x[:1], y[:1], 10), plan(3.0, 1e-5, 96, 48, 1))
    assert trainer.route is None and trainer.clipper.conv_routes is None


@pytest.mark.parametrize("model,layers", [("mnist-cnn", 2), ("cifar-cnn", 4)])
@pytest.mark.parametrize("way", ["ghost", "patches"])
def test_every_way_of_a_conv_layer_gives_the_same_clipped_sum(model, layers, way):
    reference = bookkeeping_clipped_sum(model, kernel=False, conv_routes={i: "patches" for i in range(layers)})
    forced = bookkeeping_clipped_sum(model, kernel=True, conv_routes={i: way for i in range(layers)})
    for a, b in zip(forced, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert all(a.abs().sum() > 0 for a in forced)
