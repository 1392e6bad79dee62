"""`scripts/deploy-local.sh`: a federation deployed on this machine (fedsd/deployment/local_deployment.py),
run once with the options `fedsd simulate` has, its result written as `fedsd simulate` writes
it, plus the deployment's facts; every process it started is stopped on the way out."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from fedsd.app.client.node_config import parse as parse_node_config
from fedsd.settings.run import TrainConfig
from fedsd.errors import ConfigError, DataNotFoundError, UserError
from fedsd.settings.federation import FedConfig, from_flat
from fedsd.files.results import RunResult, check_out_dir
from fedsd.settings.declared import add_options, given_flat
from fedsd.cli import dry_run
from fedsd.deployment.local_deployment import DeploymentError, LocalDeployment, add_node_arguments, node_start, stop_on_sigterm
from fedsd.training.summary import run_summary
from fedsd.app.simulated_shards import build_federation


def deploy_local(num_clients: int, rounds: int, out: Path, run_config: dict, work: Path | None = None,
                 timeout: float = 3600, client_data: Path | None = None, node_config: str = "",
                 isolate: bool = False, echo=None, nodes: dict | None = None) -> dict:
    """Start the deployment, run it, write out/result.json (the schema of `fedsd simulate`,
    plus tls / node_auth and the deployment's facts), stop everything. `nodes`: how the SuperNodes
    start (LocalDeployment's warm_clientapps and pull_interval; node_start reads them from options)."""
    out = out.absolute()
    work = Path(work or tempfile.mkdtemp(prefix="fedsd-deploy-"))
    started = time.perf_counter()
    with LocalDeployment(work, num_clients, client_data=client_data, node_config=node_config,
                         isolate=isolate, **(nodes or {})) as deployment:
        deployment.start()
        ready = time.perf_counter() - started
        deployment.run({**run_config, "num-server-rounds": rounds, "num-clients": num_clients, "out-dir": str(out)},
                       timeout=timeout, echo=echo)
    result_path = out / "result.json"
    if not result_path.is_file():
        raise DeploymentError(f"the run ended without {result_path}; see {deployment.logs}")
    result = RunResult.read(result_path)
    result.extra.update(tls=True, node_auth=True, deployment=dict(
        superlink=deployment.address, supernodes=num_clients, clientapps="warm" if deployment.warm_clientapps else "cold",
        pull_interval=deployment.pull_interval,
        processes=("separate, each client in its own network namespace, its data service and its SuperNode under "
                   "uids of their own" if isolate else "separate, loopback"),
        isolation=dict(node_addresses=[deployment.isolation.address(k) for k in range(num_clients)],
                       namespaces=[deployment.isolation.namespace(k) for k in range(num_clients)],
                       owner_uids=[deployment.isolation.uid(k) for k in range(num_clients)],
                       supernode_uids=[deployment.isolation.node_uid(k) for k in range(num_clients)]) if isolate else None,
        startup_seconds=ready, total_seconds=time.perf_counter() - started, work_dir=str(work)))
    result.write(result_path)
    return result.to_dict()


def add_deploy_arguments(p: argparse.ArgumentParser) -> None:
    # Every training and federation setting, as `fedsd simulate` has them (declared once).
    add_options(p, TrainConfig)
    # --client-data DIR (below) names the clients' folders and so means client-data=own.
    add_options(p, FedConfig, required=("num_clients", "rounds"), skip=("resume_dir", "client_data"))
    p.add_argument("--run-config", default="", help="more run-config settings, as k=v pairs")
    p.add_argument("--client-data", dest="client_folders", default=None, metavar="DIR",
                   help="each client trains on its own data: client k on DIR/client-k (fedsd split-data writes "
                        "such folders); the server loads no training data")
    p.add_argument("--node-config", default="", metavar="'K=V ...'",
                   help="more --node-config pairs for every SuperNode, e.g. 'max-epsilon=3 max-delta=1e-5'")
    p.add_argument("--isolate", action="store_true",
                   help="each SuperNode in its own network namespace (its own veth pair to the SuperLink, not "
                        "loopback) under its own uid, with only its own data readable by it (needs root)")
    add_node_arguments(p)
    p.add_argument("--work", default=None, help="folder for Flower's state, logs and credentials "
                                                "(default: a new temporary folder)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds the whole run may take")
    p.add_argument("--out", required=True, help="result folder (new or empty)")


def run_config_from_args(args: argparse.Namespace) -> dict:
    """The run config the options ask for; ConfigError (naming the option) when one is bad."""
    values = given_flat(args, TrainConfig, FedConfig)
    if args.client_folders:
        values["client-data"] = "own"
    owner = _pairs(args.node_config, "--node-config")
    try:  # the keys every SuperNode will check again, with a stand-in for what the script sets itself
        parse_node_config({"partition-id": 0, **owner})
    except ConfigError as e:
        raise ConfigError(f"--node-config: {e}") from None
    if args.client_folders and "max-epsilon" not in owner:  # every client would refuse (fedsd/app/client/node_config.py)
        raise ConfigError("--client-data: a client with its own data trains only under its owner's lifetime budget; "
                          "add --node-config \"max-epsilon=…\" (inf for no limit)")
    values.update(_pairs(args.run_config, "--run-config"))
    values.update({"num-clients": args.num_clients, "num-server-rounds": args.rounds})
    cfg, fed = from_flat(values)
    fed.validate()  # --clients, --rounds, partition, strategy, ...
    cfg.resolved()  # --method
    return values


def _pairs(text: str, option: str) -> dict[str, str]:
    """'k=v k2=v2 …' as a dict (values without spaces; quotes around a value dropped);
    ConfigError naming the option."""
    pairs = {}
    for pair in text.split():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{option}: k=v pairs, got {pair!r}")
        pairs[key] = value.strip("'\"")
    return pairs


def print_round(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploy-local.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_deploy_arguments(p)
    args = p.parse_args(argv)
    try:
        run_config = run_config_from_args(args)
        check_out_dir(args.out)
        if args.client_folders:  # each client's folder is there (its own checks run on its node)
            missing = [k for k in range(args.num_clients) if not (Path(args.client_folders) / f"client-{k}").exists()]
            if missing:
                raise DataNotFoundError(f"--client-data: no {args.client_folders}/client-{missing[0]} "
                                        f"(fedsd split-data --clients {args.num_clients} ... --out {args.client_folders})")
        else:  # a simulation's checks, before any process starts: data found, every shard, every budget
            build_federation(*from_flat(run_config)).check_plans()
    except UserError as e:
        print(f"deploy-local: error: {e}", file=sys.stderr)
        return 2
    if dry_run.requested():
        print(f"deploy-local: dry run: every check passed; would start a SuperLink and {args.num_clients} SuperNodes "
              f"for {args.rounds} rounds into {args.out}")
        return 0
    stop_on_sigterm()
    try:
        result = deploy_local(args.num_clients, args.rounds, Path(args.out), run_config,
                              work=Path(args.work) if args.work else None, timeout=args.timeout,
                              client_data=Path(args.client_folders) if args.client_folders else None,
                              node_config=args.node_config, isolate=args.isolate, echo=print_round,
                              nodes=node_start(p, args))
    except KeyboardInterrupt:
        print("deploy-local: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    except DeploymentError as e:
        print(f"deploy-local: error: {e}", file=sys.stderr)
        return 1
    print(run_summary(result, args.out))
    print(f"  deployment     {args.num_clients} SuperNodes, TLS and node authentication"
          f"{', each in its own network namespace and uid' if args.isolate else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
