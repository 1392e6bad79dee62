"""The papers' Table 1 (and Table 2, the FMNIST ablation), `fedsd reproduce --table 1|2`: its
cells as a resumable set of central runs, and the table files made from the runs on disk.

Each run is `fedsd train` with the papers' settings (docs/algorithms.md, "Settings and their defaults"), \
written to <out>/runs/<run>/; a run whose
result.json exists is not run again. The table files are made from whatever runs exist.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from fedsd.data.datasets import DATASET_TITLES, DATASETS
from fedsd.files.results import write_json
from fedsd.simulation.sweeps import paired_difference, plot_curves, seed_files, seeds_run
from simulations.readings import confirm_rows, confirm_runs, screen_rows, screen_runs

# Table 1 of DP3SD (test accuracy, %), ε = 1, 2, 3 (docs/algorithms.md); its dpdsd row is
# DPDSD's own (the same numbers as DP3SD's row).
PAPER_TABLE1 = {
    ("mnist", "dpsgd"): (95.51, 96.46, 97.01), ("mnist", "dpkd"): (94.31, 95.59, 96.88),
    ("mnist", "dpema"): (96.63, 97.51, 97.93), ("mnist", "dp3sd"): (97.21, 97.95, 98.42),
    ("mnist", "dpdsd"): (97.21, 97.95, 98.42),
    ("fmnist", "dpsgd"): (81.29, 85.28, 86.13), ("fmnist", "dpkd"): (79.58, 84.66, 85.85),
    ("fmnist", "dpema"): (82.54, 86.06, 86.91), ("fmnist", "dp3sd"): (83.22, 86.53, 87.68),
    ("fmnist", "dpdsd"): (83.22, 86.53, 87.68),
    ("cifar10", "dpsgd"): (48.47, 55.05, 59.99), ("cifar10", "dpkd"): (46.91, 52.58, 56.19),
    ("cifar10", "dpema"): (51.68, 58.51, 61.62), ("cifar10", "dp3sd"): (52.36, 59.87, 63.34),
    ("cifar10", "dpdsd"): (52.36, 59.87, 63.34),
}
# DPDSD's Table 1 is DP3SD's but for one cell: dpsgd on CIFAR-10 at ε = 1 is 48.74 there, 48.47
# in DP3SD's. Each paper's numbers are used for its own method: dpdsd's paper gain over dpsgd is
# read in DPDSD's table, every other method's in DP3SD's (the dpsgd row shows DP3SD's number).
DPDSD_TABLE1 = {**PAPER_TABLE1, ("cifar10", "dpsgd"): (48.74, 55.05, 59.99)}


def paper_gain(dataset: str, method: str, epsilon: float) -> float | None:
    """The papers' accuracy of `method` minus their dpsgd's at ε, both from the method's own
    paper's Table 1 (DPDSD's for dpdsd, DP3SD's for the others); None for dpsgd."""
    table = DPDSD_TABLE1 if method == "dpdsd" else PAPER_TABLE1
    if method == "dpsgd" or (dataset, method) not in table:
        return None
    column = int(epsilon) - 1
    return round(table[(dataset, method)][column] - table[(dataset, "dpsgd")][column], 2)
# Table 2 (FMNIST ablation, accuracy as a fraction in the papers; % here). The papers do not
# print its ε; we run it at ε = 3.
PAPER_TABLE2 = [
    ("dp3sd", "sparse + smooth", {}, 86.93), ("dp3sd", "without sparsity (τs = 1)", {"dp3sd_tau_s": 1.0}, 86.42),
    ("dp3sd", "without smoothing (τt = 1)", {"dp3sd_tau_t": 1.0}, 86.26),
    ("dp3sd", "neither (τs = τt = 1)", {"dp3sd_tau_s": 1.0, "dp3sd_tau_t": 1.0}, 86.13),
    ("dpdsd", "CE + TCSD + NCSD", {}, 86.93), ("dpdsd", "without TCSD (α = 0)", {"dpdsd_alpha": 0.0}, 86.42),
    ("dpdsd", "without NCSD (β = 0)", {"dpdsd_beta": 0.0}, 86.11),
]
TABLE2_EPSILON = 3.0
# What table2.md says under its rows about the papers' own numbers (docs/algorithms.md).
TABLE2_NOTES = [
    "", "DP3SD's \"neither\" row (86.13) equals its Table 1's dpsgd on FMNIST at ε = 3 (86.13), which reads as both "
    "terms dropped (plain DP-SGD); here it is τs = τt = 1, which still distils: α·CE_1 + (1 − α)·KL(softmax(z_t) ‖ "
    "softmax(z_s)).",
    "", "The full method is 86.93 in the papers' Table 2 and 87.68 in their Table 1 (FMNIST, ε = 3), in DP3SD and "
    "DPDSD alike. Table 2 states no ε; it is run here at ε = 3."]
