"""The `fedsd` command: train centrally or simulate a federation, prepare and check a client's data and
privacy, choose settings and measure; and, apart, this repository's experiments (`fedsd reproduce`).
The methods, their settings and the privacy accounting: docs/algorithms.md."""
from __future__ import annotations

import sys

if __name__ == "__main__" and not sys.flags.safe_path and "data-service" in sys.argv[1:]:
    # Before any other import: `python -m` put the working directory first on sys.path, and the
    # owner's service would import (and run, as the owner) a package planted there.
    # A package planted there under the name `fedsd` has run already (Python imports a module's
    # package before the module); this refuses the slip, and the docs say why it is not the way.
    sys.exit(f"python -m fedsd.cli.main data-service: refused, as the working directory ({sys.path[0]}) is first "
             f"on the import path and a package planted there would run as the data's owner; start the service "
             f"with `fedsd data-service` or `python -P -m fedsd.cli.main data-service` (clients/README.md)")

# An entry point: fedsd's process-wide speed settings, before torch loads (fedsd/runtime.py).
from fedsd.runtime import tune_process

tune_process()

import argparse
import os
from pathlib import Path

import warnings

import fedsd
from fedsd import __version__
from fedsd.errors import FedsdNote, UserError
from fedsd.benchmarks.bench import add_bench_parser
from fedsd import dry_run
from fedsd.cli.audit import add_audit_parser
from fedsd.cli.check_privacy import add_check_parser
from fedsd.cli.data_service import add_data_service_parser
from fedsd.cli.ledger import add_ledger_parser
from fedsd.settings.command_line import Parser
from fedsd.cli.pretrain import add_pretrain_parser
from fedsd.cli.recipes import add_recipes_parser
from fedsd.cli.simulate import add_simulate_parser
from fedsd.cli.split_data import add_split_data_parser
from fedsd.cli.sweep import add_sweep_parser
from fedsd.cli.train import add_train_parser

# One module a command, named as the command (fedsd/cli/); `bench` and `reproduce` are in
# fedsd/benchmarks/bench.py and simulations/reproduce.py, which only this module imports.


# The product's commands, grouped as `fedsd --help` lists them.
COMMAND_GROUPS = (
    ("training", ("train", "simulate", "pretrain", "recipes")),
    ("a client's data and privacy", ("split-data", "data-service", "ledger", "check-privacy", "audit")),
    ("choose settings and measure", ("sweep", "bench")),
)
# This repository's own result tables: experiments, not the product. `fedsd reproduce` loads
# them only when it is asked for (simulations/reproduce.py has its own parser).
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
    add_simulate_parser(sub)
    add_pretrain_parser(sub)
    add_recipes_parser(sub)
    for add in (add_split_data_parser, add_data_service_parser, add_ledger_parser, add_check_parser,
                add_audit_parser, add_sweep_parser, add_bench_parser):
        add(sub)
    # listed, and named in "did you mean"; main() hands its arguments to the experiments' own parser
    sub.add_parser(EXPERIMENTS, help=EXPERIMENTS_HELP, add_help=False)
    return parser


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
    """`fedsd reproduce`: the studies (simulations/ of a checkout, not installed) are imported here,
    only when asked for."""
    reproduce_parser = checkout_studies().reproduce_parser

    return reproduce_parser().parse_args(argv)


def checkout_studies():
    """simulations/reproduce.py of the checkout this fedsd runs from (an editable install, or the
    working directory): the studies are not part of the installed package."""
    import importlib

    root = Path(fedsd.__file__).resolve().parents[1]
    for folder in (root, Path.cwd()):
        if (folder / "simulations" / "reproduce.py").is_file():
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))  # the entry point's own choice, for this command only
            return importlib.import_module("simulations.reproduce")
    raise SystemExit("fedsd reproduce: the studies that make results/ live in a checkout's simulations/, not in the "
                     "installed package: clone the repository, `pip install -e .` there, and run it from there")


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
