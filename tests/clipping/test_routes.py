"""The run's route (fedsd.clipping.routes): with --grad-sample-mode auto, chosen while a run is planned by a
rule that reads the shapes, the conv kernel's instruction set and the thread count, never a
clock, and recorded with the run; --route (or --route-from a run) gives a recorded route back,
checked against the network first. `measure` still times every candidate, interleaved, for
calibrating the rule. Every way book-keeping can take a conv layer gives the same clipped sum."""
import json
import random

import pytest
import torch

from fedsd.clipping import routes
from fedsd.clipping.bookkeeping import CONV_WAYS
from fedsd.settings.run import TrainConfig
from fedsd.data.datasets import TensorData
from fedsd.errors import ConfigError
from fedsd.privacy.accounting import plan
from fedsd.training.loop import DPTrainer, planned_trainer
from tests.conftest import bookkeeping_clipped_sum

CPU = torch.device("cpu")


def small(**kw):
    return TrainConfig(**{**dict(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=48, threads=1),
                          **kw}).resolved()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_measuring_times_every_clipper_auto_may_take_and_every_way_of_each_conv_layer(cache):
    first = routes.measure(small(), 10, (1, 28, 28), CPU)
    candidates = routes.step_candidates()
    assert set(candidates) == {"bk", "hooks", "functorch", "ew", "ghost"}  # each clipper's own declaration
    assert first.mode in candidates and set(first.step_ms) == set(candidates) == set(first.step_spread_ms)
    assert first.memory_format == candidates[first.mode] and first.chosen_by == "measured"
    assert all(low <= first.step_ms[m] <= high for m, (low, high) in first.step_spread_ms.items())
    assert set(first.layer_ms) == {0, 1}  # mnist-cnn's two convs, each with every way it can take
    assert all({"ghost", "patches"} <= set(ways) and set(ways) <= set(CONV_WAYS) for ways in first.layer_ms.values())
    assert all(min(first.layer_ms[i], key=first.layer_ms[i].get) == w for i, w in first.conv_ways.items())


def test_no_clock_decides_a_runs_route(cache, monkeypatch):
    """Whatever the timings (here random), and with the kept routes forgotten in between, the
    same run gets the same route; nothing is measured."""
    monkeypatch.setattr(routes, "measure", lambda *a: pytest.fail("measured"))
    chosen = set()
    for seed in range(3):
        noise = random.Random(seed)
        monkeypatch.setattr(routes, "timer", lambda device: lambda fn: (fn(), noise.random())[1])
        routes.forget_all()
        route = routes.choose(small(), 10, (1, 28, 28), CPU)
        assert route.chosen_by == "rule" and route.step_ms == {} and route.made_for["threads"] == 1
        chosen.add(route.spec())
    assert chosen == {routes.for_run(small(seed=5), 10, (1, 28, 28), CPU).spec()}  # the seed does not change it
    [kept] = list((cache / "routes").glob("*.json"))  # listed for `fedsd bench routes`
    assert json.loads(kept.read_text())["key"]["batch_size"] == 48


def test_a_network_without_a_convolution_runs_contiguous_under_auto_and_a_conv_network_channels_last(cache):
    """channels-last is for convolutions: scatter-linear (GroupNorm, then a linear layer) took
    about twice as long a step in it (torch's GroupNorm on channels-last input is ~4x slower),
    and the server's evaluation too. --memory-format channels-last still gets what it asks."""
    from fedsd.models.networks import model_for
    from fedsd.training.loop import torch_memory_format

    linear = small(features="scatter", model="scatter-linear")
    assert routes.for_run(linear, 10, (81, 7, 7), CPU).memory_format == "contiguous"
    assert routes.for_run(small(), 10, (1, 28, 28), CPU).memory_format == "channels-last"  # mnist-cnn
    asked = small(features="scatter", model="scatter-linear", memory_format="channels-last")
    assert routes.for_run(asked, 10, (81, 7, 7), CPU).memory_format == "channels-last"
    assert torch_memory_format(linear, CPU, model_for(linear, 10)) == torch.contiguous_format
    assert torch_memory_format(small(), CPU, model_for(small(), 10)) == torch.channels_last
    assert torch_memory_format(asked, CPU, model_for(asked, 10)) == torch.channels_last