TABLE1_METHODS = ("dpsgd", "dpkd", "dpema", "dp3sd", "dpdsd")  # the papers' row order
# Table 1's variants (`--variant`): a setting the papers do not use, every method run with it, in
# rows of its own beside the papers' set-up and compared with dpsgd of the same variant.
# tanh: Tramèr & Boneh (ICLR 2021), the one of their settings that lifts FMNIST's dpsgd
# (results/README.md, "Fashion-MNIST's baseline gap").
TABLE1_VARIANTS = {"tanh": ({"activation": "tanh"}, "tanh, a variant")}


@dataclass
class Cell:
    dataset: str
    method: str
    epsilon: float
    paper: float
    variant: str = ""
    overrides: dict = field(default_factory=dict)
    label: str = ""  # the variant as the paper's table names it

    @property
    def name(self) -> str:
        tag = f"-{self.variant}" if self.variant else ""
        return f"{self.dataset}-{self.method}{tag}-eps{self.epsilon:g}"


def table1_cells(datasets, methods, epsilons, variant: str = "") -> list[Cell]:
    overrides, label = TABLE1_VARIANTS[variant] if variant else ({}, "")
    return [Cell(d, m, e, PAPER_TABLE1[(d, m)][int(e) - 1], variant, overrides, label)
            for d in datasets for m in methods for e in epsilons]


def table2_cells() -> list[Cell]:
    slug = lambda s: "".join(c if c.isalnum() else "_" for c in s).strip("_")  # noqa: E731
    return [Cell("fmnist", m, TABLE2_EPSILON, paper, slug(label), overrides, label) for m, label, overrides, paper
            in PAPER_TABLE2]


def table_cells(table: int, asked: list[Cell], runs_dir: Path) -> list[Cell]:
    """The cells asked for and every other cell of the table that has a run on disk, in the
    table's order: a reproduce of some cells rewrites the table without dropping the others."""
    every = table2_cells() if table == 2 else [cell for variant in ("", *TABLE1_VARIANTS)
                                                for cell in table1_cells(DATASETS, TABLE1_METHODS, [1.0, 2.0, 3.0],
                                                                         variant)]
    names = {c.name for c in asked}
    return [c for c in every if c.name in names or seed_files(runs_dir, c)]


