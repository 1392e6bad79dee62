"""The `fedsd` command: train (central), simulate (federated, Ray), bench, reproduce, sweep."""
from __future__ import annotations

import argparse
import json
import sys

from fedsd.config import TrainConfig
from fedsd.settings import add_options, from_args


def add_train_options(p: argparse.ArgumentParser, epsilon_required: bool = True, out_required: bool = True) -> None:
    """Every TrainConfig setting as an option (declared once, in fedsd.config), and the run's folder."""
    add_options(p, TrainConfig, required=("epsilon",) if epsilon_required else ())
    p.add_argument("--out", required=out_required, help="result folder (must be new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return from_args(TrainConfig, args)


def cmd_train(args) -> int:
    from fedsd.central import train

    result, _ = train(config_from_args(args), args.out, overwrite=args.overwrite, progress=not args.quiet)
    summary = {k: result[k] for k in ("dataset", "method", "epsilon_target", "epsilon_spent",
                                      "noise_multiplier", "steps", "test_accuracy", "wall_seconds")}
    print(json.dumps(summary, indent=2))
    return 0


def cmd_simulate(args) -> int:
    from simulations.simulate import simulate, sim_options_from_args

    fed = sim_options_from_args(args)
    if not fed.resume_dir and not args.out:
        raise ValueError("--out is required (or --resume DIR)")
    result = simulate(config_from_args(args), fed, args.out, overwrite=args.overwrite, progress=not args.quiet)
    print(json.dumps({k: result[k] for k in ("dataset", "method", "test_accuracy", "wall_seconds")}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="central DP training (the papers' setup)")
    add_train_options(p_train)
    p_train.set_defaults(func=cmd_train)
    try:
        from simulations.simulate import add_sim_options
    except ImportError:  # Flower not installed: central training still works
        add_sim_options = None
    if add_sim_options is not None:
        p_sim = sub.add_parser("simulate", help="federated simulation on Flower's Ray engine")
        add_train_options(p_sim, epsilon_required=False, out_required=False)
        add_sim_options(p_sim)
        p_sim.set_defaults(func=cmd_simulate)
    from simulations.bench import add_bench_parser
    from simulations.reproduce import add_reproduce_parser
    from simulations.split_data import add_split_data_parser
    from simulations.sweep import add_sweep_parser

    add_bench_parser(sub)
    add_reproduce_parser(sub)
    add_sweep_parser(sub)
    add_split_data_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("fedsd: interrupted; nothing was written", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # bad input: one clear line, no traceback
        print(f"fedsd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
