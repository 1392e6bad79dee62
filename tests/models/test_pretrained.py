"""Starting from a pretrained network (fedsd.models.pretrained; `--init-weights`, `--train-layers`,
`--features backbone`): a file that does not fit is refused with the keys named, a head of
another shape is made new, frozen blocks get no gradient and are released as the file holds
them, frozen BatchNorm runs in eval mode, the route skips frozen layers, the frozen blocks'
output is computed once, and a federation starts from the weights (a node may demand them)."""
import dataclasses
import json
from collections import OrderedDict

import pytest
import torch
from torch import nn

from fedsd.data import features
from fedsd.models import pretrained
from fedsd.clipping import routes
from fedsd.training.central import CentralRun, train
from fedsd.settings.run import TrainConfig, validate
from fedsd.errors import ConfigError
from fedsd.models.networks import build_model, model_for, with_pinned_weights
from tests.conftest import require

MNIST_CNN_BLOCKS = ["0", "3", "7", "9"]


def bn_net(num_classes, channels, image_size):
    """A small network with BatchNorm in its first block (`--model tests.models.test_pretrained:bn_net`)."""
    return nn.Sequential(OrderedDict([
        ("stem", nn.Sequential(nn.Conv2d(channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())),
        ("pool", nn.AdaptiveAvgPool2d(2)), ("flat", nn.Flatten()),
        ("body", nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU())),
        ("fc", nn.Linear(8, num_classes))]))


@pytest.fixture
def weights_file(tmp_path):
    path = tmp_path / "public.pt"
    torch.save(build_model("mnist-cnn", 10, seed=123).state_dict(), path)
    return path


def _mnist(path, **kw):
    return TrainConfig(dataset="mnist", method="dpsgd", init_weights=str(path), **kw).resolved()


def test_a_file_with_a_wrong_key_or_shape_is_refused_naming_them(tmp_path, weights_file):
    good = torch.load(weights_file)
    renamed = dict(good)
    renamed["0.kernel"] = renamed.pop("0.weight")
    torch.save(renamed, tmp_path / "renamed.pt")
    with pytest.raises(ConfigError, match=r"missing from the file: 0\.weight.*not in the network: 0\.kernel"):
        model_for(_mnist(tmp_path / "renamed.pt"), 10, weights=True)
    reshaped = dict(good)
    reshaped["3.weight"] = torch.zeros(32, 16, 3, 3)
    torch.save(reshaped, tmp_path / "reshaped.pt")
    with pytest.raises(ConfigError, match=r"of another shape: 3\.weight: file \(32, 16, 3, 3\) ≠ network "
                                          r"\(32, 16, 4, 4\)"):
        model_for(_mnist(tmp_path / "reshaped.pt"), 10, weights=True)
    (tmp_path / "junk.pt").write_bytes(b"not a weights file")
    with pytest.raises(ConfigError, match="weights_only=True"):
        model_for(_mnist(tmp_path / "junk.pt"), 10, weights=True)
    with pytest.raises(ConfigError, match="cannot be read"):
        model_for(_mnist(tmp_path / "absent.pt"), 10, weights=True)


def test_a_head_of_another_shape_is_made_new_and_the_rest_is_the_files(weights_file):
    """A file pretrained on 10 classes, a task of 5: the head (the last block) starts as the
    network's own; every other tensor is the file's, bit for bit."""
    cfg = _mnist(weights_file)
    net = model_for(cfg, 5, seed=7, weights=True).state_dict()
    own = model_for(cfg, 5, seed=7).state_dict()
    file = torch.load(weights_file)
    for key in net:
        assert torch.equal(net[key], own[key] if key.startswith("9.") else file[key]), key
    from fedsd.models.networks import start_report
    assert start_report(with_pinned_weights(cfg), 5)["head_replaced"] == ["9.weight", "9.bias"]


def test_the_run_is_pinned_to_the_files_sha256(weights_file):
    cfg = with_pinned_weights(_mnist(weights_file))
    assert cfg.init_weights_sha256 == pretrained.sha256_of(weights_file)
    with pytest.raises(ConfigError, match="other weights are refused"):
        with_pinned_weights(dataclasses.replace(cfg, init_weights_sha256="ab" * 32))