@pytest.mark.parametrize("isa,ways", [
    ("avx512", {0: "kernel", 1: "kernel"}),  # mnist-cnn conv2: 0.9× the flops of per-sample gradients
    ("avx2", {0: "kernel", 1: "kernel"}),
    ("sse", {0: "patches", 1: "patches"}),
    (None, {0: "patches", 1: "patches"}),
    ("cuda", {0: "patches", 1: "ghost"}),
])
def test_the_rule_takes_each_conv_layers_way_by_instruction_set(isa, ways, monkeypatch):
    monkeypatch.setattr(routes.conv_kernel, "applies", lambda layer, a, g: True)
    captured = routes._captured(small(), 10, (1, 28, 28), CPU, "channels-last")
    device = torch.device("cuda") if isa == "cuda" else CPU  # only read: no tensor goes there
    taken = {i: routes.conv_way(layer, a, g, isa, device) for i, (layer, a, g) in enumerate(captured)
             if isinstance(layer, torch.nn.Conv2d)}
    assert taken == ways


def test_cifar_cnns_last_conv_takes_the_kernel_where_there_is_one_else_ghost_norms(monkeypatch):
    """cifar-cnn conv4 (4 × 4 maps: ghost norms at 0.15× the flops of per-sample gradients)
    takes the kernel on avx512 and avx2, measured faster there (RULES); ghost norms where the
    per-sample gradients would be PyTorch's patches."""
    monkeypatch.setattr(routes.conv_kernel, "applies", lambda layer, a, g: True)
    cfg = TrainConfig(dataset="cifar10", method="dpsgd", epsilon=3, batch_size=48, threads=1).resolved()
    captured = routes._captured(cfg, 10, (3, 32, 32), CPU, "channels-last")
    convs = [(layer, a, g) for layer, a, g in captured if isinstance(layer, torch.nn.Conv2d)]
    for isa in routes.RULES:
        device = torch.device("cuda") if isa == "cuda" else CPU
        kernel = routes.RULES[isa]["per_sample"] == "kernel"
        assert routes.conv_way(*convs[3], isa, device) == ("kernel" if kernel else "ghost")
        assert routes.conv_way(*convs[0], isa, device) == ("kernel" if kernel else "patches")
    assert {isa for isa in routes.RULES if routes.RULES[isa]["per_sample"] == "kernel"} == {"avx512", "avx2"}


def test_a_route_reads_back_from_its_record_and_its_spec():
    route = routes.rule(small(), 10, (1, 28, 28), CPU)
    assert routes.Route.from_dict(json.loads(json.dumps(route.to_dict()))) == route
    again = routes.Route.from_spec(route.spec())
    assert (again.mode, again.memory_format, again.conv_ways) == (route.mode, route.memory_format, route.conv_ways)
    assert routes.Route.from_spec("ghost:contiguous") == routes.Route("ghost", "contiguous", chosen_by="given")


@pytest.mark.parametrize("spec,says", [
    ("bk", "is no route"), ("bk:sideways", "is no route"), ("warp:contiguous", "is no route"),
    ("bk:channels-last:0=fast", "no conv layer's way"), ("ew:contiguous:0=kernel", "no conv layer's way"),
])
def test_a_route_not_of_routes_form_is_refused_naming_the_option(spec, says):
    with pytest.raises(ConfigError, match=f"^--route: .*{says}"):
        routes.Route.from_spec(spec)


@pytest.mark.parametrize("spec,says", [
    ("bk:channels-last:0=ghost", r"names the conv layers \[0\]; --model mnist-cnn's are \[0, 1\]"),
    ("bk:channels-last:0=ghost,1=ghost,4=ghost", "names the conv layers"),
    ("hooks:channels-last", "wrong per-sample gradients on channels-last"),
])
def test_a_route_that_does_not_fit_the_network_is_refused_before_any_work(spec, says):
    with pytest.raises(ConfigError, match=f"^--route: .*{says}"):
        routes.given(small(route=spec), 10, (1, 28, 28), CPU)


def test_a_route_through_the_kernel_is_refused_where_the_kernel_does_not_take_the_layer(monkeypatch):
    monkeypatch.setattr(routes.conv_kernel, "applies", lambda layer, a, g: False)
    with pytest.raises(ConfigError, match="^--route: conv layer 0 takes fedsd's conv kernel"):
        routes.given(small(route="bk:channels-last:0=kernel,1=ghost"), 10, (1, 28, 28), CPU)
    assert routes.given(small(route="bk:channels-last:0=patches,1=ghost"), 10, (1, 28, 28), CPU).conv_ways == \
        {0: "patches", 1: "ghost"}


def test_a_route_with_a_forced_mode_is_refused_naming_the_option():
    from fedsd.settings.run import validate

    with pytest.raises(ConfigError, match="^--route: takes the place of --grad-sample-mode"):
        validate(small(route="bk:channels-last:0=ghost,1=ghost", grad_sample_mode="bk"), 1000)


