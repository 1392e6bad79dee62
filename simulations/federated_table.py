"""`fedsd reproduce --table fed`: the table no paper has. Does self-distillation help a
federation? Fashion-MNIST, 10 clients, 30 rounds of 1 local epoch, B = 256 a client, ε = 3 a
client, under IID, Dirichlet(0.5) and Dirichlet(0.1) partitions, for dpsgd, dpema, dp3sd and
dpdsd with the round's global model as teacher, and the teachers and schedules made for a
federation, one with dpema's release (TEACHER_VARIANTS). Each row's seed-by-seed differences to \
dpsgd and dpema come with
their standard error.

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

from fedsd.settings.run import TrainConfig
from fedsd.errors import ConfigError, TrainingDiverged
from fedsd.settings.federation import FedConfig, client_config
from fedsd.files.results import RunResult, write_json

from fedsd.simulation.sweeps import DIVERGED, NOT_SETTINGS, paired_difference, plot_curves, seed_files, seeds_run
from fedsd import dry_run
from fedsd.simulation.engine import simulate
from simulations.distributed_table import beside as distributed_beside
from fedsd.app.simulated_shards import build_federation

# The settings, declared once. lr 1.5, chosen on the federation's validation split: the
# central B = 256 sweep's best, 3, makes a Dirichlet(0.1) client diverge in round 1 once 10,000
# samples are held out (results/README.md, "The federated table").
FED_TABLE = dict(dataset="fmnist", epsilon=3.0, batch_size=256, lr=1.5)
FED_SHAPE = dict(num_clients=10, rounds=30, local_epochs=1)
FED_PARTITIONS = {"iid": ("iid", 0.5), "dirichlet0.5": ("dirichlet", 0.5), "dirichlet0.1": ("dirichlet", 0.1)}
FED_METHODS = ("dpsgd", "dpema", "dp3sd", "dpdsd")
# The teachers and schedules made for a federation, each chosen on the validation
# split first (results/README.md): (method, --teacher, --distill-schedule, --release, partitions).
TEACHER_VARIANTS = (
    # the average of the global models received (FedGKD's ensemble of past global models, as an EMA)
    ("dpdsd", "global-ema", "constant", None, tuple(FED_PARTITIONS)),
    ("dp3sd", "global-ema", "constant", None, tuple(FED_PARTITIONS)),
    # the distillation weight falling by round, from 1 after the warm-up round to 1/29 in the last
    ("dpdsd", "round-start", "decay", None, tuple(FED_PARTITIONS)),
    # ... releasing dpema's average of the iterates, the one release whose last round does not swing
    ("dpdsd", "round-start", "decay", "ema", tuple(FED_PARTITIONS)),
    # a client's own previous-round model, where the round's global model is furthest from its data
    ("dp3sd", "local-previous", "constant", None, ("dirichlet0.1",)),
    ("dpdsd", "local-previous", "constant", None, ("dirichlet0.1",)),
)
FED_TABLE_NAME = "table-fed"


@dataclass(frozen=True)
class FedCell:
    partition: str  # a key of FED_PARTITIONS
    method: str
    teacher: str = "round-start"  # --teacher
    schedule: str = "constant"  # --distill-schedule
    release: str | None = None  # --release (None: the method's)

    @property
    def name(self) -> str:
        tag = (f"-{self.teacher}" if self.teacher != "round-start" else "") + \
              (f"-{self.schedule}" if self.schedule != "constant" else "") + \
              (f"-release-{self.release}" if self.release else "")
        return f"{FED_TABLE['dataset']}-{self.partition}-{self.method}{tag}-eps{FED_TABLE['epsilon']:g}"

    @property
    def variant(self) -> str:
        """The row's label beside its method: its teacher, its schedule when not constant, and
        its release when not the method's."""
        return self.teacher + (f", {self.schedule}" if self.schedule != "constant" else "") + \
            (f", {self.release} released" if self.release else "")

    @property
    def is_baseline(self) -> bool:
        """The method as the papers run it (the rows every other is compared with)."""
        return (self.teacher, self.schedule, self.release) == ("round-start", "constant", None)

    def labels(self) -> dict:
        return dict(partition=self.partition, method=self.method, teacher=self.teacher, schedule=self.schedule,
                    release=self.release)

    @classmethod
    def of_row(cls, row: dict) -> "FedCell":
        return cls(row["partition"], row["method"], row["teacher"], row["schedule"], row.get("release"))


def fed_cells(partitions=tuple(FED_PARTITIONS), methods=FED_METHODS) -> list[FedCell]:
    cells = [FedCell(p, m) for p in partitions for m in FED_METHODS if m in methods]
    for method, teacher, schedule, release, where in TEACHER_VARIANTS:
        cells += [FedCell(p, method, teacher, schedule, release) for p in where
                  if p in partitions and method in methods]
    return cells


