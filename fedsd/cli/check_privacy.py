"""`fedsd check-privacy`: the independent check of a deployed run's privacy promise
(fedsd.privacy.independent_check) on a run's folder and its deployment's state folders."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedsd.errors import DataError
from fedsd.privacy.independent_check import check_run, deployment_state_dirs


def add_check_parser(sub) -> None:
    p = sub.add_parser("check-privacy", help="check a deployed run against its clients' ledgers, independently "
                                             "of fedsd's own bookkeeping (Opacus' RDP accountant)")
    p.add_argument("--run", required=True, help="the run's result folder (result.json)")
    p.add_argument("--work", required=True, help="the deployment's --work folder (each client's state folder)")
    p.set_defaults(func=cmd_check_privacy)


def cmd_check_privacy(args: argparse.Namespace) -> int:
    result_path = Path(args.run) / "result.json"
    if not result_path.is_file():
        raise DataError(f"--run {args.run}: no result.json; the check fails")
    num_clients = int(json.loads(result_path.read_text()).get("num_clients") or 0)
    report = check_run(Path(args.run), deployment_state_dirs(Path(args.work), num_clients))
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1

