"""--grad-sample-mode auto: the route measured on this machine while a run is planned, over every
clipper auto may pick, interleaved, once, and kept only when it is clear; every run and process
on the machine then takes the same one, and a run whose steps come out far slower than measured
makes the machine measure again. Every way book-keeping can take a conv layer gives the same
clipped sum."""
import json

import pytest
import torch

from fedsd import routes
from fedsd.bookkeeping import CONV_WAYS
from fedsd.config import TrainConfig
from fedsd.data import TensorData
from fedsd.privacy import plan
from fedsd.training import DPTrainer, planned_trainer
from tests.conftest import bookkeeping_clipped_sum

CPU = torch.device("cpu")


def small(**kw):
    return TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=48, threads=1, **kw).resolved()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_every_clipper_auto_may_pick_is_timed_and_the_choice_measured_once_then_read(cache, monkeypatch):
    first = routes.choose(small(), 10, (1, 28, 28), CPU)
    candidates = routes.step_candidates()
    assert set(candidates) == {"bk", "hooks", "functorch", "ew", "ghost"}  # each clipper's own declaration
    assert first.mode in candidates and set(first.step_ms) == set(candidates) == set(first.step_spread_ms)
    assert first.memory_format == candidates[first.mode]
    assert all(low <= first.step_ms[m] <= high for m, (low, high) in first.step_spread_ms.items())
    assert set(first.layer_ms) == {0, 1}  # mnist-cnn's two convs, each with every way it can take
    assert all({"ghost", "patches"} <= set(ways) and set(ways) <= set(CONV_WAYS) for ways in first.layer_ms.values())
    assert all(min(first.layer_ms[i], key=first.layer_ms[i].get) == w for i, w in first.conv_ways.items())
    [saved] = list((cache / "routes").glob("*.json"))
    assert json.loads(saved.read_text())["key"]["batch_size"] == 48
    monkeypatch.setattr(routes, "measure", lambda *a: pytest.fail("measured again"))
    assert routes.choose(small(), 10, (1, 28, 28), CPU) == first
    assert routes.choose(small(seed=5), 10, (1, 28, 28), CPU) == first  # the seed does not change the work


def test_a_choice_whose_timings_overlap_the_runner_ups_is_measured_again_an_hour_on(cache, monkeypatch):
    overlapping = {m: [0.010, 0.013] for m in routes.step_candidates()}
    overlapping["ew"] = [0.009, 0.012]
    monkeypatch.setattr(routes, "_interleaved", lambda steps, timed, failed=None: overlapping)
    route = routes.choose(small(), 10, (1, 28, 28), CPU)
    assert route.mode == "ew" and not route.settled and "not settled" in route.describe()
    apart = {m: [0.020, 0.021] for m in routes.step_candidates()}
    apart["ghost"] = [0.005, 0.006]
    monkeypatch.setattr(routes, "_interleaved", lambda steps, timed, failed=None: apart)
    assert routes.choose(small(), 10, (1, 28, 28), CPU) == route  # the same run's processes agree
    monkeypatch.setattr(routes.time, "time", lambda: 1e12)  # an hour and more later
    route = routes.choose(small(), 10, (1, 28, 28), CPU)
    assert route.mode == "ghost" and route.settled


def test_interleaving_stops_once_the_fastest_is_clear():
    steps = {"fast": lambda: None, "slow": lambda: None}
    timed = {"fast": 0.001, "slow": 0.010}
    measured = routes._interleaved(steps, lambda fn: timed["fast" if fn is steps["fast"] else "slow"])
    assert len(measured["fast"]) == routes.REPEATS and len(measured["slow"]) == routes.REPEATS
    noisy = iter([0.005, 0.004, 0.004, 0.005] * 100)
    measured = routes._interleaved({"a": lambda: None, "b": lambda: None}, lambda fn: next(noisy))
    assert len(measured["a"]) == routes.MAX_REPEATS  # never apart: measured to the end


def test_a_run_far_slower_than_its_route_forgets_it(cache):
    cfg = small()
    route = routes.choose(cfg, 10, (1, 28, 28), CPU)
    [kept] = list((cache / "routes").glob("*.json"))
    measured = route.step_ms[route.mode] / 1000
    assert routes.check(route, cfg, 10, (1, 28, 28), CPU, 1.2 * measured) and kept.exists()
    assert not routes.check(route, cfg, 10, (1, 28, 28), CPU, 3 * measured) and not kept.exists()


