"""`fedsd reproduce --table readings`: every reading of the papers, each method tuned for itself,
as resumable central runs.

A reading is a labelled variant of a method: the papers' literal reading (Table 1's first
protocol) or another way their text can be read (docs/algorithms.md, "Readings of the papers"), each a
setting. Two stages, chosen on validation only:

- the screen: in the settings where our dpsgd already equals the papers' (MNIST at ε = 1 and 3,
  FMNIST with tanh at ε = 3), every method and every reading that applies to it at each of
  SCREEN_LENGTHS epochs, with VALIDATION training samples held out, seed 0;
- the confirmation: each method's best validated reading (the best mean over the screening
  settings of its best validation accuracy), on test, CONFIRM_SEEDS seeds, in every cell of
  CONFIRM_CELLS: at the length the screen chose for it where the cell was screened, else at the
  cell's own length (Table 1's, chosen on validation for the data set and ε); its gain over dpsgd
  (at dpsgd's own length) paired by seed. A method's confirmation starts once its screen is done.

Each run is `fedsd train`, written to <out>/runs/readings/<run>/; a finished run is not run
again, so the screen goes on where it stopped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fedsd.settings.run import PAPER, default_epochs
from fedsd.files.results import RunResult, write_json
from fedsd.simulation.sweeps import finished_with, paired_difference

VALIDATION = 10_000
SCREEN_LENGTHS = (15, 30, 60)
# (data set, activation, ε): where our dpsgd equals the papers', so their numbers are the target
SCREEN_SETTINGS = (("mnist", "relu", 1.0), ("mnist", "relu", 3.0), ("fmnist", "tanh", 3.0))
SCREEN_SEED = 0
METHODS_ORDER = ("dpsgd", "dp3sd", "dpdsd", "dpema", "dpkd")  # the baseline first: every gain is against it


@dataclass(frozen=True)
class Reading:
    """A way to read the papers: the methods it applies to and the settings that make it
    (`lr_scale`: the run's lr is the papers' for the data set times this, at the papers' B)."""
    name: str
    methods: tuple[str, ...]
    overrides: dict = field(default_factory=dict)
    label: str = ""
    lr_scale: float | None = None

    def settings(self, dataset: str) -> dict:
        if self.lr_scale is None:
            return dict(self.overrides)
        return {**self.overrides, "lr": PAPER[dataset]["lr"] * self.lr_scale}


DISTILLING = ("dp3sd", "dpdsd", "dpkd")
# Every reading of the papers that a setting makes (docs/algorithms.md, "Readings of the papers").
READINGS = (
    Reading("papers", METHODS_ORDER, {}, "the papers' literal reading (Table 1)"),
    Reading("ramp", ("dp3sd", "dpdsd"), {"distill_schedule": "ramp"}, "PS-KD's ramped distillation weight"),
    Reading("teacher-step", ("dp3sd", "dpdsd"), {"teacher_every": "step"},
            "the teacher is the previous iterate, refreshed every step"),
    Reading("kl-mean", ("dp3sd",), {"dp3sd_kl_reduction": "mean"}, "the KL averaged over the classes too (÷K)"),
    Reading("dkd", ("dpdsd",), {"dpdsd_loss": "dkd"}, "Decoupled KD's loss, which DPDSD's text cites"),
    Reading("ce-tau", ("dpdsd",), {"dpdsd_ce": "tau"}, "the cross-entropy at temperature τ (eq. 5-6)"),
    Reading("ema-no-warmup", ("dpema",), {"ema_warmup": "off"}, "a constant EMA decay, without the warm-up"),
    # Momentum 0.9 was chosen on dpsgd; the papers give none. Without it a step is about ten
    # times shorter, so the lr is chosen again: the papers' own, and three times it. dpsgd runs
    # the second too, as the control: a gain there that dpsgd shares is the optimizer's, not
    # distillation's (dpsgd's momentum sweep tried momentum 0 at the papers' lr and 15 epochs only).
    Reading("momentum0", DISTILLING, {"momentum": 0.0}, "no momentum, the papers' lr", lr_scale=1.0),
    Reading("momentum0-lr3", ("dpsgd",) + DISTILLING, {"momentum": 0.0}, "no momentum, three times the papers' lr",
            lr_scale=3.0),
)


@dataclass(frozen=True)
class ScreenRun:
    """A method at a reading and a length in one setting: on validation (VALIDATION training
    samples held out) in the screen; `held_out` 0 on test (ConfirmRun)."""
    dataset: str
    activation: str
    epsilon: float
    method: str
    reading: Reading
    epochs: int
    seed: int = SCREEN_SEED
    held_out: int = VALIDATION

    @property
    def name(self) -> str:
        act = "" if self.activation == "relu" else f"-{self.activation}"
        return (f"{self.dataset}{act}-eps{self.epsilon:g}-{self.method}-{self.reading.name}"
                f"-e{self.epochs}{'' if self.held_out else '-test'}-seed{self.seed}")

    def config(self, **run) -> dict:
        held_out = {"validation": self.held_out} if self.held_out else {}
        return dict(dataset=self.dataset, activation=self.activation, epsilon=self.epsilon, method=self.method,
                    epochs=self.epochs, seed=self.seed, **held_out, **self.reading.settings(self.dataset), **run)


def screen_runs(readings=READINGS) -> list[ScreenRun]:
    """The screen's runs in the order they are run: the readings that need no new setting
    first (the papers' and PS-KD's ramp, started before the others existed), then the rest;
    within each, setting by setting, the shortest first, the baseline first."""
    first = [r for r in readings if r.name in ("papers", "ramp")]
    later = [r for r in readings if r.name not in ("papers", "ramp")]
    return [ScreenRun(d, a, e, m, r, n) for group in (first, later) for (d, a, e) in SCREEN_SETTINGS
            for n in SCREEN_LENGTHS for m in METHODS_ORDER for r in group if m in r.methods]


CONFIRM_SEEDS = 3
# The confirmation's cells (data set, activation, ε, methods): every MNIST and FMNIST cell of
# Table 1, FMNIST with tanh at ε = 3, and CIFAR-10 at ε = 3 for the self-distilling methods and
# their baseline (a CIFAR-10 run takes about two hours here).
CONFIRM_CELLS = tuple((d, "relu", e, METHODS_ORDER) for d in ("mnist", "fmnist") for e in (1.0, 2.0, 3.0)) + (
    ("fmnist", "tanh", 3.0, METHODS_ORDER), ("cifar10", "relu", 3.0, ("dpsgd", "dp3sd", "dpdsd")))


@dataclass(frozen=True)
class ConfirmRun(ScreenRun):
    """A method at its chosen reading and length in one cell, on the whole training set, scored
    on test."""
    held_out: int = 0

    @property
    def table1_name(self) -> str:
        """The Table 1 run of the same cell and seed (runs/table1/), which is this run where the
        reading is the papers' and the length the cell's own."""
        variant = "" if self.activation == "relu" else f"-{self.activation}"
        return f"{self.dataset}-{self.method}{variant}-eps{self.epsilon:g}-seed{self.seed}"

    def folder(self, runs_dir: Path) -> Path:
        """Where this run is: Table 1's run where that one computed exactly this (not run twice;
        a CIFAR-10 run takes hours), else its own folder under runs_dir."""
        table1 = runs_dir.parent / "table1" / self.table1_name
        return table1 if finished_with(table1, self.config()) else runs_dir / self.name


def chosen_readings(rows: dict[tuple, dict]) -> dict[str, str]:
    """Each method's reading for the confirmation: of its readings not dropped, the one whose
    best validation accuracy, averaged over the screening settings, is highest. A method with a
    reading not yet run at every length in every setting has none yet."""
    drop, scores = dropped(rows), {}
    for (dataset, activation, epsilon, method, reading), row in rows.items():
        if (method, reading) not in drop:
            scores.setdefault(method, {}).setdefault(reading, []).append(row)
    chosen = {}
    for method, readings in scores.items():
        if all(len(rs) == len(SCREEN_SETTINGS) and all(r["chosen_epochs"] is not None for r in rs)
               for rs in readings.values()):
            mean = {name: sum(r["best"] for r in rs) / len(rs) for name, rs in readings.items()}
            chosen[method] = max(mean, key=mean.get)
    return chosen


def confirm_runs(rows: dict[tuple, dict], seeds: int = CONFIRM_SEEDS) -> list[ConfirmRun]:
    """The confirmation's runs, for each method whose screen is done."""
    chosen, by_name = chosen_readings(rows), {r.name: r for r in READINGS}
    runs = []
    for dataset, activation, epsilon, methods in CONFIRM_CELLS:
        for method in (m for m in methods if m in chosen):
            reading = by_name[chosen[method]]
            screened = rows.get((dataset, activation, epsilon, method, reading.name))
            epochs = screened["chosen_epochs"] if screened else default_epochs(dataset, epsilon)
            runs += [ConfirmRun(dataset, activation, epsilon, method, reading, epochs, seed=s) for s in range(seeds)]
    return runs


def write_readings(runs: list[ScreenRun], runs_dir: Path, out: Path) -> Path:
    """table-readings.json and .md: per (setting, method, reading), validation accuracy at each
    length and the chosen length (the best final validation accuracy)."""
    rows = screen_rows(runs, runs_dir)
    drop = dropped(rows)
    for row in rows.values():
        row["dropped"] = (row["method"], row["reading"]) in drop
    confirmation = confirm_rows(confirm_runs(rows), runs_dir)
    write_json(out / "table-readings.json", {"screen": list(rows.values()), "chosen_readings": chosen_readings(rows),
                                             "confirmation": confirmation})
    lines = ["# Readings of the papers: the screen (validation accuracy, %, seed 0)", "",
             "Each method at its own best length of the three (the fair protocol), and its gain over dpsgd at "
             "dpsgd's best length in the same setting; a gain marked * is over lengths not all run yet. A reading "
             f"more than {DROP_MARGIN:g} point below its method's papers' reading in {DROP_SETTINGS} settings is "
             "dropped (its other runs are not made).", "",
             "| data | ε | method | reading | " + " | ".join(f"{n} ep." for n in SCREEN_LENGTHS)
             + " | chosen | best | gain over dpsgd |",
             "|---|---|---|---|" + "---|" * len(SCREEN_LENGTHS) + "---|---|---|"]
    for r in rows.values():
        data = r["dataset"] + ("" if r["activation"] == "relu" else f" ({r['activation']})")
        cells = [f"{r['validation'][str(n)]:.2f}" if str(n) in r["validation"] else "" for n in SCREEN_LENGTHS]
        gain = "" if r["gain_over_dpsgd"] is None else f"{r['gain_over_dpsgd']:+.2f}" + ("" if r["gain_final"] else "*")
        reading = r["reading"] + (" (dropped)" if r["dropped"] else "")
        lines.append(f"| {data} | {r['epsilon']:g} | {r['method']} | {reading} | " + " | ".join(cells)
                     + f" | {r['chosen_epochs'] or ''} | {'' if r['best'] is None else format(r['best'], '.2f')} "
                       f"| {gain} |")
    lines += confirmation_md(confirmation)
    path = out / "table-readings.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def confirm_rows(runs: list[ConfirmRun], runs_dir: Path) -> list[dict]:
    """Per cell and method: its reading and length, test accuracy per seed run so far, mean ±
    SE, and the gain over dpsgd in the same cell paired by seed."""
    import statistics

    rows: dict[tuple, dict] = {}
    for run in runs:
        row = rows.setdefault((run.dataset, run.activation, run.epsilon, run.method), dict(
            dataset=run.dataset, activation=run.activation, epsilon=run.epsilon, method=run.method,
            reading=run.reading.name, epochs=run.epochs, seeds=[], accuracies=[]))
        path = run.folder(runs_dir) / "result.json"
        if path.is_file():
            row["seeds"].append(run.seed)
            row["accuracies"].append(100 * RunResult.read(path).test_accuracy)
    for (dataset, activation, epsilon, method), row in rows.items():
        acc = row["accuracies"]
        row["mean"] = statistics.mean(acc) if acc else None
        row["se"] = statistics.stdev(acc) / len(acc) ** 0.5 if len(acc) > 1 else None
        base = rows.get((dataset, activation, epsilon, "dpsgd"))
        row["gain_over_dpsgd"] = None if method == "dpsgd" else paired_difference(row, base)
    return list(rows.values())


def confirmation_md(rows: list[dict]) -> list[str]:
    lines = ["", "## The confirmation (test accuracy, %)", "",
             f"Each method at its reading chosen on the screen and its length (the screen's where the cell was "
             f"screened, else the cell's own), {CONFIRM_SEEDS} seeds; the gain over dpsgd paired by seed "
             f"(mean ± SE). A method appears once its screen is done.", ""]
    if not rows:
        return lines + ["No method's screen is done yet."]
    lines += ["| data | ε | method | reading | epochs | seeds | test | gain over dpsgd |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        data = r["dataset"] + ("" if r["activation"] == "relu" else f" ({r['activation']})")
        test = "" if r["mean"] is None else f"{r['mean']:.2f}" + ("" if r["se"] is None else f" ± {r['se']:.2f}")
        g = r["gain_over_dpsgd"]
        gain = "" if g is None else f"{g['mean']:+.2f}" + ("" if g["se"] is None else f" ± {g['se']:.2f}")
        lines.append(f"| {data} | {r['epsilon']:g} | {r['method']} | {r['reading']} | {r['epochs']} | "
                     f"{len(r['seeds'])} | {test} | {gain} |")
    return lines


# The screen's rule: a reading more than DROP_MARGIN points below its method's papers' reading
# (each at its best length) in DROP_SETTINGS settings need not run further.
DROP_MARGIN, DROP_SETTINGS = 1.0, 2


def dropped(rows: dict[tuple, dict]) -> set[tuple[str, str]]:
    """The (method, reading) pairs the screen's rule drops, from the rows finished so far."""
    below: dict[tuple[str, str], int] = {}
    for (dataset, activation, epsilon, method, reading), row in rows.items():
        base = rows.get((dataset, activation, epsilon, method, "papers"))
        if reading == "papers" or base is None or row["chosen_epochs"] is None or base["chosen_epochs"] is None:
            continue
        if row["best"] < base["best"] - DROP_MARGIN:
            below[(method, reading)] = below.get((method, reading), 0) + 1
    return {key for key, n in below.items() if n >= DROP_SETTINGS}


def screen_rows(runs: list[ScreenRun], runs_dir: Path) -> dict[tuple, dict]:
    """Per (setting, method, reading): validation and test accuracy per length run so far, the
    chosen length (once every length has run), the best, and the gain over dpsgd."""
    rows: dict[tuple, dict] = {}
    for run in runs:
        key = (run.dataset, run.activation, run.epsilon, run.method, run.reading.name)
        row = rows.setdefault(key, dict(dataset=run.dataset, activation=run.activation, epsilon=run.epsilon,
                                        method=run.method, reading=run.reading.name, label=run.reading.label,
                                        validation={}, test={}))
        path = runs_dir / run.name / "result.json"
        if path.is_file():
            result = RunResult.read(path)
            row["validation"][str(run.epochs)] = 100 * result.validation_accuracy
            row["test"][str(run.epochs)] = 100 * result.test_accuracy
    for row in rows.values():
        done = row["validation"]
        row["chosen_epochs"] = int(max(done, key=done.get)) if len(done) == len(SCREEN_LENGTHS) else None
        row["best"] = max(done.values()) if done else None
    add_gains(rows)
    return rows


def add_gains(rows: dict[tuple, dict]) -> None:
    """Each row's gain over dpsgd (the papers' reading) in its setting: its best validation
    accuracy less dpsgd's best (each at its own length); final once both have every length."""
    for (dataset, activation, epsilon, method, reading), row in rows.items():
        base = rows.get((dataset, activation, epsilon, "dpsgd", "papers"))
        if method == "dpsgd" and reading == "papers" or base is None or base["best"] is None or row["best"] is None:
            row["gain_over_dpsgd"], row["gain_final"] = None, False
            continue
        row["gain_over_dpsgd"] = row["best"] - base["best"]
        row["gain_final"] = row["chosen_epochs"] is not None and base["chosen_epochs"] is not None

