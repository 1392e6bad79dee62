"""`fedsd reproduce --table distributed`: does a federation with distributed noise under secure
aggregation train as well as central DP-SGD at the same ε, whatever the partition?

Fashion-MNIST, ε = 3, δ = 10⁻⁵, 10 clients; two central recipes run by the federation, one step
a round:
- features: the features table's (ScatterNet features, the linear network, dpsgd, B = 8192, lr 8,
  momentum 0.9, C = 0.1), 400 rounds: its 50 epochs;
- cnn: Table 1's (the papers' CNN, dpsgd, B = 1600, lr 3, momentum 0.9, C = 0.1), 1140 rounds: its
  30 epochs of ⌈60000 / 1600⌉ = 38 steps.
Each under IID, Dirichlet(0.5) and Dirichlet(0.1) partitions, three seeds each, with every client
assumed honest (t = n), and one seed each with half of them (t = n/2, each share twice as large).
Its rows go beside the central runs of the same recipe and seeds (results/table-features.md,
results/table1.md) and the federated rows with local noise.

Each run is written to <out>/runs/distributed/<name>/ and resumes from its checkpoint; a
finished run is not run again.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig
from fedsd.files.results import write_json
from fedsd import dry_run
from fedsd.simulation.secure_federation import FEATURES_RECIPE, FEATURES_ROUNDS

TABLE_NAME = "table-distributed"
SEEDS = (0, 1, 2)
HALF_SEEDS = (0,)  # t = n/2, its cost against t = n: one seed a partition
CLIENTS = 10
PARTITIONS = (("iid", 0.5), ("dirichlet", 0.5), ("dirichlet", 0.1))
# Table 1's Fashion-MNIST dpsgd cell at ε = 3 (results/runs/table1/fmnist-dpsgd-eps3-seed*), the papers' CNN
CNN_RECIPE = dict(dataset="fmnist", model="mnist-cnn", method="dpsgd", epsilon=3.0, batch_size=1600, lr=3.0,
                  momentum=0.9, clip=0.1, threads=1)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A central recipe run by the federation, and where its central runs and its federated
    rows with local noise are."""
    name: str
    settings: dict
    rounds: int
    central_runs: str  # a path under <out>/runs with {seed}
    central_source: str
    local_noise: dict  # partition → (mean, standard error), the federated rows with local noise
    local_noise_source: str


RECIPES = (
    Recipe("features", FEATURES_RECIPE, FEATURES_ROUNDS,
           "features/fmnist-scatter-linear-B8192-lr8-e50-dpsgd-seed{seed}",
           "results/table-features.md (fmnist dpsgd)",
           {"iid": (87.64, 0.10), "dirichlet0.5": (86.43, 0.36)}, "results/table-features.md"),
    # the federated CNN rows: 30 rounds of one local epoch at B = 256 a client (results/table-fed.md,
    # dpsgd, round-start; its std over 3 seeds here as a standard error)
    Recipe("cnn", CNN_RECIPE, 30 * 38, "table1/fmnist-dpsgd-eps3-seed{seed}", "results/table1.md (fmnist dpsgd ε = 3)",
           {"iid": (80.41, 0.38 / 3 ** 0.5), "dirichlet0.5": (80.72, 0.58 / 3 ** 0.5),
            "dirichlet0.1": (72.79, 4.80 / 3 ** 0.5)}, "results/table-fed.md"),
)


def partition_name(partition: str, alpha: float) -> str:
    return "iid" if partition == "iid" else f"dirichlet{alpha:g}"


def run_name(recipe: Recipe, part: str, honest: int, seed: int) -> str:
    """The features runs keep the names they were first written under."""
    return f"fmnist{'' if recipe.name == 'features' else '-' + recipe.name}-{part}-t{honest}-seed{seed}"


