"""A table's runs on disk: running them several at once (`run_jobs`, one progress bar), knowing
which are finished with which settings (`finished_with`), and reading them back by seed. Every
table driver (`fedsd reproduce`'s Table 1 and 2, the federated table, the readings, `fedsd
sweep`) uses these; none imports another."""
from __future__ import annotations

import json
import math
import os
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from fedsd.files.results import RunResult


def _run_one(config: dict, out: str) -> dict:
    """One run in a worker process (spawned: its own torch, its own threads)."""
    import warnings

    warnings.filterwarnings("ignore")
    from fedsd.training.central import load_checkpoint, train, unfinished
    from fedsd.settings.run import TrainConfig

    from fedsd.files.results import write_json
    from fedsd.errors import TrainingDiverged

    try:
        if unfinished(out) and same_settings(load_checkpoint(out)["config"].to_dict(), config):
            result, _ = train(None, out, resume=True, progress=False)  # stopped earlier: goes on where it was
        else:
            result, _ = train(TrainConfig(**with_recorded_route(config, out)), out, overwrite=True, progress=False)
    except TrainingDiverged as e:
        # A sweep's answer too: this setting does not train. Kept, so that it is not run again.
        Path(out).mkdir(parents=True, exist_ok=True)
        write_json(Path(out) / DIVERGED, dict(config=TrainConfig(**config).resolved().to_dict(), reason=str(e)))
        return dict(test_accuracy=float("nan"), diverged=str(e))
    return result


DIVERGED = "diverged.json"  # beside where result.json would be, for a run that diverged


def with_recorded_route(config: dict, out) -> dict:
    """`config`, run again in `out`, where a run of the same settings recorded its route: with
    that route (--route), so the run gives that run's weights. A route that does not fit (made
    at another thread count, for another network) or none: `config` as it is."""
    from fedsd.clipping import routes
    from fedsd.settings.run import TrainConfig
    from fedsd.errors import ConfigError

    if config.get("route") or config.get("grad_sample_mode", "auto") != "auto":
        return config
    try:
        _, done = routes.recorded(out)
        if not same_settings(done, config):
            return config
        return {**config, "route": routes.route_from(out, TrainConfig(**config).resolved())}
    except ConfigError:
        return config


def run_jobs(todo: list[tuple[dict, str]], total: int, jobs: int, desc: str, quiet: bool = False) -> None:
    """Run (config, out) pairs as `fedsd train` runs, `jobs` processes at once, with one progress
    bar over `total` runs (those already done count as done)."""
    from tqdm.auto import tqdm

    from fedsd.training.central import prepare_run
    from fedsd.settings.run import TrainConfig
    from fedsd import dry_run

    for config, _ in todo:  # every run's settings and data checked before the first starts
        prepare_run(TrainConfig(**config))
    dry_run.stop_here(f"run {len(todo)} of {total} runs ({total - len(todo)} done), {jobs} at once")
    bar = tqdm(total=total, initial=total - len(todo), desc=desc, unit="run", disable=quiet)
    if todo:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(_run_one, config, run_out): run_out for config, run_out in todo}
            for future in as_completed(futures):
                result = future.result()
                shown = "diverged" if "diverged" in result else f"{100 * result['test_accuracy']:.2f}%"
                bar.set_postfix_str(f"{Path(futures[future]).name}: {shown}")
                bar.update(1)
    bar.close()


# Where a run went does not change what it computed.
# How a run is computed, not what it computes: every clipping mode and layout gives the same
# weights to float tolerance and the same ε (tests/clipping/test_grad_sample_modes.py), so a cell made
# with another of them is not run again.
NOT_SETTINGS = ("device", "threads", "data_dir", "download", "grad_sample_mode", "memory_format", "route")


def finished_with(run_out: Path, config: dict) -> bool:
    """A finished run in `run_out` made with these settings (a run made with other settings,
    e.g. before a default changed, is run again)."""
    path = run_out / "result.json"
    if not path.exists():
        path = run_out / DIVERGED
    if not path.exists():
        return False
    done = RunResult.read(path).config if path.name == "result.json" else json.loads(path.read_text())["config"]
    return same_settings(done, config)


def same_settings(done: dict, config: dict) -> bool:
    """Whether a run made with settings `done` (a resolved config) computes what `config` asks."""
    from fedsd.settings.run import TrainConfig, renamed_settings

    from fedsd.models.networks import with_pinned_weights

    done = renamed_settings(done, done.get("method"))  # a run fedsd 0.1 made: its settings' new names
    wanted = with_pinned_weights(TrainConfig(**config).resolved()).to_dict()  # --init-weights: its sha256 too
    # A setting added since that run was made is absent from its config: it ran as the default.
    defaults = TrainConfig().to_dict()
    return all(done.get(k, defaults.get(k)) == v for k, v in wanted.items() if k not in NOT_SETTINGS)


def threads_per_job(device: str, jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // jobs) if device == "cpu" else 0


def seed_files(runs_dir: Path, cell, name: str = "result.json") -> dict[int, Path]:
    """The file `name` of each run of `cell` (a Cell or a federated table's FedCell) under
    `runs_dir` that has one, by seed, in seed order (whatever seeds a reproduce ran)."""
    found = {}
    for path in runs_dir.glob(f"{cell.name}-seed*/{name}"):
        seed = path.parent.name.removeprefix(f"{cell.name}-seed")
        if seed.isdigit():
            found[int(seed)] = path
    return dict(sorted(found.items()))


def seeds_run(runs_dir: Path, cell) -> dict[int, RunResult]:
    """The finished runs (result.json) of `cell` under `runs_dir`, by seed, in seed order."""
    return {seed: RunResult.read(path) for seed, path in seed_files(runs_dir, cell).items()}


def paired_difference(row: dict, base: dict | None, accuracies: str = "accuracies") -> dict | None:
    """This row's accuracy minus `base`'s, seed by seed over the seeds both ran (the same seed:
    the same data order, initial model and noise; in a federation the same shards too): the
    mean, its standard error (None with one seed) and whether the mean is beyond two standard
    errors of 0."""
    if base is None or base is row or "diverged" in base:
        return None
    by_seed = dict(zip(base["seeds"], base[accuracies]))
    diffs = [a - by_seed[s] for s, a in zip(row["seeds"], row[accuracies]) if s in by_seed]
    if not diffs:
        return None
    mean = statistics.mean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return dict(mean=mean, se=se, seeds=len(diffs), beyond_2se=se is not None and abs(mean) > 2 * se)


def plot_curves(path: Path, title: str, xlabel: str, lines: list[tuple[str, list[list[float]], str]]) -> None:
    """Test accuracy (%) against `xlabel`, one line (label, curves over seeds, line style) each,
    the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curves, style in lines:
        mean = [statistics.mean(v) for v in zip(*curves)]
        ax.plot(range(1, len(mean) + 1), mean, linestyle=style, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
