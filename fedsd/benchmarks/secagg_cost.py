"""`python -m fedsd.benchmarks.secagg_cost`: what secure aggregation costs a simulated
round, against plain aggregation, side by side in one run.

The federation of the distributed-noise table (Fashion-MNIST, ScatterNet features, the linear
network, 10 clients, IID, B = 8192, distributed noise) runs the same rounds twice from the same
model, alternating blocks of rounds: with SecAgg+ (every client's stages and the server's, in
this process) and with the server summing the clients' vectors as it receives them. Each
round's training is the same; what differs is the protocol. Written to
results/bench-secagg-<clients>clients.json: rounds per second of each, their ratio, the bytes
each client sends and receives a round, and the protocol's seconds a round.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig
from fedsd.simulation.secure_federation import FEATURES_RECIPE as RECIPE
from fedsd.simulation.secure_federation import FEATURES_ROUNDS as ROUNDS
from fedsd.simulation.secure_federation import SecureFederation


def measure(clients: int, blocks: int, rounds: int) -> dict:
    cfg = TrainConfig(**RECIPE, seed=0).resolved()
    fed = FedConfig(num_clients=clients, rounds=ROUNDS, secure_aggregation=True, noise="distributed")
    torch.set_num_threads(1)
    runs = {"secure": SecureFederation(cfg, fed, None), "plain": SecureFederation(cfg, fed, None, plain=True)}
    seconds = {k: [] for k in runs}
    protocol = {k: [] for k in runs}
    for block in range(blocks):
        for name, run in (runs.items() if block % 2 == 0 else reversed(list(runs.items()))):
            for r in range(block * rounds + 1, (block + 1) * rounds + 1):
                started = time.perf_counter()
                record = run.take_round(r)
                seconds[name].append(time.perf_counter() - started)
                protocol[name].append(record["protocol_seconds"])
                last = record
            if name == "secure":
                cost = dict(bytes_to_server=last["bytes_to_server"], bytes_from_server=last["bytes_from_server"])
    rate = {k: 1 / statistics.median(v) for k, v in seconds.items()}
    return dict(question="rounds per second of a simulated distributed-noise federation, with secure aggregation "
                         "and with plain aggregation, side by side",
                clients=clients, dim=runs["secure"].noise.dim, rounds_each=len(seconds["secure"]),
                rounds_per_second=rate, ratio_secure_to_plain=rate["secure"] / rate["plain"],
                protocol_seconds_per_round={k: statistics.median(v) for k, v in protocol.items()},
                bytes_per_client_per_round=dict(to_server=cost["bytes_to_server"] / clients,
                                                from_server=cost["bytes_from_server"] / clients),
                machine=platform.processor() or platform.machine(), threads=1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    result = measure(args.clients, args.blocks, args.rounds)
    path = Path(args.out) / f"bench-secagg-{args.clients}clients.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
