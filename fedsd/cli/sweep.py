"""`fedsd sweep`: choose settings the papers leave open (EMA decay; DPKD's τ, α, stage split;
the run length) on a validation split carved from the training set, never the test set.

    fedsd sweep --dataset fmnist --method dpema --grid ema-decay=0.9,0.98,0.995,0.999 \\
        --validation 10000 --out results/sweeps/fmnist-dpema

Every combination of the --grid values is a `fedsd train` run with --validation held out
(the same samples for every run; none trained on). The choice is the combination with the
best final validation accuracy (mean over seeds). Writes DIR/sweep.json and DIR/sweep.md; the
test accuracy is recorded beside it for the reader but plays no part in the choice. Resumes:
a finished run (DIR/runs/<run>/result.json) is not run again.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

from fedsd.settings.run import METHODS, RENAMED, TrainConfig, renamed_settings
from fedsd.errors import ConfigError
from fedsd.data.datasets import DATASETS
from fedsd.settings.declared import settings_of

from fedsd.simulation.sweeps import DIVERGED, finished_with, run_jobs, threads_per_job
from fedsd.files.results import RunResult, write_json

SWEEPABLE = {s.name: s for s in settings_of(TrainConfig)
             if s.name in ("ema_decay", "dp3sd_tau_s", "dp3sd_tau_t", "dp3sd_alpha", "dpdsd_tau", "dpdsd_alpha",
                           "dpdsd_beta", "dpkd_tau", "dpkd_alpha", "dpkd_teacher_epochs", "epochs", "lr", "clip",
                           "momentum", "batch_size", "distill_warmup_epochs", "activation",
                           "mean", "std", "train_layers", "init_weights", "features", "public_first", "threads")}


def parse_grid(items: list[str], option: str = "--grid", method: str | None = None) -> dict[str, list]:
    """["ema-decay=0.99,0.999", ...] → {"ema_decay": [0.99, 0.999], ...}; ConfigError when bad.
    A value of a setting with a list in it (--mean 0.5,0.4,0.4) is swept one value at a time;
    give such a setting one KEY=VALUE --grid entry of one value."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        name = key.strip().replace("-", "_")
        if not sep or not values:
            raise ConfigError(f"{option}: KEY=V1,V2,... got {item!r}")
        if name in RENAMED:  # fedsd 0.1's name: the method's own, with a note
            name = next(iter(renamed_settings({name: values}, method, say="key")))
            key = name.replace("_", "-")
        if name not in SWEEPABLE:
            allowed = ", ".join(sorted(k.replace("_", "-") for k in SWEEPABLE))
            raise ConfigError(f"{option}: {key!r} cannot be swept; choose from {allowed}")
        declared = SWEEPABLE[name]
        try:
            grid[name] = [declared.type(v) for v in values.split(",")]
        except ValueError:
            raise ConfigError(f"{option}: {key} takes {declared.type.__name__} values, got {values!r}") from None
        bad = [v for v in grid[name] if declared.choices and v not in declared.choices]
        if bad:
            raise ConfigError(f"{option}: {key} takes {', '.join(map(str, declared.choices))}; got {bad[0]!r}")
    if not grid:
        raise ConfigError(f"{option}: give at least one KEY=V1,V2,...")
    return grid


def parse_fixed(items: list[str], method: str | None = None) -> dict:
    """--set ["momentum=0", ...] → {"momentum": 0.0, ...}: settings every run of the sweep takes."""
    fixed = {}
    for item in items:
        name, values = parse_grid([item], "--set", method).popitem()
        if len(values) != 1:
            raise ConfigError(f"--set: KEY=VALUE, one value (--grid sweeps several), got {item!r}")
        fixed[name] = values[0]
    return fixed


def shown(value) -> str:
    return value if isinstance(value, str) else format(value, "g")


# A run's folder is named by its swept settings under their fedsd 0.1 names where one was renamed
# (dpkd_tau: tau), so the runs of every committed sweep are found as they were made; the sweep's
# own folder already names its method.
NAMED_AS_BEFORE = {new: old for old, by_method in RENAMED.items() for new in by_method.values()}


def slug(settings: dict) -> str:
    return "-".join(f"{NAMED_AS_BEFORE.get(k, k).replace('_', '')}{shown(v)}" for k, v in settings.items())


