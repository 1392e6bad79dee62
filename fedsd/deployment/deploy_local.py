"""`scripts/deploy-local.sh`: a federation deployed on this machine (fedsd/deployment/local_deployment.py),
run once with the options `fedsd simulate` has, its result written as `fedsd simulate` writes
it, plus the deployment's facts; every process it started is stopped on the way out."""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

from fedsd.app.client.node_config import parse as parse_node_config
from fedsd.app.server import secure_plans
from fedsd.data.client_data import task_for, training_records
from fedsd.settings.run import TrainConfig
from fedsd.errors import ConfigError, DataNotFoundError, UserError
from fedsd.settings.federation import FedConfig, deployed_honest_clients, from_flat
from fedsd.files.results import RunResult, check_out_dir
from fedsd.settings.declared import add_options, given_flat
from fedsd import dry_run
from fedsd.settings.recipe_files import add_recipe_option, blamed_on, with_recipe
from fedsd.deployment.local_deployment import DeploymentError, LocalDeployment, stop_on_sigterm
from fedsd.deployment.node_options import add_node_arguments, node_start
from fedsd.training.summary import nothing_trained, run_summary
from fedsd.app.simulated_shards import build_federation


def deploy_local(num_clients: int, rounds: int, out: Path, run_config: dict, work: Path | None = None,
                 timeout: float = 3600, client_data: Path | None = None, node_config: str | list[str] = "",
                 isolate: bool = False, echo=None, nodes: dict | None = None, roster: bool = False) -> dict:
    """Start the deployment, run it, write out/result.json (the schema of `fedsd simulate`,
    plus tls / node_auth and the deployment's facts), stop everything. `nodes`: how the SuperNodes
    start (LocalDeployment's warm_clientapps and pull_interval; node_start reads them from options).
    `node_config`: every client's pairs, or a list of them, client k's at k. `roster` (under
    `isolate`): each owner makes its identity as its own uid, one roster lists them, and every
    owner and the server read it (`with_roster`)."""
    out = out.absolute()
    work = Path(work or tempfile.mkdtemp(prefix="fedsd-deploy-"))
    started = time.perf_counter()
    with LocalDeployment(work, num_clients, client_data=client_data, node_config=node_config,
                         isolate=isolate, **(nodes or {})) as deployment:
        if roster:
            run_config = with_roster(deployment, run_config)
        deployment.start()
        ready = time.perf_counter() - started
        deployment.run({**run_config, "num-server-rounds": rounds, "num-clients": num_clients, "out-dir": str(out)},
                       timeout=timeout, echo=echo)
    result_path = out / "result.json"
    if not result_path.is_file():
        raise DeploymentError(f"the run ended without {result_path}; see {deployment.logs}")
    result = RunResult.read(result_path)
    result.extra.update(tls=True, node_auth=True, deployment=dict(
        superlink=deployment.address, supernodes=num_clients,
        clientapps="warm" if deployment.warm_clientapps else "cold",
        pull_interval=deployment.pull_interval, superlink_state="file" if deployment.durable_superlink else "memory",
        shared_pages=deployment.shared_pages is not None,
        processes=("separate, each client in its own network namespace, its data service and its SuperNode under "
                   "uids of their own" if isolate else "separate, loopback"),
        isolation=dict(node_addresses=[deployment.isolation.address(k) for k in range(num_clients)],
                       namespaces=[deployment.isolation.namespace(k) for k in range(num_clients)],
                       owner_uids=[deployment.isolation.uid(k) for k in range(num_clients)],
                       supernode_uids=[deployment.isolation.node_uid(k) for k in range(num_clients)])
                  if isolate else None,
        startup_seconds=ready, total_seconds=time.perf_counter() - started, work_dir=str(work)))
    result.write(result_path)
    return result.to_dict()


def with_roster(deployment: LocalDeployment, run_config: dict) -> dict:
    """Each owner's identity, made by its own uid (`LocalDeployment.identities`), on one roster
    in the deployment's shared folder; every owner's node config names it, with secagg-min-clients
    at the run's t (honest-clients) unless its owner set one, and the run config gets the server's
    copy. Returns that run config."""
    path = deployment.shared_dir() / "roster"
    t = int(run_config.get("honest-clients") or run_config["num-clients"])  # honest-clients 0: every client
    deployment.node_config = [c + f" secagg-roster='{path}'" + (
        f" secagg-min-clients={t}" if t >= 2 and "secagg-min-clients=" not in c else "")
        for c in deployment.node_config]
    deployment.write_roster()
    return {**run_config, "secagg-roster": str(path)}