def test_a_route_kept_from_before_a_network_was_traced_is_not_read_and_the_others_are(cache):
    """torchvision's resnets are traced for Opacus' hooks since the GPU checks: a route kept from
    before (measured without the hook modes, which could not run) is measured again; the key of a
    network that is not traced, and so every route kept for one, is what it was."""
    resnet = TrainConfig(dataset="cifar10", model="torchvision:resnet18", method="dpsgd", epsilon=3, batch_size=8,
                         threads=1).resolved()
    key = routes._key(resnet, 10, (3, 32, 32), CPU, 1)
    assert key["traced_for_hooks"] is True
    kept_before = routes._route_file({k: v for k, v in key.items() if k != "traced_for_hooks"})
    assert routes._route_file(key) != kept_before
    assert "traced_for_hooks" not in routes._key(small(), 10, (1, 28, 28), CPU, 1)


def test_fedsd_bench_routes_lists_and_clears(cache, capsys):
    from simulations.cli import main

    from fedsd.results import write_json

    (cache / "routes").mkdir()
    write_json(cache / "routes" / "x.json", {"key": {"model": "mnist-cnn", "batch_size": 48, "device": "cpu",
                                                    "threads": 1}, "route": routes.Route("ew", "contiguous").to_dict()})
    assert main(["bench", "routes"]) == 0
    assert "mnist-cnn B=48 cpu 1 thread(s): ew, contiguous" in capsys.readouterr().out
    assert main(["bench", "routes", "--clear"]) == 0
    assert "forgot 1 route(s)" in capsys.readouterr().out and not list((cache / "routes").glob("*.json"))


def test_measuring_leaves_the_runs_random_state_alone(cache):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    routes.choose(small(), 10, (1, 28, 28), CPU)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("chosen", [routes.Route("ew", "contiguous"),
                                    routes.Route("bk", "channels-last", {0: "ghost", 1: "patches"})])
def test_a_planned_trainer_takes_the_cached_choice(cache, monkeypatch, chosen):
    monkeypatch.setattr(routes, "measure", lambda *a: chosen)
    x, y = torch.zeros(96, 1, 28, 28), torch.arange(96) % 10
    trainer = planned_trainer(small(), TensorData(x, y, x[:1], y[:1], 10), plan(3.0, 1e-5, 96, 48, 1))
    assert trainer.route == chosen
    assert trainer.memory_format == routes.LAYOUTS[chosen.memory_format]
    assert trainer.data.x_train.is_contiguous(memory_format=trainer.memory_format)
    assert trainer.clipper.mode == chosen.mode
    if chosen.mode == "bk":
        assert trainer.clipper.conv_ways == chosen.conv_ways


def test_the_trainer_is_handed_its_route_and_measures_nothing(cache, monkeypatch):
    monkeypatch.setattr(routes, "measure", lambda *a: pytest.fail("measured"))
    x, y = torch.zeros(96, 1, 28, 28), torch.arange(96) % 10
    data, p = TensorData(x, y, x[:1], y[:1], 10), plan(3.0, 1e-5, 96, 48, 1)
    with pytest.raises(ValueError, match="auto trains on the run's measured route"):
        DPTrainer(small(), data, p)
    trainer = planned_trainer(small(grad_sample_mode="bk"), data, p)  # a forced mode: nothing to measure
    assert trainer.route is None and trainer.clipper.conv_ways is None


def test_an_older_route_still_reads():
    old = {"format": 2, "mode": "bk", "memory_format": "channels-last", "conv_routes": {"0": "ghost"},
           "cpu_isa": "avx2", "step_ms": {"bk": 1.0, "ew": 2.0}, "layer_ms": {"0": {"ghost": 0.1}}}
    assert routes.Route.from_dict(old).conv_ways == {0: "ghost"}


@pytest.mark.parametrize("model,layers", [("mnist-cnn", 2), ("cifar-cnn", 4)])
@pytest.mark.parametrize("way", ["ghost", "patches"])
def test_every_way_of_a_conv_layer_gives_the_same_clipped_sum(model, layers, way):
    reference = bookkeeping_clipped_sum(model, kernel=False, conv_ways={i: "patches" for i in range(layers)})
    forced = bookkeeping_clipped_sum(model, kernel=True, conv_ways={i: way for i in range(layers)})
    for a, b in zip(forced, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert all(a.abs().sum() > 0 for a in forced)
