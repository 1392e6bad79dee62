"""Loading the real data sets as whole tensors, finding them, subsets."""
import numpy as np
import pytest
import torch

from fedsd import data as data_lib
from tests.conftest import require


def test_mnist_idx_files():
    require("mnist")
    d = data_lib.load("mnist")
    assert d.x_train.shape == (60000, 1, 28, 28) and d.x_train.dtype == torch.uint8
    assert d.x_test.shape == (10000, 1, 28, 28)
    assert d.y_train[:8].tolist() == [5, 0, 4, 1, 9, 2, 1, 3]  # the famous first labels
    mean, std = d.channel_stats
    assert mean.item() == pytest.approx(0.1307, abs=1e-4) and std.item() == pytest.approx(0.3081, abs=1e-4)


def test_fashion_mnist_debian_package():
    require("fmnist")
    d = data_lib.load("fmnist")
    assert d.x_train.shape == (60000, 1, 28, 28) and d.num_classes == 10
    assert torch.bincount(d.y_train).tolist() == [6000] * 10
    mean, std = d.channel_stats
    assert (mean.item(), std.item()) == pytest.approx((0.2860, 0.3530), abs=1e-4)  # STANDARD_STATS
    x = d.normalised(d.x_train[:5000])
    assert x.dtype == torch.float32 and abs(x.mean().item()) < 0.05


def test_cifar10_npz_and_torchvision_batches_agree(tmp_path):
    require("cifar10")
    d = data_lib.load("cifar10")
    assert d.x_train.shape == (50000, 3, 32, 32) and d.y_train.shape == (50000,)
    mean, std = d.channel_stats
    assert (mean * 255).tolist() == pytest.approx([125.307, 122.950, 113.865], abs=0.01)
    assert std.tolist() == pytest.approx(list(data_lib.STANDARD_STATS["cifar10"][1]), abs=1e-4)
    # The same images written in torchvision's pickled layout load identically.
    import pickle
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    flat = d.x_train.numpy().reshape(50000, 3072)
    for i in range(5):
        with open(folder / f"data_batch_{i + 1}", "wb") as f:
            pickle.dump({"data": flat[i * 10000:(i + 1) * 10000], "labels": d.y_train[i * 10000:(i + 1) * 10000].tolist()}, f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"data": d.x_test.numpy().reshape(10000, 3072), "labels": d.y_test.tolist()}, f)
    other = data_lib._load_cifar(folder)
    assert torch.equal(other.x_train, d.x_train) and torch.equal(other.y_test, d.y_test)


def test_missing_data_names_every_place_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDSD_DATA_DIR", raising=False)
    with pytest.raises(data_lib.DataNotFoundError) as e:
        data_lib.load("cifar10", data_dir=tmp_path)
    message = str(e.value)
    assert str(tmp_path / "cifar10" / "cifar10.npz") in message and "cifar-10-batches-py" in message
    assert "--download" in message


def test_stratified_subset_is_seeded_and_balanced():
    labels = torch.from_numpy(np.repeat(np.arange(10), [600, 500, 700, 600, 600, 600, 600, 600, 600, 600]))
    a = data_lib.stratified_subset(labels, 1200, seed=1)
    b = data_lib.stratified_subset(labels, 1200, seed=1)
    c = data_lib.stratified_subset(labels, 1200, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(a) == 1200 and len(set(a.tolist())) == 1200 and torch.equal(a, a.sort().values)
    counts = torch.bincount(labels[a]).tolist()
    assert counts == [120, 100, 140, 120, 120, 120, 120, 120, 120, 120]
    with pytest.raises(ValueError, match="--subset"):
        data_lib.stratified_subset(labels, 0, seed=1)


def test_validation_split_is_fixed_stratified_and_never_trained_on():
    require("mnist")
    images = data_lib.load("mnist")
    val = data_lib.validation_indices(images, 5000)
    assert len(val) == 5000 and torch.equal(val, data_lib.validation_indices(images, 5000))
    share = torch.bincount(images.y_train[val], minlength=10).double() / 5000
    assert torch.allclose(share, torch.bincount(images.y_train).double() / len(images.y_train), atol=1e-3)
    for seed in (0, 1):
        train = data_lib.training_indices(images, None, seed, validation=5000)
        assert len(train) == 55000 and not set(val.tolist()) & set(train.tolist())
        subset = data_lib.training_indices(images, 2000, seed, validation=5000)
        assert len(subset) == 2000 and not set(val.tolist()) & set(subset.tolist())
    # No validation: exactly the indices runs used before there was one.
    assert torch.equal(data_lib.training_indices(images, 2000, 3), data_lib.stratified_subset(images.y_train, 2000, 3))
    with pytest.raises(ValueError, match="--validation"):
        data_lib.validation_indices(images, 60000)
