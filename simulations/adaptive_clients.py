"""The whole-client rows of `fedsd reproduce --table adaptive`: does --update-clip-quantile (Andrew
et al. 2021, under secure aggregation with distributed noise: docs/algorithms.md, "Whole clients
with an adaptive clip") free a user from tuning the update clip S?

The recipe is the README's whole-client one: Fashion-MNIST, 100 clients (IID), every client every
round, 30 rounds of one local epoch (dpsgd's network, B = 32, lr 0.05, no momentum) without
noise, each update clipped to S, client-level ε = 3, δ = 1e-5. The runs add the clients' vectors in
the clear (`--secure-sum plain`: the protocol's sum bit for bit, tests/simulation/test_secure_simulation.py),
which spares 100 clients' protocol, about 37 s a round here, and changes nothing they compute.

Three stages, nothing chosen on test accuracy:
- the fixed S of CLIPS with the best validation accuracy (VALIDATION held out, seed 0) is the tuned S;
- each quantile of QUANTILES from 10× and 0.1× the tuned S (the clip's rate CLIP_LR: the paper's
  0.2 moves the clip 10× in about 23 rounds at γ = 0.5, most of a 30-round run; the count's noise
  at its default), in two arms: Andrew et al.'s rule as it is (the server applies the mean
  update, whose noise follows S), and with --update-clip-normalize (the mean in units of S, at
  --server-lr the tuned S); each scored by its worse start, the best chosen, a tie the quantile
  nearer 0.5; the tuned S on test, three seeds, beside it;
- the normalized arm's chosen quantile from both starts, three seeds each, on test. (The plain
  arm's screen ended near chance at every quantile from both starts: its first rounds at 10× S
  carry ten times the tuned noise, and from 0.1× the clip overshot; it is shown, not confirmed.)

Each run is `fedsd simulate`'s in-process federation, in <out>/runs/adaptive/<run>/; a finished
run is not run again.
"""
from __future__ import annotations

import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from fedsd.simulation.sweeps import paired_difference
from fedsd.files.results import RunResult

RECIPE = "whole-clients"
SETTINGS = dict(dataset="fmnist", method="dpsgd", batch_size=32, lr=0.05, momentum=0.0, epsilon=3.0)
FEDERATION = dict(num_clients=100, rounds=30, local_epochs=1, secure_aggregation=True, noise="distributed",
                  privacy_unit="client", secure_sum="plain")
CLIPS = (0.05, 0.1, 0.2, 0.5)  # the fixed S screened on validation (the README's is 0.5)
QUANTILES = (0.5, 0.7)  # the rule as it is (it ended near chance at both, from both starts)
# normalized: below the median too, since the tuned S = 0.2 sits below the clients' median update
# norm (0.43-0.46, where γ = 0.5 settled in the first screen runs); 0.3 then 0.1 added as they led
NORMALIZED_QUANTILES = (0.1, 0.3, 0.5, 0.7)
STARTS = (10.0, 0.1)  # the clip's start, times the tuned S
NORMALIZED = (False, True)  # the arms screened: the rule as it is, and with --update-clip-normalize
# the count's noise σ_b of the normalized arm. 0: σ_b = Z, this plan's z (the rule's default, max(m/20, z), when the
# first arms ran), which leaves the update's noise 1/√(1 − (z/2σ_b)²) = 1.155× the fixed S's (the joint
# mechanism: fedsd.secure.client_level); 33 ≈ 4z leaves it 1.008×, the count noisier (σ_b/m = 0.33 of the
# fraction a round). The second was added after the first's test rows stayed 1.3-1.4 points below the tuned S;
# the rule's default is now max(m/20, 4z) = 32.8 here.
Z = 8.197155417873951  # the plan's z: 100 clients, every one every round, 30 rounds, client-level ε = 3
COUNT_NOISES = (0.0, 33.0)
LOUDER_COUNT_QUANTILES = (0.1, 0.3)  # screened at σ_b = 33: the default's best two
CLIP_LR = 1.0
VALIDATION, SCREEN_SEED, SEEDS = 10_000, 0, 3


@dataclass(frozen=True)
class ClientRun:
    clip: float  # S, or where it starts
    quantile: float | None = None  # None: S fixed
    start: float = 1.0  # for the name: the start, times the tuned S
    seed: int = 0
    validation: int = 0
    normalized: bool = False  # --update-clip-normalize at --server-lr the tuned S
    count_noise: float = 0.0  # σ_b (0: the rule's default)

    @property
    def name(self) -> str:
        arm = f"fixed-S{self.clip:g}" if self.quantile is None else f"q{self.quantile:g}-from{self.start:g}x"
        arm += "-normalized" if self.normalized else ""
        arm += f"-sb{self.count_noise:g}" if self.count_noise else ""
        return f"{RECIPE}-{arm}{'-val' if self.validation else ''}-seed{self.seed}"

    def settings(self, threads: int) -> tuple[dict, dict]:
        adaptive = {} if self.quantile is None else dict(update_clip_quantile=self.quantile, update_clip_lr=CLIP_LR)
        if self.normalized:  # the step per unit of clip: the tuned S, where the step is plain FedAvg's
            adaptive.update(update_clip_normalize=True, server_lr=self.clip / self.start)
        if self.quantile is not None:
            adaptive.update(update_clip_count_noise=self.count_noise or Z)
        return (dict(SETTINGS, seed=self.seed, validation=self.validation, threads=threads),
                dict(FEDERATION, update_clip=self.clip, **adaptive))