def write_tables(table: int, cells: list[Cell], runs_dir: Path, out: Path) -> None:
    """table<N>.json and table<N>.md from every finished run of `cells` (mean ± std over the
    seeds found), and for Table 1 the gain of each method over dpsgd in the same seeds."""
    rows = []
    for cell in cells:
        runs = seeds_run(runs_dir, cell)
        results = list(runs.values())
        rows.append(dict(
            dataset=cell.dataset, method=cell.method, variant=cell.variant, label=cell.label, epsilon=cell.epsilon,
            seeds=list(runs), accuracies=[100 * r.test_accuracy for r in results], paper=cell.paper,
            config=results[0].config if results else None,
            epochs=sorted({len(r.epochs) for r in results}),  # as trained (a length can change)
            noise_multiplier=results[0].noise_multiplier if results else None,
            epsilon_spent=[r.epsilon_spent for r in results], seconds=[r.wall_seconds for r in results],
            curves=[[100 * e["test_accuracy"] for e in r.epochs] for r in results]))
    for row in rows:
        row["gain_over_dpsgd"] = gain_over_dpsgd(row, rows, ("dataset", "epsilon", "variant")) if table == 1 else None
        if table == 1:
            row["paper_gain_over_dpsgd"] = paper_gain(row["dataset"], row["method"], row["epsilon"])
    second = second_protocol(runs_dir.parent) if table == 1 else None
    write_json(out / f"table{table}.json", {"cells": rows, **({"second_protocol": second} if table == 1 else {})})
    gain_head, gain_rule = (" vs dpsgd, same seeds |", "---|") if table == 1 else ("", "")
    lines = [f"# Table {table}: ours (mean ± std over seeds) beside the paper's", "",
             f"| data | method | ε | epochs | ours (%) | seeds | paper (%) | ours − paper |{gain_head}",
             f"|---|---|---|---|---|---|---|---|{gain_rule}"]
    for r in rows:
        accs = r["accuracies"]
        method = r["method"] + (f" ({r['label'] or r['variant']})" if r["variant"] else "")
        gain = "" if table != 1 else (f" {r['gain_over_dpsgd']:+.2f} |" if r["gain_over_dpsgd"] is not None
                                      else " |")
        if accs:
            mean = statistics.mean(accs)
            std = statistics.stdev(accs) if len(accs) > 1 else 0.0
            epochs = ", ".join(map(str, r["epochs"]))
            lines.append(f"| {r['dataset']} | {method} | {r['epsilon']:g} | {epochs} | {mean:.2f} ± {std:.2f} "
                         f"| {len(accs)} | {r['paper']:.2f} | {mean - r['paper']:+.2f} |{gain}")
        else:
            lines.append(f"| {r['dataset']} | {method} | {r['epsilon']:g} | | not run | 0 | {r['paper']:.2f} | |{gain}")
    if table == 1:
        lines += by_data_set_md(rows) + second_protocol_md(second)
        _figure3(rows, out)
    else:
        lines += TABLE2_NOTES
    (out / f"table{table}.md").write_text("\n".join(lines) + "\n")


def second_protocol(runs_root: Path) -> list[dict]:
    """Table 1's second protocol: each method at its own validated reading and length,
    the readings' confirmation as it stands on disk under <runs_root>/readings (and the Table 1
    runs it reuses), each row with the papers' accuracy and their difference to their dpsgd."""
    runs_dir = runs_root / "readings"
    rows = confirm_rows(confirm_runs(screen_rows(screen_runs(), runs_dir)), runs_dir)
    for r in rows:
        paper = PAPER_TABLE1.get((r["dataset"], r["method"]))
        r["paper"] = paper[int(r["epsilon"]) - 1] if paper else None
        r["paper_gain_over_dpsgd"] = paper_gain(r["dataset"], r["method"], r["epsilon"]) if paper else None
    return rows


