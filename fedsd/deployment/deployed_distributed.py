"""The distributed-noise table's features recipe, deployed: a SuperLink and 10 SuperNodes under
--isolate, each client with its owner's data service (its own uid, network namespace, data,
ledger and Ed25519 identity), one roster listing the ten, secure aggregation with distributed
noise at record level (each round one DP-SGD step of the whole federation, t = n).

    python -m fedsd.deployment.deployed_distributed --partition iid --work W --out O
    python -m fedsd.deployment.deployed_distributed --privacy-unit client --rounds 3 --work W --out O

It is resumable: the owners' state folders (ledgers, identities, admitted plans) stay in W, the
run's checkpoint in O; stop it with `kill -TERM` (every process and namespace it started stops),
run the same command again and the run goes on from its last checkpoint (`resume-dir`), each
owner charged once a round. scripts/deployed-run-state.sh saves a stopped run's W and O (without
what a start makes again) to carry it to another machine or session, and restores them. Each round's line and
its wall-clock time go to W/rounds.jsonl (copied to O at the end); at the end O/result.json is
the run's result (`fedsd simulate`'s schema) and O/deployment.json what the deployment was.

With --floor-rounds N, the same deployment then runs Flower's floor (scripts/floor: every node sends
the model's arrays back, nothing else) for N rounds: what one exchange with these nodes costs Flower
itself, beside the rounds it is part of (O/floor/floor.json; deployment.json's floor_exchange_seconds
and deployed_round_seconds, medians of rounds 2…).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from fedsd.app.server import checkpoint
from fedsd.simulation.secure_federation import FEATURES_RECIPE, FEATURES_ROUNDS
from fedsd.simulation.client_folders import write_client_folders
from fedsd.data.client_data import training_records
from fedsd.deployment.stage_links import stage_links, table
from fedsd.deployment.local_deployment import LocalDeployment, stop_on_sigterm
from fedsd.deployment.node_options import add_node_arguments, node_start
from fedsd.errors import OutputExistsError
from fedsd.files.results import check_out_dir, write_json
from fedsd.privacy.lifetime_ledger import read_all
from fedsd.settings.federation import FedConfig
from fedsd.settings.run import TrainConfig

RECORDS = 60000  # Fashion-MNIST's training records, all owners together
# --privacy-unit client: README's whole-client recipe (fedsd simulate --privacy-unit client), each
# owner an epoch's worth of plain SGD steps (⌈6000 / 32⌉ = 188, batches drawn with replacement: an
# owner's work does not tell its records), its update clipped to S = 0.5, its share added
CLIENT_RECIPE = {"dataset": "fmnist", "method": "dpsgd", "epsilon": 3.0, "batch-size": 32, "lr": 0.05,
                 "momentum": 0.0, "threads": 1, "local-steps": 188, "update-clip": 0.5, "privacy-unit": "client"}
# the exchanges with every owner a round after the first, by --secure-sum (docs/algorithms.md's stage tables)
STEADY_EXCHANGES = {"multi-round": 2, "protocol": 6}
CLIENT_LIFETIME = 10.0  # each owner's max-epsilon there: each record's ε is the run's at z_e / 2 (above 3)


def run_config(rounds: int, seed: int, clients: int, roster: Path, out: Path, unit: str = "record",
               secure_sum: str = "multi-round", honest: int = 0) -> dict:
    """The features recipe of results/table-distributed.md as a deployment's run config; with
    unit client, README's whole-client recipe (every owner every round, q = 1)."""
    if unit == "client":
        recipe = dict(CLIENT_RECIPE)
    else:
        recipe = {k.replace("_", "-"): v for k, v in FEATURES_RECIPE.items()}
        recipe["sample-rate"] = FEATURES_RECIPE["batch_size"] / RECORDS
    return {**recipe, "seed": seed, "num-clients": clients, "num-server-rounds": rounds, "client-data": "own",
            "secure-aggregation": True, "noise": "distributed", "honest-clients": honest or clients,
            "secagg-roster": str(roster), "out-dir": str(out), "secure-sum": secure_sum}