def _folder(out: Path, run: ClientRun) -> Path:
    return out / "runs" / "adaptive" / run.name


def _result(out: Path, run: ClientRun) -> RunResult | None:
    path = _folder(out, run) / "result.json"
    return RunResult.read(path) if path.exists() else None


def _validation(out: Path, run: ClientRun) -> float | None:
    result = _result(out, run)
    return None if result is None else 100 * result.validation_accuracy


def tuned_clip(out: Path) -> float | None:
    """The fixed S with the best validation accuracy (a tie: the smaller); None while one is missing."""
    scores = {s: _validation(out, ClientRun(s, seed=SCREEN_SEED, validation=VALIDATION)) for s in CLIPS}
    if None in scores.values():
        return None
    return max(CLIPS, key=lambda s: (scores[s], -s))


def _started(tuned: float, quantile: float, start: float, seed: int, validation: int = 0,
             normalized: bool = False, count_noise: float = 0.0) -> ClientRun:
    return ClientRun(tuned * start, quantile, start, seed, validation, normalized, count_noise)


def quantiles(normalized: bool, count_noise: float = 0.0) -> tuple:
    return (LOUDER_COUNT_QUANTILES if count_noise else NORMALIZED_QUANTILES) if normalized else QUANTILES


def screened() -> list[tuple[bool, float]]:
    """The screen's arms: (normalized, σ_b)."""
    return [(False, 0.0)] + [(True, sb) for sb in COUNT_NOISES]


def chosen_quantile(out: Path, normalized: bool = True, count_noise: float = 0.0) -> float | None:
    """The quantile whose worse start is best on validation; None while a screen run is missing."""
    tuned = tuned_clip(out)
    if tuned is None:
        return None
    scores = {}
    for q in quantiles(normalized, count_noise):
        each = [_validation(out, _started(tuned, q, s, SCREEN_SEED, VALIDATION, normalized, count_noise))
                for s in STARTS]
        if None in each:
            return None
        scores[q] = min(each)
    return max(quantiles(normalized, count_noise), key=lambda q: (scores[q], -abs(q - 0.5)))


def stages(out: Path, seeds: int = SEEDS) -> list[list[ClientRun]]:
    """The runs each stage needs, as far as the finished ones say (a stage waits for the one before)."""
    fixed = [ClientRun(s, seed=SCREEN_SEED, validation=VALIDATION) for s in CLIPS]
    tuned = tuned_clip(out)
    if tuned is None:
        return [fixed]
    screen = [_started(tuned, q, s, SCREEN_SEED, VALIDATION, normalized, sb) for normalized, sb in screened()
              for q in quantiles(normalized, sb) for s in STARTS]
    screen += [ClientRun(tuned, seed=seed) for seed in range(seeds)]
    chosen = {sb: chosen_quantile(out, True, sb) for sb in COUNT_NOISES}
    if None in chosen.values():
        return [fixed, screen]
    return [fixed, screen, [_started(tuned, q, s, seed, normalized=True, count_noise=sb)
                            for sb, q in chosen.items() for s in STARTS for seed in range(seeds)]]


def check_done(out: Path, seeds: int) -> None:
    """Under a dry run, stop saying how many of the stages' runs (as far as the finished ones tell)
    are still to run; otherwise nothing."""
    from fedsd import dry_run

    runs = [r for stage in stages(out, seeds) for r in stage]
    todo = [r for r in runs if _result(out, r) is None]
    if todo:
        dry_run.stop_here(f"run {len(todo)} of {len(runs)} whole-client runs ({len(runs) - len(todo)} done) first")


def _run_one(cfg: dict, fed: dict, out: str) -> dict:
    """One run in a worker process (spawned: its own torch, its own threads); resumed where it stopped."""
    from fedsd.simulation.secure_federation import CHECKPOINT, simulate_secure
    from fedsd.settings.federation import FedConfig
    from fedsd.settings.run import TrainConfig

    resume = (Path(out) / CHECKPOINT).is_file()
    result, _ = simulate_secure(None if resume else TrainConfig(**cfg), FedConfig(**fed), out, overwrite=not resume,
                                progress=False, resume=resume)
    return result


def run_stages(out: Path, seeds: int, jobs: int, threads: int, quiet: bool) -> None:
    """Every stage's missing runs, `jobs` at once, one progress bar a stage."""
    from tqdm.auto import tqdm

    done = 0
    while True:
        wanted = stages(out, seeds)
        if len(wanted) == done:
            return
        done, runs = len(wanted), wanted[-1]
        todo = [r for r in runs if _result(out, r) is None]
        bar = tqdm(total=len(runs), initial=len(runs) - len(todo), unit="run", disable=quiet,
                   desc=f"adaptive clipping, whole clients: stage {done}")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_run_one, *r.settings(threads), str(_folder(out, r))) for r in todo]
            for future in as_completed(futures):
                future.result()
                bar.update(1)
        bar.close()


