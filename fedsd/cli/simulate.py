"""`fedsd simulate`: the Flower app on Flower's simulation engine (Ray backend), or with secure
aggregation and distributed noise, the in-process secure federation (fedsd.simulation)."""
from __future__ import annotations

import argparse
import sys

from fedsd.settings.run import TrainConfig
from fedsd.errors import ConfigError
from fedsd.settings.federation import FedConfig
from fedsd.settings.declared import add_options, from_args, settings_of
from fedsd.settings.recipe_files import add_recipe_option, blamed_on, with_recipe
from fedsd.simulation.engine import simulate
from fedsd.training.summary import nothing_trained, run_summary
from fedsd.cli.train import add_train_options, config_from_args


def add_sim_options(p: argparse.ArgumentParser) -> None:
    """Every FedConfig setting as an option (declared once, in fedsd.settings.federation)."""
    add_options(p, FedConfig)
    p.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                   help="run on this running Ray cluster (`ray start --head` on one node, `ray start "
                        "--address=HOST:PORT` on the others) instead of a private Ray instance on this machine; "
                        "auto: RAY_ADDRESS, else the cluster last started on this machine")
    p.add_argument("--verbose", action="store_true",
                   help="Flower's full log (every message, with timestamps) and the clients' output")


def sim_options_from_args(args: argparse.Namespace) -> FedConfig:
    return from_args(FedConfig, args)


def add_simulate_parser(sub) -> None:
    p_sim = sub.add_parser("simulate", help="federated simulation on Flower's Ray engine")
    add_train_options(p_sim, epsilon_required=False, out_required=False)
    add_sim_options(p_sim)
    add_recipe_option(p_sim, "simulate")
    p_sim.set_defaults(func=cmd_simulate)


def cmd_simulate(args) -> int:
    recipe = with_recipe(args, "simulate")
    with blamed_on(recipe, args):
        return _simulate(args)


def _simulate(args) -> int:
    fed = sim_options_from_args(args)
    if hasattr(args, "epochs"):
        raise ConfigError("--epochs: a federation's length is --rounds × --local-epochs (each client plans its "
                          "privacy for them); leave --epochs out")
    if fed.resume_dir:
        given = [s.flag for cls in (TrainConfig, FedConfig) for s in settings_of(cls)
                 if hasattr(args, s.name) and s.name != "resume_dir"]
        given += [flag for flag, on in (("--out", args.out), ("--overwrite", args.overwrite),
                                        ("--route-from", args.route_from)) if on]
        if given:
            raise ConfigError(f"--resume DIR goes on with that run's own saved settings and folder; leave out "
                              f"{', '.join(given)}")
    if not fed.resume_dir and not args.out:
        raise ConfigError("--out is required (or --resume DIR)")
    result, _ = simulate(config_from_args(args), fed, args.out, overwrite=args.overwrite, progress=not args.quiet,
                      verbose=args.verbose, ray_address=args.ray_address, log_dir=args.log_dir)
    print(run_summary(result, fed.resume_dir or args.out))
    why = nothing_trained(result, fed.resume_dir or args.out)
    if why:
        print(f"fedsd simulate: error: {why}", file=sys.stderr)
        return 1
    return 0

