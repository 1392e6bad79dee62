"""The `fedsd` command: train (central), simulate (federated, Ray), bench, reproduce, sweep."""
from __future__ import annotations

import argparse
import json
import sys

from fedsd.config import ACCOUNTANTS, DEVICES, GRAD_SAMPLE_MODES, MEMORY_FORMATS, METHODS, TrainConfig
from fedsd.data import DATASETS

# TrainConfig fields set from the command line, with their flag's type.
TRAIN_OPTIONS = {
    "epsilon": float, "delta": float, "epochs": int, "batch_size": int, "lr": float, "clip": float,
    "momentum": float, "tau_s": float, "tau_t": float, "tau": float, "alpha": float, "beta": float,
    "ema_decay": float, "distill_warmup_epochs": int, "kd_teacher_epochs": int, "subset": int,
    "seed": int, "threads": int, "validation": int,
}


def add_train_options(p: argparse.ArgumentParser, epsilon_required: bool = True, out_required: bool = True) -> None:
    p.add_argument("--dataset", choices=DATASETS, default="fmnist")
    p.add_argument("--method", choices=METHODS, default="dp3sd")
    p.add_argument("--accountant", choices=ACCOUNTANTS, default="rdp")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--grad-sample-mode", choices=GRAD_SAMPLE_MODES, default=TrainConfig.grad_sample_mode,
                   help="per-sample clipping route; all give the same weights and ε (default: %(default)s, "
                        "the fastest)")
    p.add_argument("--memory-format", choices=MEMORY_FORMATS, default=TrainConfig.memory_format,
                   help="image and activation layout; auto: channels-last where the mode is exact under it")
    p.add_argument("--model", default=None, help="mnist-cnn or cifar-cnn (default: the data set's)")
    for name, typ in TRAIN_OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        if name == "epsilon":
            p.add_argument(flag, type=typ, required=epsilon_required, default=3.0 if not epsilon_required else None)
        else:
            p.add_argument(flag, type=typ, default=None)
    p.add_argument("--data-dir", default=None, help="root with mnist/, fashion-mnist/, cifar10/ (or FEDSD_DATA_DIR)")
    p.add_argument("--download", action="store_true", help="download with torchvision when not found")
    p.add_argument("--out", required=out_required, help="result folder (must be new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {name: getattr(args, name) for name in TRAIN_OPTIONS if getattr(args, name) is not None}
    return TrainConfig(dataset=args.dataset, method=args.method, accountant=args.accountant, device=args.device,
                       grad_sample_mode=args.grad_sample_mode, memory_format=args.memory_format, model=args.model, data_dir=args.data_dir,
                       download=args.download, **values)


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
    if args.resume:
        fed.resume_dir = args.resume
    elif not args.out:
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
    from simulations.sweep import add_sweep_parser

    add_bench_parser(sub)
    add_reproduce_parser(sub)
    add_sweep_parser(sub)
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