def _arm(out: Path, runs: list[ClientRun]) -> dict:
    done = {r.seed: res for r in runs if (res := _result(out, r)) is not None}
    accuracies = [100 * r.test_accuracy for r in done.values()]
    first = runs[0]
    return dict(quantile=first.quantile, start_times_tuned=None if first.quantile is None else first.start,
                clip=first.clip, normalized=first.normalized, count_noise=first.count_noise, seeds=list(done),
                accuracies=accuracies,
                mean=statistics.mean(accuracies) if accuracies else None,
                standard_error=statistics.stdev(accuracies) / len(accuracies) ** 0.5 if len(accuracies) > 1 else None,
                epsilon_spent=max((r.epsilon_spent for r in done.values()), default=None),
                final_clip=[r.rounds[-1].get("clip") for r in done.values()] if first.quantile is not None else None)


def row(out: Path, seeds: int = SEEDS) -> dict:
    """The whole-client row: the screens on validation, and each arm on test against the tuned S."""
    tuned = tuned_clip(out)
    chosen = {sb: chosen_quantile(out, True, sb) for sb in COUNT_NOISES}
    screen = {f"fixed-S{s:g}": _validation(out, ClientRun(s, seed=SCREEN_SEED, validation=VALIDATION)) for s in CLIPS}
    if tuned is not None:
        screen.update({_started(tuned, qq, s, SCREEN_SEED, VALIDATION, n, sb).name.removeprefix(RECIPE + "-")
                       .removesuffix(f"-val-seed{SCREEN_SEED}"): _validation(
                           out, _started(tuned, qq, s, SCREEN_SEED, VALIDATION, n, sb))
                       for n, sb in screened() for qq in quantiles(n, sb) for s in STARTS})
    arms = []
    if tuned is not None:
        fixed = _arm(out, [ClientRun(tuned, seed=seed) for seed in range(seeds)])
        arms = [fixed]
        for sb, q in chosen.items():
            for s in STARTS if q is not None else ():
                arm = _arm(out, [_started(tuned, q, s, seed, normalized=True, count_noise=sb)
                                 for seed in range(seeds)])
                arm["against_fixed"] = paired_difference(arm, fixed)
                arms.append(arm)
    return dict(recipe=RECIPE, settings=SETTINGS, federation=FEDERATION, clip_lr=CLIP_LR, tuned_clip=tuned,
                chosen_quantile=chosen[0.0], chosen_quantile_by_count_noise={f"{sb:g}": q for sb, q in chosen.items()},
                screen_validation_accuracy=screen, arms=arms)


def markdown(r: dict) -> list[str]:
    """The row's lines in table-adaptive.md."""
    lines = ["", "## Whole clients: the update clip S, started 10× and 0.1× off the tuned S", "",
             "The README's whole-client recipe (Fashion-MNIST, 100 IID clients, 30 rounds of one local epoch, B = 32, "
             "lr 0.05, no momentum, client-level ε = 3) under secure aggregation with distributed noise, "
             "the sum added in the clear "
             f"(`--secure-sum plain`, the protocol's bit for bit); the clip's rate η = {r['clip_lr']:g}. S tuned on "
             f"validation among {', '.join(f'{s:g}' for s in CLIPS)}; the quantile chosen as above for "
             "`--update-clip-normalize` at `--server-lr` the tuned S (the rule as it stands ended near chance in "
             "its screen, below, and is not confirmed).", "",
             "| clip | chosen quantile | test accuracy | against the tuned S (points) | final clip |",
             "|---|---|---|---|---|"]
    for arm in r["arms"]:
        clip = f"tuned S = {arm['clip']:g}, fixed" if arm["quantile"] is None else \
            f"from {arm['start_times_tuned']:g}× S ({arm['clip']:g})" + \
            (", normalized step" if arm["normalized"] else "") + \
            (f", σ_b = {arm.get('count_noise') or Z:.3g}" if arm["quantile"] is not None else "")
        diff = arm.get("against_fixed")
        diff_text = (f"{diff['mean']:+.2f} ± {diff['se']:.2f}" if diff and diff["se"] is not None
                     else f"{diff['mean']:+.2f}" if diff else "–")
        final = ", ".join(f"{c:.3g}" for c in arm["final_clip"] or [] if c is not None) or "–"
        cell = "–" if arm["mean"] is None else f"{arm['mean']:.2f}" + (
            f" ± {arm['standard_error']:.2f}" if arm["standard_error"] is not None else "") + \
            f" ({len(arm['accuracies'])} seeds)"
        lines.append(f"| {clip} | {arm['quantile'] or '–'} | {cell} | {diff_text} | {final} |")
    shown = ", ".join(f"{name} {'–' if v is None else f'{v:.2f}'}"
                      for name, v in r["screen_validation_accuracy"].items())
    return lines + ["", f"The screen (validation accuracy, %, seed 0): {shown}."]
