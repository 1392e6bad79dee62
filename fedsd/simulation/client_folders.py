"""A built-in data set cut into one folder per client (`fedsd split-data`), in the formats a
SuperNode's `--node-config data=...` reads, so a new user can try a real deployment where each
client holds its own files.

    DIR/client-K/train/<label>/<n>.png, DIR/client-K/test/<label>/<n>.png   (--format imagefolder)
    DIR/client-K/data.npz with x_train, y_train, x_test, y_test             (--format npz)

Training samples are split with the simulations' partitioner (same shards as `fedsd simulate`
with the same settings); the public test split is dealt out evenly, so every client also has a
test split of its own for federated evaluation.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedsd.settings.run import TrainConfig
from fedsd.errors import ConfigError
from fedsd.settings.federation import FedConfig
from fedsd.data import datasets as data_lib
from fedsd.files.results import check_out_dir, staged_out_dir
from fedsd import dry_run
from fedsd.app.simulated_shards import cut_shards

FORMATS = ("imagefolder", "npz")


def write_client_folders(cfg: TrainConfig, fed: FedConfig, out: Path, fmt: str, overwrite: bool = False,
                         echo=print) -> None:
    """out/client-K for every client of `fed`: its shard of cfg.dataset's training split (as
    `fedsd simulate` cuts it) and an even share of the test split, in `fmt`. Checks first;
    writes into a staging folder that becomes `out` only when every client's is written."""
    if cfg.dataset not in data_lib.DATASETS:
        raise ConfigError(f"--dataset: split-data cuts a built-in data set; "
                          f"choose one of {', '.join(data_lib.DATASETS)}")
    fed.validate()
    check_out_dir(out, overwrite)
    images, indices, parts = cut_shards(cfg, fed)
    dry_run.stop_here(f"write {fed.num_clients} client folders ({fmt}, {len(indices)} training samples) into {out}")
    test_parts = np.array_split(np.random.default_rng(cfg.seed).permutation(len(images.y_test)), fed.num_clients)
    with staged_out_dir(out, overwrite) as scratch:
        for k, part in enumerate(parts):
            chosen = indices[part]
            test = torch.from_numpy(np.sort(test_parts[k]))
            splits = {"train": (images.x_train[chosen], images.y_train[chosen]),
                      "test": (images.x_test[test], images.y_test[test])}
            folder = Path(scratch) / f"client-{k}"
            folder.mkdir()
            (_write_npz if fmt == "npz" else _write_imagefolder)(folder, splits)
            echo(f"client-{k}: {len(chosen)} training and {len(test)} test images")


def _write_npz(folder: Path, splits: dict) -> None:
    arrays = {}
    for split, (x, y) in splits.items():
        arrays[f"x_{split}"] = x.permute(0, 2, 3, 1).numpy()  # N×H×W×C, as image arrays usually are
        arrays[f"y_{split}"] = y.numpy()
    np.savez_compressed(folder / "data.npz", **arrays)


def _write_imagefolder(folder: Path, splits: dict) -> None:
    from torchvision.io import write_png

    for split, (x, y) in splits.items():
        for n, (image, label) in enumerate(zip(x, y.tolist())):
            target = folder / split / str(label)
            target.mkdir(parents=True, exist_ok=True)
            write_png(image, str(target / f"{n}.png"))
