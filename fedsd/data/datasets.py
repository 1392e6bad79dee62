"""Image data sets as whole tensors: find the files, load them, normalise them, take subsets.

Everything lives in memory as one tensor per split (uint8 on disk, float32 once normalised), so
training samples a batch by indexing and never goes through a DataLoader, PIL or workers.
"""
from __future__ import annotations

import gzip
import os
import pickle
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from fedsd.errors import ConfigError, DataError, DataNotFoundError
from fedsd.data.features import inputs

DATASETS = ("mnist", "fmnist", "cifar10")
BUILTIN_SHAPES = {"mnist": (1, 28), "fmnist": (1, 28), "cifar10": (3, 32)}  # channels, image size
CUSTOM = "custom"  # a task whose data only the clients hold (fedsd.data.client_data)
DATASET_TITLES = {"mnist": "MNIST", "fmnist": "FMNIST", "cifar10": "CIFAR-10"}  # as the papers name them
# Fixed normalisation constants: the public training sets' per-channel mean and std (checked in
# tests/datasets/test_data.py). Every party uses these, never statistics of anybody's private data,
# which would be a release that no accountant covers: a client holding its own data and the
# server evaluating on the public test split then normalise alike.
STANDARD_STATS = {"mnist": ((0.1307,), (0.3081,)), "fmnist": ((0.2860,), (0.3530,)),
                  "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))}
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
# Folders tried under a data root, in order: ours first, then torchvision's layouts.
IDX_FOLDERS = {"mnist": ("mnist", "MNIST/raw"), "fmnist": ("fashion-mnist", "fmnist", "FashionMNIST/raw")}
HOW_TO_GET = {
    "mnist": "pass --data-dir D with D/mnist/ holding the four IDX .gz files, or add --download",
    "fmnist": "run `apt-get install dataset-fashion-mnist` (Debian), pass --data-dir, or add --download",
    "cifar10": "pass --data-dir D with D/cifar10/cifar10.npz or D/cifar-10-batches-py/, or add --download",
}


@dataclass
class ImageData:
    """A labelled image data set: uint8 images (N, C, H, W) and int64 labels, both splits."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str
    # A custom data set's (fedsd.data.client_data.custom_images): its fixed normalisation constants
    # and its number of classes (a class may have no training sample in a subset).
    stats: tuple | None = None
    class_count: int = 0

    @property
    def num_classes(self) -> int:
        return self.class_count or int(self.y_train.max()) + 1

    @property
    def standard_stats(self) -> tuple:
        """The fixed (mean, std) this data set is normalised with unless a run says otherwise."""
        return self.stats or STANDARD_STATS[self.name]

    @cached_property
    def channel_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and std of the training images, scaled to [0, 1] (what
        STANDARD_STATS holds, to four places)."""
        x = self.x_train.to(torch.float64) / 255.0
        return x.mean(dim=(0, 2, 3)).float(), x.std(dim=(0, 2, 3)).float()

    def normalised(self, images: torch.Tensor, stats: tuple | None = None) -> torch.Tensor:
        """Images as float32, scaled to [0, 1], normalised with `stats` (mean, std), by default
        the data set's fixed constants."""
        return normalise(images, *(stats or self.standard_stats))

    def normalised_test(self, stats: tuple | None = None) -> torch.Tensor:
        """The test images normalised with `stats`; with the fixed constants, the one shared copy."""
        if stats is None or tuple(map(tuple, stats)) == tuple(map(tuple, self.standard_stats)):
            return self.normalised_x_test
        return self.normalised(self.x_test, stats)

    @cached_property
    def normalised_x_test(self) -> torch.Tensor:
        """The test images normalised once: a Ray worker prepares a shard for every client it
        serves, and each shares this (nothing writes into it)."""
        return self.normalised(self.x_test)


def normalise(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 images (N, C, H, W) as float32 in [0, 1], then (x - mean) / std per channel."""
    x = images.to(torch.float32) / 255.0
    return (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)


def data_roots(data_dir: str | os.PathLike | None) -> list[Path]:
    roots = []
    if data_dir:
        roots.append(Path(data_dir))
    env = os.environ.get("FEDSD_DATA_DIR")
    if env and Path(env) not in roots:
        roots.append(Path(env))
    return roots


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _idx_folder_candidates(name: str, roots: list[Path]) -> list[Path]:
    folders = [root / sub for root in roots for sub in IDX_FOLDERS[name]]
    if name == "fmnist":
        folders.append(DEBIAN_FASHION_MNIST)
    return folders


def _load_idx(name: str, folder: Path) -> ImageData:
    arrays = {key: _read_idx(folder / fname) for key, fname in IDX_FILES.items()}
    as_images = lambda a: torch.from_numpy(a.copy()).unsqueeze(1)  # noqa: E731  (N, 1, 28, 28)
    as_labels = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return ImageData(name, as_images(arrays["train_images"]), as_labels(arrays["train_labels"]),
                     as_images(arrays["test_images"]), as_labels(arrays["test_labels"]), str(folder))


def _cifar_candidates(roots: list[Path]) -> list[Path]:
    found = []
    for root in roots:
        found += [root / "cifar10" / "cifar10.npz", root / "cifar10.npz",
                  root / "cifar10" / "cifar-10-batches-py", root / "cifar-10-batches-py"]
    return found


def _load_cifar(path: Path) -> ImageData:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            xtr, ytr, xte, yte = z["x_train"], z["y_train"], z["x_test"], z["y_test"]
        to_nchw = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2)))  # noqa: E731
        xtr, xte = to_nchw(xtr), to_nchw(xte)
    else:  # torchvision's pickled batches
        def batch(fname):
            with open(path / fname, "rb") as f:
                try:
                    d = ArraysOnlyUnpickler(f, encoding="latin1").load()
                except pickle.UnpicklingError as e:
                    raise DataError(f"{path / fname}: {e}") from None
            return np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(d["labels"])
        parts = [batch(f"data_batch_{i}") for i in range(1, 6)]
        xtr = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        ytr = np.concatenate([p[1] for p in parts])
        xte_np, yte = batch("test_batch")
        xte = torch.from_numpy(xte_np)
    return ImageData("cifar10", xtr, torch.from_numpy(np.asarray(ytr, dtype=np.int64)),
                     xte, torch.from_numpy(np.asarray(yte, dtype=np.int64)), str(path))


class ArraysOnlyUnpickler(pickle.Unpickler):
    """CIFAR-10's python batches are pickles of dicts of lists, bytes and numpy arrays. A pickle
    can name any callable to run on load; this one builds numpy arrays and nothing else, so a
    file planted where the data set is looked for can be refused data, never run as code."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a data set: this file is refused")
        return super().find_class(module, name)


def _download(name: str, root: Path) -> None:
    import torchvision.datasets as tvd  # only here: a download is the one thing we need it for

    cls = {"mnist": tvd.MNIST, "fmnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10}[name]
    for train in (True, False):
        cls(str(root), train=train, download=True)


def locate(name: str, data_dir=None) -> Path | None:
    """The first place that holds data set `name`, or None."""
    roots = data_roots(data_dir)
    if name == "cifar10":
        candidates = _cifar_candidates(roots)
        return next((p for p in candidates if p.exists()), None)
    candidates = _idx_folder_candidates(name, roots)
    return next((p for p in candidates if all((p / f).exists() for f in IDX_FILES.values())), None)


def places_looked(name: str, data_dir=None) -> list[Path]:
    roots = data_roots(data_dir)
    return _cifar_candidates(roots) if name == "cifar10" else _idx_folder_candidates(name, roots)


_CACHE: dict[tuple, ImageData] = {}


def load(name: str, data_dir=None, download: bool = False) -> ImageData:
    """Load a whole data set; cached per process, so a worker reads the files once."""
    if name not in DATASETS:
        raise ConfigError(f"--dataset: unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    if data_dir and not Path(data_dir).is_dir() and not download:  # a path someone typed: never passed over
        raise DataNotFoundError(f"--data-dir {data_dir}: no such folder")
    key = (name, str(data_dir), os.environ.get("FEDSD_DATA_DIR"))
    if key in _CACHE:
        return _CACHE[key]
    path = locate(name, data_dir)
    if path is None and download:
        root = Path(data_dir or os.environ.get("FEDSD_DATA_DIR") or "data")
        _download(name, root)
        path = locate(name, root)
    if path is None:
        looked = "\n  ".join(str(p) for p in places_looked(name, data_dir)) or "(no --data-dir or FEDSD_DATA_DIR given)"
        raise DataNotFoundError(f"data set {name!r} not found. Looked in:\n  {looked}\nTo get it: {HOW_TO_GET[name]}.")
    data = _load_cifar(path) if name == "cifar10" else _load_idx(name, path)
    _CACHE[key] = data
    return data


def stratified_subset(labels: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """A fixed, seeded, class-stratified choice of `size` indices (sorted ascending).

    Each class gets its share of `size` in proportion to its frequency (largest remainders
    break ties), so a subset keeps the training set's class balance.
    """
    n = len(labels)
    if not 1 <= size <= n:
        raise ConfigError(f"--subset: must be between 1 and the training set's size {n}, got {size}")
    if size == n:
        return torch.arange(n)
    counts = torch.bincount(labels).double()
    share = counts * size / n
    take = share.floor().long()
    remainder_order = torch.argsort(share - take, descending=True, stable=True)
    take[remainder_order[: size - int(take.sum())]] += 1
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for c, k in enumerate(take.tolist()):
        members = torch.nonzero(labels == c).flatten()
        chosen.append(members[torch.randperm(len(members), generator=g)[:k]])
    return torch.sort(torch.cat(chosen)).values


# One held-out set per data set and size, whatever the run's seed: every run of a sweep is
# judged on the same samples, and none of them is ever trained on.
VALIDATION_SEED = 7919


def validation_indices(data: ImageData, size: int) -> torch.Tensor:
    """The --validation split: `size` training samples, fixed and class-stratified."""
    if size == 0:
        return torch.zeros(0, dtype=torch.long)
    if not 1 <= size < len(data.y_train):
        raise ConfigError(f"--validation: must be in [0, {len(data.y_train)}) for this training set, got {size}")
    return stratified_subset(data.y_train, size, VALIDATION_SEED)


def validation_split(data: ImageData, size: int, stats: tuple | None = None,
                     features="none") -> tuple[torch.Tensor, torch.Tensor]:
    """The --validation split's images (normalised with `stats`, as ImageData.normalised; their
    `features`, as prepare) and labels (empty for size 0)."""

    held_out = validation_indices(data, size)
    return (inputs(data.normalised(data.x_train[held_out], stats), features, "validation images"),
            data.y_train[held_out].clone())


def training_indices(data: ImageData, subset: int | None, seed: int, validation: int = 0,
                     public_first: int = 0) -> torch.Tensor:
    """The training samples a run uses: the training set less the --validation split and the
    first `public_first` images (--public-first: a public set, never trained on privately), then
    a seeded stratified --subset of that, or all of it."""
    pool = torch.arange(len(data.y_train))
    if validation:
        keep = torch.ones(len(pool), dtype=torch.bool)
        keep[validation_indices(data, validation)] = False
        pool = pool[keep]
    if public_first:
        if public_first >= len(data.y_train):
            raise ConfigError(f"--public-first: must be below the {len(data.y_train)} training samples, "
                              f"got {public_first}")
        pool = pool[pool >= public_first]
    if subset is None:
        return pool
    if subset > len(pool):
        raise ConfigError(f"--subset: must be between 1 and the {len(pool)} training samples left, got {subset}")
    return pool[stratified_subset(data.y_train[pool], subset, seed)]


@dataclass
class TensorData:
    """Normalised training and test tensors, ready for a training run (possibly on a GPU)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def to(self, device, memory_format: torch.memory_format = torch.preserve_format) -> "TensorData":
        """On `device`, the images in `memory_format` (a no-op for what already is)."""
        def images(x):
            x = x.to(device)
            return x if memory_format is torch.preserve_format else x.contiguous(memory_format=memory_format)
        return TensorData(images(self.x_train), self.y_train.to(device), images(self.x_test),
                          self.y_test.to(device), self.num_classes)


def prepare(data: ImageData, train_indices: torch.Tensor | None = None, device="cpu",
            stats: tuple | None = None, features="none") -> TensorData:
    """Normalise with `stats` (a run's --mean / --std: client_data.input_stats; by default the
    data set's fixed constants), keep the chosen training indices, and make the run's
    `features` of both (fedsd.data.features: computed on this machine, from these images only)."""

    x_train, y_train = data.x_train, data.y_train
    if train_indices is not None:
        x_train, y_train = x_train[train_indices], y_train[train_indices]
    return TensorData(inputs(data.normalised(x_train, stats), features, "training images"), y_train.clone(),
                      inputs(data.normalised_test(stats), features, "test images"), data.y_test.clone(),
                      data.num_classes).to(device)
