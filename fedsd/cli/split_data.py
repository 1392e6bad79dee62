"""`fedsd split-data`: a built-in data set cut into one folder per client
(fedsd.simulation.client_folders), for a new user's real deployment."""
from __future__ import annotations

import argparse
from pathlib import Path

from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig
from fedsd.settings.declared import add_options, from_args
from fedsd.simulation.client_folders import FORMATS, write_client_folders


def add_split_data_parser(sub) -> None:
    p = sub.add_parser("split-data", help="write one data folder per client from a built-in data set")
    add_options(p, TrainConfig, only=("dataset", "subset", "seed", "validation", "data_dir", "download"))
    add_options(p, FedConfig, only=("num_clients", "partition", "dirichlet_alpha", "classes_per_client"))
    p.add_argument("--format", choices=FORMATS, required=True, help="imagefolder (PNG files) or npz (arrays)")
    p.add_argument("--out", required=True, help="folder to write client-0/, client-1/, … into (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=cmd_split_data)


def cmd_split_data(args: argparse.Namespace) -> int:
    cfg, fed = from_args(TrainConfig, args), from_args(FedConfig, args)
    write_client_folders(cfg, fed, Path(args.out), args.format, args.overwrite)
    print(f"wrote {fed.num_clients} client folders to {args.out} ({args.format}); start SuperNode k with "
          f"--node-config \"data='{Path(args.out).absolute()}/client-k' max-epsilon=… ...\"")
    return 0

