"""A data owner's lifetime privacy ledgers, on the owner's own disk (docs/algorithms.md).

One Rényi privacy filter (fedsd.privacy.accounting.PrivacyFilter) per data set, kept as readable JSON in
the client's state folder, `ledger-<fingerprint>.json`, where the fingerprint is a hash of the
data's content (so a copied or moved data set keeps its ledger). A charge is admitted and
written under a file lock, so two runs on one machine cannot both take what is left.
`fedsd ledger --state-dir DIR` reads them back for the owner (fedsd/cli/ledger.py). A node with its
own data also keeps a record of each ledger outside the folder (fedsd.privacy.owner_record), checked
and raised in the same locked section as each charge, so that a restored copy of the folder, whose
ledger is older, is refused rather than charged on from.
"""
from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from fedsd.privacy.accounting import PrivacyFilter
from fedsd.files.atomic import _jsonable
from fedsd.files.state_folder import StateFolder, state_folder
from fedsd.errors import DataError, DataNotFoundError, StateRolledBack

PREFIX = "ledger-"


def ledger_path(root: Path, fingerprint: str) -> Path:
    return Path(root) / ledger_name(fingerprint)


def ledger_name(fingerprint: str) -> str:
    return f"{PREFIX}{fingerprint}.json"


def _folder(root: "Path | StateFolder") -> StateFolder:
    """The state folder held open (fedsd.files.state_folder): a path is opened once per process, as a
    simulated client's folder (links on its way followed); an owner's comes already opened."""
    return root if isinstance(root, StateFolder) else state_folder(root, private=False)


def adopt(root: "Path | StateFolder", old: str, new: str) -> None:
    """Move the ledger kept under fingerprint `old` to `new` (the same data under a newer
    fingerprint), unless `new` has one: an upgrade never starts a data set's budget again."""
    if not old or old == new:
        return
    folder = _folder(root)
    source, target = ledger_name(old), ledger_name(new)
    if folder.exists(source) and not folder.exists(target):
        with folder.lock(source[:-len(".json")] + ".lock"):
            if folder.exists(source) and not folder.exists(target):
                os.replace(source, target, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)


@contextmanager
def opened(root: "Path | StateFolder", fingerprint: str, max_epsilon: float, max_delta: float, records=None,
           accept: bool = False):
    """The filter for this data under the owner's current limits (a lowered limit applies at
    once; what was spent stays spent), locked against other runs on this machine; written back
    when the block ends without an exception. Every file is opened through the state folder's
    descriptor, never following a link (fedsd.files.state_folder). With the owner's `records`
    (fedsd.privacy.owner_record.Records): a ledger behind its record raises StateRolledBack before
    the block (with `accept`, it is raised to the record), and the record is raised to the ledger
    after it, before the ledger is written."""
    folder = _folder(root)
    name = ledger_name(fingerprint)
    with folder.lock(f"{PREFIX}{fingerprint}.lock"):
        state = folder.read_json(name)
        ledger = (PrivacyFilter.from_state_dict(state, max_epsilon, max_delta) if state is not None
                  else PrivacyFilter(max_epsilon, max_delta))
        with nullcontext() if records is None else records.guard(fingerprint, ledger, folder, accept):
            yield ledger
            # the ledger first, the record raised after it: a process killed between the two leaves the record
            # behind (the next charge raises it), never the folder behind its record (refused as restored)
            folder.write_atomic(name, (json.dumps(ledger.state_dict(), indent=2, default=_jsonable) + "\n").encode())


def peeked(root: "Path | StateFolder", fingerprint: str, max_epsilon: float, max_delta: float) -> PrivacyFilter:
    """The filter for this data as it stands, read without a lock and never written: for a check
    of what a charge would do (a round admitted before anyone releases), never for a charge."""
    state = _folder(root).read_json(ledger_name(fingerprint))
    return (PrivacyFilter.from_state_dict(state, max_epsilon, max_delta) if state is not None
            else PrivacyFilter(max_epsilon, max_delta))


def fingerprints(root: "Path | StateFolder") -> list[str]:
    """The data sets the state folder holds a ledger for."""
    names = os.listdir(_folder(root).fd)
    return sorted(n[len(PREFIX):-len(".json")] for n in names if n.startswith(PREFIX) and n.endswith(".json"))


def check_restored(root: "Path | StateFolder", records, max_epsilon: float, max_delta: float,
                   accept: bool = False) -> None:
    """Every ledger in the state folder, and every data set whose record names the folder,
    against the owner's `records`: StateRolledBack saying each one behind its record; with
    `accept`, each raised to its record instead (records.accepted says which)."""
    folder = _folder(root)
    refused = []
    for fingerprint in sorted({*fingerprints(folder), *records.tied(folder)}):
        try:
            with opened(folder, fingerprint, max_epsilon, max_delta, records, accept):
                pass
        except StateRolledBack as e:
            refused.append(str(e))
    if refused:
        raise StateRolledBack("\n".join(refused))


# Whether a run fits is decided by composing, never by subtracting: max ε − spent ε says nothing of
# it (a run of ε = 1 may fit where 3 − 2.5 = 0.5 is "left", as RDP composes tighter than adding ε).
ADMITS = ("a run is admitted when its planned steps, composed (RDP) with everything spent, stay within max_epsilon "
          "at max_delta: the client decides it when the run starts, before any step (under secure aggregation at "
          "stage 0, on a copy of the ledger, before anything is charged); max_epsilon - spent_epsilon is not what "
          "a run may spend")


@dataclass(frozen=True)
class LedgerReport:
    """One data set's ledger as its owner reads it."""
    fingerprint: str
    path: str
    max_epsilon: float  # inf: the owner set no limit
    max_delta: float
    spent: float  # ε at max δ of everything ever admitted (RDP, composed)
    steps: int
    experiments: list[dict]  # PrivacyFilter.by_experiment()
    charges: int = 0  # a restored entry counts the charges it stands for
    rdp: tuple = ()  # the RDP curve at RDP_ORDERS of everything admitted

    def to_dict(self) -> dict:
        unlimited = math.isinf(self.max_epsilon)
        return dict(fingerprint=self.fingerprint, path=self.path,
                    max_epsilon="inf" if unlimited else self.max_epsilon, max_delta=self.max_delta,
                    spent_epsilon=self.spent, admits=ADMITS, steps=self.steps,
                    charges=self.charges,
                    sum_of_experiments_epsilon=sum(e["epsilon"] for e in self.experiments),
                    experiments=self.experiments)


def read_all(root: Path) -> list[LedgerReport]:
    """Every ledger under `root`, at the (max ε, max δ) the owner last ran with. Raises
    FileNotFoundError for a missing folder and ValueError naming a file that is not a ledger."""
    root = Path(root)
    if not root.is_dir():
        raise DataNotFoundError(f"--state-dir: {root} is not a folder")
    reports = []
    for path in sorted(root.glob(f"{PREFIX}*.json")):
        try:
            state = json.loads(path.read_text())
            ledger = PrivacyFilter.from_state_dict(state, float(state["max_epsilon"]), float(state["max_delta"]))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: not a readable fedsd ledger ({e})") from None
        reports.append(LedgerReport(path.stem[len(PREFIX):], str(path), ledger.max_epsilon, ledger.max_delta,
                                    ledger.epsilon(), ledger.steps(), ledger.by_experiment(),
                                    ledger.charges(), tuple(float(x) for x in ledger.rdp())))
    return reports