def split(data: Path, clients: int, partition: str, alpha: float, seed: int) -> None:
    """Fashion-MNIST's training set in `clients` owners' folders (as `fedsd split-data`), once."""
    if not (data / f"client-{clients - 1}").exists():
        fed = FedConfig(num_clients=clients, rounds=1, client_data="own", partition=partition, dirichlet_alpha=alpha)
        write_client_folders(TrainConfig(dataset="fmnist", seed=seed), fed, data, "npz", echo=print)


def echo_to(path: Path):
    last = [time.perf_counter()]

    def echo(line: str) -> None:
        now = time.perf_counter()
        print(line, flush=True)
        with path.open("a") as f:
            f.write(json.dumps(dict(line=line, seconds=round(now - last[0], 2), at=time.time())) + "\n")
        last[0] = now
    return echo


def out_refusal(out: Path, work: Path) -> str | None:
    """Why --out and --work can neither start a run nor resume one (None: they can), said before
    anything starts. A run stopped before its first checkpoint cannot go on: its owners' ledgers in
    --work keep the round they released, so a new run there would find their budgets short of its plan."""
    if (out / "result.json").is_file():
        return f"--out: {out} holds a finished run (its result.json); a new run needs a new --work and --out"
    if checkpoint.path_in(out).is_file():
        return None  # resumed from its checkpoint
    try:
        check_out_dir(out)
        charged = [ledger for state in work.glob("deployment/nodes/*/state") for ledger in read_all(state)
                   if ledger.experiments]
    except (OutputExistsError, OSError, ValueError):  # a ledger that cannot be read: DataError, a ValueError
        charged = [out]
    if charged:
        return (f"--out {out} and --work {work} hold a run stopped before its first round ended (no checkpoint to "
                "resume from; its owners' ledgers keep what they released): start again with a new --work and --out")
    return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--partition", choices=["iid", "dirichlet"], default="iid")
    p.add_argument("--dirichlet-alpha", type=float, default=0.1)
    p.add_argument("--privacy-unit", choices=["record", "client"], default="record",
                   help="client: README's whole-client recipe (each owner clips its update), else the features one")
    p.add_argument("--secure-sum", choices=["multi-round", "protocol"], default="multi-round",
                   help="multi-round: the protocol set up once a run, two exchanges a round; protocol: the whole "
                        "protocol every round (six exchanges)")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--honest-clients", type=int, default=0,
                   help="t, the fewest owners whose noise alone gives the run's σ (each owner requires it as its "
                        "secagg-min-clients); 0: every owner. Below the owners, from 41 of them, the round runs on "
                        "the ring (secagg-graph auto) under --secure-sum protocol")
    p.add_argument("--rounds", type=int, default=FEATURES_ROUNDS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", required=True, help="the deployment's folder (owners' state, logs); kept")
    p.add_argument("--out", required=True, help="the run's result folder (its checkpoint: resumed from)")
    p.add_argument("--timeout", type=float, default=48 * 3600)
    p.add_argument("--floor-rounds", type=int, default=0,
                   help="after the run, Flower's floor on the same deployment for this many rounds (at least 2: "
                        "round 1 starts the floor's tasks), each an exchange that only sends the model back; 0: none")
    add_node_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    nodes = node_start(p, args)
    work, out = Path(args.work).absolute(), Path(args.out).absolute()
    if refusal := out_refusal(out, work):
        p.error(refusal)
    if args.floor_rounds < 0 or args.floor_rounds == 1:
        p.error(f"--floor-rounds {args.floor_rounds}: 0 (none) or at least 2 (round 1 starts the floor's tasks; "
                "rounds 2… are timed)")
    if not 0 <= args.honest_clients <= args.clients:
        p.error(f"--honest-clients {args.honest_clients}: in [0, --clients {args.clients}] (0: every owner)")
    honest = args.honest_clients or args.clients
    data = work / "data"
    split(data, args.clients, args.partition, args.dirichlet_alpha, args.seed)
    lifetime = CLIENT_LIFETIME if args.privacy_unit == "client" else 3
    owners = f"max-epsilon={lifetime:g} max-delta=1e-5 secagg-min-clients={{t}} secagg-roster='{{roster}}'"
    started = time.perf_counter()
    stop_on_sigterm()  # `kill -TERM` stops every process and namespace it started; the run resumes later
    try:
        with LocalDeployment(work / "deployment", args.clients, client_data=data, isolate=True,
                             **nodes) as deployment:
            roster = deployment.shared_dir() / "roster"
            # each owner's bound on its records, its folder's count: its step padded to q times that
            bounds = [f" max-records={training_records(data / f'client-{k}')}" if args.privacy_unit == "record"
                      else "" for k in range(args.clients)]
            deployment.node_config = [owners.format(t=honest, roster=roster) + b for b in bounds]
            deployment.write_roster()
            deployment.start()
            ready = time.perf_counter() - started
            config = run_config(args.rounds, args.seed, args.clients, roster, out, args.privacy_unit, args.secure_sum,
                                honest)
            resumed = checkpoint.path_in(out).is_file() and not (out / "result.json").is_file()
            deployment.run({"resume-dir": str(out)} if resumed else config, timeout=args.timeout,
                           echo=echo_to(work / "rounds.jsonl"))
            floor = flower_floor(deployment, out, args.floor_rounds, args.timeout)
    except KeyboardInterrupt:
        refusal = out_refusal(out, work)
        print("deployed_distributed: interrupted; every process it started is stopped; " + (
            refusal if refusal else "the same command resumes the run from its last checkpoint"
            if checkpoint.path_in(out).is_file() else "no owner had been charged: the same command starts it again"),
            file=sys.stderr)
        return 130
    if (work / "rounds.jsonl").is_file():  # none when the run ended before its first round (its logs say why)
        (out / "rounds.jsonl").write_text((work / "rounds.jsonl").read_text())
    if (out / "secure-aggregation.json").is_file():  # where each stage's time went, link by link
        links = stage_links(work / "deployment" / "logs", out / "secure-aggregation.json")
        write_json(out / "stage-links.json", links)
        print("each stage's median seconds over rounds 2…, by link (fedsd/deployment/stage_links.py):\n" + table(links))
    write_json(out / "deployment.json", dict(
        command="python -m fedsd.deployment.deployed_distributed " + " ".join(argv or sys.argv[1:]),
        run_config=config, resumed=resumed, startup_seconds=round(ready, 1),
        total_seconds=round(time.perf_counter() - started, 1), supernodes=args.clients, clientapps=args.clientapps,
        pull_interval=deployment.pull_interval, superlink_state="file" if deployment.durable_superlink else "memory",
        node_threads=deployment.node_threads, shared_pages=deployment.shared_pages is not None,
        **floor_report(work / "rounds.jsonl", floor, STEADY_EXCHANGES[args.secure_sum])))
    return 0