def cell_settings(cell: FedCell, seed: int, rounds: int | None = None, subset: int | None = None,
                  device: str = "cpu", data_dir: str | None = None) -> tuple[TrainConfig, FedConfig]:
    partition, alpha = FED_PARTITIONS[cell.partition]
    cfg = TrainConfig(**FED_TABLE, method=cell.method, distill_schedule=cell.schedule, release=cell.release, seed=seed,
                      subset=subset, device=device, data_dir=data_dir)
    fed = FedConfig(**{**FED_SHAPE, **({"rounds": rounds} if rounds else {})}, partition=partition,
                     dirichlet_alpha=alpha, teacher=cell.teacher)
    return client_config(cfg, fed), fed  # its epochs: rounds × local epochs, as the run records them


def _settings(cfg: TrainConfig, fed: FedConfig) -> dict:
    """What a run computes: its flat settings without where it ran or how it was computed."""
    from fedsd.app.server.checkpoint import settings


    skip = {k.replace("_", "-") for k in NOT_SETTINGS}
    return {k: v for k, v in settings(cfg, fed).items() if k not in skip}


def flawed(result: RunResult) -> bool:
    """A finished run the table does not use (run_state says why): a client missed a round, sat
    one out, or reported a smaller ε than in an earlier round (it had lost its privacy state)."""
    return bool(result.missed) or any(r.get("skipped") for r in result.rounds or []) or bool(epsilon_drops(result))


def epsilon_drops(result: RunResult) -> list[tuple[int, str]]:
    """(round, client) wherever a client reports a smaller ε than it did in an earlier round of
    the run: its accountant started again (a resumed simulation whose clients' state folder was
    lost), so its ε, and the training state it kept, are not those of one run."""
    drops, last = [], {}
    for r in result.rounds or []:
        fell = set(r.get("epsilon_fell_from") or {})  # the server's word (it now keeps the larger ε)
        for client, eps in (r.get("client_epsilon") or {}).items():
            if client in fell or eps < last.get(client, 0.0) - 1e-9:  # the second: results made before
                drops.append((r["round"], client))
            last[client] = eps
    return drops


def run_state(run_out: Path, cfg: TrainConfig, fed: FedConfig) -> str:
    """"done" (result.json, or diverged.json, with these settings), "resume" (a checkpoint with
    these settings) or "fresh" (nothing, a run made with other settings, or one in which a client
    went missing, a worker killed for memory or a round timed out, sat a round out, or started
    its accountant again: each is replaced, since the table compares methods, not the machine's
    failures). A table run plans every client's budget for all its rounds, so a client skipped
    for a spent budget means a round was charged twice: a run resumed by a fedsd from before
    clients kept their last reply (fedsd/app/client/handler.py)."""
    from fedsd.app.server import checkpoint

    wanted = _settings(cfg, fed)
    for name in ("result.json", DIVERGED):
        if (run_out / name).exists():
            if name == "result.json":
                done = RunResult.read(run_out / name)
                if flawed(done):
                    return "fresh"
                config, federation = done.config, done.federation
            else:
                config, federation = (json.loads((run_out / name).read_text())[k] for k in ("config", "federation"))
            if _settings(TrainConfig.from_dict(config), FedConfig.from_dict(federation)) == wanted:
                return "done"
            return "fresh"
    if checkpoint.path_in(run_out).exists():
        if _settings(*checkpoint.resumed_settings(run_out)) == wanted:
            return "resume"
    return "fresh"


def reproduce_fed(partitions, methods, seeds: int, jobs: int, rounds: int | None, subset: int | None,
                  device: str, data_dir: str | None, out: Path, quiet: bool) -> None:
    """Run what is missing of the federated table, then write it from every finished run."""
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
    for k, (cell, cfg, fed, run_out, state) in enumerate(todo, 1):
        if not quiet:
            print(f"[{k}/{len(todo)}] {run_out.name}" + (" (resumed)" if state == "resume" else ""), flush=True)
        run_federation(cfg, fed, run_out, state, jobs, quiet)
    write_fed_table(fed_cells(), runs_dir, out)


def run_federation(cfg: TrainConfig, fed: FedConfig, run_out: Path, state: str, jobs: int, quiet: bool) -> None:
    """One table run, by its run_state: resumed from its checkpoint, or started afresh (what a
    run with other settings left there removed); a run that diverges leaves diverged.json."""
    try:
        if state == "resume":
            simulate(cfg, dataclasses.replace(fed, resume_dir=str(run_out)), None, progress=not quiet, ray_cpus=jobs)
        else:
            if run_out.exists():  # made with other settings
                shutil.rmtree(run_out)
            simulate(cfg, fed, run_out, progress=not quiet, ray_cpus=jobs)
    except TrainingDiverged as e:
        # An answer of the table too (this method does not train in this federation): kept
        # beside the run's checkpoints, so it is not run again, and the table goes on.
        write_json(run_out / DIVERGED, dict(config=cfg.to_dict(), federation=dataclasses.asdict(fed), reason=str(e)))
        if not quiet:
            print(f"  diverged: {e}", flush=True)


