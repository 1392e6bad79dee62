"""`python -m fedsd.benchmarks.secagg_protocol`: what one round of the secure-aggregation
protocol costs (seconds outside the clients' vectors, bytes each way), for n clients and a
vector of d values, against plain aggregation and the multi-round protocol set up once a run
(fedsd.secure.secagg_runs, the same clients' sum each round) and, with `--against PATH`, against the same
protocol in another checkout of fedsd (an earlier commit: `git worktree add /tmp/old REV`),
side by side: the two run alternately, each in its own process, `--blocks` times.

The default, 10 clients and d = 26,010, is the papers' Fashion-MNIST CNN (the deployment test's
vector; 2.09 MB to the server a round). Written to results/bench-secagg-protocol-<n>clients.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ONE_TREE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from fedsd.secure.distributed_step import plain_round, run_roster, secure_round
try:  # the multi-round protocol, where the tree has it
    from fedsd.secure.secagg_runs_server import InProcessRun
except ImportError:
    InProcessRun = None
n, d, rounds = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
xs = {k: rng.integers(0, 2 ** 40, d, dtype=np.uint64) for k in range(n)}
secure, plain, multi = [], [], []
run = InProcessRun(*run_roster(range(n)), min_cohort=n) if InProcessRun else None
for r in range(rounds):
    total, cost = secure_round(f"bench-{r}".encode(), {k: (lambda v=v: v) for k, v in xs.items()}, d, min_cohort=n)
    assert np.array_equal(total, sum(xs.values()))
    secure.append(cost)
    plain.append(plain_round({k: (lambda v=v: v) for k, v in xs.items()}, d)[1])
    if run is not None:
        total, cost = run.round(r + 1, {k: (lambda v=v: v) for k, v in xs.items()}, d)
        assert np.array_equal(total, sum(xs.values()))
        multi.append(cost)
print(json.dumps({"secure": secure, "plain": plain, "multi": multi}))
"""


def one_block(tree: str, clients: int, dim: int, rounds: int) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE_TREE, tree, str(clients), str(dim), str(rounds)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summary(blocks: list[dict]) -> dict:
    secure = [c for b in blocks for c in b["secure"]]
    plain = [c for b in blocks for c in b["plain"]]
    multi = [c["protocol_seconds"] for b in blocks for c in b.get("multi", [])]
    return dict(protocol_seconds=statistics.median(c["protocol_seconds"] for c in secure),
                plain_seconds=statistics.median(c["protocol_seconds"] for c in plain),
                bytes_to_server=secure[-1]["bytes_to_server"], bytes_from_server=secure[-1]["bytes_from_server"],
                plain_bytes_to_server=plain[-1]["bytes_to_server"], rounds=len(secure),
                # the multi-round protocol (set up once): a steady round's median, and the mean with each
                # batch's dealing (every 8 rounds) spread over its rounds
                **(dict(multi_round_seconds=statistics.median(multi), multi_round_mean_seconds=statistics.mean(multi))
                   if multi else {}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--dim", type=int, default=26_010)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--rounds", type=int, default=16, help="rounds a block (16: two batches of the multi-round "
                   "protocol's dealing)")
    p.add_argument("--against", default=None, metavar="PATH", help="another checkout of fedsd, run alternately")
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    here = str(Path(__file__).resolve().parents[2])
    trees = {"this": here, **({"against": str(Path(args.against).resolve())} if args.against else {})}
    blocks: dict[str, list] = {k: [] for k in trees}
    for block in range(args.blocks):
        for name, tree in (trees.items() if block % 2 == 0 else reversed(list(trees.items()))):
            blocks[name].append(one_block(tree, args.clients, args.dim, args.rounds))
    result = dict(question="seconds and bytes of one secure-aggregation round (the protocol alone), side by side",
                  clients=args.clients, dim=args.dim, machine=platform.processor() or platform.machine(),
                  **{name: summary(b) for name, b in blocks.items()})
    if args.against:
        result["ratio_this_to_against"] = result["this"]["protocol_seconds"] / result["against"]["protocol_seconds"]
    path = Path(args.out) / f"bench-secagg-protocol-{args.clients}clients.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
