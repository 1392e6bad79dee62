"""`fedsd check-privacy`: the independent check of a deployed run's privacy promise
(fedsd.privacy.independent_check) on a run's folder and its clients' state folders: a deploy-local
--work folder's, or each owner's state-dir given with --state K=DIR (owners run by hand)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedsd.errors import ConfigError, DataError
from fedsd.privacy.independent_check import STATE_FOLDERS, check_run, clients_state_dirs


def add_check_parser(sub) -> None:
    p = sub.add_parser("check-privacy", help="check a deployed run against its clients' ledgers, independently "
                                             "of fedsd's own bookkeeping (Opacus' RDP accountant)")
    p.add_argument("--run", required=True, help="the run's result folder (result.json)")
    p.add_argument("--work", default=None,
                   help="a fedsd deploy-local --work folder: client K's state folder is WORK/client-state/K "
                        "(WORK/nodes/K/state under --isolate)")
    p.add_argument("--state", action="append", default=[], metavar="K=DIR",
                   help="client K's state folder (K: its partition-id; DIR: its owner's node-config state-dir, "
                        "holding its ledger-*.json), for owners run by hand; once per client, beside or instead "
                        "of --work")
    p.set_defaults(func=cmd_check_privacy)


def given_state_dirs(pairs: list[str]) -> dict[int, Path]:
    """--state K=DIR, each K once."""
    out = {}
    for pair in pairs:
        k, sep, folder = pair.partition("=")
        if not sep or not k.strip().isdigit() or not folder:
            raise ConfigError(f"--state {pair!r}: K=DIR, K a client's partition-id and DIR its state folder "
                              f"(--state 0=/srv/owner-0/state)")
        if int(k) in out:
            raise ConfigError(f"--state {pair!r}: client {int(k)} given twice")
        out[int(k)] = Path(folder)
    return out


def cmd_check_privacy(args: argparse.Namespace) -> int:
    result_path = Path(args.run) / "result.json"
    if not result_path.is_file():
        raise DataError(f"--run {args.run}: no result.json; the check fails")
    if args.work is None and not args.state:
        raise ConfigError(f"the clients' state folders: none given. {STATE_FOLDERS}")
    num_clients = int(json.loads(result_path.read_text()).get("num_clients") or 0)
    report = check_run(Path(args.run), clients_state_dirs(args.work, given_state_dirs(args.state), num_clients))
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1