def runs() -> list[tuple[str, TrainConfig, FedConfig]]:
    """Every run, recipe by recipe: t = n first (seed by seed across the partitions), then t = n/2."""
    out = []
    for recipe in RECIPES:
        for honest, seeds in ((CLIENTS, SEEDS), (CLIENTS // 2, HALF_SEEDS)):
            for seed in seeds:
                for partition, alpha in PARTITIONS:
                    cfg = TrainConfig(**recipe.settings, seed=seed)
                    fed = FedConfig(num_clients=CLIENTS, rounds=recipe.rounds, partition=partition,
                                     dirichlet_alpha=alpha, secure_aggregation=True, noise="distributed",
                                     honest_clients=honest)
                    out.append((run_name(recipe, partition_name(partition, alpha), honest, seed), cfg, fed))
    return out


def run_all(out: Path, progress: bool = True, only: list[str] = ()) -> None:
    """Every run not finished yet; with `only`, those whose names hold one of its parts, in
    that order (queues on several cores, e.g. "t10-seed0" and "t5-seed0")."""
    from fedsd.simulation.secure_federation import CHECKPOINT, RESULT, simulate_secure

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


def _mean_se(values: list[float], sign: str = "") -> str:
    """Mean ± standard error, to two decimals (`sign` "+": a difference, its sign shown)."""
    if len(values) < 2:
        return f"{values[0]:{sign}.2f}" if values else ""
    return f"{statistics.mean(values):{sign}.2f} ± {statistics.stdev(values) / len(values) ** 0.5:.2f}"


def central_by_seed(out: Path, recipe: Recipe) -> dict[int, float]:
    """The central runs of the recipe, seed → test accuracy (%)."""
    found = {}
    for seed in SEEDS:
        path = out / "runs" / recipe.central_runs.format(seed=seed) / "result.json"
        if path.is_file():
            found[seed] = 100 * json.loads(path.read_text())["test_accuracy"]
    return found


def _row(out: Path, recipe: Recipe, part: str, honest: int, central: dict[int, float]) -> dict | None:
    results = [json.loads(path.read_text()) for seed in SEEDS
               if (path := out / "runs" / "distributed" / run_name(recipe, part, honest, seed)
                   / "result.json").is_file()]
    if not results:
        return None
    accuracy = [100 * r["test_accuracy"] for r in results]
    paired = [a - central[r["config"]["seed"]] for a, r in zip(accuracy, results) if r["config"]["seed"] in central]
    cost = results[0]["secure_aggregation"]
    return dict(recipe=recipe.name, partition=part, honest=honest, seeds=len(results), accuracy=accuracy,
                vs_central=statistics.mean(accuracy) - statistics.mean(central.values()) if central else None,
                paired=paired, local_noise=recipe.local_noise.get(part),
                epsilon=max(r["epsilon_spent"] for r in results), z=results[0]["noise_multiplier"],
                minutes=statistics.mean(r["wall_seconds"] for r in results) / 60,
                bytes_to_server=cost["bytes_to_server_per_round"],
                protocol_seconds=cost["protocol_seconds_per_round"], round_seconds=cost["round_seconds"])


# The features recipe deployed (fedsd/deployment/deployed_distributed.py: a SuperLink and 10
# isolated SuperNodes, each client with its owner's data service, ledger and identity), one seed;
# its state carried from session to session in runs/deploy-distributed-400/<--partition>/.
# (the table's partition, --partition, its folder, the protocol): per-round, the whole protocol every round
# (--secure-sum protocol); multi-round, set up once a run (the study driver's default)
DEPLOYED = (("iid", "iid", "iid", "per-round"), ("dirichlet0.1", "dirichlet", "dirichlet", "per-round"),
            ("iid", "iid", "iid-multi-round", "multi-round"),
            ("dirichlet0.1", "dirichlet", "dirichlet-multi-round", "multi-round"),
            ("iid", "iid", "iid-one-object", "multi-round, one object a message"),
            ("iid", "iid", "iid-rides", "multi-round, later batches dealt riding"),
            ("iid", "iid", "iid-light", "multi-round, riding, lighter rounds"),
            ("dirichlet0.1", "dirichlet", "dirichlet-light", "multi-round, riding, lighter rounds"))
DEPLOYED_COMMAND = {"per-round": "python -m fedsd.deployment.deployed_distributed --partition {} --secure-sum protocol "
                                 "--work W --out O",
                    "multi-round": "python -m fedsd.deployment.deployed_distributed --partition {} --work W --out O"}
DEPLOYED_COMMAND["multi-round, one object a message"] = DEPLOYED_COMMAND["multi-round"]
DEPLOYED_COMMAND["multi-round, later batches dealt riding"] = DEPLOYED_COMMAND["multi-round"]
DEPLOYED_COMMAND["multi-round, riding, lighter rounds"] = DEPLOYED_COMMAND["multi-round"]


def deployed_rows(out: Path, central: dict[int, float]) -> list[dict]:
    """The finished deployed runs, each beside the simulated run of the same partition and seed."""
    rows = []
    for part, argument, name, protocol in DEPLOYED:
        folder = out / "runs" / "deploy-distributed-400" / name
        if not (folder / "out" / "result.json").is_file():
            continue
        result = json.loads((folder / "out" / "result.json").read_text())
        seed, accuracy = result["seed"], 100 * result["test_accuracy"]
        simulated = out / "runs" / "distributed" / run_name(RECIPES[0], part, CLIENTS, seed) / "result.json"
        seconds = [json.loads(line)["seconds"] for line in (folder / "rounds.jsonl").read_text().splitlines()]
        simulated = json.loads(simulated.read_text()) if simulated.is_file() else None
        # a deployed result keeps no owner's z (each service calibrates its own); the plan's is the simulated run's
        z = max((z for z in result["noise_multiplier"].values() if z), default=None) or \
            (simulated["noise_multiplier"] if simulated else None)
        rows.append(dict(recipe=RECIPES[0].name, partition=part, honest=CLIENTS, seed=seed, accuracy=accuracy,
                         vs_central=accuracy - statistics.mean(central.values()) if central else None,
                         paired=accuracy - central[seed] if seed in central else None,
                         simulated=100 * simulated["test_accuracy"] if simulated else None,
                         epsilon=result["epsilon_spent"], z=z,
                         round_seconds=statistics.median(seconds[1:]), protocol=protocol,
                         rounds_minutes=sum(seconds) / 60, command=DEPLOYED_COMMAND[protocol].format(argument)))
    return rows


def write_table(out: Path, to: Path | None = None) -> dict:
    """results/table-distributed.{json,md} from the finished runs under `out` (written to `to`, else `out`)."""
    rows, recipes = [], {}
    for recipe in RECIPES:
        central = central_by_seed(out, recipe)
        recipes[recipe.name] = dict(settings=recipe.settings, rounds=recipe.rounds, central=sorted(central.items()),
                                    central_source=recipe.central_source,
                                    local_noise_source=recipe.local_noise_source)
        for honest in (CLIENTS, CLIENTS // 2):
            for partition, alpha in PARTITIONS:
                row = _row(out, recipe, partition_name(partition, alpha), honest, central)
                if row is not None:
                    rows.append(row)
    table = dict(question=__doc__.split("\n")[0], clients=CLIENTS, recipes=recipes, rows=rows,
                 deployed=deployed_rows(out, dict(recipes[RECIPES[0].name]["central"])))
    write_json((to or out) / f"{TABLE_NAME}.json", table)
    ((to or out) / f"{TABLE_NAME}.md").write_text(markdown(table))
    return table


def markdown(table: dict) -> str:
    centrals = "; ".join(
        f"{name}: {_mean_se([a for _, a in r['central']])} ({len(r['central'])} seeds, {r['central_source']})"
        for name, r in table["recipes"].items() if r["central"])
    lines = [
        "# Distributed noise under secure aggregation: Fashion-MNIST, 10 clients, ε = 3",
        "",
        "Written by `fedsd reproduce --table distributed` (simulations/distributed_table.py). Two "
        "central recipes run by 10 clients, one DP-SGD step a round, each client adding its share of Skellam noise "
        "to its quantised clipped sum under SecAgg+: **features** (ScatterNet features, the linear network, dpsgd, "
        "B = 8192 for the federation, lr 8, momentum 0.9, C = 0.1, 400 rounds: 50 epochs) and **cnn** (the papers' "
        "CNN, dpsgd, B = 1600 for the federation, lr 3, momentum 0.9, C = 0.1, 1140 rounds: 30 epochs). t: the "
        "fewest clients each assumes honest (any t shares give the target σ). Test accuracy, mean ± standard error "
        "over the seeds; vs central: the difference of the means, and the seed-by-seed differences with the "
        f"central run of the same recipe and seed (mean ± standard error). The central runs: {centrals}. "
        "Federated, local noise: the same federation with each update noised alone (features: "
        "results/table-features.md, same recipe; cnn: results/table-fed.md, dpsgd, 30 rounds of one local epoch "
        "at B = 256 a client, its standard deviation over 3 seeds as a standard error). Minutes and seconds: the "
        "2-core development machine, two runs at once beside other work (one thread each); the protocol's cost "
        "measured side by side is in results/bench-secagg-10clients-*.json.",
        "",
        "| recipe | partition | t | seeds | test accuracy (%) | vs central (mean) | vs central, paired by seed | "
        "federated, local noise, 10 clients | client ε | z | minutes a run | MB to the server a round | "
        "protocol s a round | round s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table["rows"]:
        local = f"{r['local_noise'][0]:.2f} ± {r['local_noise'][1]:.2f}" if r["local_noise"] else ""
        vs = f"{r['vs_central']:+.2f}" if r["vs_central"] is not None else ""
        lines.append(f"| {r['recipe']} | {r['partition']} | {r['honest']} | {r['seeds']} | {_mean_se(r['accuracy'])} | "
                     f"{vs} | {_mean_se(r['paired'], '+')} | {local} | {r['epsilon']:.3f} | {r['z']:.3f} | "
                     f"{r['minutes']:.1f} | {r['bytes_to_server'] / 1e6:.2f} | {r['protocol_seconds']:.2f} | "
                     f"{r['round_seconds']:.2f} |")
    return "\n".join(lines + deployed_markdown(table.get("deployed", []))) + "\n"


def deployed_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## Deployed: the features recipe on owners' services (results/deploy-distributed.md)", "",
             "A SuperLink and 10 SuperNodes on this machine, each in its own network namespace and uid, each client "
             "with its owner's data service (its own data, ledger with `max-epsilon=3`, Ed25519 identity on one "
             "roster), TLS and node authentication; secure aggregation with distributed noise at record level, "
             "t = n = 10, one seed; the protocol: per-round, the whole secure-aggregation protocol every round (its "
             "runs' state carried from session to session), or multi-round, set up once a run and two exchanges a "
             "round (docs/algorithms.md, \"Set up once a run\"); one object a message: the same on the plumbing of "
             "results/deploy-distributed.md's section \"Fewer requests a round\" (a message's records one Flower "
             "object, no unsent telemetry, the grid's pulls at 0.2 s, the server on every core); later batches "
             "dealt riding: each batch of eight rounds set up riding on the two rounds before it (fedsd/app/rides.py); "
             "lighter rounds: the section \"The simulated round halved\" (the server's evaluation in small batches, "
             "NCHW for a network without a convolution, the ClientApp tasks' imports). "
             "Files: results/runs/deploy-distributed-400/. "
             "Simulated: the table's run of the same partition and seed; vs central: against the mean of the central "
             "runs, and against the central run of the same seed. Rounds' minutes: the rounds' own seconds added up "
             "(start-up left out), on 2 cores, other work beside the first two multi-round runs for part of each, "
             "none beside the one-object run.", ""]
    lines += [f"    {r['command']}" for r in rows]
    lines += ["", "| recipe | partition | protocol | t | seed | test accuracy (%) | vs central (mean) | "
              "vs central, same seed | simulated, same seed (%) | client ε | z | median round s | rounds' minutes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        signed = [f"{v:+.2f}" if v is not None else "" for v in (r["vs_central"], r["paired"])]
        simulated = f"{r['simulated']:.2f}" if r["simulated"] is not None else ""
        z = f"{r['z']:.3f}" if r["z"] is not None else ""
        lines.append(f"| {r['recipe']} | {r['partition']} | {r['protocol']} | {r['honest']} | {r['seed']} | "
                     f"{r['accuracy']:.2f} | {signed[0]} | {signed[1]} | {simulated} | {r['epsilon']:.3f} | {z} | "
                     f"{r['round_seconds']:.1f} | {r['rounds_minutes']:.0f} |")
    return lines


def beside(out: Path, recipe: str) -> list[str]:
    """The recipe's rows as lines for the table that holds its federated rows with local noise
    (results/table-features.md, results/table-fed.md), from results/table-distributed.json."""
    path = out / f"{TABLE_NAME}.json"
    rows = [r for r in json.loads(path.read_text())["rows"] if r["recipe"] == recipe] if path.is_file() else []
    if not rows:
        return []
    settings = next(r for r in RECIPES if r.name == recipe)
    lines = ["", f"## The same federation with secure aggregation and distributed noise (results/{TABLE_NAME}.md)", "",
             f"The central recipe (B = {settings.settings['batch_size']} for the federation, lr "
             f"{settings.settings['lr']:g}, momentum {settings.settings['momentum']:g}) run by {CLIENTS} clients, one "
             f"DP-SGD step a round for {settings.rounds} rounds, each adding its share of the noise under SecAgg+; "
             "t: the clients each assumes honest. Test accuracy, mean ± standard error; vs central paired by seed.", "",
             "| partition | t | seeds | test accuracy | vs central, paired by seed |", "|---|---|---|---|---|"]
    lines += [f"| {r['partition']} | {r['honest']} | {r['seeds']} | {_mean_se(r['accuracy'])} | "
              f"{_mean_se(r['paired'], '+')} |"
              for r in rows]
    return lines


if __name__ == "__main__":
    import sys

    run_all(Path("results"), only=sys.argv[1:])
