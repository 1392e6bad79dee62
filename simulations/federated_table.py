"""`fedsd reproduce --table fed`: the table no paper has. Does self-distillation help a
federation? Fashion-MNIST, 10 clients, 30 rounds of 1 local epoch, B = 256 a client, ε = 3 a
client, under IID, Dirichlet(0.5) and Dirichlet(0.1) partitions, for dpsgd, dpema, dp3sd and
dpdsd; under Dirichlet(0.1) also dp3sd and dpdsd with teacher=local-previous.

Each run is `fedsd simulate`, one at a time (its clients share the `--jobs` CPUs through Ray),
in <out>/runs/table-fed/<run>/. A finished run (result.json with these settings) is not run
again; a run stopped part-way goes on from its last completed round (its checkpoint.pt). The
table and figures are made from whatever runs exist.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

from fedsd.config import ConfigError, TrainConfig
from fedsd.federation import FedOptions, client_config
from fedsd.results import RunResult, write_json
from fedsd.training import TrainingDiverged

from .reproduce import DIVERGED

# The settings, declared once. lr 3 is the best of the B = 256 sweep (results/README.md,
# "The learning rate at batch sizes the papers did not use"); linear scaling would give 0.48.
FED_TABLE = dict(dataset="fmnist", epsilon=3.0, batch_size=256, lr=3.0)
FED_SHAPE = dict(num_clients=10, rounds=30, local_epochs=1)
FED_PARTITIONS = {"iid": ("iid", 0.5), "dirichlet0.5": ("dirichlet", 0.5), "dirichlet0.1": ("dirichlet", 0.1)}
FED_METHODS = ("dpsgd", "dpema", "dp3sd", "dpdsd")
# The teacher ablation: a client's own previous-round model as its teacher, where the round's
# global model is furthest from each client's data.
LOCAL_TEACHER = ("dirichlet0.1", ("dp3sd", "dpdsd"))
FED_TABLE_NAME = "table-fed"


@dataclass(frozen=True)
class FedCell:
    partition: str  # a key of FED_PARTITIONS
    method: str
    teacher: str = "round-start"

    @property
    def name(self) -> str:
        tag = "-local-previous" if self.teacher == "local-previous" else ""
        return f"{FED_TABLE['dataset']}-{self.partition}-{self.method}{tag}-eps{FED_TABLE['epsilon']:g}"


def fed_cells(partitions=tuple(FED_PARTITIONS), methods=FED_METHODS) -> list[FedCell]:
    cells = [FedCell(p, m) for p in partitions for m in FED_METHODS if m in methods]
    partition, local_methods = LOCAL_TEACHER
    if partition in partitions:
        cells += [FedCell(partition, m, "local-previous") for m in local_methods if m in methods]
    return cells


def cell_settings(cell: FedCell, seed: int, rounds: int | None = None, subset: int | None = None,
                  device: str = "cpu", data_dir: str | None = None) -> tuple[TrainConfig, FedOptions]:
    partition, alpha = FED_PARTITIONS[cell.partition]
    cfg = TrainConfig(**FED_TABLE, method=cell.method, seed=seed, subset=subset, device=device, data_dir=data_dir)
    fed = FedOptions(**{**FED_SHAPE, **({"rounds": rounds} if rounds else {})}, partition=partition,
                     dirichlet_alpha=alpha, teacher=cell.teacher)
    return client_config(cfg, fed), fed  # its epochs: rounds × local epochs, as the run records them


def _settings(cfg: TrainConfig, fed: FedOptions) -> dict:
    """What a run computes: its flat settings without where it ran or how it was computed."""
    from server.checkpoint import settings

    from .reproduce import NOT_SETTINGS

    skip = {k.replace("_", "-") for k in NOT_SETTINGS}
    return {k: v for k, v in settings(cfg, fed).items() if k not in skip}


def run_state(run_out: Path, cfg: TrainConfig, fed: FedOptions) -> str:
    """"done" (result.json, or diverged.json, with these settings), "resume" (a checkpoint with
    these settings) or "fresh" (nothing, or a run made with other settings, which is replaced)."""
    from server import checkpoint

    wanted = _settings(cfg, fed)
    for name in ("result.json", DIVERGED):
        if (run_out / name).exists():
            if name == "result.json":
                done = RunResult.read(run_out / name)
                config, federation = done.config, done.federation
            else:
                config, federation = (json.loads((run_out / name).read_text())[k] for k in ("config", "federation"))
            if _settings(TrainConfig.from_dict(config), FedOptions.from_dict(federation)) == wanted:
                return "done"
            return "fresh"
    if checkpoint.path_in(run_out).exists():
        if _settings(*checkpoint.resumed_settings(run_out)) == wanted:
            return "resume"
    return "fresh"


def reproduce_fed(partitions, methods, seeds: int, jobs: int, rounds: int | None, subset: int | None,
                  device: str, data_dir: str | None, out: Path, quiet: bool) -> None:
    """Run what is missing of the federated table, then write it from every finished run."""
    from simulations import dry_run
    from task.federation import build_federation

    if device != "cpu" and jobs > 1:
        raise ConfigError("--jobs: the federated table runs one simulation at a time; on a GPU its clients "
                          "share it by --client-gpus, so leave --jobs at 1")
    cells = fed_cells(partitions, methods)
    runs_dir = out / "runs" / FED_TABLE_NAME
    todo = []
    for cell in cells:
        for seed in range(seeds):
            cfg, fed = cell_settings(cell, seed, rounds, subset, device, data_dir)
            run_out = runs_dir / f"{cell.name}-seed{seed}"
            state = run_state(run_out, cfg, fed)
            if state != "done":
                build_federation(cfg, fed).check_plans()  # every run's data and budgets before the first starts
                todo.append((cell, cfg, fed, run_out, state))
    total = len(cells) * seeds
    dry_run.stop_here(f"simulate {len(todo)} of {total} federations ({total - len(todo)} done), one at a time "
                      f"on {jobs} CPUs")
    from simulations.simulate import simulate

    for k, (cell, cfg, fed, run_out, state) in enumerate(todo, 1):
        if not quiet:
            print(f"[{k}/{len(todo)}] {run_out.name}" + (" (resumed)" if state == "resume" else ""), flush=True)
        try:
            if state == "resume":
                simulate(cfg, dataclasses.replace(fed, resume_dir=str(run_out)), None, progress=not quiet,
                         ray_cpus=jobs)
            else:
                if run_out.exists():  # made with other settings
                    shutil.rmtree(run_out)
                simulate(cfg, fed, run_out, progress=not quiet, ray_cpus=jobs)
        except TrainingDiverged as e:
            # An answer of the table too (this method does not train in this federation): kept
            # beside the run's checkpoints, so it is not run again, and the table goes on.
            write_json(run_out / DIVERGED, dict(config=cfg.to_dict(), federation=dataclasses.asdict(fed),
                                                reason=str(e)))
            if not quiet:
                print(f"  diverged: {e}", flush=True)
    write_fed_table(fed_cells(), runs_dir, out)


def write_fed_table(cells: list[FedCell], runs_dir: Path, out: Path) -> None:
    """table-fed.json / .md (final accuracy, best round, client ε range, and the gain over dpsgd
    in the same partition and seeds) and fig-fed-<partition>.png, from the finished runs."""
    from .reproduce import gain_over_dpsgd, seed_files, seeds_run

    rows = []
    for cell in cells:
        runs = seeds_run(runs_dir, cell)
        results = list(runs.values())
        diverged = [json.loads(p.read_text())["reason"] for p in seed_files(runs_dir, cell, DIVERGED).values()]
        if diverged and not results:
            rows.append(dict(partition=cell.partition, method=cell.method, teacher=cell.teacher, seeds=[], final=[],
                             diverged=diverged, gain_over_dpsgd=None))
            continue
        if not results:
            continue
        curves = [[100 * r["test_accuracy"] for r in res.rounds] for res in results]
        mean_curve = [statistics.mean(v) for v in zip(*curves)]
        best = max(range(len(mean_curve)), key=mean_curve.__getitem__)
        epsilons = [e for res in results for e in res.rounds[-1]["client_epsilon"].values()]
        rows.append(dict(partition=cell.partition, method=cell.method, teacher=cell.teacher,
                         seeds=list(runs),
                         final=[100 * res.test_accuracy for res in results], best_round=best + 1,
                         best_accuracy=mean_curve[best], client_epsilon=[min(epsilons), max(epsilons)],
                         noise_multiplier=sorted(set(results[0].noise_multiplier.values())),
                         shard_sizes=results[0].shard_sizes, seconds=[res.wall_seconds for res in results],
                         curves=curves))
    for row in rows:
        if "diverged" not in row:
            row["gain_over_dpsgd"] = gain_over_dpsgd(row, rows, ("partition",), "final")
    write_json(out / f"{FED_TABLE_NAME}.json", {"settings": {**FED_TABLE, **FED_SHAPE}, "cells": rows})
    lines = ["# The federated table: Fashion-MNIST, 10 clients, 1 local epoch a round, B = 256, ε = 3 a client",
             "", "| partition | method | teacher | final (%) | seeds | vs dpsgd | best (%) at round | client ε |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "diverged" in r:
            where = r["diverged"][0].split(": training diverged")[0]  # "round R, client K"
            lines.append(f"| {r['partition']} | {r['method']} | {r['teacher']} | diverged ({where}) | 0 | | | |")
            continue
        final = statistics.mean(r["final"])
        std = statistics.stdev(r["final"]) if len(r["final"]) > 1 else 0.0
        gain = f"{r['gain_over_dpsgd']:+.2f}" if r["gain_over_dpsgd"] is not None else ""
        lo, hi = r["client_epsilon"]
        lines.append(f"| {r['partition']} | {r['method']} | {r['teacher']} | {final:.2f} ± {std:.2f} "
                     f"| {len(r['final'])} | {gain} | {r['best_accuracy']:.2f} at {r['best_round']} "
                     f"| {lo:.3f}–{hi:.3f} |")
    (out / f"{FED_TABLE_NAME}.md").write_text("\n".join(lines) + "\n")
    _figures(rows, out)


def _figures(rows: list[dict], out: Path) -> None:
    """Test accuracy of the global model by round, one figure a partition, one line a method
    (dashed: the local-previous teacher)."""
    from .reproduce import plot_curves

    rows = [r for r in rows if "diverged" not in r]
    for partition in dict.fromkeys(r["partition"] for r in rows):
        local = lambda r: r["teacher"] == "local-previous"  # noqa: E731
        plot_curves(out / f"fig-fed-{partition}.png", f"fmnist, 10 clients, {partition}, ε = 3 a client", "round",
                    [(r["method"] + (" (local-previous teacher)" if local(r) else ""), r["curves"],
                      "--" if local(r) else "-") for r in rows if r["partition"] == partition])
