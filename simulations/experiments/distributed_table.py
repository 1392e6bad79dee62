"""`fedsd reproduce --table distributed`: does a federation with distributed noise under secure
aggregation train as well as central DP-SGD at the same ε, whatever the partition?

Fashion-MNIST, ε = 3, δ = 10⁻⁵, 10 clients; the features recipe of the features table
(ScatterNet features, the linear network, dpsgd, B = 8192, lr 8, momentum 0.9, C = 0.1, 400
steps: 50 epochs) run by the federation, one step a round (400 rounds), under IID, Dirichlet(0.5)
and Dirichlet(0.1) partitions, three seeds each, with every client assumed honest (t = n), and
one seed each with half of them (t = n/2, each share twice as large). Its rows go beside the central run of
the same recipe (results/table-features.md) and the federated rows with local noise.

Each run is written to <out>/runs/distributed/<name>/ and resumes from its checkpoint; a
finished run is not run again.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from fedsd.config import TrainConfig
from fedsd.fed_settings import FedOptions
from fedsd.results import write_json
from simulations.commands import dry_run
from simulations.commands.secure_simulation import FEATURES_RECIPE as RECIPE
from simulations.commands.secure_simulation import FEATURES_ROUNDS as ROUNDS

TABLE_NAME = "table-distributed"
SEEDS = (0, 1, 2)
HALF_SEEDS = (0,)  # t = n/2: its cost against t = n, one seed a partition
CLIENTS = 10
PARTITIONS = (("iid", 0.5), ("dirichlet", 0.5), ("dirichlet", 0.1))
CENTRAL = {"test accuracy (%)": (89.56, 0.10), "source": "results/table-features.md (fmnist dpsgd, 3 seeds)"}
LOCAL_NOISE = {"iid": (87.64, 0.10), "dirichlet0.5": (86.43, 0.36)}  # the federated features rows, local noise


def partition_name(partition: str, alpha: float) -> str:
    return "iid" if partition == "iid" else f"dirichlet{alpha:g}"


def runs() -> list[tuple[str, TrainConfig, FedOptions]]:
    """Every run, t = n first (seed by seed across the partitions), then t = n/2."""
    out = []
    for honest, seeds in ((CLIENTS, SEEDS), (CLIENTS // 2, HALF_SEEDS)):
        for seed in seeds:
            for partition, alpha in PARTITIONS:
                name = f"fmnist-{partition_name(partition, alpha)}-t{honest}-seed{seed}"
                cfg = TrainConfig(**RECIPE, seed=seed)
                fed = FedOptions(num_clients=CLIENTS, rounds=ROUNDS, partition=partition, dirichlet_alpha=alpha,
                                 secure_aggregation=True, noise="distributed", honest_clients=honest)
                out.append((name, cfg, fed))
    return out


def run_all(out: Path, progress: bool = True, only: list[str] = ()) -> None:
    """Every run not finished yet; with `only`, those whose names hold one of its parts, in
    that order (queues on several cores, e.g. "t10-seed0" and "t5-seed0")."""
    from simulations.commands.secure_simulation import CHECKPOINT, RESULT, simulate_secure

    chosen = [r for part in only for r in runs() if part in r[0]] if only else runs()
    todo = [r for r in chosen if not (out / "runs" / "distributed" / r[0] / RESULT).is_file()]
    dry_run.stop_here(f"run {len(todo)} of {len(chosen)} runs of the distributed table into "
                      f"{out / 'runs' / 'distributed'}")
    for name, cfg, fed in chosen:
        folder = out / "runs" / "distributed" / name
        if (folder / RESULT).is_file():
            continue
        resume = (folder / CHECKPOINT).is_file()
        simulate_secure(None if resume else cfg, fed, folder, overwrite=not resume, progress=progress,
                        resume=resume)
        write_table(out)


def _mean_se(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f}" if values else ""
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values) / len(values) ** 0.5:.2f}"


def central_by_seed(out: Path) -> dict[int, float]:
    """The central runs of the recipe (the features table's), seed → test accuracy."""
    found = {}
    for seed in SEEDS:
        path = out / "runs" / "features" / f"fmnist-scatter-linear-B8192-lr8-e50-dpsgd-seed{seed}" / "result.json"
        if path.is_file():
            found[seed] = json.loads(path.read_text())["test_accuracy"]
    return found


def _paired(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:+.2f}" if values else ""
    return f"{statistics.mean(values):+.2f} ± {statistics.stdev(values) / len(values) ** 0.5:.2f}"


def write_table(out: Path) -> dict:
    """results/table-distributed.{json,md} from the finished runs."""
    rows, central = [], central_by_seed(out)
    for honest in (CLIENTS, CLIENTS // 2):
        for partition, alpha in PARTITIONS:
            part = partition_name(partition, alpha)
            results = []
            for seed in SEEDS:
                path = out / "runs" / "distributed" / f"fmnist-{part}-t{honest}-seed{seed}" / "result.json"
                if path.is_file():
                    results.append(json.loads(path.read_text()))
            if not results:
                continue
            accuracy = [100 * r["test_accuracy"] for r in results]
            paired = [100 * (r["test_accuracy"] - central[r["config"]["seed"]]) for r in results
                      if r["config"]["seed"] in central]
            cost = results[0]["secure_aggregation"]
            rows.append(dict(partition=part, honest=honest, seeds=len(results), accuracy=accuracy,
                             vs_central=statistics.mean(accuracy) - CENTRAL["test accuracy (%)"][0], paired=paired,
                             local_noise=LOCAL_NOISE.get(part), epsilon=max(r["epsilon_spent"] for r in results),
                             z=results[0]["noise_multiplier"], minutes=statistics.mean(r["wall_seconds"] for r in results) / 60,
                             bytes_to_server=cost["bytes_to_server_per_round"],
                             protocol_seconds=cost["protocol_seconds_per_round"],
                             round_seconds=cost["round_seconds"]))
    table = dict(question=__doc__.split("\n")[0], central=CENTRAL, recipe=RECIPE, rounds=ROUNDS, clients=CLIENTS,
                 rows=rows)
    write_json(out / f"{TABLE_NAME}.json", table)
    (out / f"{TABLE_NAME}.md").write_text(markdown(table))
    return table


def markdown(table: dict) -> str:
    lines = [
        "# Distributed noise under secure aggregation: Fashion-MNIST, 10 clients, ε = 3",
        "",
        "Written by `fedsd reproduce --table distributed` (simulations/experiments/distributed_table.py). The "
        "features recipe (ScatterNet features, the linear network, dpsgd, B = 8192 for the federation, lr 8, "
        "momentum 0.9, C = 0.1) run by 10 clients, one DP-SGD step a round for 400 rounds, each client adding its "
        "share of Skellam noise to its quantised clipped sum under SecAgg+. t: the fewest clients each assumes "
        "honest (any t shares give the target σ). Test accuracy, mean ± standard error over the seeds (as in "
        "results/table-features.md, whose central and local-noise federated rows stand beside these); vs central: "
        "the difference of the means, and the seed-by-seed differences with the central run of the same seed "
        "(mean ± standard error). The central run "
        f"of the same recipe: {table['central']['test accuracy (%)'][0]:.2f} ± "
        f"{table['central']['test accuracy (%)'][1]:.2f} ({table['central']['source']}). Minutes and seconds: the "
        "2-core development machine, two runs at once beside other work (one thread each); the protocol's cost "
        "measured side by side is in results/bench-secagg-10clients-*.json.",
        "",
        "| partition | t | seeds | test accuracy (%) | vs central (mean) | vs central, paired by seed | federated, "
        "local noise, 10 clients | client ε | z | minutes a run | MB to the server a round | protocol s a round | round s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table["rows"]:
        local = f"{r['local_noise'][0]:.2f} ± {r['local_noise'][1]:.2f}" if r["local_noise"] else ""
        lines.append(f"| {r['partition']} | {r['honest']} | {r['seeds']} | {_mean_se(r['accuracy'])} | "
                     f"{r['vs_central']:+.2f} | {_paired(r['paired'])} | {local} | {r['epsilon']:.3f} | {r['z']:.3f} | {r['minutes']:.1f} | "
                     f"{r['bytes_to_server'] / 1e6:.2f} | {r['protocol_seconds']:.2f} | {r['round_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    run_all(Path("results"), only=sys.argv[1:])
