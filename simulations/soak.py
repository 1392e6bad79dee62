"""`fedsd bench soak`: a real deployment (deploy-local's: SuperLink, SuperNodes with TLS and
node authentication, each client with its own state folder and its owner's max-epsilon, the
ServerApp) under K seeded faults, each a SIGKILL of one part, restarted after a seeded delay as
a supervisor would (the SuperLink on its database, the server with resume-dir); then the
independent privacy check (simulations/privacy_check.py: Opacus' RDP accountant over each
client's ledger and the rounds the server aggregated) and the accuracy against the same seed's
run without faults.

A fault is due at a seeded moment of a seeded round (a share of the time the soak's last whole
round took, after the round began), so over many faults they land in every phase of a round; the
phase each one found is read from the deployment's files when it lands (a client's ledger
written for the round but its reply not yet aggregated: "between charge and reply"; the
server's checkpoint being written: "checkpoint"; every reply of the round in: "aggregation";
else "training").
"""
from __future__ import annotations

import json
import random
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fedsd.errors import ConfigError

KINDS = ("supernode", "worker", "superlink", "serverapp")
RUN = {"dataset": "fmnist", "batch-size": 100, "lr": 0.8, "threads": 1, "epsilon": 2.0}
MAX_EPSILON = 2.5  # each owner's lifetime limit (--node-config max-epsilon): the run asks 2


@dataclass
class Fault:
    round: int
    share: float  # of the round's fault-free time, after the round began
    kind: str
    client: int | None
    delay: float  # seconds before the killed part is started again
    phase: str = ""
    landed_round: int = 0  # the round in flight when it landed (its round, or later where that one ended first)
    landed_at: float = 0.0


def max_faults(rounds: int) -> int:
    """At most one fault in each round but the first and the last: a server killed is resumed
    from its last checkpoint (there is none before round 1 completes), and a round whose
    server was killed is run again, so more would leave a run no progress to make."""
    return max(0, rounds - 2)


def plan_faults(clients: int, rounds: int, faults: int, seed: int) -> list[Fault]:
    if faults > max_faults(rounds):
        raise ConfigError(f"--faults: at most {max_faults(rounds)} for --rounds {rounds} (one a round, none in "
                          f"the first or the last), got {faults}")
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(2, rounds), faults))
    plan = []
    for r in chosen:
        kind = rng.choice(KINDS)
        plan.append(Fault(r, rng.random(), kind, rng.randrange(clients) if kind in ("supernode", "worker") else None,
                          rng.uniform(1.0, 6.0)))
    return plan


def _checkpoint_round(out: Path) -> int:
    import torch

    try:
        return int(torch.load(out / "checkpoint.pt", weights_only=True)["round"])
    except (OSError, RuntimeError, KeyError, EOFError):
        return 0


def _pids(pattern: str) -> list[int]:
    proc = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()]


def _kill(pids: list[int]) -> None:
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _phase(work: Path, out: Path, round_: int, clients: int) -> str:
    if list(out.glob("*.tmp")) or list(out.glob(".checkpoint*")):
        return "checkpoint"
    charged = 0
    for k in range(clients):
        for ledger in (work / "client-state" / str(k)).rglob("ledger-*.json"):
            try:
                entries = json.loads(ledger.read_text())["entries"]
            except (OSError, ValueError, KeyError):
                continue
            charged += any(e.get("round") == round_ for e in entries)
    if charged == clients:
        return "aggregation"
    return "between charge and reply" if charged else "training"