def second_protocol_md(rows: list[dict]) -> list[str]:
    lines = ["", "## Second protocol: each method at its own validated reading", "",
             "The reading and length chosen for each method on validation by the readings screen (`fedsd reproduce "
             "--table readings`, results/table-readings.md), on test; test accuracy mean ± standard error over the "
             "seeds, and the gain over dpsgd (at dpsgd's own chosen reading) paired by seed, the papers' difference "
             "in brackets. The papers' reading is the first protocol, above.", ""]
    if not rows:
        return lines + ["No method's screen is done yet."]
    lines += ["| data | ε | method | reading, epochs | ours (%) | seeds | paper (%) | vs dpsgd, same seeds (papers) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        data = r["dataset"] + ("" if r["activation"] == "relu" else f" ({r['activation']})")
        ours = "" if r["mean"] is None else f"{r['mean']:.2f}" + ("" if r["se"] is None else f" ± {r['se']:.2f}")
        g, pg = r["gain_over_dpsgd"], r["paper_gain_over_dpsgd"]
        gain = ("" if g is None else f"{g['mean']:+.2f}" + ("" if g["se"] is None else f" ± {g['se']:.2f}")) + \
            ("" if pg is None else f" ({pg:+.2f})")
        paper = "" if r["paper"] is None else f"{r['paper']:.2f}"
        lines.append(f"| {data} | {r['epsilon']:g} | {r['method']} | {r['reading']}, {r['epochs']} | {ours} | "
                     f"{len(r['seeds'])} | {paper} | {gain} |")
    return lines


def by_data_set_md(rows: list[dict]) -> list[str]:
    """Table 1 laid out as in the papers (a table per data set, methods by ε; the papers' set-up
    only, not the variants), then each method's gain over dpsgd in the same seeds beside the
    papers' difference: the tables results/README.md shows (tests/simulations/test_results_tables.py)."""
    cells = {(r["dataset"], r["method"], r["epsilon"]): r for r in rows if not r["variant"]}
    epsilons = sorted({e for _, _, e in cells})
    datasets = [d for d in DATASET_TITLES if any(k[0] == d for k in cells)]
    signed = lambda x: f"{x:+.2f}".replace("-", "−")  # noqa: E731 (the README's minus sign)

    def cell_md(r):
        accs, seeds = r["accuracies"], r["seeds"]
        if not accs:
            return f"not run / {r['paper']:.2f}"
        mean = statistics.mean(accs)
        if len(accs) == 1:
            ours = f"{mean:.2f} (seed {seeds[0]})"
        else:
            ours = f"{mean:.2f} ± {statistics.stdev(accs):.2f}"
            if len(accs) < 3:
                ours += f" (seeds {', '.join(map(str, seeds))})"
        return f"{ours} / {r['paper']:.2f} ({signed(mean - r['paper'])})"

    lines = ["", "## By data set, as in the papers", "",
             "Test accuracy (%), mean ± std over seeds / paper (ours − paper):"]
    for d in datasets:
        lines += ["", f"| {DATASET_TITLES[d]} | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |",
                  "|---|" + "---|" * len(epsilons)]
        lines += [f"| {m} | " + " | ".join(cell_md(cells[d, m, e]) if (d, m, e) in cells else "—" for e in epsilons)
                  + " |" for m in TABLE1_METHODS if any((d, m, e) in cells for e in epsilons)]
    columns = [(d, e) for d in datasets for e in epsilons]
    lines += ["", "Against dpsgd in the same seeds (mean of the per-seed differences; the papers' difference in "
              "brackets):", "", "| | " + " | ".join(f"{DATASET_TITLES[d]} ε = {e:g}" for d, e in columns) + " |",
              "|---|" + "---|" * len(columns)]
    for m in TABLE1_METHODS[1:]:
        gains = []
        for d, e in columns:
            r, base = cells.get((d, m, e)), cells.get((d, "dpsgd", e))
            gains.append("—" if r is None or base is None or r["gain_over_dpsgd"] is None
                         else f"{signed(r['gain_over_dpsgd'])} ({signed(paper_gain(d, m, e))})")
        lines.append(f"| {m} | " + " | ".join(gains) + " |")
    return lines + ["", "The papers' Table 1 differ in one cell: dpsgd on CIFAR-10 at ε = 1 is 48.47 in DP3SD's, "
                    "48.74 in DPDSD's. The dpsgd row shows DP3SD's; each method's difference in brackets is read in "
                    "its own paper's table (dpdsd's in DPDSD's, the others' in DP3SD's)."]


def gain_over_dpsgd(row: dict, rows: list[dict], same: tuple[str, ...], accuracies: str = "accuracies"
                    ) -> float | None:
    """Mean, over the seeds both ran, of (this row's accuracy − dpsgd's) in the dpsgd row that
    agrees on the `same` keys (data set and ε)."""
    if row["method"] == "dpsgd":
        return None
    base = next((r for r in rows if r["method"] == "dpsgd" and all(r[k] == row[k] for k in same)), None)
    if base is not None and base["epochs"] != row["epochs"]:
        return None  # runs of other lengths (a cell made before its default length changed): not a pair
    difference = paired_difference(row, base, accuracies)
    return difference["mean"] if difference else None


def _figure3(rows: list[dict], out: Path) -> None:
    """Test accuracy vs epoch, all methods at ε = 3, one figure a data set (the papers' Fig. 3)."""
    for dataset in sorted({r["dataset"] for r in rows}):
        curves = [r for r in rows if r["dataset"] == dataset and r["epsilon"] == 3.0 and r["curves"]
                  and not r["variant"]]
        if curves:
            plot_curves(out / f"fig3-{dataset}.png", f"{dataset}, ε = 3", "epoch",
                        [(r["method"], r["curves"], "-") for r in curves])
