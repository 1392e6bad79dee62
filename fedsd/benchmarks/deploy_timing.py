"""`fedsd bench deploy`: a simulated round, a deployed round (SuperLink, SuperNodes, TLS, own
data) and Flower's floor (a round that only sends a model back), side by side in one run."""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from fedsd.settings.run import TrainConfig
from fedsd.errors import ConfigError
from fedsd.settings.federation import FedConfig, to_flat
from fedsd.files.results import RunResult, check_out_dir
from fedsd.settings.declared import from_args
from fedsd.benchmarks.step_timing import emit
from fedsd import dry_run
from fedsd.simulation.engine import simulate
from fedsd.simulation.client_folders import write_client_folders
from fedsd.deployment.local_deployment import LocalDeployment, stop_on_sigterm
from fedsd.app.simulated_shards import build_federation




def bench_deploy(args: argparse.Namespace) -> int:
    """The same federation three ways, one after the other on this machine: simulated (Ray),
    deployed (a SuperLink and a SuperNode per client, TLS, node authentication, each client on
    its own folder of the same shard under max-epsilon=inf), and Flower's floor on the same
    deployment (scripts/floor: a round that sends a model of the same shapes and gets it back).
    Each is the median of rounds 2…R (round 1 starts processes and fills caches)."""
    cfg, fed = from_args(TrainConfig, args), from_args(FedConfig, args)
    fed.validate()
    cfg.resolved()  # every setting checked before anything starts
    if fed.rounds < 2:
        raise ConfigError("--rounds: at least 2 (round 1 starts processes; rounds 2… are timed)")
    if args.work:
        check_out_dir(args.work)
    build_federation(cfg, fed).check_plans()  # the data found, every client's σ within its budget
    dry_run.stop_here(f"time {fed.rounds} rounds of {fed.num_clients} clients simulated, deployed and at Flower's "
                      f"floor in {args.work or 'a temporary folder'}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fedsd-bench-deploy-"))
    try:
        runs = three_ways(cfg, fed, work, args.timeout)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report = deploy_report(cfg, fed, runs)
    return emit(args, report, f"{fed.num_clients} clients, {cfg.dataset} {cfg.method}, rounds 2–{fed.rounds} median: "
                               f"simulated {report['simulated_round_seconds']:.2f} s, deployed "
                               f"{report['deployed_round_seconds']:.2f} s, Flower's floor "
                               f"{report['floor_round_seconds']:.2f} s; (deployed − floor) / simulated = "
                               f"{report['fedsd_share']:.2f}; same model: max |Δw| = "
                               f"{report['max_weight_difference']:.1e}")


def _phase(text: str) -> None:
    print(f"bench deploy: {text}", file=sys.stderr, flush=True)


def three_ways(cfg: TrainConfig, fed: FedConfig, work: Path, timeout: float) -> dict:
    """The federation simulated, deployed on the clients' own folders, and Flower's floor on the
    same deployment: what each run left (results, weights, the deployment's poll and threads)."""
    _phase(f"{fed.num_clients} client folders")
    write_client_folders(cfg, fed, work / "client-data", "npz", echo=lambda line: None)
    _phase("simulated run (Ray)")
    simulated, simulated_weights = simulate(cfg, fed, progress=False)
    _phase("deployment: SuperLink, SuperNodes, TLS, node authentication")
    # `kill -TERM` leaves through the deployment's stop (every process it started), as Ctrl-C does:
    # the default action ended this process alone and left the SuperLink and SuperNodes running.
    # Set here, after the simulated run: Ray's start sets a handler of its own.
    stop_on_sigterm()
    # Seeded noise, the owner's word given: this bench owns both sides and checks that the
    # deployed clients train the simulated model exactly (a real owner keeps the default,
    # secret noise, which no server can predict).
    with LocalDeployment(work / "deployment", fed.num_clients, client_data=work / "client-data",
                         node_config="max-epsilon=inf noise='seeded' trust-server-with-noise=true") as deployment:
        deployment.start()
        _phase("deployed run (clients on their own data)")
        deployment.run({**to_flat(cfg, fed), "client-data": "own", "num-clients": fed.num_clients,
                        "num-server-rounds": fed.rounds, "out-dir": str(work / "deployed")}, timeout=timeout)
        # The floor sends what fedsd's ServerApp sends: the model's arrays, as many floats.
        _phase("Flower's floor (scripts/floor) on the same deployment")
        floor = deployment.run_floor([list(v.shape) for v in simulated_weights.values()], fed.rounds, work / "floor",
                                     timeout)
        superexec_poll = float(deployment.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"])
        node_threads = deployment.node_threads
    return dict(simulated=simulated, simulated_weights=simulated_weights,
                deployed=RunResult.read(work / "deployed" / "result.json"),
                deployed_weights=torch.load(work / "deployed" / "model.pt", weights_only=True),
                floor=floor,
                superexec_poll=superexec_poll, node_threads=node_threads)


def deploy_report(cfg: TrainConfig, fed: FedConfig, runs: dict) -> dict:
    """Rounds 2…R's medians of the three, and what fedsd adds to Flower's floor per second of a
    simulated round."""
    from fedsd.app.server.grid import default_poll_seconds  # Flower's

    simulated, deployed, floor = runs["simulated"], runs["deployed"], runs["floor"]
    sim_rounds = [r["seconds"] for r in simulated["rounds"]]
    dep_rounds = [r["seconds"] for r in deployed.rounds]
    report = dict(dataset=cfg.dataset, method=cfg.method, epsilon=cfg.epsilon, batch_size=deployed.config["batch_size"],
                  clients=fed.num_clients, rounds=fed.rounds, local_epochs=fed.local_epochs, partition=fed.partition,
                  threads=cfg.threads, deployed_threads_per_node=cfg.threads or runs["node_threads"],
                  simulated_threads_per_client=cfg.threads or max(1, int(fed.client_cpus)),
                  shard_sizes=deployed.shard_sizes, cpu_isa=torch.backends.cpu.get_cpu_capability().lower(),
                  grid_poll_seconds=default_poll_seconds(), superexec_poll_seconds=runs["superexec_poll"],
                  simulated_round_seconds=statistics.median(sim_rounds[1:]),
                  deployed_round_seconds=statistics.median(dep_rounds[1:]),
                  floor_round_seconds=statistics.median(floor[1:]),
                  simulated_rounds=sim_rounds, deployed_rounds=dep_rounds, floor_rounds=floor,
                  simulated_test_accuracy=simulated["test_accuracy"], deployed_test_accuracy=deployed.test_accuracy,
                  max_weight_difference=max(float((runs["simulated_weights"][k] - v).abs().max())
                                            for k, v in runs["deployed_weights"].items()))
    report["deployed_over_simulated"] = report["deployed_round_seconds"] / report["simulated_round_seconds"]
    # What fedsd adds to Flower's floor, per second of a simulated round (the target: ≤ 1.15).
    report["fedsd_share"] = (report["deployed_round_seconds"] - report["floor_round_seconds"]) / \
        report["simulated_round_seconds"]
    return report

