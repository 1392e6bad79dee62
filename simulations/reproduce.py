"""`fedsd reproduce`: this repository's own result tables, each a resumable set of runs (several
at once, one progress bar for the whole table), the table files made from the runs on disk:

- `--table 1`, `--table 2`: the papers' Table 1 and Table 2 (central runs; paper_tables.py);
- `--table fed`: the federated table (simulations; federated_table.py);
- `--table readings`: every reading of the papers, on validation (readings.py);
- `--table features`: DP-SGD on ScatterNet features, ε = 3 (features_table.py);
- `--table adaptive`: adaptive clipping started 10× and 0.1× off the tuned C (adaptive_table.py);
- `--table distributed`: the features and CNN recipes as a 10-client federation with distributed
  noise under secure aggregation (distributed_table.py).

An experiment, not a command of the product: `fedsd` loads this module only when asked for
`reproduce` (fedsd/cli/main.py), and it has its own parser.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fedsd.settings.run import METHODS
from fedsd.data.datasets import DATASETS
from fedsd.errors import ConfigError
from fedsd.settings.command_line import Parser
from fedsd.simulation.sweeps import finished_with, run_jobs, threads_per_job
from simulations.features_table import reproduce_features
from simulations.federated_table import FED_METHODS, FED_PARTITIONS, FED_TABLE_NAME, reproduce_fed
from simulations.paper_tables import (TABLE1_METHODS, TABLE1_VARIANTS, table1_cells, table2_cells, table_cells,
                                      write_tables)
from simulations.readings import confirm_runs, dropped, screen_rows, screen_runs, write_readings

HELP = "the papers' Table 1 / Table 2, the federated, readings, features, distributed and adaptive tables, resumable"


def reproduce_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fedsd reproduce", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", choices=["1", "2", "fed", "readings", "features", "distributed", "adaptive"], default="1",
                   help="1, 2: the papers' tables (central runs); fed: the federated table (simulations); "
                        "readings: every reading of the papers on validation (simulations/readings.py); "
                        "features: DP-SGD on ScatterNet features, ε = 3 (simulations/features_table.py); "
                        "distributed: the features and CNN recipes as a federation with distributed noise under "
                        "secure aggregation (simulations/distributed_table.py); adaptive: adaptive clipping "
                        "started 10× and 0.1× off the tuned C (simulations/adaptive_table.py)")
    p.add_argument("--datasets", nargs="+", choices=DATASETS, default=None,
                   help="Table 1 (default: all); Table 2 and the federated table are FMNIST's")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None, help="default: the table's")
    p.add_argument("--epsilons", nargs="+", type=float, choices=[1.0, 2.0, 3.0], default=[1.0, 2.0, 3.0],
                   help="Table 1")
    p.add_argument("--partitions", nargs="+", choices=list(FED_PARTITIONS), default=list(FED_PARTITIONS),
                   help="the federated table")
    p.add_argument("--variant", choices=list(TABLE1_VARIANTS), default="",
                   help="Table 1: every cell with a setting the papers do not use, in rows of its own")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: 3; the federated table 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at once (processes); the federated table: CPUs its one simulation at a time uses")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of each run (default: the CPUs divided by --jobs)")
    p.add_argument("--epochs", type=int, default=None,
                   help="override the run length of every cell (the federated table: its rounds)")
    p.add_argument("--subset", type=int, default=None, help="train on a subset (quick checks only)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="results")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_reproduce, command="reproduce")
    return p


def cmd_reproduce(args: argparse.Namespace) -> int:
    check_reproduce_args(args)
    out = Path(args.out)
    threads = args.threads or threads_per_job(args.device, args.jobs)
    table = {"features": features_table, "readings": readings_table, "fed": federated_table,
             "distributed": distributed_table, "adaptive": adaptive_table}.get(args.table, paper_table)
    print(f"wrote {table(args, out, threads)}")
    return 0


def check_reproduce_args(args: argparse.Namespace) -> None:
    """Every option against the table asked for, before any run."""
    for name in ("seeds", "jobs", "epochs", "subset", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}: must be >= 1, got {value}")
    if args.table not in ("1", "features") and args.datasets not in (None, ["fmnist"]):
        raise ConfigError(f"--datasets: Table {args.table} is Fashion-MNIST's only; leave --datasets out")
    if args.table != "1" and args.variant:
        raise ConfigError(f"--variant: Table 1's only; Table {args.table} has its own rows")
    own = {"features": (("methods", "variant", "epochs", "subset"), "the features table has its own settings"),
           "readings": (("datasets", "methods", "variant", "seeds", "epochs", "subset"),
                        "the readings table has its own settings, runs and seeds"),
           "distributed": (("datasets", "methods", "variant", "seeds", "epochs", "subset"),
                           "the distributed table has its own settings, runs and seeds"),
           "adaptive": (("datasets", "methods", "variant", "epochs", "subset"),
                        "the adaptive clipping table has its own settings")}
    for name in own.get(args.table, ((), ""))[0]:
        if getattr(args, name):
            raise ConfigError(f"--{name}: {own[args.table][1]}; leave it out")
    if args.table == "fed" and not set(args.methods or FED_METHODS) <= set(FED_METHODS):
        raise ConfigError(f"--methods: the federated table has {', '.join(FED_METHODS)}")


def features_table(args: argparse.Namespace, out: Path, threads: int) -> str:
    return str(reproduce_features(args.datasets, args.seeds or 3, args.jobs, threads, args.device, args.data_dir, out,
                                  args.quiet))


def adaptive_table(args: argparse.Namespace, out: Path, threads: int) -> str:
    from simulations.adaptive_table import reproduce_adaptive

    return str(reproduce_adaptive(args.seeds or 3, args.jobs, threads, args.device, args.data_dir, out, args.quiet))


def distributed_table(args: argparse.Namespace, out: Path, threads: int) -> str:
    from simulations.distributed_table import TABLE_NAME, run_all

    run_all(out, progress=not args.quiet)
    return f"{out / f'{TABLE_NAME}.json'} and {out / f'{TABLE_NAME}.md'}"


def federated_table(args: argparse.Namespace, out: Path, threads: int) -> str:
    reproduce_fed(args.partitions, args.methods or FED_METHODS, args.seeds or 1, args.jobs, args.epochs, args.subset,
                  args.device, args.data_dir, out, args.quiet)
    return f"{out / f'{FED_TABLE_NAME}.json'} and {out / f'{FED_TABLE_NAME}.md'}"


def paper_table(args: argparse.Namespace, out: Path, threads: int) -> str:
    """Table 1 or 2: each cell's missing seeds run, then the table files from every run on disk."""
    table = int(args.table)
    methods = args.methods or list(TABLE1_METHODS)
    cells = (table2_cells() if table == 2
             else table1_cells(args.datasets or DATASETS, methods, args.epsilons, args.variant))
    if table == 2 and args.methods:
        cells = [c for c in cells if c.method in methods]
    seeds = args.seeds or 3
    runs_dir = out / "runs" / f"table{table}"
    todo = []
    for cell in cells:
        for seed in range(seeds):
            run_out = runs_dir / f"{cell.name}-seed{seed}"
            config = dict(dataset=cell.dataset, method=cell.method, epsilon=cell.epsilon, seed=seed,
                          device=args.device, threads=threads, epochs=args.epochs, subset=args.subset,
                          data_dir=args.data_dir, **cell.overrides)
            if not finished_with(run_out, config):
                todo.append((config, str(run_out)))
    run_jobs(todo, len(cells) * seeds, args.jobs, f"table {table}", args.quiet)
    write_tables(table, table_cells(table, cells, runs_dir), runs_dir, out)
    return f"{out / f'table{table}.json'} and {out / f'table{table}.md'}"