def soak(clients: int, rounds: int, faults: int, seed: int, work: Path, echo=print) -> dict:
    """Run the same seed's fault-free baseline (kept in work/baseline-seed<S> and reused), then
    the soak (work/soak-seed<S>: every node's state, the server's result, the logs, report.json);
    return the report."""
    from fedsd.results import write_json

    from .local_deployment import LocalDeployment
    from .privacy_check import check_run, deployment_state_dirs

    plan = plan_faults(clients, rounds, faults, seed)
    config = {**RUN, "num-clients": clients, "num-server-rounds": rounds, "client-data": "own", "seed": seed}
    work = Path(work)
    data = work / "client-data"  # each client's own images (fedsd split-data), one folder a SuperNode
    if not data.is_dir():
        import contextlib
        import sys

        from .cli import main

        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the report alone
            made = main(["split-data", "--dataset", RUN["dataset"], "--clients", str(clients),
                         "--subset", str(600 * clients), "--format", "imagefolder", "--out", str(data)])
        if made != 0:
            raise RuntimeError("fedsd split-data failed")
    owners = dict(client_data=data, node_config=f"max-epsilon={MAX_EPSILON}")
    base = work / f"baseline-seed{seed}"  # the same seed's run without faults, kept and reused
    base_out = base / "out"
    if not (base_out / "result.json").is_file():
        with LocalDeployment(base / "deployment", clients, **owners) as d:
            d.start()
            started = time.monotonic()
            d.run({**config, "out-dir": str(base_out)}, timeout=3600)
            write_json(base / "wall.json", {"seconds": time.monotonic() - started})
    baseline = json.loads((base_out / "result.json").read_text())
    base_wall = json.loads((base / "wall.json").read_text())["seconds"]
    per_round = base_wall / rounds

    soaked = work / f"soak-seed{seed}"
    if soaked.exists():  # a soak is one run from the start: an earlier one's state would be resumed
        import shutil

        shutil.rmtree(soaked)
    out = soaked / "out"
    restarts = []
    with LocalDeployment(soaked / "deployment", clients, **owners) as d:
        d.start()
        started = time.monotonic()
        run = d.submit({**config, "out-dir": str(out)})
        pending = list(plan)
        round_began, seen_round = time.monotonic(), 0
        while not (out / "result.json").is_file():
            if time.monotonic() - started > 20 * base_wall + 600:
                raise RuntimeError(f"the soak did not finish within {20 * base_wall + 600:.0f} s; see {d.logs}")
            done = _checkpoint_round(out)
            if done != seen_round:
                if done == seen_round + 1 and seen_round:  # a whole round, in this run: the next one's measure
                    per_round = time.monotonic() - round_began
                seen_round, round_began = done, time.monotonic()
                echo(f"soak: round {done} checkpointed at {time.monotonic() - started:.0f} s")
            fault = pending[0] if pending else None
            if fault is not None and done + 1 >= fault.round and \
                    time.monotonic() - round_began >= fault.share * per_round:
                pending.pop(0)
                fault.phase, fault.landed_round = _phase(d.work, out, done + 1, clients), done + 1
                fault.landed_at = round(time.monotonic() - started, 1)
                echo(f"soak: fault {fault.kind}" + (f" (client {fault.client})" if fault.client is not None else "")
                     + f" in round {done + 1}, {fault.phase}")
                run = _inject(d, fault, run, out, restarts)
            if run.poll() is not None and not (out / "result.json").is_file():
                # the run's `flwr run` ended without a result (its ServerApp was killed): resumed
                time.sleep(2)
                if not (out / "result.json").is_file():
                    restarts.append("server (resume-dir)")
                    run = d.submit({"resume-dir": str(out)})
            time.sleep(0.2)
        wall = time.monotonic() - started
        d.stop(run)
    result = json.loads((out / "result.json").read_text())
    check = check_run(out, deployment_state_dirs(d.work, clients))
    gap = 100 * (baseline["test_accuracy"] - result["test_accuracy"])
    kinds, phases = {}, {}
    for f in plan:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
        phases[f.phase] = phases.get(f.phase, 0) + 1
    report = dict(seed=seed, clients=clients, rounds=rounds, faults=faults,
                  rounds_completed=len(result["rounds"]), faults_by_kind=kinds, faults_by_phase=phases,
                  fault_log=[asdict(f) for f in plan], restarts=restarts, wall_seconds=round(wall, 1),
                  baseline_wall_seconds=round(base_wall, 1), test_accuracy=result["test_accuracy"],
                  baseline_test_accuracy=baseline["test_accuracy"], accuracy_gap_points=round(gap, 2),
                  privacy_check=check,
                  passed=check["passed"] and check["finished"] and gap <= 3.0)
    write_json(soaked / "report.json", report)
    return report


def _inject(d, fault: Fault, run, out: Path, restarts: list[str]):
    """SIGKILL the fault's part; start it again after its delay; the run's `flwr run` process
    (a new one where the server had to be resumed)."""
    k = fault.client
    worker = f"clients.data_service --socket {d.work / 'client-state' / str(k)}/" if k is not None else ""
    if fault.kind == "supernode":  # the SuperNode, its ClientApp and its warm worker
        d.stop(d.supernodes[k], grace=0)
        _kill(_pids(worker))
        time.sleep(fault.delay)
        # The SuperLink takes the node's key again once it has marked the killed node offline.
        deadline = time.monotonic() + 300
        while d.online_nodes() >= d.num_clients and time.monotonic() < deadline:
            time.sleep(1)
        d.start_supernode(k)
        restarts.append(f"supernode {k}")
    elif fault.kind == "worker":  # the warm worker alone: the node's next ClientApp starts another
        _kill(_pids(worker))
        restarts.append(f"worker {k} (on demand)")
    elif fault.kind == "superlink":  # with its ServerApp; started again on its database, the run resumed
        d.stop(d.superlink, grace=0)
        d.stop(run, grace=0)
        time.sleep(fault.delay)
        d.start_superlink()
        d.wait_online(d.num_clients, timeout=300)
        restarts.append("superlink")
        restarts.append("server (resume-dir)")
        return d.submit({"resume-dir": str(out)})
    elif fault.kind == "serverapp":
        _kill(_pids("flwr-serverapp"))
        d.stop(run, grace=0)
        time.sleep(fault.delay)
        restarts.append("server (resume-dir)")
        return d.submit({"resume-dir": str(out)})
    return run