@pytest.mark.parametrize("spec,trained", [("all", MNIST_CNN_BLOCKS), ("head", ["9"]), ("last:2", ["7", "9"])])
def test_train_layers_freezes_every_other_block(spec, trained):
    net = model_for(TrainConfig(dataset="mnist", method="dpsgd", train_layers=spec).resolved(), 10)
    assert sorted({n.split(".")[0] for n, p in net.named_parameters() if p.requires_grad}) == trained


@pytest.mark.parametrize("spec", ["last:0", "last:x", "first:2", "some"])
def test_train_layers_of_another_form_are_refused(spec):
    cfg = TrainConfig(dataset="mnist", method="dpsgd", train_layers=spec).resolved()
    with pytest.raises(ConfigError, match="--train-layers"):
        validate(cfg, 60000)
    with pytest.raises(ConfigError, match="more blocks than the network's 4"):
        model_for(TrainConfig(dataset="mnist", method="dpsgd", train_layers="last:5").resolved(), 10)


def test_backbone_features_need_weights_and_frozen_blocks(weights_file):
    with pytest.raises(ConfigError, match="give --init-weights"):
        validate(TrainConfig(dataset="mnist", method="dpsgd", features="backbone", train_layers="head").resolved(),
                 60000)
    with pytest.raises(ConfigError, match="give --train-layers head or last:N"):
        validate(_mnist(weights_file, features="backbone"), 60000)


def test_a_frozen_batchnorm_runs_in_eval_mode_and_a_trainable_one_is_replaced():
    frozen = build_model("tests.models.test_pretrained:bn_net", 10, seed=0, channels=1, image_size=8,
                         train_layers="last:2")
    assert pretrained.is_frozen_batchnorm(frozen.stem[1])  # kept, with its statistics
    assert isinstance(frozen.body[1], nn.GroupNorm)  # trainable: replaced, as without weights
    frozen.train()
    assert frozen.training and not frozen.stem[1].training
    before = frozen.stem[1].running_mean.clone()
    frozen(torch.randn(6, 1, 8, 8) * 5 + 3)
    assert torch.equal(frozen.stem[1].running_mean, before)  # never updated from a batch
    whole = build_model("tests.models.test_pretrained:bn_net", 10, seed=0, channels=1, image_size=8)
    assert isinstance(whole.stem[1], nn.GroupNorm)


def test_the_route_skips_frozen_layers():
    """The rule's conv ways are for the trained conv layers only (frozen ones have no route)."""
    def ways(spec):
        cfg = TrainConfig(dataset="mnist", method="dpsgd", train_layers=spec, threads=1).resolved()
        return routes.rule(cfg, 10, (1, 28, 28), torch.device("cpu")).conv_ways
    assert sorted(ways("all")) == [0, 1] and ways("last:2") == {}


def test_the_frozen_blocks_output_is_computed_once_and_cached(weights_file, tmp_path, monkeypatch):
    from fedsd.models.networks import backbone_for

    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path / "cache"))
    cfg = with_pinned_weights(_mnist(weights_file, features="backbone", train_layers="last:2"))
    backbone = backbone_for(cfg)
    x = torch.randn(300, 1, 28, 28)
    out = features.inputs(x, backbone)
    assert out.shape == (300, 512, 1, 1)
    full = build_model("mnist-cnn", 10)
    full.load_state_dict(torch.load(weights_file))
    assert torch.allclose(out.flatten(1), nn.Sequential(*list(full)[:7])(x), atol=1e-6)  # the file's frozen blocks
    monkeypatch.setattr(backbone.module, "forward", lambda *a: pytest.fail("computed again"))
    assert torch.equal(features.inputs(x, backbone), out)
    tail = model_for(cfg, 10)
    assert [n for n, _ in tail.named_parameters()] == ["7.weight", "7.bias", "9.weight", "9.bias"]