def _record(folder, route: dict | None, **config):
    from fedsd.files.results import write_json

    folder.mkdir(parents=True)
    write_json(folder / "result.json", {"config": small(**config).to_dict(), "route": route})
    return folder


def test_route_from_gives_back_a_recorded_route_and_refuses_one_that_does_not_fit(tmp_path):
    route = routes.rule(small(), 10, (1, 28, 28), CPU)
    run = _record(tmp_path / "a", route.to_dict())
    assert routes.route_from(run, small()) == route.spec()
    with pytest.raises(ConfigError, match="^--route-from: the route in .* was made for threads 1, this run's is 2 "
                                          r"\(give --threads 1\)"):
        routes.route_from(run, small(threads=2))
    with pytest.raises(ConfigError, match="^--route-from: the route in .* was made for model mnist-cnn"):
        routes.route_from(run, TrainConfig(dataset="cifar10", method="dpsgd", epsilon=3, threads=1).resolved())
    with pytest.raises(ConfigError, match="^--route-from: .* holds no run"):
        routes.route_from(tmp_path / "nothing", small())
    forced = _record(tmp_path / "forced", None, grad_sample_mode="bk")
    with pytest.raises(ConfigError, match="^--route-from: the run in .* recorded no route .*--grad-sample-mode bk"):
        routes.route_from(forced, small())
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "result.json").write_text("{")
    with pytest.raises(ConfigError, match="^--route-from: cannot read the route recorded in"):
        routes.route_from(tmp_path / "broken", small())


def test_route_from_on_the_command_line_is_refused_before_any_work(tmp_path, capsys):
    from fedsd.cli.main import main

    out = tmp_path / "out"
    assert main(["train", "--epsilon", "3", "--threads", "1", "--route-from", str(tmp_path / "nothing"),
                 "--out", str(out)]) == 2
    assert "fedsd train: error: --route-from: " in capsys.readouterr().err and not out.exists()
    run = _record(tmp_path / "a", routes.rule(small(), 10, (1, 28, 28), CPU).to_dict())
    assert main(["train", "--epsilon", "3", "--threads", "1", "--route-from", str(run), "--route", "ew:contiguous",
                 "--out", str(out)]) == 2
    assert "--route-from: gives the run's route; leave out --route" in capsys.readouterr().err and not out.exists()


def test_a_rerun_of_a_runs_settings_in_its_folder_takes_its_recorded_route(tmp_path):
    from fedsd.simulation.sweeps import with_recorded_route

    recorded = routes.Route("bk", "channels-last", {0: "patches", 1: "ghost"}, chosen_by="rule",
                            made_for=dict(model="mnist-cnn", threads=1, input=[1, 28, 28]))
    run = _record(tmp_path / "a", recorded.to_dict())
    config = dict(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=48, threads=1)
    assert with_recorded_route(config, run) == {**config, "route": "bk:channels-last:0=patches,1=ghost"}
    assert with_recorded_route({**config, "lr": 0.5}, run) == {**config, "lr": 0.5}  # other settings: its own
    assert with_recorded_route({**config, "threads": 2}, run) == {**config, "threads": 2}  # made for 1 thread
    assert with_recorded_route(config, tmp_path / "none") == config


def test_interleaving_stops_once_the_fastest_is_clear():
    steps = {"fast": lambda: None, "slow": lambda: None}
    timed = {"fast": 0.001, "slow": 0.010}
    measured = routes._interleaved(steps, lambda fn: timed["fast" if fn is steps["fast"] else "slow"])
    assert len(measured["fast"]) == routes.REPEATS and len(measured["slow"]) == routes.REPEATS
    noisy = iter([0.005, 0.004, 0.004, 0.005] * 100)
    measured = routes._interleaved({"a": lambda: None, "b": lambda: None}, lambda fn: next(noisy))
    assert len(measured["a"]) == routes.MAX_REPEATS  # never apart: measured to the end


def test_a_route_kept_for_a_traced_network_is_kept_apart_and_the_others_are_not(cache):
    """torchvision's resnets are traced for Opacus' hooks since the GPU checks: their kept routes
    are listed apart from those kept before; the key of a network that is not traced is what it was."""
    resnet = TrainConfig(dataset="cifar10", model="torchvision:resnet18", method="dpsgd", epsilon=3, batch_size=8,
                         threads=1).resolved()
    key = routes._key(resnet, 10, (3, 32, 32), CPU, 1)
    assert key["traced_for_hooks"] is True
    kept_before = routes._route_file({k: v for k, v in key.items() if k != "traced_for_hooks"})
    assert routes._route_file(key) != kept_before
    assert "traced_for_hooks" not in routes._key(small(), 10, (1, 28, 28), CPU, 1)