def add_sweep_parser(sub) -> None:
    p = sub.add_parser("sweep", help="choose open settings on a validation split (never the test set)")
    p.add_argument("--dataset", choices=DATASETS, required=True)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting fixed for every run of the sweep (any setting --grid takes; not in the run names)")
    p.add_argument("--validation", type=int, default=10000, help="training samples held out (default 10000)")
    p.add_argument("--epochs", type=int, default=None, help="run length (default: the paper's)")
    p.add_argument("--subset", type=int, default=None, help="train on a subset of what is left (quick checks)")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    grid = parse_grid(args.grid, method=args.method)
    fixed = parse_fixed(args.set, args.method)
    both = sorted(set(fixed) & set(grid))
    if both:
        raise ConfigError(f"--set: {both[0].replace('_', '-')} is swept by --grid too; give it one or the other")
    if args.validation < 1:
        raise ConfigError(f"--validation: a sweep needs a validation split (>= 1 samples), got {args.validation}")
    if args.seeds < 1 or args.jobs < 1:
        raise ConfigError("--seeds and --jobs must be >= 1")
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    base = {**dict(dataset=args.dataset, method=args.method, epsilon=args.epsilon, validation=args.validation,
                   epochs=args.epochs, subset=args.subset, device=args.device, data_dir=args.data_dir,
                   threads=threads_per_job(args.device, args.jobs)), **fixed}  # --set threads=N too
    out = Path(args.out)
    todo = []
    for combo in combos:
        for seed in range(args.seeds):
            run_out = out / "runs" / f"{slug(combo)}-seed{seed}"
            if not finished_with(run_out, {**base, **combo, "seed": seed}):
                todo.append(({**base, **combo, "seed": seed}, str(run_out)))
    run_jobs(todo, len(combos) * args.seeds, args.jobs, f"sweep {args.dataset} {args.method}", args.quiet)
    summary = write_sweep(out, args, grid, combos)
    choice = summary["choice"]
    print(f"chose {choice['settings']} (validation accuracy {choice['validation_accuracy']:.2f} %); "
          f"wrote {out / 'sweep.json'} and {out / 'sweep.md'}")
    return 0


def write_sweep(out: Path, args: argparse.Namespace, grid: dict, combos: list[dict]) -> dict:
    rows = []
    for combo in combos:
        runs = [out / "runs" / f"{slug(combo)}-seed{s}" for s in range(args.seeds)]
        if any((run / DIVERGED).exists() for run in runs):  # a setting that does not train is not a choice
            rows.append(dict(settings=combo, diverged=True, validation_mean=None))
            continue
        results = [RunResult.read(run / "result.json") for run in runs]
        val = [100 * r.validation_accuracy for r in results]
        rows.append(dict(settings=combo, validation_accuracy=val, validation_mean=statistics.mean(val),
                         test_accuracy=[100 * r.test_accuracy for r in results],
                         noise_multiplier=results[0].noise_multiplier, epochs=results[0].config["epochs"]))
    trained = [r for r in rows if not r.get("diverged")]
    if not trained:
        raise ConfigError(f"every run of the sweep diverged ({out / 'runs'}/*/{DIVERGED}); "
                          f"try smaller --grid lr values")
    best = max(trained, key=lambda r: r["validation_mean"])
    fixed = parse_fixed(args.set, args.method)
    summary = dict(dataset=args.dataset, method=args.method, epsilon=args.epsilon, validation=args.validation,
                   subset=args.subset, seeds=args.seeds, grid=grid, **({"fixed": fixed} if fixed else {}), runs=rows,
                   choice=dict(settings=best["settings"], validation_accuracy=best["validation_mean"]),
                   rule="highest final validation accuracy, mean over seeds; the test set is not used")
    write_json(out / "sweep.json", summary)
    keys = list(grid)
    lines = [f"# Sweep: {args.dataset} {args.method}, ε = {args.epsilon:g}, "
             f"{args.validation} validation samples held out",
             "", "Chosen by validation accuracy only; test accuracy shown for the record.", "",
             "| " + " | ".join(k.replace("_", "-") for k in keys) + " | validation (%) | test (%) | |",
             "|" + "---|" * (len(keys) + 3)]
    for r in sorted(rows, key=lambda r: -(r["validation_mean"] if r in trained else -1.0)):
        mark = "**chosen**" if r is best else ""
        scores = "diverged | - " if r.get("diverged") else \
            f"{r['validation_mean']:.2f} | {statistics.mean(r['test_accuracy']):.2f}"
        lines.append("| " + " | ".join(shown(r["settings"][k]) for k in keys) + f" | {scores} | {mark} |")
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    return summary
