"""`fedsd pretrain`: a network trained without privacy on public data, saved as a weights file
that `--init-weights` reads (a plain state dict).

It is for public data only: no clipping, no noise, no accountant. Its uses here are to make the
public pretrained network a demonstration needs where no network can be downloaded (a network
pretrained on Fashion-MNIST, then fine-tuned privately on MNIST), or, with `--first N`, on the
first N training images of a data set, which the private run then leaves out (`fedsd train
--public-first N`). Beside FILE it writes FILE.json: its settings, its test (and validation)
accuracy per epoch and the file's sha256, which a private run started from it records.

    fedsd pretrain --dataset fmnist --model mnist-cnn --epochs 10 --out pretrained/fmnist-mnist-cnn.pt

A FILE that FILE.json says was made with the same settings is kept (nothing to do), as a
finished run is; one made otherwise is refused unless --overwrite.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from fedsd.data import datasets as data_lib
from fedsd.files.atomic import save_atomic, write_json
from fedsd.settings.run import TrainConfig
from fedsd.errors import ConfigError, OutputExistsError
from fedsd.models.networks import build_model, image_shape_of
from fedsd.models.pretrained import sha256_of
from fedsd.settings.declared import add_options, from_args
from fedsd.training.loop import evaluate
from fedsd import dry_run


def add_pretrain_parser(sub) -> None:
    p = sub.add_parser("pretrain", help="train a network without privacy on public data, for --init-weights")
    add_options(p, TrainConfig, only=("dataset", "model", "activation", "seed", "threads", "validation", "data_dir",
                                      "download"))
    p.add_argument("--epochs", type=int, default=10, help="passes over the public data (default: 10)")
    p.add_argument("--batch-size", type=int, default=128, help="batch size (default: 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (default: 0.001)")
    p.add_argument("--first", type=int, default=0, metavar="N",
                   help="train on the first N training images only: the public part of a data set whose other "
                        "images a private run trains on (fedsd train --public-first N); default: all of them")
    p.add_argument("--out", required=True, help="the weights file to write (a state dict), with FILE.json beside it")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(func=cmd_pretrain)


def cmd_pretrain(args: argparse.Namespace) -> int:
    cfg = from_args(TrainConfig, args, method="dpsgd").resolved()
    record = pretrain(cfg, args.epochs, args.batch_size, args.lr, args.first, Path(args.out), args.overwrite)
    last = record["epochs"][-1]
    print(f"fedsd: pretrained {cfg.model} on {record['num_train']} public {cfg.dataset} images without privacy, "
          f"{record['wall_seconds']:.0f} s\n  test accuracy  {100 * last['test_accuracy']:.2f} %\n"
          f"  files          {Path(args.out).absolute()} (sha256 {record['sha256']}) and its .json")
    return 0


def made_with(out: Path) -> dict | None:
    """What FILE.json says a finished `fedsd pretrain` made FILE with, where FILE is that file
    still (its sha256); else None."""
    import json

    try:
        made = json.loads(out.with_name(out.name + ".json").read_text())
    except (OSError, ValueError):
        return None
    return made if isinstance(made, dict) and made.get("sha256") == sha256_of(out) else None


def pretrain(cfg: TrainConfig, epochs: int, batch_size: int, lr: float, first: int, out: Path,
             overwrite: bool = False) -> dict:
    for flag, value in (("--epochs", epochs), ("--batch-size", batch_size)):
        if value < 1:
            raise ConfigError(f"{flag}: must be >= 1, got {value}")
    if not lr > 0:
        raise ConfigError(f"--lr: must be > 0, got {lr}")
    settings = dict(dataset=cfg.dataset, model=cfg.model, activation=cfg.activation, seed=cfg.seed,
                    epochs_planned=epochs, batch_size=batch_size, lr=lr, optimizer="adam", first=first or None,
                    validation=cfg.validation)
    if out.exists() and not overwrite:
        made = made_with(out)
        if made is None or {k: made.get(k) for k in settings} != settings:
            raise OutputExistsError(f"--out: {out} exists, made with other settings or not by fedsd pretrain; choose a "
                                    f"new file or pass --overwrite")
        dry_run.stop_here(f"pretrain nothing: {out} is made with these settings (sha256 {made['sha256'][:16]}…)")
        return made
    images = data_lib.load(cfg.dataset, cfg.data_dir, cfg.download)
    if not 0 <= first < len(images.y_train):
        raise ConfigError(f"--first: must be in [0, {len(images.y_train)}), got {first}")
    indices = data_lib.training_indices(images, None, cfg.seed, cfg.validation)
    if first:
        indices = indices[indices < first]
    channels, size = image_shape_of(cfg)
    dry_run.stop_here(f"pretrain {cfg.model} without privacy on {len(indices)} public {cfg.dataset} images for "
                      f"{epochs} epochs (Adam, lr {lr:g}, B = {batch_size}) into {out}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tensors = data_lib.prepare(images, indices)
    validation = data_lib.validation_split(images, cfg.validation) if cfg.validation else None
    model = build_model(cfg.model, images.num_classes, seed=cfg.seed, activation=cfg.activation, channels=channels,
                        image_size=size)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(cfg.seed)
    started, record = time.perf_counter(), []
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(len(tensors.y_train), generator=generator)
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(tensors.x_train[batch]), tensors.y_train[batch]).backward()
            optimizer.step()
        accuracy, loss = evaluate(model, tensors.x_test, tensors.y_test)
        row = dict(epoch=epoch, test_accuracy=accuracy, test_loss=loss)
        if validation is not None:
            row["validation_accuracy"] = evaluate(model, *validation)[0]
        record.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(out, {k: v.detach().cpu() for k, v in model.state_dict().items()})
    result = dict(kind="fedsd pretrain (no privacy: public data only)", **settings, num_train=len(indices),
                  wall_seconds=time.perf_counter() - started, sha256=sha256_of(out), epochs=record)
    write_json(out.with_name(out.name + ".json"), result)
    return result