def test_fedsd_bench_routes_lists_and_clears(cache, capsys):
    from fedsd.cli.main import main

    from fedsd.files.results import write_json

    (cache / "routes").mkdir()
    write_json(cache / "routes" / "x.json", {"key": {"model": "mnist-cnn", "batch_size": 48, "device": "cpu",
                                                    "threads": 1}, "route": routes.Route("ew", "contiguous").to_dict()})
    assert main(["bench", "routes"]) == 0
    assert "mnist-cnn B=48 cpu 1 thread(s): ew, contiguous" in capsys.readouterr().out
    assert main(["bench", "routes", "--clear"]) == 0
    assert "forgot 1 route(s)" in capsys.readouterr().out and not list((cache / "routes").glob("*.json"))


def test_choosing_and_measuring_leave_the_runs_random_state_alone(cache):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    routes.choose(small(), 10, (1, 28, 28), CPU)
    routes.choose(small(route="bk:channels-last:0=ghost,1=patches"), 10, (1, 28, 28), CPU)
    routes.measure(small(), 10, (1, 28, 28), CPU)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("chosen", [routes.Route("ew", "contiguous"),
                                    routes.Route("bk", "channels-last", {0: "ghost", 1: "patches"})])
def test_a_planned_trainer_takes_the_given_route(cache, chosen):
    x, y = torch.zeros(96, 1, 28, 28), torch.arange(96) % 10
    trainer = planned_trainer(small(route=chosen.spec()), TensorData(x, y, x[:1], y[:1], 10),
                              plan(3.0, 1e-5, 96, 48, 1))
    assert trainer.route.spec() == chosen.spec() and trainer.route.chosen_by == "given"
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


TRAIN = ["train", "--dataset", "fmnist", "--method", "dpema", "--epsilon", "3", "--subset", "300", "--batch-size", "50",
         "--lr", "1", "--epochs", "1", "--threads", "1", "--quiet"]


def _weights(folder):
    return torch.load(folder / "model.pt")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_the_same_command_twice_with_the_kept_routes_forgotten_between_gives_the_same_weights(cache, tmp_path,
                                                                                              monkeypatch):
    """As a user would: `fedsd train …`, `fedsd bench routes --clear`, the same command again, each
    time with other timings on the machine (here random ones): the same route, the same weights."""
    from fedsd.cli.main import main
    from tests.conftest import require

    require("fmnist")
    for run, seed in (("a", 0), ("b", 1)):
        noise = random.Random(seed)
        monkeypatch.setattr(routes, "timer", lambda device, noise=noise: lambda fn: (fn(), noise.random())[1])
        assert main(["bench", "routes", "--clear"]) == 0
        assert main([*TRAIN, "--out", str(tmp_path / run)]) == 0
    a, b = (json.loads((tmp_path / r / "result.json").read_text())["route"] for r in "ab")
    assert a == b and a["chosen_by"] == "rule"
    assert _same(_weights(tmp_path / "a"), _weights(tmp_path / "b"))


@pytest.mark.slow
def test_a_run_given_another_runs_route_releases_that_runs_weights(cache, tmp_path):
    """Run a takes a route other than the rule's (PyTorch's patches for conv0, the other way for
    conv1 than the rule's): its weights differ from the rule's run; a run --route-from a gives
    a's weights bit for bit, and records a's route as its --route."""
    from fedsd.cli.main import main
    from tests.conftest import require

    require("fmnist")
    ruled = routes.rule(small(), 10, (1, 28, 28), CPU)
    other = {0: "patches", 1: "patches" if ruled.conv_ways[1] == "ghost" else "ghost"}
    spec = routes.Route("bk", "channels-last", other).spec()
    assert main([*TRAIN, "--route", spec, "--out", str(tmp_path / "a")]) == 0
    assert main([*TRAIN, "--out", str(tmp_path / "rule")]) == 0
    assert main([*TRAIN, "--route-from", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / r / "result.json").read_text()) for r in "ab")
    assert a["route"]["conv_ways"] == b["route"]["conv_ways"] == {str(k): v for k, v in other.items()}
    assert b["config"]["route"] == spec and b["route"]["chosen_by"] == "given"
    assert not _same(_weights(tmp_path / "a"), _weights(tmp_path / "rule"))  # the route changes the bits
    assert _same(_weights(tmp_path / "a"), _weights(tmp_path / "b"))
