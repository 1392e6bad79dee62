"""`fedsd ledger --state-dir DIR`: what a client machine's lifetime ledgers hold, for its owner.

Run on the client's machine, over the SuperNode's `state-dir`. For every data set (by the
fingerprint of its content): what has been spent against the owner's (ε, δ), and the
experiments that spent it, with Flower's run ids and dates; and beside each ledger, the owner's
record of it kept outside the state folder (fedsd.privacy.owner_record; `--record-dir`), saying
when the two disagree: a ledger behind its record is a restored, older copy of the folder, which
the owner's service refuses until it is started with --accept-restored-state. `--json` prints
the same as JSON. The spent total is the RDP composition of every charge, which is at most the
sum of the experiments' own ε (RDP composes tighter than adding ε). For the same reason no "ε
left" is shown: whether a run fits is decided by composing its steps with the ledger's (the
client's own check when the run starts), and a run of ε = 1 may fit where max − spent is 0.5.
"""
from __future__ import annotations

import argparse
import json
import math

from pathlib import Path

from fedsd.privacy.lifetime_ledger import LedgerReport, read_all
from fedsd.privacy.owner_record import ACCEPT, Spent, expected, read_spent, read_state_id, read_tied


def add_ledger_parser(sub) -> None:
    p = sub.add_parser("ledger", help="what this client machine's lifetime privacy ledgers hold (run on the client)")
    p.add_argument("--state-dir", required=True,
                   help="the SuperNode's state-dir (its --node-config state-dir, else FEDSD_CLIENT_STATE_DIR, else "
                        "~/.cache/fedsd/client-state)")
    p.add_argument("--record-dir", default="",
                   help="the owner's record folder, outside state-dir (the data service's node-config record-dir, "
                        "else FEDSD_RECORD_DIR, else $XDG_STATE_HOME/fedsd, else ~/.local/state/fedsd)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_ledger)


def cmd_ledger(args: argparse.Namespace) -> int:
    from fedsd.app.client.node_config import record_root_of  # no Flower: the owner's node config's keys

    reports, records = read_all(args.state_dir), record_root_of(args.record_dir)
    sid = read_state_id(Path(args.state_dir))
    kept = {r.fingerprint: expected(read_spent(records, r.fingerprint), sid, r.charges > 0) for r in reports}
    missing = {f: read_spent(records, f)[sid] for f in read_tied(records, Path(args.state_dir)) if f not in kept}
    if args.json:
        print(json.dumps([{**r.to_dict(), **record_dict(r, kept[r.fingerprint], records)} for r in reports]
                         + [missing_dict(f, m, records) for f, m in missing.items()], indent=2, ensure_ascii=False))
        return 0
    if not reports and not missing:
        print(f"no ledgers in {args.state_dir}: this client has spent nothing on its own data")
        return 0
    print("\n\n".join([describe(r) + "\n" + describe_record(r, kept[r.fingerprint], records) for r in reports]
                      + [describe_missing(f, m, records) for f, m in missing.items()]))
    return 0


def disagreement(r: LedgerReport, record: Spent) -> str:
    """How the ledger and its record differ, in words ("" where they agree)."""
    found = Spent(r.charges, r.steps, r.rdp)
    if found.below(record):
        return (f"the ledger holds less than the owner's record ({r.charges} charges against {record.charges}): a "
                f"restored, older copy of the state folder, which the owner's service refuses ({ACCEPT} adds the "
                f"{record.charges - r.charges} missing charge(s) back, ε = "
                f"{max(0.0, record.epsilon(r.max_delta) - r.spent):.3f})")
    if record.below(found):
        return ("the ledger holds more than the owner's record (a record kept elsewhere before, or a charge stopped "
                "between the two): the record is raised at the next charge")
    return ""


def record_dict(r: LedgerReport, record: Spent | None, records: Path) -> dict:
    if record is None:
        return dict(record=None, record_agrees=False)
    return dict(record=dict(path=str(records / f"spent-{r.fingerprint}.json"), charges=record.charges,
                            steps=record.steps, epsilon=record.epsilon(r.max_delta)),
                record_agrees=not disagreement(r, record), disagreement=disagreement(r, record))


def missing_dict(fingerprint: str, record: Spent, records: Path) -> dict:
    return dict(fingerprint=fingerprint, path=None, record_agrees=False,
                record=dict(path=str(records / f"spent-{fingerprint}.json"), charges=record.charges,
                            steps=record.steps, epsilon=record.epsilon(1e-5)),
                disagreement="no ledger in this state folder, which the owner's record says charged this data")


def describe_record(r: LedgerReport, record: Spent | None, records: Path) -> str:
    if record is None:
        return (f"  owner's record  none in {records} (outside the state folder; written at the next charge, or "
                f"kept elsewhere: --record-dir)")
    why = disagreement(r, record)
    return (f"  owner's record  {record.said(r.max_delta)}  ({records / f'spent-{r.fingerprint}.json'}, outside "
            f"the state folder)\n" + (f"  DISAGREE        {why}" if why else "  agrees         with the ledger"))


def describe_missing(fingerprint: str, record: Spent, records: Path) -> str:
    return (f"data {fingerprint}  (no ledger in this state folder)\n"
            f"  owner's record  {record.said(1e-5)} at δ = 1e-05  ({records / f'spent-{fingerprint}.json'})\n"
            f"  DISAGREE        the record says this folder charged this data, and the folder holds no ledger of "
            f"it: a restored, older copy, which the owner's service refuses ({ACCEPT} adds the charges back)")


def describe(r: LedgerReport) -> str:
    limit = "no limit (max-epsilon=inf)" if math.isinf(r.max_epsilon) else f"ε ≤ {r.max_epsilon:g}"
    of = "" if math.isinf(r.max_epsilon) else f" of the owner's {r.max_epsilon:g}"
    lines = [f"data {r.fingerprint}  ({r.path})",
             f"  owner's budget  {limit}, δ ≤ {r.max_delta:g}",
             f"  spent           ε = {r.spent:.3f}{of} over {r.steps} steps (composed; the experiments' own ε sum "
             f"to {sum(e['epsilon'] for e in r.experiments):.3f})",
             "  a new run       " + ("fits: no limit" if math.isinf(r.max_epsilon) else
                                         f"fits if its steps, composed (RDP) with those spent, stay within ε ≤ "
                                         f"{r.max_epsilon:g}: the client checks it when the run starts, before any "
                                         f"step; not by subtraction (a run's ε above max − spent may fit)"),
             "  experiments:"]
    for e in r.experiments:
        runs = f", Flower run {', '.join(map(str, e['flower_runs']))}" if e["flower_runs"] else ""
        when = f"{e['first'] or '?'} … {e['last'] or '?'}"
        lines.append(f"    {e['experiment'] or '(no id)'}: ε = {e['epsilon']:.3f}, {e['steps']} steps in "
                     f"{e['charges']} charges{runs}; {when}")
    return "\n".join(lines)
