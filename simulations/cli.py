"""The `fedsd` command: train (central), simulate (federated, Ray), bench, reproduce, sweep, audit."""
from __future__ import annotations

# An entry point: fedsd's process-wide speed settings, before torch loads (fedsd/runtime.py).
from fedsd.runtime import tune_process

tune_process()

import argparse
import sys

from fedsd.config import TrainConfig
from fedsd.errors import ConfigError, UserError
from fedsd.settings import add_options, from_args, settings_of
from simulations import dry_run
from fedsd.summary import run_summary


def add_train_options(p: argparse.ArgumentParser, epsilon_required: bool = True, out_required: bool = True) -> None:
    """Every TrainConfig setting as an option (declared once, in fedsd.config), and the run's folder."""
    add_options(p, TrainConfig, required=("epsilon",) if epsilon_required else ())
    p.add_argument("--out", required=out_required, help="result folder (must be new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--route-from", metavar="RUN", default=None,
                   help="take the clipping route the run in folder RUN recorded (its result.json or checkpoint): "
                        "its weights again, on any machine with the same thread count and instruction set")
    p.add_argument("--log-dir", default=None, help="TensorBoard log folder, per epoch or round: accuracy, loss, ε "
                   "(each client's too), and the settings as hparams (default: OUT/tensorboard where TensorBoard is "
                   "installed, pip install 'fedsd[tensorboard]'; off: none)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The settings given, with --route-from's route as --route (checked against the run's network,
    input and thread count)."""
    cfg = from_args(TrainConfig, args)
    if getattr(args, "route_from", None):
        import dataclasses

        from fedsd import routes
        from fedsd.client_data import with_custom_task

        if cfg.route:
            raise ConfigError("--route-from: gives the run's route; leave out --route")
        cfg = dataclasses.replace(cfg, route=routes.route_from(args.route_from, with_custom_task(cfg).resolved()))
    return cfg


def cmd_train(args) -> int:
    from fedsd.central import load_checkpoint, plan_run, train

    if args.resume:
        given = [s.flag for s in settings_of(TrainConfig) if hasattr(args, s.name)]
        given += [flag for flag, on in (("--out", args.out), ("--overwrite", args.overwrite),
                                        ("--route-from", args.route_from)) if on]
        if given:
            raise ConfigError(f"--resume DIR goes on with that run's own saved settings and folder; leave out "
                             f"{', '.join(given)}")
        saved = load_checkpoint(args.resume)  # every check before any work
        if dry_run.requested():
            plan_run(saved["config"])
            dry_run.stop_here(f"resume {args.resume} after epoch {len(saved['epochs'])} of {saved['config'].epochs}")
        result, _ = train(None, args.resume, resume=True, progress=not args.quiet, log_dir=args.log_dir)
        print(run_summary(result, args.resume))
        return 0
    missing = [flag for flag, value in (("--epsilon", getattr(args, "epsilon", None)), ("--out", args.out)) if value is None]
    if missing:
        raise ConfigError(f"the following arguments are required: {', '.join(missing)} (or --resume DIR)")
    if dry_run.requested():  # train() runs the same checks first
        inputs, plan = plan_run(config_from_args(args), args.out, args.overwrite)
        cfg = inputs.cfg
        dry_run.stop_here(f"train {cfg.method} on {len(inputs.train_indices)} {cfg.dataset} samples for {cfg.epochs} "
                          f"epochs at B = {cfg.batch_size}, lr {cfg.lr:g}, momentum {cfg.momentum:g}, "
                          f"σ={plan.noise_multiplier:.3f}, q={plan.sample_rate:.4g} (ε={cfg.epsilon:g}) into {args.out}")
    result, _ = train(config_from_args(args), args.out, overwrite=args.overwrite, progress=not args.quiet,
                      log_dir=args.log_dir)
    print(run_summary(result, args.out))
    return 0


def cmd_simulate(args) -> int:
    from fedsd.fed_settings import FedOptions
    from simulations.simulate import simulate, sim_options_from_args

    fed = sim_options_from_args(args)
    if hasattr(args, "epochs"):
        raise ConfigError("--epochs: a federation's length is --rounds × --local-epochs (each client plans its "
                          "privacy for them); leave --epochs out")
    if fed.resume_dir:
        given = [s.flag for cls in (TrainConfig, FedOptions) for s in settings_of(cls)
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
    return 0


class Parser(argparse.ArgumentParser):
    """argparse, stricter and shorter: no abbreviated options (`--verbos` is not taken for
    `--verbose`), and a bad option or value answered in one line, with the nearest allowed one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        import difflib
        import re

        hint = ""
        if m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            close = difflib.get_close_matches(m.group(1), [c.strip(" '") for c in m.group(2).split(",")], n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
        elif m := re.search(r"unrecognized arguments: (--[\w-]+)", message):
            options = [o for action in self._actions for o in action.option_strings]
            close = difflib.get_close_matches(m.group(1), options, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (all options: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from fedsd import __version__

    parser = Parser(prog="fedsd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fedsd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # each command's own parser: it answers for the options given to it
    p_train = sub.add_parser("train", help="central DP training (the papers' setup)")
    add_train_options(p_train, epsilon_required=False, out_required=False)
    # Required unless --resume (argparse cannot say "one of"): its help must not show the
    # declared default, 3.0, which only `fedsd simulate` and a Flower run take.
    epsilon = next(a for a in p_train._actions if a.dest == "epsilon")
    epsilon.help = epsilon.help.split(" (default:")[0] + " (required, unless --resume)"
    p_train.add_argument("--resume", metavar="DIR", default=None,
                         help="continue the unfinished run in DIR (stopped at any moment) with its own saved "
                              "settings; it ends with the weights of a run that was never stopped")
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
    from simulations.audit import add_audit_parser
    from simulations.bench import add_bench_parser
    from simulations.ledger import add_ledger_parser
    from simulations.privacy_check import add_check_parser
    from simulations.reproduce import add_reproduce_parser
    from simulations.split_data import add_split_data_parser
    from simulations.sweep import add_sweep_parser

    add_bench_parser(sub)
    add_reproduce_parser(sub)
    add_sweep_parser(sub)
    add_split_data_parser(sub)
    add_audit_parser(sub)
    add_ledger_parser(sub)
    add_check_parser(sub)
    add_data_service_parser(sub)
    return parser


def add_data_service_parser(sub) -> None:
    try:
        from clients.data_service import add_service_arguments, run_service
    except ImportError:  # Flower not installed: no client machine to serve, central training still works
        return

    p = sub.add_parser("data-service", help="a client machine's data service: the owner's process that alone reads "
                                            "the node's data, state and budget (deploy/README.md)",
                       description="Run as the data owner, from the owner's installation. The SuperNode (another user) "
                                   "gets --node-config \"partition-id=K service='SOCKET'\"; its ClientApp only "
                                   "forwards messages here.")
    add_service_arguments(p)
    p.set_defaults(func=run_service)


def say_notes_in_one_line() -> None:
    """fedsd's notes (FedsdNote) as one line each on stderr, `fedsd: note: …`, not Python's
    two-line warning with a file and line; other warnings as Python shows them."""
    import warnings

    from fedsd.errors import FedsdNote

    shown = warnings.showwarning
    if getattr(shown, "fedsd", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, FedsdNote):
            print(f"fedsd: note: {message}", file=file or sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    show.fedsd = True
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    say_notes_in_one_line()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command they were given to, with its nearest option
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except dry_run.DryRun as e:
        print(f"fedsd {args.command}: dry run: every check passed; would {e}")
        return 0
    except KeyboardInterrupt:
        print("fedsd: interrupted; nothing was written", file=sys.stderr)
        return 130
    except UserError as e:  # bad input: one clear line, no traceback (anything else is a bug: its traceback)
        print(f"fedsd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
