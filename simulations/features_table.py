"""`fedsd reproduce --table features`: DP training on ScatterNet features (issue 41; Tramèr &
Boneh, ICLR 2021), central, ε = 3, δ = 10⁻⁵, against the anchors that use no public data.

Two stages, as for the readings: nothing is chosen on test accuracy.

- The screen, on validation (VALIDATION training samples held out, seed 0, dpsgd): for MNIST
  and Fashion-MNIST, each of Tramèr & Boneh's two networks at their batch size and length (the
  epochs their σ spends ε = 3 in), at their lr and at half and twice it. CIFAR-10 is not
  screened (a run takes hours here): Tramèr & Boneh's ScatterNet + CNN settings.
- The confirmation, on test: each data set's best validated setting, three seeds, for dpsgd
  and, to answer whether self-distillation adds on a strong feature baseline, for dp3sd and
  dpdsd in the papers' reading (their τ, α, β for the data set).

The features are normalised per sample by GroupNorm (27 groups) where Tramèr & Boneh used, for
MNIST and CIFAR-10, batch statistics made private at a cost in ε. Each run is `fedsd train`,
resumable, written to <out>/runs/features/<run>/; a finished run is not run again.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from fedsd.results import RunResult, write_json

from .runs import finished_with, paired_difference, run_jobs

TABLE_NAME = "table-features"
EPSILON = 3.0
SEEDS = 3
VALIDATION = 10_000
SCREEN_SEED = 0
METHODS = ("dpsgd", "dp3sd", "dpdsd")  # the baseline first: every gain is against it
LR_SCALES = (0.5, 1.0, 2.0)
# Tramèr & Boneh's settings (their README): network, B, lr, and the epochs in which their σ
# spends ε = 3 under Opacus' RDP accountant.
TB_SETTINGS = {
    "mnist": (dict(model="scatter-linear", batch_size=4096, lr=8.0, epochs=55),
              dict(model="scatter-cnn", batch_size=1024, lr=1.0, epochs=30)),
    "fmnist": (dict(model="scatter-linear", batch_size=8192, lr=16.0, epochs=50),
               dict(model="scatter-cnn", batch_size=2048, lr=4.0, epochs=50)),
    "cifar10": (dict(model="scatter-cnn", batch_size=8192, lr=4.0, epochs=85),),
}
SCREENED = ("mnist", "fmnist")
# (anchor, {data set: test accuracy %}): none uses public data
ANCHORS = (
    ("the DP3SD/DPDSD papers", {"mnist": 98.42, "fmnist": 87.68, "cifar10": 63.34}),
    ("Tramèr & Boneh, ScatterNet", {"mnist": 98.7, "fmnist": 89.7, "cifar10": 69.3}),
    ("DPSUR, ScatterNet", {"mnist": 98.88, "fmnist": 89.71, "cifar10": 70.83}),
    ("goal (issue 41)", {"mnist": 98.9, "fmnist": 89.8, "cifar10": 70.9}),
)


@dataclass(frozen=True)
class FeatureRun:
    dataset: str
    settings: dict = field(default_factory=dict)  # model, batch_size, lr, epochs
    method: str = "dpsgd"
    seed: int = 0
    validation: int = 0

    @property
    def setting_name(self) -> str:
        s = self.settings
        return f"{self.dataset}-{s['model']}-B{s['batch_size']}-lr{s['lr']:g}-e{s['epochs']}"

    @property
    def name(self) -> str:
        return f"{self.setting_name}-{self.method}{'-val' if self.validation else ''}-seed{self.seed}"

    def config(self, threads: int, device: str, data_dir) -> dict:
        return dict(dataset=self.dataset, method=self.method, epsilon=EPSILON, seed=self.seed, features="scatter",
                    momentum=0.9, clip=0.1, validation=self.validation, device=device, threads=threads,
                    data_dir=data_dir, **self.settings)


def screen_runs(datasets) -> list[FeatureRun]:
    return [FeatureRun(d, {**tb, "lr": tb["lr"] * scale}, seed=SCREEN_SEED, validation=VALIDATION)
            for d in SCREENED if d in datasets for tb in TB_SETTINGS[d] for scale in LR_SCALES]


def read(runs_dir: Path, run: FeatureRun) -> RunResult | None:
    path = runs_dir / run.name / "result.json"
    return RunResult.read(path) if path.is_file() else None


def chosen(runs_dir: Path, dataset: str) -> dict | None:
    """A data set's best validated setting (its screen complete), or Tramèr & Boneh's where it is
    not screened; None while its screen runs."""
    if dataset not in SCREENED:
        return TB_SETTINGS[dataset][0]
    results = [(run, read(runs_dir, run)) for run in screen_runs([dataset])]
    if any(r is None for _, r in results):
        return None
    return max(results, key=lambda pair: pair[1].validation_accuracy)[0].settings


def confirm_runs(runs_dir: Path, datasets, seeds: int) -> list[FeatureRun]:
    runs = []
    for d in datasets:
        settings = chosen(runs_dir, d)
        if settings is not None:
            runs += [FeatureRun(d, settings, m, seed) for m in METHODS for seed in range(seeds)]
    return runs


def reproduce_features(datasets: list[str] | None, seeds: int, jobs: int, threads: int, device: str, data_dir,
                       out: Path, quiet: bool = False) -> Path:
    datasets = [d for d in TB_SETTINGS if datasets is None or d in datasets]
    runs_dir = out / "runs" / "features"

    def run_all(runs: list[FeatureRun], desc: str) -> None:
        todo = [(r.config(threads, device, data_dir), str(runs_dir / r.name)) for r in runs]
        run_jobs([(c, o) for c, o in todo if not finished_with(Path(o), c)], len(todo), jobs, desc, quiet)

    run_all(screen_runs(datasets), "features: screen")
    write_features_table(runs_dir, out, seeds)
    run_all(confirm_runs(runs_dir, datasets, seeds), "features: confirmation")
    return write_features_table(runs_dir, out, seeds)


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    return statistics.mean(values), (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None)


def table_rows(runs_dir: Path, seeds: int = SEEDS) -> dict:
    screen = []
    for run in screen_runs(SCREENED):
        r = read(runs_dir, run)
        if r is not None:
            screen.append(dict(dataset=run.dataset, setting=run.setting_name, **run.settings,
                               validation_accuracy=100 * r.validation_accuracy, minutes=round(r.wall_seconds / 60, 1)))
    confirmed = []
    for d in TB_SETTINGS:
        settings = chosen(runs_dir, d)
        if settings is None:
            continue
        base = None
        for m in METHODS:
            found = {s: r for s in range(seeds) if (r := read(runs_dir, FeatureRun(d, settings, m, s))) is not None}
            if not found:
                continue
            accuracies = [100 * r.test_accuracy for r in found.values()]
            mean, se = _mean_se(accuracies)
            row = dict(dataset=d, method=m, setting=FeatureRun(d, settings).setting_name, **settings,
                       chosen_on="validation" if d in SCREENED else "Tramèr & Boneh's settings (not screened)",
                       seeds=list(found), accuracies=accuracies, mean=mean, se=se,
                       epsilon_spent=[r.epsilon_spent for r in found.values()],
                       minutes=[round(r.wall_seconds / 60, 1) for r in found.values()],
                       anchors={name: values[d] for name, values in ANCHORS})
            if m == "dpsgd":
                base = row
            row["gain_over_dpsgd"] = paired_difference(row, base)
            confirmed.append(row)
    return dict(screen=screen, confirmed=confirmed)


def write_features_table(runs_dir: Path, out: Path, seeds: int = SEEDS) -> Path:
    rows = table_rows(runs_dir, seeds)
    write_json(out / f"{TABLE_NAME}.json", dict(epsilon=EPSILON, delta=1e-5, validation=VALIDATION, **rows))
    names = [name for name, _ in ANCHORS]
    lines = ["# DP training on ScatterNet features (central, ε = 3, δ = 1e-5)", "",
             "Written by `fedsd reproduce --table features` from results/runs/features/ "
             "(simulations/features_table.py). Test accuracy (%), mean ± standard error over the seeds; the gain "
             "over dpsgd paired by seed; minutes per run on the CPU that ran it (one thread, shared).", "",
             "| data set | method | network, B, lr, epochs | chosen on | seeds | test accuracy | gain over dpsgd | "
             "minutes a run | " + " | ".join(names) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(names)]
    for r in rows["confirmed"]:
        acc = f"{r['mean']:.2f}" + (f" ± {r['se']:.2f}" if r["se"] is not None else "")
        gain = r["gain_over_dpsgd"]
        gain = "" if gain is None else f"{gain['mean']:+.2f}" + (f" ± {gain['se']:.2f}" if gain["se"] is not None else "")
        lines.append(f"| {r['dataset']} | {r['method']} | {r['model']}, {r['batch_size']}, {r['lr']:g}, {r['epochs']} | "
                     f"{r['chosen_on']} | {len(r['seeds'])} | {acc} | {gain} | {statistics.mean(r['minutes']):.1f} | "
                     + " | ".join(f"{v:g}" for v in r["anchors"].values()) + " |")
    lines += ["", f"## The screen (dpsgd, seed {SCREEN_SEED}, {VALIDATION} training samples held out)", "",
              "| data set | network | B | lr | epochs | validation accuracy | minutes |", "|---|---|---|---|---|---|---|"]
    for r in rows["screen"]:
        lines.append(f"| {r['dataset']} | {r['model']} | {r['batch_size']} | {r['lr']:g} | {r['epochs']} | "
                     f"{r['validation_accuracy']:.2f} | {r['minutes']:.1f} |")
    (out / f"{TABLE_NAME}.md").write_text("\n".join(lines) + "\n")
    return out / f"{TABLE_NAME}.md"
