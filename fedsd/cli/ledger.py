"""`fedsd ledger --state-dir DIR`: what a client machine's lifetime ledgers hold, for its owner.

Run on the client's machine, over the SuperNode's `state-dir`. For every data set (by the
fingerprint of its content): what has been spent, what is left at the owner's (ε, δ), and the
experiments that spent it, with Flower's run ids and dates. `--json` prints the same as JSON.
The spent total is the RDP composition of every charge, which is at most the sum of the
experiments' own ε (RDP composes tighter than adding ε).
"""
from __future__ import annotations

import argparse
import json
import math

from fedsd.privacy.lifetime_ledger import LedgerReport, read_all


def add_ledger_parser(sub) -> None:
    p = sub.add_parser("ledger", help="what this client machine's lifetime privacy ledgers hold (run on the client)")
    p.add_argument("--state-dir", required=True,
                   help="the SuperNode's state-dir (its --node-config state-dir, else FEDSD_CLIENT_STATE_DIR, else "
                        "~/.cache/fedsd/client-state)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_ledger)


def cmd_ledger(args: argparse.Namespace) -> int:
    reports = read_all(args.state_dir)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2, ensure_ascii=False))
        return 0
    if not reports:
        print(f"no ledgers in {args.state_dir}: this client has spent nothing on its own data")
        return 0
    print("\n\n".join(describe(r) for r in reports))
    return 0


def describe(r: LedgerReport) -> str:
    limit = "no limit (max-epsilon=inf)" if math.isinf(r.max_epsilon) else f"ε ≤ {r.max_epsilon:g}"
    left = "unlimited" if math.isinf(r.max_epsilon) else f"ε = {r.left:.3f}"
    lines = [f"data {r.fingerprint}  ({r.path})",
             f"  owner's budget  {limit}, δ ≤ {r.max_delta:g}",
             f"  spent           ε = {r.spent:.3f} over {r.steps} steps (composed; the experiments' own ε sum to "
             f"{sum(e['epsilon'] for e in r.experiments):.3f})",
             f"  left            {left}",
             "  experiments:"]
    for e in r.experiments:
        runs = f", Flower run {', '.join(map(str, e['flower_runs']))}" if e["flower_runs"] else ""
        when = f"{e['first'] or '?'} … {e['last'] or '?'}"
        lines.append(f"    {e['experiment'] or '(no id)'}: ε = {e['epsilon']:.3f}, {e['steps']} steps in "
                     f"{e['charges']} charges{runs}; {when}")
    return "\n".join(lines)
