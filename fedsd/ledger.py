"""A data owner's lifetime privacy ledgers, on the owner's own disk (docs/algorithms.md).

One Rényi privacy filter (fedsd.privacy.PrivacyFilter) per data set, kept as readable JSON in
the client's state folder, `ledger-<fingerprint>.json`, where the fingerprint is a hash of the
data's content (so a copied or moved data set keeps its ledger). A charge is admitted and
written under a file lock, so two runs on one machine cannot both take what is left.
`fedsd ledger --state-dir DIR` reads them back for the owner (simulations/commands/ledger_command.py).
"""
from __future__ import annotations

import fcntl
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .privacy import PrivacyFilter
from .atomic import write_json
from .errors import DataError, DataNotFoundError

PREFIX = "ledger-"


def ledger_path(root: Path, fingerprint: str) -> Path:
    return Path(root) / f"{PREFIX}{fingerprint}.json"


def adopt(root: Path, old: str, new: str) -> None:
    """Move the ledger kept under fingerprint `old` to `new` (the same data under a newer
    fingerprint), unless `new` has one: an upgrade never starts a data set's budget again."""
    source, target = ledger_path(root, old), ledger_path(root, new)
    if old and old != new and source.is_file() and not target.exists():
        with open(source.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if source.is_file() and not target.exists():
                os.replace(source, target)


@contextmanager
def opened(root: Path, fingerprint: str, max_epsilon: float, max_delta: float):
    """The filter for this data under the owner's current limits (a lowered limit applies at
    once; what was spent stays spent), locked against other runs on this machine; written back
    when the block ends without an exception."""
    path = ledger_path(root, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ledger = (PrivacyFilter.from_state_dict(json.loads(path.read_text()), max_epsilon, max_delta)
                  if path.is_file() else PrivacyFilter(max_epsilon, max_delta))
        yield ledger
        write_json(path, ledger.state_dict())


@dataclass(frozen=True)
class LedgerReport:
    """One data set's ledger as its owner reads it."""
    fingerprint: str
    path: str
    max_epsilon: float  # inf: the owner set no limit
    max_delta: float
    spent: float  # ε at max δ of everything ever admitted (RDP, composed)
    left: float
    steps: int
    experiments: list[dict]  # PrivacyFilter.by_experiment()

    def to_dict(self) -> dict:
        unlimited = math.isinf(self.max_epsilon)
        return dict(fingerprint=self.fingerprint, path=self.path,
                    max_epsilon="inf" if unlimited else self.max_epsilon, max_delta=self.max_delta,
                    spent_epsilon=self.spent, left_epsilon="inf" if unlimited else self.left, steps=self.steps,
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
                                    ledger.epsilon(), ledger.left(), sum(e["steps"] for e in ledger.entries),
                                    ledger.by_experiment()))
    return reports
