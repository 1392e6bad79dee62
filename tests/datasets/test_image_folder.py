"""Own data kept as torchvision's plain ImageFolder, DIR/<class>/<image> (no train/): taken as
DIR/train/<class>/<image> without test/ is, centrally (a stratified test split held out) and as
a SuperNode's `data=`."""
import json
import shutil

import pytest
import torch

from fedsd.data import client_data
from fedsd.data.client_data import builtin_task, load_holder_data
from fedsd.settings.run import TrainConfig
from fedsd.errors import DataError
from fedsd.training.loop import initial_model
from fedsd.cli.main import main
from tests.conftest import write_image_folder


def plain_and_nested(tmp_path, per_class: int):
    """The same images twice: DIR/train/<class>/ (nested) and DIR/<class>/ (plain)."""
    nested = write_image_folder(tmp_path / "nested", {"tshirt": 0, "trouser": 1}, per_class=per_class)
    shutil.copytree(nested / "train", tmp_path / "plain")
    return tmp_path / "plain", nested


def samples(held):
    return [(int(y), x.numpy().tobytes()) for x, y in zip(held.x_train, held.y_train)]


def test_a_plain_image_folder_holds_what_train_holds(tmp_path):
    plain, nested = plain_and_nested(tmp_path, per_class=20)
    cfg = client_data.with_custom_task(TrainConfig(dataset="custom", data_dir=str(plain))).resolved()
    assert (cfg.classes, cfg.channels, cfg.image_size) == ("trouser,tshirt", 1, 28)
    task = client_data.task_for(cfg)
    held, reference = (load_holder_data(p, task, tmp_path / "cache" / p.name) for p in (plain, nested))
    assert samples(held) == samples(reference) and len(held.y_train) == 40
    assert held.y_train.tolist() == [0] * 20 + [1] * 20 and len(held.y_test) == 0


def test_a_folder_that_is_neither_layout_is_refused(tmp_path):
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    (tmp_path / "empty" / "cat" / "notes.txt").write_text("no image")
    with pytest.raises(DataError, match="no train/ folder and no class folder of images"):
        load_holder_data(tmp_path / "empty", builtin_task("fmnist"), tmp_path / "cache")
    code = main(["train", "--dataset", "custom", "--data-dir", str(tmp_path / "empty"), "--epsilon", "3",
                 "--out", str(tmp_path / "o")])
    assert code == 2 and not (tmp_path / "o").exists()


def test_a_plain_image_folder_is_a_nodes_data(tmp_path, flower_task):
    """A SuperNode whose data= is a plain ImageFolder trains on every image of it."""
    from fedsd.app.records import record_to_model
    from tests.app.client.test_client_owned import run_config, send

    plain = write_image_folder(tmp_path / "nested", {str(k): k for k in range(10)}, per_class=12) / "train"
    cfg, flat = run_config(batch_size=30)
    start = initial_model(cfg.resolved(), 10)
    node = {"partition-id": 0, "data": str(plain), "state-dir": str(tmp_path / "state"), "max-epsilon": 3}
    reply, _ = send(flat, node, start, 1)
    assert reply.content["metrics"]["num-examples"] == 120 and reply.content["metrics"]["skipped"] == 0
    trained = record_to_model(reply.content["arrays"])["student"]
    assert max((trained[k] - start["student"][k]).abs().max().item() for k in start["student"]) > 1e-3


@pytest.mark.slow
def test_a_plain_image_folder_trains_centrally_as_train_does(tmp_path, capsys, monkeypatch):
    """`fedsd train --dataset custom --data-dir DIR` with DIR/<class>/: the run `train/` would
    make, bit for bit (the same stratified test split held out), and it learns."""
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path / "cache"))
    plain, nested = plain_and_nested(tmp_path, per_class=150)
    results = {}
    for name, data in (("plain", plain), ("nested", nested)):
        assert main(["train", "--dataset", "custom", "--data-dir", str(data), "--method", "dpsgd", "--epochs", "4",
                     "--batch-size", "40", "--lr", "0.5", "--epsilon", "8", "--threads", "1", "--quiet",
                     "--out", str(tmp_path / f"run-{name}")]) == 0
        assert "(no test split: 60 of its 300 training samples, 20%, held out as the test split" in \
            capsys.readouterr().out
        results[name] = json.loads((tmp_path / f"run-{name}" / "result.json").read_text())
    weights = {name: torch.load(tmp_path / f"run-{name}" / "model.pt", weights_only=True) for name in results}
    assert all(torch.equal(weights["plain"][k], weights["nested"][k]) for k in weights["nested"])
    assert results["plain"]["test_accuracy"] == results["nested"]["test_accuracy"] >= 0.85
    assert results["plain"]["config"]["classes"] == "trouser,tshirt"