def add_deploy_arguments(p: argparse.ArgumentParser) -> None:
    # Every training and federation setting, as `fedsd simulate` has them (declared once).
    add_options(p, TrainConfig)
    # --client-data DIR (below) names the clients' folders and so means client-data=own.
    # --clients and --rounds: required, unless a --recipe gives them (checked in run_config_from_args)
    add_options(p, FedConfig, skip=("resume_dir", "client_data"))
    p.add_argument("--run-config", default="", help="more run-config settings, as k=v pairs")
    p.add_argument("--client-data", dest="client_folders", default=None, metavar="DIR",
                   help="each client trains on its own data: client k on DIR/client-k (fedsd split-data writes "
                        "such folders); the server loads no training data")
    p.add_argument("--node-config", default="", metavar="'K=V ...'",
                   help="more --node-config pairs for every SuperNode, e.g. 'max-epsilon=3 max-delta=1e-5'")
    p.add_argument("--node-config-for", nargs=2, action="append", default=[], metavar=("K", "'K=V ...'"),
                   help="more --node-config pairs for client K alone, after --node-config's (its owner's own "
                        "budget, say: --node-config-for 2 'max-epsilon=1'); repeat for other clients")
    p.add_argument("--isolate", action="store_true",
                   help="each SuperNode in its own network namespace (its own veth pair to the SuperLink, not "
                        "loopback) under its own uid, with only its own data readable by it (needs root)")
    add_node_arguments(p)
    add_recipe_option(p, "simulate")
    p.add_argument("--work", default=None, help="folder for Flower's state, logs and credentials "
                                                "(default: a new temporary folder)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds the whole run may take")
    p.add_argument("--out", required=True, help="result folder (new or empty)")


def run_config_from_args(args: argparse.Namespace) -> dict:
    """The run config the options ask for; ConfigError (naming the option) when one is bad."""
    for name, flag in (("num_clients", "--clients"), ("rounds", "--rounds")):
        if not hasattr(args, name):
            raise ConfigError(f"{flag} is required (or a --recipe that sets it)")
    values = given_flat(args, TrainConfig, FedConfig)
    if args.client_folders:
        values["client-data"] = "own"
    node_configs(args)  # every client's, checked
    values.update(_pairs(args.run_config, "--run-config"))
    values.update({"num-clients": args.num_clients, "num-server-rounds": args.rounds})
    cfg, fed = from_flat(values)
    fed.validate()  # --clients, --rounds, partition, strategy, ...
    cfg.resolved()  # --method
    return values


def node_configs(args: argparse.Namespace) -> list[str]:
    """Client k's node config pairs: --node-config's, then --node-config-for k's (one owner's own
    budget, say). Each checked as its SuperNode will check it again; ConfigError naming the option."""
    every = _pairs(args.node_config, "--node-config")
    own: dict[int, str] = {}
    for k, text in args.node_config_for:
        if not k.isdigit() or int(k) >= args.num_clients:
            raise ConfigError(f"--node-config-for {k}: a client's index, 0 to {args.num_clients - 1}")
        _pairs(text, f"--node-config-for {k}")
        own[int(k)] = (own.get(int(k), "") + " " + text).strip()
    configs = []
    for k in range(args.num_clients):
        option = f"--node-config-for {k}" if k in own else "--node-config"
        pairs = {**every, **_pairs(own.get(k, ""), option)}
        try:  # with a stand-in for what the script sets itself
            parse_node_config({"partition-id": k, **pairs})
        except ConfigError as e:
            raise ConfigError(f"{option}: {e}") from None
        if args.client_folders and "max-epsilon" not in pairs:  # it would refuse (fedsd/app/client/node_config.py)
            raise ConfigError(f"--client-data: a client with its own data trains only under its owner's lifetime "
                              f"budget; client {k} has none: add --node-config \"max-epsilon=…\" (inf for no limit)")
        # one pair a key, the owner's own in place of --node-config's (the owner's service refuses a key twice)
        configs.append(" ".join({**_as_written(args.node_config), **_as_written(own.get(k, ""))}.values()))
    return configs


def secure_owners(args: argparse.Namespace, values: dict, echo=print) -> bool:
    """What a secure deployment on this machine makes for its owners, said before any start:
    under --isolate, an identity for each owner and one roster (returns True); with --noise
    distributed at record level and --client-data, the sample rate from the records handed out
    (batch-size over them all) unless --run-config gives one. ConfigError when distributed noise
    cannot run here, naming what to add. `values`: the run config, completed in place."""
    _, fed = from_flat(values)
    if not fed.secure_aggregation:
        return False
    distributed = fed.noise == "distributed"
    if distributed and not args.client_folders:
        raise ConfigError("--noise distributed: each owner adds its share of the noise to its own data's sum; "
                          "give each its folder with --client-data DIR (fedsd split-data writes them)")
    if distributed and not args.isolate:
        raise ConfigError("--noise distributed: each owner signs its part with an identity on the federation's "
                          "roster, made by the owner's own uid; add --isolate (it makes them and the roster)")
    if distributed:
        _distributed_defaults(args, values, fed, echo)
        cfg, fed = from_flat(values)
        cfg = cfg.resolved()
        classes = len(task_for(cfg).classes)
        if fed.privacy_unit == "client":  # the server's own checks of the plan, here before any process starts
            secure_plans.client_level_plan(cfg, fed, classes, deployed_honest_clients(fed))
        else:
            secure_plans.distributed_plan(cfg, fed, classes)
    return bool(args.isolate)