def _difference_text(d: dict | None) -> str:
    if d is None:
        return ""
    if d["se"] is None:
        return f"{d['mean']:+.2f}"
    return f"{d['mean']:+.2f} ± {d['se']:.2f}" + (" **>2 SE**" if d["beyond_2se"] else "")


def write_fed_table(cells: list[FedCell], runs_dir: Path, out: Path) -> None:
    """table-fed.json / .md (final accuracy, best round, client ε range, and the paired
    difference to dpsgd and to dpema in the same partition, with its standard error) and
    fig-fed-<partition>.png, from the finished runs."""

    rows = []
    for cell in cells:
        runs = {seed: run for seed, run in seeds_run(runs_dir, cell).items() if not flawed(run)}
        results = list(runs.values())
        diverged = [json.loads(p.read_text())["reason"] for p in seed_files(runs_dir, cell, DIVERGED).values()]
        labels = cell.labels()
        if diverged and not results:
            rows.append(dict(**labels, seeds=[], final=[], diverged=diverged, gain_over_dpsgd=None))
            continue
        if not results:
            continue
        curves = [[100 * r["test_accuracy"] for r in res.rounds] for res in results]
        mean_curve = [statistics.mean(v) for v in zip(*curves)]
        best = max(range(len(mean_curve)), key=mean_curve.__getitem__)
        epsilons = [e for res in results for e in res.rounds[-1]["client_epsilon"].values()]
        rows.append(dict(**labels, seeds=list(runs),
                         final=[100 * res.test_accuracy for res in results], best_round=best + 1,
                         best_accuracy=mean_curve[best], client_epsilon=[min(epsilons), max(epsilons)],
                         noise_multiplier=sorted(set(results[0].noise_multiplier.values())),
                         shard_sizes=results[0].shard_sizes, seconds=[res.wall_seconds for res in results],
                         curves=curves))
    baseline = {(r["partition"], r["method"]): r for r in rows if FedCell.of_row(r).is_baseline}
    for row in rows:
        if "diverged" not in row:
            for method in ("dpsgd", "dpema"):
                row[f"vs_{method}"] = paired_difference(row, baseline.get((row["partition"], method)), "final")
            row["gain_over_dpsgd"] = row["vs_dpsgd"]["mean"] if row["vs_dpsgd"] else None
    write_json(out / f"{FED_TABLE_NAME}.json", {"settings": {**FED_TABLE, **FED_SHAPE}, "cells": rows})
    lines = ["# The federated table: Fashion-MNIST, 10 clients, 1 local epoch a round, "
             f"B = {FED_TABLE['batch_size']}, lr {FED_TABLE['lr']:g}, ε = {FED_TABLE['epsilon']:g} a client", "",
             "Final test accuracy of the global model, mean ± std over the seeds; vs dpsgd / dpema: the mean "
             "of the seed-by-seed differences ± its standard error, in bold where beyond two standard errors.",
             "", "| partition | method | teacher | final (%) | seeds | vs dpsgd | vs dpema | best (%) at round | "
             "client ε |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = f"| {r['partition']} | {r['method']} | {FedCell.of_row(r).variant} |"
        if "diverged" in r:
            where = r["diverged"][0].split(": training diverged")[0]  # "round R, client K"
            lines.append(f"{label} diverged ({where}) | 0 | | | | |")
            continue
        final = statistics.mean(r["final"])
        std = statistics.stdev(r["final"]) if len(r["final"]) > 1 else 0.0
        lo, hi = r["client_epsilon"]
        lines.append(f"{label} {final:.2f} ± {std:.2f} | {len(r['final'])} | {_difference_text(r['vs_dpsgd'])} "
                     f"| {_difference_text(r['vs_dpema'])} | {r['best_accuracy']:.2f} at {r['best_round']} "
                     f"| {lo:.3f}–{hi:.3f} |")
    lines += distributed_beside(out, "cnn")
    (out / f"{FED_TABLE_NAME}.md").write_text("\n".join(lines) + "\n")
    _figures(rows, out)


def _figures(rows: list[dict], out: Path) -> None:
    """Test accuracy of the global model by round, one figure a partition, one line a row
    (dashed: a teacher, schedule or release other than the papers')."""

    rows = [r for r in rows if "diverged" not in r]
    for partition in dict.fromkeys(r["partition"] for r in rows):
        lines = []
        for r in rows:
            if r["partition"] == partition:
                cell = FedCell.of_row(r)
                plain = cell.is_baseline
                lines.append((r["method"] + ("" if plain else f" ({cell.variant})"), r["curves"],
                              "-" if plain else "--"))
        plot_curves(out / f"fig-fed-{partition}.png", f"fmnist, 10 clients, {partition}, ε = 3 a client", "round",
                    lines)
