"""`fedsd bench`: side-by-side timings (filled in by the speed work)."""
from __future__ import annotations


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: federated overhead, DP step cost")
    p.add_argument("what", choices=["federated"])
    p.set_defaults(func=lambda args: 0)
