"""`fedsd reproduce --table adaptive`: does adaptive clipping (--clip-quantile; Andrew et al. 2021,
docs/algorithms.md) free a user from tuning C? Fashion-MNIST, central, ε = 3, δ = 10⁻⁵, two
recipes: the features recipe (features-fmnist: scatter-linear, B = 8192, 50 epochs) and the
papers' CNN (table1-fmnist-dpsgd: mnist-cnn, B = 1600, 30 epochs), each tuned at C = 0.1.

Two stages, as every table: nothing is chosen on test accuracy.

- The screen, on validation (VALIDATION training samples held out, seed 0): each recipe with the
  clip starting 10× and 0.1× its tuned C, at each quantile of QUANTILES (the clip's rate and the
  count's noise at the paper's defaults), and the recipe at its tuned fixed C. A quantile's score
  is the worse of its two starts' validation accuracies (a user does not know which side of the
  tuned C they start on); the best score is chosen, a tie the quantile nearer the middle.
- The confirmation, on test: the chosen quantile from both starts, and the tuned fixed C, three
  seeds each. The question's answer is each start's mean against the fixed C's, paired by seed.

Each run is `fedsd train`, resumable, in <out>/runs/adaptive/<run>/; a finished run is not run again.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from simulations import adaptive_clients
from fedsd.simulation.sweeps import DIVERGED, finished_with, paired_difference, run_jobs
from fedsd.files.results import RunResult, write_json

TABLE_NAME = "table-adaptive"
RECIPES = ("features-fmnist", "table1-fmnist-dpsgd")
EPSILON = 3.0
VALIDATION = 10_000
SCREEN_SEED = 0
SEEDS = 3
QUANTILES = (0.3, 0.5, 0.7, 0.9)  # the tuned C = 0.1 sits near the 0.5–0.75 quantile late in both recipes
STARTS = (10.0, 0.1)  # the clip's start, times the recipe's tuned C
# Andrew et al.'s rule as it is (the step lr · C follows the clip), and with --clip-normalize (the
# step per unit of clip, at the recipe's lr × C): the first screen's runs showed the papers' lr,
# tuned at C = 0.1, does not survive a clip that grows.
NORMALIZED = (False, True)
FIXED = None  # a run at the tuned C, not adapted


@dataclass(frozen=True)
class AdaptiveRun:
    recipe: str
    quantile: float | None  # None: the tuned fixed C
    start: float = 1.0  # times the tuned C
    seed: int = 0
    validation: int = 0
    normalized: bool = False  # --clip-normalize, at the recipe's lr × C per unit of clip

    @property
    def name(self) -> str:
        arm = "fixed" if self.quantile is None else f"q{self.quantile:g}-from{self.start:g}x"
        arm += "-normalized" if self.normalized else ""
        return f"{self.recipe}-{arm}{'-val' if self.validation else ''}-seed{self.seed}"

    def config(self, threads: int, device: str, data_dir) -> dict:
        from fedsd.settings.recipe_files import read_recipe, recipe_path

        values = {name: value for name, (_, value) in read_recipe(recipe_path(self.recipe)).values.items()}
        adapted = {} if self.quantile is None else dict(clip=values["clip"] * self.start, clip_quantile=self.quantile)
        if self.normalized:  # the step per unit of clip: the recipe's lr at its tuned C
            adapted.update(clip_normalize=True, lr=values["lr"] * values["clip"])
        return {**values, **adapted, "epsilon": EPSILON, "seed": self.seed, "validation": self.validation,
                "threads": threads, "device": device, "data_dir": data_dir}


def screen_runs() -> list[AdaptiveRun]:
    return [AdaptiveRun(r, q, s, SCREEN_SEED, VALIDATION, normalized) for normalized in NORMALIZED for r in RECIPES
            for q in QUANTILES for s in STARTS] + \
           [AdaptiveRun(r, FIXED, seed=SCREEN_SEED, validation=VALIDATION) for r in RECIPES]


def _result(out: Path, run: AdaptiveRun) -> RunResult | None:
    path = out / "runs" / "adaptive" / run.name / "result.json"
    return RunResult.read(path) if path.exists() else None


def _validation_score(out: Path, run: AdaptiveRun) -> float | None:
    """Validation accuracy (%); a diverged run scores 0; None: not run yet."""
    if (out / "runs" / "adaptive" / run.name / DIVERGED).exists():
        return 0.0
    result = _result(out, run)
    return None if result is None else 100 * result.validation_accuracy


def _screen_cell(out: Path, run: AdaptiveRun) -> float | str | None:
    """A screen run as the table shows it: its validation accuracy (%), "diverged", or None (not run)."""
    if (out / "runs" / "adaptive" / run.name / DIVERGED).exists():
        return "diverged"
    return _validation_score(out, run)


def chosen_quantile(out: Path, recipe: str, normalized: bool = False) -> float | None:
    """The screen's quantile for `recipe` (the best worse-of-two-starts validation accuracy; a tie
    keeps the quantile nearer 0.5); None while any of its screen runs is missing."""
    scores = {}
    for q in QUANTILES:
        each = [_validation_score(out, AdaptiveRun(recipe, q, s, SCREEN_SEED, VALIDATION, normalized)) for s in STARTS]
        if None in each:
            return None
        scores[q] = min(each)
    return max(QUANTILES, key=lambda q: (scores[q], -abs(q - 0.5)))


def confirmation_runs(out: Path, seeds: int = SEEDS) -> list[AdaptiveRun]:
    runs = []
    for recipe in RECIPES:
        for normalized in NORMALIZED:
            q = chosen_quantile(out, recipe, normalized)
            if q is not None:
                runs += [AdaptiveRun(recipe, q, s, seed, normalized=normalized)
                         for s in STARTS for seed in range(seeds)]
        runs += [AdaptiveRun(recipe, FIXED, seed=seed) for seed in range(seeds)]
    return runs


def _run(runs: list[AdaptiveRun], out: Path, jobs: int, threads: int, device: str, data_dir, desc: str,
         quiet: bool) -> None:
    todo = [(r.config(threads, device, data_dir), str(out / "runs" / "adaptive" / r.name)) for r in runs]
    todo = [(c, o) for c, o in todo if not finished_with(Path(o), c)]
    run_jobs(todo, len(runs), jobs, desc, quiet)


def reproduce_adaptive(seeds: int, jobs: int, threads: int, device: str, data_dir, out: Path,
                       quiet: bool = False) -> Path:
    """The screen, then the confirmation of what it chose, then the table files from every run on disk."""
    adaptive_clients.check_done(out, seeds)  # a dry run says what the whole-client stages still need
    _run(screen_runs(), out, jobs, threads, device, data_dir, "adaptive clipping: screen", quiet)
    _run(confirmation_runs(out, seeds), out, jobs, threads, device, data_dir, "adaptive clipping: test", quiet)
    adaptive_clients.run_stages(out, seeds, jobs, threads, quiet)
    return write_table(out, seeds)


def _arm(out: Path, recipe: str, quantile: float | None, start: float, seeds: int, normalized: bool = False) -> dict:
    results = {seed: _result(out, AdaptiveRun(recipe, quantile, start, seed, normalized=normalized))
               for seed in range(seeds)}
    done = {seed: r for seed, r in results.items() if r is not None}
    accuracies = [100 * r.test_accuracy for r in done.values()]
    return dict(quantile=quantile, start_times_tuned=None if quantile is None else start, normalized=normalized,
                seeds=list(done),
                accuracies=accuracies, mean=statistics.mean(accuracies) if accuracies else None,
                standard_error=statistics.stdev(accuracies) / len(accuracies) ** 0.5 if len(accuracies) > 1 else None,
                epsilon_spent=max((r.epsilon_spent for r in done.values()), default=None),
                final_clip=[r.epochs[-1].get("clip") for r in done.values()] if quantile is not None else None)


def table(out: Path, seeds: int = SEEDS) -> dict:
    rows = []
    for recipe in RECIPES:
        chosen = {normalized: chosen_quantile(out, recipe, normalized) for normalized in NORMALIZED}
        screen = {}
        for normalized in NORMALIZED:
            screen.update({f"q{qq:g}-from{s:g}x" + ("-normalized" if normalized else ""): _screen_cell(
                out, AdaptiveRun(recipe, qq, s, SCREEN_SEED, VALIDATION, normalized))
                for qq in QUANTILES for s in STARTS})
        screen["fixed"] = _screen_cell(out, AdaptiveRun(recipe, FIXED, seed=SCREEN_SEED, validation=VALIDATION))
        fixed = _arm(out, recipe, FIXED, 1.0, seeds)
        arms = [fixed] + [_arm(out, recipe, q, s, seeds, normalized) for normalized, q in chosen.items()
                          if q is not None for s in STARTS]
        for arm in arms[1:]:
            arm["against_fixed"] = paired_difference(arm, fixed)
        rows.append(dict(recipe=recipe,
                         chosen_quantile={("normalized" if n else "plain"): q for n, q in chosen.items()},
                         screen_validation_accuracy=screen, arms=arms))
    return dict(question="does --clip-quantile, started 10× or 0.1× off the tuned C, reach the tuned fixed C's "
                         "accuracy?", epsilon=EPSILON, delta=1e-5, seeds=seeds, rows=rows,
                whole_clients=adaptive_clients.row(out, seeds))


def _cell(arm: dict) -> str:
    if arm["mean"] is None:
        return "–"
    se = f" ± {arm['standard_error']:.2f}" if arm["standard_error"] is not None else ""
    return f"{arm['mean']:.2f}{se} ({len(arm['accuracies'])} seeds)"


def markdown(t: dict) -> str:
    lines = ["# Adaptive clipping: started 10× and 0.1× off the tuned C", "",
             f"Fashion-MNIST, central, ε = {t['epsilon']:g}, δ = 1e-5; test accuracy (%), mean ± standard error over "
             "seeds; the difference to the tuned fixed C paired by seed. The quantile was chosen on validation "
             f"({VALIDATION:,} training samples held out, seed 0) as the best worse-of-two-starts accuracy "
             "(simulations/adaptive_table.py). `fedsd reproduce --table adaptive` makes it.", "",
             "| recipe | clip | chosen quantile | test accuracy | against the fixed C (points) | final clip |",
             "|---|---|---|---|---|---|"]
    for row in t["rows"]:
        for arm in row["arms"]:
            clip = "tuned C = 0.1, fixed" if arm["quantile"] is None else f"from {arm['start_times_tuned']:g}× C" + (
                ", normalized step" if arm["normalized"] else "")
            diff = arm.get("against_fixed")
            diff_text = (f"{diff['mean']:+.2f} ± {diff['se']:.2f}" if diff and diff["se"] is not None
                         else f"{diff['mean']:+.2f}" if diff else "–")
            final = ", ".join(f"{c:.3g}" for c in arm["final_clip"] or [] if c is not None) or "–"
            lines.append(f"| {row['recipe']} | {clip} | {arm['quantile'] if arm['quantile'] else '–'} | "
                         f"{_cell(arm)} | {diff_text} | {final} |")
    lines += ["", "The screen (validation accuracy, %, seed 0; normalized: `--clip-normalize` at the recipe's lr × C):",
              "", "| recipe | run | " + " | ".join(f"γ = {q:g}" for q in QUANTILES) + " |",
              "|---|---|" + "---|" * len(QUANTILES)]
    for row in t["rows"]:
        cells = row["screen_validation_accuracy"]
        for normalized in NORMALIZED:
            for s in STARTS:
                tail = "-normalized" if normalized else ""
                shown = [cells[f"q{q:g}-from{s:g}x{tail}"] for q in QUANTILES]
                lines.append(f"| {row['recipe']} | from {s:g}× C{', normalized' if normalized else ''} | " + " | ".join(
                    "–" if v is None else v if isinstance(v, str) else f"{v:.2f}" for v in shown) + " |")

    lines += ["", "At the tuned fixed C, on validation: " + ", ".join(
        f"{row['recipe']} " + ("–" if row["screen_validation_accuracy"]["fixed"] is None
                               else f"{row['screen_validation_accuracy']['fixed']:.2f}") for row in t["rows"]) + "."]
    if "whole_clients" in t:
        lines += adaptive_clients.markdown(t["whole_clients"])
    return "\n".join(lines) + "\n"


def write_table(out: Path, seeds: int = SEEDS, to: Path | None = None) -> Path:
    """The table files from the runs under `out` (into `to`, default `out`)."""
    to = Path(to) if to is not None else out
    t = table(out, seeds)
    write_json(to / f"{TABLE_NAME}.json", t)
    (to / f"{TABLE_NAME}.md").write_text(markdown(t))
    return to / f"{TABLE_NAME}.md"