def _distributed_defaults(args: argparse.Namespace, values: dict, fed: FedConfig, echo) -> None:
    """What --noise distributed needs of the data the harness hands out, where the options leave
    it unset, each said: the multi-round protocol; at record level the sample rate (batch-size over every owner's
    records); at client level the method (dpsgd, the one it runs) and the local steps (an epoch
    of the largest owner's records). Unsaid, as ever on this harness: t is every owner (honest-clients,
    to which `with_roster` sets each owner's secagg-min-clients), where a federation run by hand takes
    the owners' default, 2 (fedsd.settings.federation.deployed_honest_clients)."""
    if not fed.honest_clients:
        values["honest-clients"] = fed.num_clients
    if "secure-sum" not in values:
        values["secure-sum"] = "multi-round"
        echo("deploy-local: secure-sum=multi-round: the owners set secure aggregation up once a run, then two "
             "exchanges a round (--run-config secure-sum=protocol runs the whole protocol every round)")
    folders = [Path(args.client_folders) / f"client-{k}" for k in range(fed.num_clients)]
    if fed.privacy_unit == "client":
        if "method" not in values:
            values["method"] = "dpsgd"
            echo("deploy-local: method=dpsgd: privacy-unit=client trains each owner's update without a teacher")
        if not fed.local_steps:
            batch = from_flat(values)[0].resolved().batch_size
            most = max(training_records(f) for f in folders)
            values["local-steps"] = math.ceil(most / batch)
            echo(f"deploy-local: local-steps={values['local-steps']}: an epoch of the largest owner's {most} records "
                 f"at batch-size {batch}, the same for every owner, so that its work does not tell its records "
                 f"(--local-steps sets another)")
        return
    sizes = [training_records(f) for f in folders]
    if not sum(sizes):
        raise ConfigError(f"--client-data: the client folders in {args.client_folders} hold no training records")
    if not fed.sample_rate:
        batch = from_flat(values)[0].resolved().batch_size  # the method's batch size where none is given
        values["sample-rate"] = min(1.0, batch / sum(sizes))
        echo(f"deploy-local: sample-rate={values['sample-rate']:.6g}: batch-size {batch} over the {sum(sizes)} "
             f"training records of the {fed.num_clients} client folders in {args.client_folders} (each owner draws "
             f"its records at this rate; --run-config sample-rate=… sets another)")
    given = node_configs(args)
    bounds = {k: n for k, n in enumerate(sizes) if "max-records=" not in given[k]}
    args.node_config_for += [(str(k), f"max-records={n}") for k, n in bounds.items()]
    if bounds:
        counts = set(bounds.values())  # one count for all (a hundred folders of a split): said once
        which = (f"={counts.pop()} for each of the {len(bounds)} clients" if len(counts) == 1 and
                 len(bounds) == fed.num_clients > 1 else
                 f"={','.join(str(n) for n in bounds.values())} for client(s) {','.join(map(str, bounds))}")
        echo(f"deploy-local: max-records{which}: each owner's bound on its records, its folder's count; its step is "
             f"padded to q times that many and its draw rate set from it, whatever it holds "
             f"(--node-config-for K 'max-records=…' sets another)")


def _as_written(text: str) -> dict[str, str]:
    """'k=v k2=v2 …' as key → its pair as written (quotes kept), the last of a key given twice."""
    return {pair.partition("=")[0]: pair for pair in text.split()}


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
        recipe = with_recipe(args, "simulate")
        with blamed_on(recipe, args):
            run_config = run_config_from_args(args)
        check_out_dir(args.out)
        if args.client_folders:  # each client's folder is there (its own checks run on its node)
            missing = [k for k in range(args.num_clients) if not (Path(args.client_folders) / f"client-{k}").exists()]
            if missing:
                raise DataNotFoundError(f"--client-data: no {args.client_folders}/client-{missing[0]} "
                                        f"(fedsd split-data --clients {args.num_clients} ... "
                                        f"--out {args.client_folders})")
        else:  # a simulation's checks, before any process starts: data found, every shard, every budget
            build_federation(*from_flat(run_config)).check_plans()
        roster = secure_owners(args, run_config)
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
                              node_config=node_configs(args), isolate=args.isolate, echo=print_round,
                              nodes=node_start(p, args), roster=roster)
    except KeyboardInterrupt:
        print("deploy-local: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    except DeploymentError as e:
        print(f"deploy-local: error: {e}", file=sys.stderr)
        return 1
    print(run_summary(result, args.out))
    print(f"  deployment     {args.num_clients} SuperNodes, TLS and node authentication"
          f"{', each in its own network namespace and uid' if args.isolate else ''}")
    why = nothing_trained(result, args.out)
    if why:
        print(f"deploy-local: error: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
