"""The `fedsd` command: train centrally or simulate a federation, prepare and check a client's data and
privacy, choose settings and measure; and, apart, this repository's experiments (`fedsd reproduce`).
The methods, their settings and the privacy accounting: docs/algorithms.md."""
from __future__ import annotations

import sys

if __name__ == "__main__" and not sys.flags.safe_path and "data-service" in sys.argv[1:]:
    # Before any other import: `python -m` put the working directory first on sys.path, and the
    # owner's service would import (and run, as the owner) a package planted there.
    sys.exit(f"python -m simulations.cli data-service: refused, as the working directory ({sys.path[0]}) is first "
             f"on the import path and a package planted there would run as the data's owner; start the service "
             f"with `fedsd data-service` (deploy/README.md)")

# An entry point: fedsd's process-wide speed settings, before torch loads (fedsd/runtime.py).
from fedsd.runtime import tune_process

tune_process()

import argparse
import os

import warnings

from fedsd import __version__
from fedsd.central import load_checkpoint, plan_run, train
from fedsd.config import TrainConfig
from fedsd.errors import ConfigError, FedsdNote, UserError
from fedsd.models import start_report
from fedsd.pretrained import start_line
from fedsd.fed_settings import FedOptions
from fedsd.settings import add_options, from_args, settings_of
from fedsd.summary import run_summary
from simulations.benchmarks.bench import add_bench_parser
from simulations.commands import dry_run
from simulations.commands.audit_command import add_audit_parser
from simulations.commands.ledger_command import add_ledger_parser
from simulations.commands.parsing import Parser
from simulations.commands.pretrain import add_pretrain_parser
from simulations.commands.privacy_check import add_check_parser
from simulations.commands.simulate import add_sim_options, sim_options_from_args, simulate
from simulations.commands.split_data import add_split_data_parser
from simulations.commands.sweep import add_sweep_parser

try:  # a client machine's data service (Flower's); without Flower, central training still works
    from clients.data_service import add_service_arguments, run_service
except ImportError:
    add_service_arguments = run_service = None


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
                          f"σ={plan.noise_multiplier:.3f}, q={plan.sample_rate:.4g} (ε={cfg.epsilon:g}) into {args.out}"
                          + (f"; {start_line(start_report(cfg, inputs.data.num_classes))}"
                             if start_report(cfg, inputs.data.num_classes) else ""))
    result, _ = train(config_from_args(args), args.out, overwrite=args.overwrite, progress=not args.quiet,
                      log_dir=args.log_dir)
    print(run_summary(result, args.out))
    return 0


def cmd_simulate(args) -> int:
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


# The product's commands, grouped as `fedsd --help` lists them.
COMMAND_GROUPS = (
    ("training", ("train", "simulate", "pretrain")),
    ("a client's data and privacy", ("split-data", "data-service", "ledger", "check-privacy", "audit")),
    ("choose settings and measure", ("sweep", "bench")),
)
# This repository's own result tables: experiments, not the product. `fedsd reproduce` loads
# them only when it is asked for (simulations/experiments/reproduce.py has its own parser).
EXPERIMENTS = "reproduce"
EXPERIMENTS_TITLE = "this repository's result tables (experiments, run from a checkout)"
EXPERIMENTS_HELP = "the papers' Table 1 / Table 2, the federated, readings, features and distributed tables, resumable"


class CommandsHelp(argparse.RawDescriptionHelpFormatter):
    """`fedsd --help`: the commands by group, not argparse's one list."""

    def _format_action(self, action):
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            width = max(map(len, helps)) + 2
            lines = []
            for title, names in COMMAND_GROUPS + ((EXPERIMENTS_TITLE, (EXPERIMENTS,)),):
                lines += [f"  {title}:"] + [f"    {n.ljust(width)}{helps[n]}" for n in names if n in helps] + [""]
            return "\n".join(lines)
        return super()._format_action(action)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fedsd", description=__doc__, formatter_class=CommandsHelp)
    parser.add_argument("--version", action="version", version=f"fedsd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    parser.commands = sub.choices  # each command's own parser: it answers for the options given to it
    add_train_parser(sub)
    p_sim = sub.add_parser("simulate", help="federated simulation on Flower's Ray engine")
    add_train_options(p_sim, epsilon_required=False, out_required=False)
    add_sim_options(p_sim)
    add_pretrain_parser(sub)
    p_sim.set_defaults(func=cmd_simulate)
    for add in (add_split_data_parser, add_data_service_parser, add_ledger_parser, add_check_parser,
                add_audit_parser, add_sweep_parser, add_bench_parser):
        add(sub)
    # listed, and named in "did you mean"; main() hands its arguments to the experiments' own parser
    sub.add_parser(EXPERIMENTS, help=EXPERIMENTS_HELP, add_help=False)
    return parser


def add_train_parser(sub) -> None:
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


def add_data_service_parser(sub) -> None:
    if add_service_arguments is None:  # Flower not installed: no client machine to serve
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


def users_modules_from_working_directory() -> None:
    """A user's own network (`--model package.module:callable`) is found as `python -m` would
    find it: on the Python path, then in the working directory, which a console script such as
    `fedsd` does not put there. Said here, at the entry point of the user's own commands, and
    never in the owner's data service (`fedsd data-service`), which imports no code a server
    names; fedsd itself never touches sys.path."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def main(argv: list[str] | None = None) -> int:
    say_notes_in_one_line()
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parse_experiment(argv[1:]) if argv[:1] == [EXPERIMENTS] else parse_command(argv))


def parse_command(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command they were given to, with its nearest option
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command != "data-service":
        users_modules_from_working_directory()
    return args


def parse_experiment(argv: list[str]) -> argparse.Namespace:
    """`fedsd reproduce`: the experiments are imported here, only when asked for."""
    from simulations.experiments.reproduce import reproduce_parser

    return reproduce_parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
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
