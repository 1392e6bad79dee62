"""`fedsd reproduce --table features`: DP training on ScatterNet features (Tramèr &
Boneh, ICLR 2021), central, ε = 3, δ = 10⁻⁵, against the anchors that use no public data.

Two stages, as for the readings: nothing is chosen on test accuracy.

- The screen, on validation (VALIDATION training samples held out, seed 0, dpsgd): each of
  Tramèr & Boneh's networks for the data set (MNIST and Fashion-MNIST: their linear network and
  their CNN; CIFAR-10: their CNN) at their batch size and length (the epochs their σ spends
  ε = 3 in), at their lr and at half and twice it. Where a network's best lr is at the edge of
  its grid, the grid goes on past that edge (half or twice again), so that the chosen lr is one
  the screen brackets. CIFAR-10's runs take about an hour each on this CPU and half a minute on
  a GPU: its stages go after the other data sets' confirmation (SLOW).
- The normalisation, on validation (dpsgd, seed 0): at each data set's chosen network, B, lr and
  epochs, the features normalised per sample by GroupNorm (free of
  privacy cost; the screen's) against Tramèr & Boneh's private per-channel statistics (their ε
  composed into the run's: fedsd.data.features.private_statistics). A tie keeps GroupNorm.
- The recipe, on validation: dpema (dpsgd releasing an average of its iterates) at the chosen
  setting against dpsgd's run of it; the better is what fedsd reports against the anchors.
- The confirmation, on test: each data set's best validated setting, three seeds, for dpsgd,
  dpema and, to answer whether self-distillation adds on a strong feature baseline, for dp3sd
  and dpdsd in the papers' reading (their τ, α, β for the data set) and, once the readings'
  screen (`--table readings`) has chosen one for the method, in that reading too.

- In a federation (does the recipe hold there?): the federated table's shape and partitions
  IID and Dirichlet(0.5) (`fedsd reproduce --table fed`: Fashion-MNIST, 10 clients, 30 rounds
  of one local epoch, B = 256 a client, ε = 3 a client), each client computing the features of
  its own images, on Fashion-MNIST's chosen network; the lr chosen on the federation's
  validation split (dpsgd, IID, seed 0), then three seeds of each method under each partition.
  These runs take minutes to an hour; they go after CIFAR-10's dpsgd seeds and before its
  other methods' (hours each).

The screen normalises the features per sample by GroupNorm (27 groups), Tramèr & Boneh's choice for
Fashion-MNIST; for MNIST and CIFAR-10 they used private statistics, which the normalisation stage
weighs against it. The federation normalises per sample (--feature-norm private is central only).
Each run is `fedsd train`, resumable, written to <out>/runs/features/<run>/; a finished run is
not run again.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig, client_config
from fedsd.files.results import RunResult, write_json
from fedsd.simulation.sweeps import DIVERGED, finished_with, paired_difference, run_jobs
from simulations.federated_table import FED_PARTITIONS, FED_SHAPE, FED_TABLE, flawed, run_federation, run_state
from simulations.distributed_table import beside as distributed_beside
from simulations.readings import READINGS, chosen_readings, screen_rows
from simulations.readings import screen_runs as readings_screen

TABLE_NAME = "table-features"
EPSILON = 3.0
SEEDS = 3
VALIDATION = 10_000
SCREEN_SEED = 0
BASELINE = "dpsgd"
# dpsgd releasing an exponential moving average of its iterates (post-processing, free of
# privacy cost; De et al. 2022): the recipe's other candidate beside dpsgd's last iterate
EMA = "dpema"
METHODS = (BASELINE, "dp3sd", "dpdsd", EMA)  # the baseline first: every gain is against it
PAPERS = "papers"  # the papers' literal reading: the method's settings as Table 1 runs them
# The normalisation stage's candidates (fedsd.data.features.FEATURE_NORMS), the free one first: a
# tie on validation keeps it.
NORMS = ("group", "private")
NORM_TITLES = {"group": "GroupNorm", "private": "private statistics"}
LR_SCALES = (0.5, 1.0, 2.0)
LR_STEP = (0.5, 2.0)  # the factor past the grid's low and high edge
MAX_LR_STEPS = 2
# Tramèr & Boneh's settings (their README): network, B, lr, and the epochs in which their σ
# spends ε = 3 under Opacus' RDP accountant.
TB_SETTINGS = {
    "mnist": (dict(model="scatter-linear", batch_size=4096, lr=8.0, epochs=55),
              dict(model="scatter-cnn", batch_size=1024, lr=1.0, epochs=30)),
    "fmnist": (dict(model="scatter-linear", batch_size=8192, lr=16.0, epochs=50),
               dict(model="scatter-cnn", batch_size=2048, lr=4.0, epochs=50)),
    "cifar10": (dict(model="scatter-cnn", batch_size=8192, lr=4.0, epochs=85),),
}
# Hours a run on this CPU (CIFAR-10's CNN on 8192-sample batches): every stage of the data sets
# of minutes a run goes first, each to its confirmation, then these.
SLOW = ("cifar10",)
# (anchor, {data set: test accuracy %}): none uses public data
ANCHORS = (
    ("the DP3SD/DPDSD papers", {"mnist": 98.42, "fmnist": 87.68, "cifar10": 63.34}),
    ("Tramèr & Boneh, ScatterNet", {"mnist": 98.7, "fmnist": 89.7, "cifar10": 69.3}),
    ("DPSUR, ScatterNet", {"mnist": 98.88, "fmnist": 89.71, "cifar10": 70.83}),
    ("goal (just above DPSUR)", {"mnist": 98.9, "fmnist": 89.8, "cifar10": 70.9}),
)


def reading_settings(reading: str, settings: dict) -> dict:
    """A reading of the papers (simulations.readings.READINGS) applied to a features setting:
    its settings, and its lr scale (given against the papers' lr there) against this setting's lr."""
    r = next(x for x in READINGS if x.name == reading)
    return {**settings, **r.overrides, **({} if r.lr_scale is None else {"lr": settings["lr"] * r.lr_scale})}


def readings_chosen(runs_dir: Path) -> dict[str, str]:
    """Each method's reading as the readings' screen chose it (runs under <out>/runs/readings),
    for the methods whose screen is done."""
    readings_dir = runs_dir.parent / "readings"
    return chosen_readings(screen_rows(readings_screen(), readings_dir)) if readings_dir.is_dir() else {}


def method_readings(runs_dir: Path, method: str) -> tuple[str, ...]:
    """The readings a method runs in on features: dpsgd its features setting as screened; a
    self-distilling method the papers' reading and, where the readings' screen chose another,
    that one too."""
    if method == BASELINE:
        return (PAPERS,)
    chosen = readings_chosen(runs_dir).get(method, PAPERS)
    return (PAPERS,) if chosen == PAPERS else (PAPERS, chosen)


@dataclass(frozen=True)
class FeatureRun:
    dataset: str
    settings: dict = field(default_factory=dict)  # model, batch_size, lr, epochs
    method: str = BASELINE
    seed: int = 0
    validation: int = 0
    reading: str = PAPERS

    @property
    def setting_name(self) -> str:
        s = self.settings
        norm = "" if norm_of(s) == "group" else f"-{norm_of(s)}-norm"
        return f"{self.dataset}-{s['model']}-B{s['batch_size']}-lr{s['lr']:g}-e{s['epochs']}{norm}"

    @property
    def name(self) -> str:
        reading = "" if self.reading == PAPERS else f"-{self.reading}"
        return f"{self.setting_name}-{self.method}{reading}{'-val' if self.validation else ''}-seed{self.seed}"

    def config(self, threads: int, device: str, data_dir) -> dict:
        return dict(dataset=self.dataset, method=self.method, epsilon=EPSILON, seed=self.seed, features="scatter",
                    clip=0.1, validation=self.validation, device=device, threads=threads, data_dir=data_dir,
                    **reading_settings(self.reading, {"momentum": 0.9, **self.settings}))


def norm_of(settings: dict) -> str:
    """A features setting's normalisation (the screen's settings leave it out: GroupNorm)."""
    return settings.get("feature_norm", "group")


def with_norm(settings: dict, norm: str) -> dict:
    rest = {k: v for k, v in settings.items() if k != "feature_norm"}
    return rest if norm == "group" else {**rest, "feature_norm": norm}


def screen_runs(runs_dir: Path, datasets) -> list[FeatureRun]:
    return [run for d in TB_SETTINGS if d in datasets for tb in TB_SETTINGS[d]
            for run in network_screen(runs_dir, d, tb)]


def network_screen(runs_dir: Path, dataset: str, tb: dict) -> list[FeatureRun]:
    """One network's lr grid, in increasing lr: Tramèr & Boneh's lr times LR_SCALES; then, once
    every run of it is done and the best sits at an edge, one more lr past that edge (half the
    lowest or twice the highest), at most MAX_LR_STEPS times. A best at the edge means the grid
    has not found the lr's optimum (both MNIST and FMNIST's linear networks did best at half
    their lr)."""
    lrs = sorted(tb["lr"] * scale for scale in LR_SCALES)
    while True:
        runs = [FeatureRun(dataset, {**tb, "lr": lr}, seed=SCREEN_SEED, validation=VALIDATION) for lr in lrs]
        results = [read(runs_dir, run) for run in runs]
        if any(r is None for r in results) or len(lrs) == len(LR_SCALES) + MAX_LR_STEPS:
            return runs
        best = max(range(len(runs)), key=lambda k: preference(runs[k], results[k]))
        if best == 0:
            lrs.insert(0, lrs[0] * LR_STEP[0])
        elif best == len(lrs) - 1:
            lrs.append(lrs[-1] * LR_STEP[1])
        else:
            return runs


def preference(run: FeatureRun, result: RunResult) -> tuple[float, float]:
    """How the screen ranks a run: by validation accuracy; a tie (10,000 samples give accuracy
    in steps of 0.01 %) goes to the lr nearer Tramèr & Boneh's for the network, the published
    prior, which a tie gives no reason to leave."""
    published = tb_setting(run.dataset, run.settings["model"])["lr"]
    return result.validation_accuracy, -abs(math.log2(run.settings["lr"] / published))


def tb_setting(dataset: str, model: str) -> dict:
    """Tramèr & Boneh's setting for this data set's network."""
    return next(s for s in TB_SETTINGS[dataset] if s["model"] == model)


def read(runs_dir: Path, run: FeatureRun) -> RunResult | None:
    path = runs_dir / run.name / "result.json"
    return RunResult.read(path) if path.is_file() else None


def chosen_network(runs_dir: Path, dataset: str) -> dict | None:
    """A data set's best validated network, B, lr and epochs (its screen complete; GroupNorm);
    None while its screen runs."""
    results = [(run, read(runs_dir, run)) for run in screen_runs(runs_dir, [dataset])]
    if any(r is None for _, r in results):
        return None
    return max(results, key=lambda pair: preference(*pair))[0].settings


def norm_runs(runs_dir: Path, datasets) -> list[FeatureRun]:
    """dpsgd on validation, seed 0, at each data set's chosen network under each normalisation
    (a screened data set's GroupNorm run is its screen's own)."""
    return [FeatureRun(d, with_norm(network, norm), seed=SCREEN_SEED, validation=VALIDATION)
            for d in datasets if (network := chosen_network(runs_dir, d)) is not None for norm in NORMS]


def chosen(runs_dir: Path, dataset: str) -> dict | None:
    """A data set's setting: its chosen network under the normalisation that did better on
    validation (a tie keeps GroupNorm, which spends nothing); None while either stage runs."""
    runs = norm_runs(runs_dir, [dataset])
    results = [read(runs_dir, run) for run in runs]
    if not runs or any(r is None for r in results):
        return None
    best = max(range(len(runs)), key=lambda k: (results[k].validation_accuracy, -k))  # NORMS: the free one first
    return runs[best].settings


def recipe_runs(runs_dir: Path, datasets) -> list[FeatureRun]:
    """dpema at each data set's chosen setting, on validation, seed 0 (in its reading from the
    readings' screen, where that has chosen one): against dpsgd's run of the same setting (the
    normalisation stage's), it decides the data set's recipe."""
    return [FeatureRun(d, settings, EMA, SCREEN_SEED, VALIDATION, reading=method_readings(runs_dir, EMA)[-1])
            for d in TB_SETTINGS if d in datasets and (settings := chosen(runs_dir, d)) is not None]


def recipe(runs_dir: Path, dataset: str) -> dict | None:
    """The data set's recipe, what fedsd reports against the anchors: of dpsgd's last iterate and
    dpema's EMA at the chosen setting, the better on validation. None while either run is not done."""
    runs = recipe_runs(runs_dir, [dataset])
    if not runs or (ema := read(runs_dir, runs[0])) is None:
        return None
    run = runs[0]
    last = read(runs_dir, FeatureRun(dataset, run.settings, BASELINE, SCREEN_SEED, VALIDATION))
    validation = {BASELINE: 100 * last.validation_accuracy, EMA: 100 * ema.validation_accuracy}
    method = max(validation, key=validation.get)  # a tie keeps dpsgd, the simpler release
    return dict(method=method, reading=PAPERS if method == BASELINE else run.reading, validation=validation)


def confirm_runs(runs_dir: Path, datasets, seeds: int) -> list[FeatureRun]:
    runs = []
    for d in datasets:
        settings = chosen(runs_dir, d)
        if settings is not None:
            runs += [FeatureRun(d, settings, m, seed, reading=r) for m in METHODS for r in method_readings(runs_dir, m)
                     for seed in range(seeds)]
    return runs


# The federation (FED_SHAPE, B and ε of the federated table, on FED_DATASET's chosen network).
FED_DATASET = "fmnist"
FED_PARTITIONS_RUN = ("iid", "dirichlet0.5")
# The lr screen: Tramèr & Boneh's lr for the chosen network scaled to B = 256 (linear in B),
# times each of these. The federated table's CNN took 3.1 times its linear scaling (lr 1.5
# against 3 · 256/1600), so the grid reaches above it. Anchored to their lr, not to the central
# screen's choice, the federation's grid does not move when the central grid is extended.
FED_LR_SCALES = (0.5, 2.0, 8.0)


@dataclass(frozen=True)
class FedFeatureRun:
    """A federation of the federated table's shape on ScatterNet features."""
    partition: str  # a key of the federated table's FED_PARTITIONS
    method: str
    lr: float
    network: str
    seed: int = 0
    validation: int = 0
    reading: str = PAPERS

    @property
    def name(self) -> str:
        reading = "" if self.reading == PAPERS else f"-{self.reading}"
        return (f"fed-{FED_DATASET}-{self.partition}-{self.network}-lr{self.lr:g}-{self.method}{reading}"
                f"{'-val' if self.validation else ''}-seed{self.seed}")

    def settings(self, device: str, data_dir):
        """(TrainConfig, FedConfig) as `fedsd simulate` takes them."""
        partition, alpha = FED_PARTITIONS[self.partition]
        settings = reading_settings(self.reading, {"momentum": 0.9, "lr": self.lr})
        cfg = TrainConfig(**{**FED_TABLE, **settings}, method=self.method, seed=self.seed, features="scatter",
                          model=self.network, clip=0.1, validation=self.validation, device=device, data_dir=data_dir)
        fed = FedConfig(**FED_SHAPE, partition=partition, dirichlet_alpha=alpha)
        return client_config(cfg, fed), fed


def fed_screen_runs(runs_dir: Path) -> list[FedFeatureRun]:
    """dpsgd, IID, seed 0, on validation, at each lr of the grid; none while the central screen
    of FED_DATASET has not chosen its network."""
    central = chosen_network(runs_dir, FED_DATASET)
    if central is None:
        return []
    tb = tb_setting(FED_DATASET, central["model"])
    base = tb["lr"] * FED_TABLE["batch_size"] / tb["batch_size"]
    return [FedFeatureRun("iid", BASELINE, base * scale, central["model"], SCREEN_SEED, VALIDATION)
            for scale in FED_LR_SCALES]


def read_fed(runs_dir: Path, run: FedFeatureRun) -> RunResult | None:
    path = runs_dir / run.name / "result.json"
    result = RunResult.read(path) if path.is_file() else None
    return None if result is None or flawed(result) else result


def fed_diverged(runs_dir: Path, run: FedFeatureRun) -> bool:
    """A run that diverged (its diverged.json): done, with no accuracy."""
    return (runs_dir / run.name / DIVERGED).is_file()


def fed_chosen(runs_dir: Path) -> FedFeatureRun | None:
    """The screen's run of the best validation accuracy among those that did not diverge; None
    while the screen runs, or where every run of it diverged."""
    screen = [(run, read_fed(runs_dir, run)) for run in fed_screen_runs(runs_dir)]
    if any(r is None and not fed_diverged(runs_dir, run) for run, r in screen):
        return None
    trained = [(run, r) for run, r in screen if r is not None]
    return max(trained, key=lambda pair: pair[1].validation_accuracy)[0] if trained else None


def fed_confirm_runs(runs_dir: Path, seeds: int) -> list[FedFeatureRun]:
    """Each method under each partition, at the screen's chosen lr, on test; none while the
    screen runs."""
    best = fed_chosen(runs_dir)
    if best is None:
        return []
    return [FedFeatureRun(p, m, best.lr, best.network, seed, reading=r) for p in FED_PARTITIONS_RUN for m in METHODS
            for r in method_readings(runs_dir, m) for seed in range(seeds)]


def run_federations(runs: list[FedFeatureRun], runs_dir: Path, device: str, data_dir, jobs: int,
                    quiet: bool) -> None:
    for k, run in enumerate(runs, 1):
        cfg, fed = run.settings(device, data_dir)
        state = run_state(runs_dir / run.name, cfg, fed)
        if state == "done":
            continue
        if not quiet:
            print(f"features, federated [{k}/{len(runs)}] {run.name}" + (" (resumed)" if state == "resume" else ""),
                  flush=True)
        run_federation(cfg, fed, runs_dir / run.name, state, jobs, quiet)


def reproduce_features(datasets: list[str] | None, seeds: int, jobs: int, threads: int, device: str, data_dir,
                       out: Path, quiet: bool = False) -> Path:
    datasets = [d for d in TB_SETTINGS if datasets is None or d in datasets]
    runs_dir = out / "runs" / "features"

    def run_all(runs: list[FeatureRun], desc: str) -> None:
        todo = [(r.config(threads, device, data_dir), str(runs_dir / r.name)) for r in runs]
        run_jobs([(c, o) for c, o in todo if not finished_with(Path(o), c)], len(todo), jobs, desc, quiet)

    def screen(datasets: list[str]) -> None:
        for _ in range(MAX_LR_STEPS + 1):  # each pass may extend a network's grid past its edge
            run_all(screen_runs(runs_dir, datasets), "features: screen")

    slow = [d for d in datasets if d in SLOW]
    fast = [d for d in datasets if d not in slow]
    # the data sets of minutes a run first, each to its confirmation, then CIFAR-10's
    screen(fast)
    run_all(norm_runs(runs_dir, fast), "features: normalisation")
    run_all(recipe_runs(runs_dir, fast), "features: the recipe's EMA")
    write_features_table(runs_dir, out, seeds)
    run_all(confirm_runs(runs_dir, fast, seeds), "features: confirmation")
    screen(slow)
    run_all(norm_runs(runs_dir, slow), "features: normalisation")
    run_all(recipe_runs(runs_dir, slow), "features: the recipe's EMA")
    # the baseline's seeds on every data set before the federation (minutes to an hour a run)
    # and before the other methods' hours-long runs: the table's first question is the baseline
    run_all([r for r in confirm_runs(runs_dir, slow, seeds) if r.method == BASELINE], "features: confirmation")
    if FED_DATASET in datasets:
        run_federations(fed_screen_runs(runs_dir), runs_dir, device, data_dir, jobs, quiet)
        write_features_table(runs_dir, out, seeds)
        run_federations(fed_confirm_runs(runs_dir, seeds), runs_dir, device, data_dir, jobs, quiet)
        write_features_table(runs_dir, out, seeds)
    run_all(confirm_runs(runs_dir, slow, seeds), "features: confirmation")
    return write_features_table(runs_dir, out, seeds)


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    return statistics.mean(values), (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None)


def table_rows(runs_dir: Path, seeds: int = SEEDS) -> dict:
    screen = []
    screened = screen_runs(runs_dir, TB_SETTINGS)
    for run in screened + [run for run in norm_runs(runs_dir, TB_SETTINGS) if run not in screened]:
        r = read(runs_dir, run)
        if r is not None:
            screen.append(dict(dataset=run.dataset, method=run.method, setting=run.setting_name,
                               **with_norm(run.settings, "group"), feature_norm=norm_of(run.settings),
                               validation_accuracy=100 * r.validation_accuracy, minutes=round(r.wall_seconds / 60, 1),
                               device=device_kind(r)))
    for run in recipe_runs(runs_dir, TB_SETTINGS):
        r = read(runs_dir, run)
        if r is not None:
            screen.append(dict(dataset=run.dataset, method=method_cell(dict(method=run.method, reading=run.reading)),
                               setting=run.setting_name, **with_norm(run.settings, "group"),
                               feature_norm=norm_of(run.settings),
                               validation_accuracy=100 * r.validation_accuracy, minutes=round(r.wall_seconds / 60, 1),
                               device=device_kind(r)))
    recipes = {d: chosen_recipe for d in TB_SETTINGS if (chosen_recipe := recipe(runs_dir, d)) is not None}
    confirmed = []
    for d, settings in ((d, with_norm(network, norm)) for d in TB_SETTINGS
                        if (network := chosen_network(runs_dir, d)) is not None for norm in NORMS):
        final = chosen(runs_dir, d)
        if final is None and norm_of(settings) != "group":
            continue  # until the normalisation is chosen, the rows confirmed under GroupNorm
        base = None
        for m, reading in ((m, r) for m in METHODS for r in method_readings(runs_dir, m)):
            found = {s: r for s in range(seeds)
                     if (r := read(runs_dir, FeatureRun(d, settings, m, s, reading=reading))) is not None}
            if not found:
                continue
            accuracies = [100 * r.test_accuracy for r in found.values()]
            mean, se = _mean_se(accuracies)
            row = dict(dataset=d, method=m, reading=reading, setting=FeatureRun(d, settings).setting_name,
                       **with_norm(settings, "group"), feature_norm=norm_of(settings),
                       chosen=None if final is None else settings == final,
                       chosen_on="validation",
                       seeds=list(found), accuracies=accuracies, mean=mean, se=se,
                       epsilon_spent=[r.epsilon_spent for r in found.values()],
                       minutes=[round(r.wall_seconds / 60, 1) for r in found.values()],
                       devices=[device_kind(r) for r in found.values()],
                       anchors={name: values[d] for name, values in ANCHORS})
            if m == BASELINE:
                base = row
            row["gain_over_dpsgd"] = paired_difference(row, base)
            row["recipe"] = (settings == final and d in recipes
                             and (recipes[d]["method"], recipes[d]["reading"]) == (m, reading))
            confirmed.append(row)
    return dict(screen=screen, recipes=recipes, confirmed=confirmed, federated=fed_rows(runs_dir, seeds))


def fed_rows(runs_dir: Path, seeds: int = SEEDS) -> dict:
    """The federation's lr screen (validation) and its rows (test, per partition and method,
    the gain over dpsgd paired by seed)."""
    screen = []
    for run in fed_screen_runs(runs_dir):
        r = read_fed(runs_dir, run)
        if r is not None:
            screen.append(dict(partition=run.partition, network=run.network, lr=run.lr,
                               validation_accuracy=100 * r.validation_accuracy, minutes=round(r.wall_seconds / 60, 1)))
        elif fed_diverged(runs_dir, run):
            screen.append(dict(partition=run.partition, network=run.network, lr=run.lr, diverged=True))
    rows, base = [], {}
    best = fed_chosen(runs_dir)
    cells = [(p, m, r) for p in FED_PARTITIONS_RUN for m in METHODS for r in method_readings(runs_dir, m)] \
        if best is not None else []
    for partition, method, reading in cells:
        found = {s: r for s in range(seeds)
                 if (r := read_fed(runs_dir, FedFeatureRun(partition, method, best.lr, best.network, s,
                                                           reading=reading)))}
        if not found:
            continue
        accuracies = [100 * r.test_accuracy for r in found.values()]
        mean, se = _mean_se(accuracies)
        row = dict(partition=partition, method=method, reading=reading, network=best.network, lr=best.lr,
                   seeds=list(found), accuracies=accuracies, mean=mean, se=se,
                   minutes=[round(r.wall_seconds / 60, 1) for r in found.values()])
        if method == BASELINE:
            base[partition] = row
        row["gain_over_dpsgd"] = paired_difference(row, base.get(partition))
        rows.append(row)
    return dict(screen=screen, rows=rows)


def write_features_table(runs_dir: Path, out: Path, seeds: int = SEEDS) -> Path:
    rows = table_rows(runs_dir, seeds)
    write_json(out / f"{TABLE_NAME}.json", dict(epsilon=EPSILON, delta=1e-5, validation=VALIDATION, **rows))
    names = [name for name, _ in ANCHORS]
    lines = ["# DP training on ScatterNet features (central, ε = 3, δ = 1e-5)", "",
             "Written by `fedsd reproduce --table features` from results/runs/features/ "
             "(simulations/features_table.py). Test accuracy (%), mean ± standard error over the seeds; the gain "
             "over dpsgd paired by seed; minutes per run on the machine that ran it: this project's CPU (one thread, "
             "shared) unless the cell names a GPU (its card, or cuda where the run did not record it). "
             "The data set's "
             "recipe (**bold**), what fedsd reports against the anchors, is the better on validation of dpsgd's last "
             "iterate and dpema's average of its iterates at the chosen setting.", "",
             "| data set | method | network, B, lr, epochs, normalisation | chosen on | seeds | test accuracy | "
             "gain over dpsgd | minutes a run | " + " | ".join(names) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(names)]
    for r in rows["confirmed"]:
        acc = f"{r['mean']:.2f}" + (f" ± {r['se']:.2f}" if r["se"] is not None else "")
        gain = r["gain_over_dpsgd"]
        gain = "" if gain is None else \
            f"{gain['mean']:+.2f}" + (f" ± {gain['se']:.2f}" if gain["se"] is not None else "")
        method = f"**{method_cell(r)}**" if r.get("recipe") else method_cell(r)
        chosen_on = {True: r["chosen_on"], False: "not chosen (the other normalisation did better on validation)",
                     None: "the normalisation not yet chosen"}[r["chosen"]]
        lines.append(f"| {r['dataset']} | {method} | {r['model']}, {r['batch_size']}, {r['lr']:g}, {r['epochs']}, "
                     f"{NORM_TITLES[r['feature_norm']]} | {chosen_on} | {len(r['seeds'])} | {acc} | {gain} | "
                     f"{minutes_cell(r['minutes'], r['devices'])} | "
                     + " | ".join(f"{v:g}" for v in r["anchors"].values()) + " |")
    lines += ["", f"## The screen (seed {SCREEN_SEED}, {VALIDATION} training samples held out): dpsgd's networks and "
              "lrs under GroupNorm, then its normalisation at the chosen network, then dpema at the chosen setting", "",
              "| data set | method | network | B | lr | epochs | normalisation | validation accuracy | minutes |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows["screen"]:
        lines.append(f"| {r['dataset']} | {r['method']} | {r['model']} | {r['batch_size']} | {r['lr']:g} | "
                     f"{r['epochs']} | {NORM_TITLES[r['feature_norm']]} | {r['validation_accuracy']:.2f} | "
                     f"{minutes_cell([r['minutes']], [r['device']])} |")
    lines += fed_md(rows["federated"]) + distributed_beside(out, "features")
    (out / f"{TABLE_NAME}.md").write_text("\n".join(lines) + "\n")
    return out / f"{TABLE_NAME}.md"


def device_kind(result: RunResult) -> str:
    """Where a run went, as the table names it: its GPU's name where result.json has it, else
    cpu or cuda (an index such as cuda:0 left out)."""
    return result.device_name or result.device.split(":")[0]


def minutes_cell(minutes: list[float], devices: list[str]) -> str:
    """The mean minutes a run on each device (device_kind) its runs went to, the device named
    unless it is this CPU: a GPU's minutes are not the CPU's (CIFAR-10's ScatterNet runs took
    about 0.4 on an H200 against 50 here), so a cell never averages the two."""
    by_device: dict[str, list[float]] = {}
    for m, device in zip(minutes, devices, strict=True):
        by_device.setdefault(device, []).append(m)
    return ", ".join(f"{statistics.mean(ms):.1f}" + ("" if device == "cpu" else f" ({device})")
                     for device, ms in sorted(by_device.items(), key=lambda item: item[0] != "cpu"))


def method_cell(row: dict) -> str:
    """The method, and its reading where it is not the papers'."""
    return row["method"] if row.get("reading", PAPERS) == PAPERS else f"{row['method']} ({row['reading']})"


def fed_md(fed: dict) -> list[str]:
    lines = ["", f"## In a federation ({FED_DATASET}, {FED_SHAPE['num_clients']} clients, {FED_SHAPE['rounds']} rounds "
             f"of {FED_SHAPE['local_epochs']} local epoch, B = {FED_TABLE['batch_size']} and "
             f"ε = {FED_TABLE['epsilon']:g} a "
             "client, each client's own features)", ""]
    if not fed["screen"]:
        return lines + ["No run finished yet (the lr screen comes first, once the central screen has chosen the "
                        "network)."]
    lines += [f"The lr, on the federation's validation split (dpsgd, IID, seed {SCREEN_SEED}, {VALIDATION} held out):",
              "", "| network | lr | validation accuracy | minutes |", "|---|---|---|---|"]
    lines += [f"| {r['network']} | {r['lr']:g} | diverged | |" if r.get("diverged") else
              f"| {r['network']} | {r['lr']:g} | {r['validation_accuracy']:.2f} | {r['minutes']:.1f} |"
              for r in fed["screen"]]
    if fed["rows"]:
        lines += ["", "| partition | method | network, lr | seeds | test accuracy | gain over dpsgd | minutes a run |",
                  "|---|---|---|---|---|---|---|"]
        for r in fed["rows"]:
            acc = f"{r['mean']:.2f}" + (f" ± {r['se']:.2f}" if r["se"] is not None else "")
            g = r["gain_over_dpsgd"]
            gain = "" if g is None else f"{g['mean']:+.2f}" + (f" ± {g['se']:.2f}" if g["se"] is not None else "")
            lines.append(f"| {r['partition']} | {method_cell(r)} | {r['network']}, {r['lr']:g} | {len(r['seeds'])} | "
                         f"{acc} | {gain} | {statistics.mean(r['minutes']):.1f} |")
    return lines
