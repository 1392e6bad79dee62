"""Loading the real data sets as whole tensors, finding them, subsets."""
import numpy as np
import pytest
import torch

from fedsd.data import datasets as data_lib
from tests.conftest import require, write_cifar_shaped, write_idx_dataset


def test_idx_files_load_as_written(tmp_path):
    """MNIST's file format (and Fashion-MNIST's), on files the test writes in it."""
    written = write_idx_dataset(tmp_path / "mnist", n_train=90, n_test=30)
    d = data_lib.load("mnist", data_dir=tmp_path)
    assert d.x_train.shape == (90, 1, 28, 28) and d.x_train.dtype == torch.uint8 and d.x_test.shape == (30, 1, 28, 28)
    assert torch.equal(d.x_train[:, 0], torch.from_numpy(written["train_images"]))
    assert d.y_test.tolist() == written["test_labels"].tolist() and d.y_train.dtype == torch.int64
    assert d.source == str(tmp_path / "mnist")
    mean, std = d.channel_stats
    assert mean.item() == pytest.approx(written["train_images"].mean() / 255, abs=1e-6)


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
    """CIFAR-10's two layouts (the npz, torchvision's pickled batches), on a CIFAR-shaped set
    the test makes; the real set's statistics are data_lib.STANDARD_STATS' (checked where it is)."""
    d = data_lib.load("cifar10", data_dir=write_cifar_shaped(tmp_path / "npz", n_train=500, n_test=100))
    assert d.x_train.shape == (500, 3, 32, 32) and d.y_train.shape == (500,) and d.x_train.dtype == torch.uint8
    import pickle
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    flat = d.x_train.numpy().reshape(500, 3072)
    for i in range(5):
        with open(folder / f"data_batch_{i + 1}", "wb") as f:
            pickle.dump({"data": flat[i * 100:(i + 1) * 100], "labels": d.y_train[i * 100:(i + 1) * 100].tolist()}, f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"data": d.x_test.numpy().reshape(100, 3072), "labels": d.y_test.tolist()}, f)
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
    require("fmnist")
    images = data_lib.load("fmnist")
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