def test_a_node_refuses_a_run_from_other_weights():
    from fedsd.app.client.owner_checks import check_init_weights
    from fedsd.app.client.node_config import NodeConfigError, parse

    node = parse({"partition-id": 0, "init-weights-sha256": "AB" * 32})
    check_init_weights({"init-weights-sha256": "ab" * 32}, node)
    for told in ({"init-weights-sha256": "cd" * 32}, {}):
        with pytest.raises(NodeConfigError, match="other weights are refused"):
            check_init_weights(told, node)
    check_init_weights({}, parse({"partition-id": 0}))  # a node that names none takes any


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "hooks"])
def test_frozen_blocks_get_no_gradient_and_are_released_as_the_file_holds_them(weights_file, tmp_path, mode):
    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=200, subset=2000, epochs=1, threads=1,
                      init_weights=str(weights_file), train_layers="last:2", grad_sample_mode=mode)
    run = CentralRun(cfg)
    run.take_epoch(1)
    for name, p in run.trainer.model.named_parameters():
        frozen = name.split(".")[0] in ("0", "3")
        assert (p.grad is None and getattr(p, "grad_sample", None) is None) == frozen, name
    result, weights = run.finish()
    file = torch.load(weights_file)
    for key in weights:
        assert torch.equal(weights[key], file[key]) == (key.split(".")[0] in ("0", "3")), key
    assert result["config"]["init_weights_sha256"] == pretrained.sha256_of(weights_file)
    assert result["pretrained"]["sha256"] == pretrained.sha256_of(weights_file)
    assert result["pretrained"]["frozen_blocks"] == ["0", "3"]


@pytest.mark.slow
def test_a_run_on_backbone_features_trains_the_head_and_writes_its_sha256(weights_file, tmp_path, monkeypatch):
    require("fmnist")
    import fedsd

    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path / "cache"))
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=500, lr=0.5, subset=5000, epochs=2,
                      threads=1, init_weights=str(weights_file), train_layers="head", features="backbone")
    result, weights = train(cfg, tmp_path / "run", progress=False)
    assert sorted(weights) == ["9.bias", "9.weight"]
    written = json.loads((tmp_path / "run" / "result.json").read_text())
    assert written["config"]["init_weights_sha256"] == pretrained.sha256_of(weights_file)
    released = fedsd.load_model(tmp_path / "run")  # its frozen blocks from the file
    assert released(torch.zeros(3, 1, 28, 28, dtype=torch.uint8)).shape == (3, 10)


@pytest.mark.slow
def test_a_federation_started_from_the_weights_trains(weights_file):
    require("fmnist")
    from fedsd.settings.federation import FedConfig
    from fedsd.simulation.engine import simulate

    state = torch.load(weights_file)
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=200, lr=0.5, subset=4000, seed=0,
                      threads=1, init_weights=str(weights_file), train_layers="last:2")
    result, weights = simulate(cfg, FedConfig(num_clients=2, rounds=2), progress=False)
    assert result["config"]["init_weights_sha256"] == pretrained.sha256_of(weights_file)
    for key in ("0.weight", "0.bias", "3.weight", "3.bias"):  # the frozen blocks: the file's, bit for bit
        assert torch.equal(weights[key], state[key]), key  # kept through aggregation (fedsd.app.records.with_frozen)
    assert not torch.equal(weights["9.weight"], state["9.weight"])
    assert all(r["trained"] for r in result["rounds"])


def test_public_first_leaves_the_public_images_out_of_the_private_set():
    """--public-first N: the first N training images pretrained the network (fedsd pretrain
    --first N); the private run never trains on them, with or without a validation split."""
    require("fmnist")
    from fedsd.data import datasets as data_lib

    images = data_lib.load("fmnist")
    private = data_lib.training_indices(images, None, 0, 0, public_first=5000)
    assert private.min() == 5000 and len(private) == 55000
    held = data_lib.training_indices(images, None, 0, 10000, public_first=5000)
    assert held.min() >= 5000 and not set(held.tolist()) & set(data_lib.validation_indices(images, 10000).tolist())
    with pytest.raises(ConfigError, match="--public-first"):
        data_lib.training_indices(images, None, 0, 0, public_first=60000)


@pytest.mark.slow
def test_fedsd_pretrain_writes_a_file_init_weights_reads_and_keeps_it(tmp_path, capsys):
    require("fmnist")
    from fedsd.cli.main import main

    out = tmp_path / "public.pt"
    args = ["pretrain", "--dataset", "fmnist", "--first", "600", "--epochs", "1", "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    made = json.loads((tmp_path / "public.pt.json").read_text())
    assert made["num_train"] == 600 and made["first"] == 600 and made["sha256"] == pretrained.sha256_of(out)
    assert main(args) == 0 and pretrained.sha256_of(out) == made["sha256"]  # the same settings: kept as it is
    assert main(args[:-4] + ["--epochs", "2", "--out", str(out)]) == 2  # other settings: refused
    assert "made with other settings" in capsys.readouterr().err
    model_for(_mnist(out), 10, weights=True)  # it fits the network it was made for
