"""A data owner's lifetime privacy ledgers, on the owner's own disk (docs/algorithms.md).

One Rényi privacy filter (fedsd.privacy.accounting.PrivacyFilter) per data set, kept as readable JSON in
the client's state folder, `ledger-<fingerprint>.json`, where the fingerprint is a hash of the
data's content (so a copied or moved data set keeps its ledger). A charge is admitted and
written under a file lock, so two runs on one machine cannot both take what is left.
`fedsd ledger --state-dir DIR` reads them back for the owner (fedsd/cli/ledger.py).
"""
from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedsd.privacy.accounting import PrivacyFilter
from fedsd.files.atomic import _jsonable
from fedsd.files.state_folder import StateFolder, state_folder
from fedsd.errors import DataError, DataNotFoundError

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
def opened(root: "Path | StateFolder", fingerprint: str, max_epsilon: float, max_delta: float):
    """The filter for this data under the owner's current limits (a lowered limit applies at
    once; what was spent stays spent), locked against other runs on this machine; written back
    when the block ends without an exception. Every file is opened through the state folder's
    descriptor, never following a link (fedsd.files.state_folder)."""
    folder = _folder(root)
    name = ledger_name(fingerprint)
    with folder.lock(f"{PREFIX}{fingerprint}.lock"):
        state = folder.read_json(name)
        ledger = (PrivacyFilter.from_state_dict(state, max_epsilon, max_delta) if state is not None
                  else PrivacyFilter(max_epsilon, max_delta))
        yield ledger
        folder.write_atomic(name, (json.dumps(ledger.state_dict(), indent=2, default=_jsonable) + "\n").encode())


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
