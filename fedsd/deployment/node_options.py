"""How a local deployment (fedsd/deployment/local_deployment.py) starts its SuperNodes: the options
deploy-local, deployed_distributed and `fedsd bench deploy` share, and LocalDeployment's keywords
for them."""
from __future__ import annotations

import argparse


# A warm SuperNode's pull loop sleeps at most this long after a pull that found no message (Flower's
# SuperNode: a fixed 3 s, so each stage of a round waited up to 3 s for its slowest node); 0.5 s,
# as the SuperExec's and the ServerApp grid's polls (fedsd/app/server/grid.py).
PULL_SECONDS = 0.5
# By default the nodes' pulls add up to at most this many a second, each node's interval longer with
# more nodes (20 nodes: 0.5 s; 100: 2.5 s): a hundred nodes at 0.5 s each, 200 TLS requests a second
# with their heartbeats on a two-core SuperLink, cut heartbeats off and broke the ServerApp's first push
# (results/runs/secure-aggregation-scale/2026-12-07-deployed-100/).
PULLS_PER_SECOND = 40


def spread_pulls(nodes: int) -> float:
    """The default --pull-interval for `nodes` SuperNodes on one SuperLink (3 s at most: Flower's own)."""
    from fedsd.deployment.warm_supernode import PULL_INTERVALS

    return min(PULL_INTERVALS[1], max(PULL_SECONDS, nodes / PULLS_PER_SECOND))


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """How a deployment starts its SuperNodes (deploy-local's and deployed_distributed's options)."""
    from fedsd.deployment.warm_supernode import seconds

    p.add_argument("--clientapps", choices=["warm", "cold"], default="warm",
                   help="warm (default): each SuperNode's ClientApp tasks forked from a process that imported Flower "
                        "once (fedsd/deployment/warm_supernode.py); cold: Flower's own start, a new interpreter a "
                        "message, and Flower's own SuperNode command")
    p.add_argument("--pull-interval", type=seconds, default=None, metavar="S",
                   help=f"with warm ClientApps: the longest a SuperNode waits before it asks the SuperLink again "
                        f"after finding no message (default {PULL_SECONDS:g}, or longer with more than "
                        f"{PULL_SECONDS * PULLS_PER_SECOND:g} nodes, so that all pull {PULLS_PER_SECOND} times a "
                        f"second at most; 3 is Flower's own)")
    p.add_argument("--superlink-state", choices=["memory", "file"], default="memory",
                   help="memory (default): Flower's in-memory SuperLink state (the SuperLink starts once a "
                        "command); file: its SQLite database in the work folder")
    p.add_argument("--share-pages", action="store_true",
                   help="a trial of many clients in one machine's memory (about a hundred in 24 GiB): the kernel "
                        "merges the processes' identical pages, which start without address randomisation; weaker "
                        "isolation, never for a real deployment (fedsd/deployment/shared_pages.py; needs root)")


def node_start(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """LocalDeployment's keywords for add_node_arguments' options."""
    if args.clientapps == "cold" and args.pull_interval is not None:
        p.error("--pull-interval: only with --clientapps warm (cold is Flower's own SuperNode, which waits 3 s)")
    return dict(warm_clientapps=args.clientapps == "warm", durable_superlink=args.superlink_state == "file",
                pull_interval="spread" if args.pull_interval is None else args.pull_interval,
                share_pages=args.share_pages)