def flower_floor(deployment: LocalDeployment, out: Path, rounds: int, timeout: float) -> list[float]:
    """Flower's floor on this deployment for `rounds` rounds (none for 0): each round the ServerApp
    sends every node the run's model arrays (their shapes from O/model.pt) and waits for them back;
    the seconds of each round, also in O/floor/floor.json."""
    if not rounds:
        return []
    import torch

    shapes = [list(v.shape) for v in torch.load(out / "model.pt", weights_only=True).values()]
    print(f"deployed_distributed: Flower's floor (scripts/floor) on the same {deployment.num_clients} nodes, "
          f"{rounds} rounds", flush=True)
    return deployment.run_floor(shapes, rounds, out / "floor", timeout)


def floor_report(rounds_log: Path, floor: list[float], exchanges: int) -> dict:
    """deployment.json's floor fields: the floor's exchange and the deployed round, medians of rounds
    2… (the deployed ones from rounds_log's lines, start to start), printed as a line too with the
    protocol's `exchanges` a steady round; {} with no floor."""
    if not floor:
        return {}
    deployed = [json.loads(line)["seconds"] for line in rounds_log.read_text().splitlines()[1:]] \
        if rounds_log.is_file() else []
    report = dict(floor_round_seconds=[round(s, 3) for s in floor],
                  floor_exchange_seconds=round(statistics.median(floor[1:]), 3),
                  deployed_round_seconds=round(statistics.median(deployed), 3) if deployed else None)
    print(f"Flower's floor: {report['floor_exchange_seconds']:.2f} s an exchange (median of rounds 2–{len(floor)}); "
          f"a deployed round: " + (f"{report['deployed_round_seconds']:.2f} s" if deployed else "none timed") +
          f" (median of rounds 2…, {exchanges} exchanges each after the first)", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(main())
