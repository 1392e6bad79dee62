"""`fedsd reproduce --table features`: DP-SGD on ScatterNet features (issue 41; Tramèr & Boneh,
ICLR 2021), central, ε = 3, δ = 10⁻⁵, three seeds, against the anchors that use no public data.

Each cell is `fedsd train --features scatter` with Tramèr & Boneh's published settings for the
data set (their README: B, lr, and the length their σ spends ε = 3 in; momentum 0.9, C = 0.1),
with the features normalised per sample by GroupNorm (27 groups) instead of their private
batch statistics. Runs are resumable and written to <out>/runs/features/<cell>-seed<k>/.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from fedsd.results import write_json

from .runs import finished_with, run_jobs, seeds_run

TABLE_NAME = "table-features"
EPSILON = 3.0
SEEDS = 3
# (anchor, {data set: test accuracy %}): none uses public data
ANCHORS = (
    ("the DP3SD/DPDSD papers", {"mnist": 98.42, "fmnist": 87.68, "cifar10": 63.34}),
    ("Tramèr & Boneh, ScatterNet", {"mnist": 98.7, "fmnist": 89.7, "cifar10": 69.3}),
    ("DPSUR, ScatterNet", {"mnist": 98.88, "fmnist": 89.71, "cifar10": 70.83}),
    ("goal (issue 41)", {"mnist": 98.9, "fmnist": 89.8, "cifar10": 70.9}),
)


@dataclass(frozen=True)
class FeatureCell:
    dataset: str
    settings: dict = field(default_factory=dict)
    method: str = "dpsgd"
    source: str = ""

    @property
    def name(self) -> str:
        return f"{self.dataset}-scatter-{self.settings['model'].split('-')[1]}-{self.method}-eps{EPSILON:g}"


CELLS = (
    FeatureCell("mnist", dict(model="scatter-linear", batch_size=4096, lr=8.0, epochs=55),
                source="T&B's ScatterNet + linear (their σ = 3.04 spends ε = 3 in about 55 epochs)"),
    FeatureCell("fmnist", dict(model="scatter-linear", batch_size=8192, lr=16.0, epochs=50),
                source="T&B's ScatterNet + linear, GroupNorm 27 groups (σ = 4.05: about 50 epochs)"),
    FeatureCell("cifar10", dict(model="scatter-cnn", batch_size=8192, lr=4.0, epochs=85),
                source="T&B's ScatterNet + CNN (σ = 5.67: about 85 epochs)"),
)


def cell_config(cell: FeatureCell, seed: int, threads: int, device: str, data_dir) -> dict:
    return dict(dataset=cell.dataset, method=cell.method, epsilon=EPSILON, seed=seed, features="scatter",
                momentum=0.9, clip=0.1, device=device, threads=threads, data_dir=data_dir, **cell.settings)


def reproduce_features(datasets: list[str] | None, seeds: int, jobs: int, threads: int, device: str, data_dir,
                       out: Path, quiet: bool = False) -> Path:
    cells = [c for c in CELLS if datasets is None or c.dataset in datasets]
    runs_dir = out / "runs" / "features"
    todo = []
    for cell in cells:
        for seed in range(seeds):
            config = cell_config(cell, seed, threads, device, data_dir)
            run_out = runs_dir / f"{cell.name}-seed{seed}"
            if not finished_with(run_out, config):
                todo.append((config, str(run_out)))
    run_jobs(todo, len(cells) * seeds, jobs, "table features", quiet)
    return write_features_table(runs_dir, out)


def table_rows(runs_dir: Path) -> list[dict]:
    rows = []
    for cell in CELLS:
        runs = seeds_run(runs_dir, cell)
        if not runs:
            continue
        accuracies = [100 * r.test_accuracy for r in runs.values()]
        se = statistics.stdev(accuracies) / len(accuracies) ** 0.5 if len(accuracies) > 1 else None
        rows.append(dict(dataset=cell.dataset, model=cell.settings["model"], method=cell.method, epsilon=EPSILON,
                         settings=cell.settings, source=cell.source, seeds=list(runs), accuracies=accuracies,
                         mean=statistics.mean(accuracies), se=se,
                         epsilon_spent=[r.epsilon_spent for r in runs.values()],
                         minutes=[round(r.wall_seconds / 60, 1) for r in runs.values()],
                         anchors={name: values[cell.dataset] for name, values in ANCHORS}))
    return rows


def write_features_table(runs_dir: Path, out: Path) -> Path:
    rows = table_rows(runs_dir)
    write_json(out / f"{TABLE_NAME}.json", dict(epsilon=EPSILON, delta=1e-5, rows=rows))
    lines = ["# DP-SGD on ScatterNet features (central, ε = 3, δ = 1e-5)", "",
             "Written by `fedsd reproduce --table features` from results/runs/features/. Test accuracy (%), "
             "mean ± standard error over the seeds run; minutes per run on the CPU that ran it (one thread).", "",
             "| data set | model | B, lr, epochs | seeds | test accuracy | minutes a run | "
             + " | ".join(name for name, _ in ANCHORS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(ANCHORS)]
    for r in rows:
        s = r["settings"]
        acc = f"{r['mean']:.2f}" + (f" ± {r['se']:.2f}" if r["se"] is not None else "")
        lines.append(f"| {r['dataset']} | {r['model']} | {s['batch_size']}, {s['lr']:g}, {s['epochs']} | "
                     f"{len(r['seeds'])} | {acc} | {statistics.mean(r['minutes']):.1f} | "
                     + " | ".join(f"{v:g}" for v in r["anchors"].values()) + " |")
    (out / f"{TABLE_NAME}.md").write_text("\n".join(lines) + "\n")
    return out / f"{TABLE_NAME}.md"