def readings_table(args: argparse.Namespace, out: Path, threads: int) -> str:
    return str(reproduce_readings(out, args.jobs, threads, args.device, args.data_dir, args.quiet))


def reproduce_readings(out: Path, jobs: int, threads: int, device: str, data_dir: str | None,
                       quiet: bool) -> Path:
    """Run the screen's missing runs, then the confirmation's of each method whose screen is
    done, then write table-readings.{json,md} from what is on disk."""
    runs_dir = out / "runs" / "readings"
    runs = screen_runs()
    drop = dropped(screen_rows(runs, runs_dir))
    todo = []
    for run in runs:
        config = run.config(device=device, threads=threads, data_dir=data_dir)
        if (run.method, run.reading.name) not in drop and not finished_with(runs_dir / run.name, config):
            todo.append((config, str(runs_dir / run.name)))
    run_jobs(todo, len(runs), jobs, "readings: screen", quiet)
    write_readings(runs, runs_dir, out)
    confirm = confirm_runs(screen_rows(runs, runs_dir))
    todo = [(run.config(device=device, threads=threads, data_dir=data_dir), str(run.folder(runs_dir)))
            for run in confirm]
    run_jobs([(c, o) for c, o in todo if not finished_with(Path(o), c)], len(todo), jobs, "readings: confirmation",
             quiet)
    rewrite_table1(out)  # its second protocol is this confirmation
    return write_readings(runs, runs_dir, out)


def rewrite_table1(out: Path) -> None:
    """Table 1 written again from the runs on disk, its second protocol from this confirmation."""
    table1 = out / "runs" / "table1"
    if table1.is_dir():
        write_tables(1, table_cells(1, [], table1), table1, out)
