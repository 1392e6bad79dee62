"""The owner's record of what its state folder spent and joined, kept outside that folder
(docs/algorithms.md, "A data owner's lifetime budget"). A copy of the state folder restored
over it (a backup, a snapshot) holds an older ledger: charged on from, it spends the rounds
since the copy again, without limit as restores repeat; and its older list of the rounds it
joined lets it join one of them again.

The record lives in the owner's state home (node-config record-dir, else FEDSD_RECORD_DIR, else
$XDG_STATE_HOME/fedsd, else ~/.local/state/fedsd: fedsd.app.client.node_config.record_root_of),
which a copy of the state folder does not carry. It is opened as a state folder is
(fedsd.files.state_folder: walked from `/` without following a link, the owner's alone, made
0700; every file 0600, written whole and atomically), and it is only ever raised:
- `spent-<fingerprint>.json` for each data set: for each state folder that charged it (by its
  id, `state-id` in the folder, made on its first charge, join or service start, so that a copy
  carries it), how many charges its ledger holds, their steps and their RDP curve at the
  ledger's orders; raised at every charge, under the ledger's lock, after the ledger is written
  and before anything is released (`Records.guard`: a process killed between the two leaves the
  record behind, which the next charge raises; a restore in that window re-spends one charge);
- `joined-<state id>.json` for each state folder: the last round it joined for each run and
  experiment.

A folder behind its record (fewer charges or steps, less RDP at an order, a lower round joined
for a run) raises StateRolledBack, saying what was found against the record and the ε a
rollback would spend again. A folder the record does not know by its id that holds a ledger of a
data set the record knows (a copy made before it had an id) is held against the most any folder
charged that data; one that holds none is a fresh folder, of its own. Accepted (`fedsd
data-service --accept-restored-state`), the folder is raised to the record: the charges it lacks
go into its ledger as one entry of their RDP curve (PrivacyFilter.restore), so none is spent
twice, and its rounds joined become the record's. The record is never lowered. A restore of the
record along with the folder (a whole disk) is beyond this defence.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from fedsd.errors import DataError, StateRolledBack
from fedsd.files.state_folder import StateFolder, StateFolderError, read_nofollow, state_folder
from fedsd.privacy.accounting import RDP_ORDERS, PrivacyFilter, curve_to_json, rdp_epsilon

STATE_ID = "state-id"  # in the state folder: its identity, which a copy carries
ACCEPT = "fedsd data-service --accept-restored-state"
SERVER_REASON = "refused: state"  # all the server is told; the details are the owner's
FORMAT = 1
TOLERANCE = 1e-9  # relative: the same sums taken in another order


@dataclass(frozen=True)
class Spent:
    """What a ledger holds, as its record compares it: charges, steps, RDP curve at RDP_ORDERS."""
    charges: int
    steps: int
    rdp: tuple

    @classmethod
    def of(cls, ledger: PrivacyFilter) -> "Spent":
        return cls(ledger.charges(), ledger.steps(), tuple(float(x) for x in ledger.rdp()))

    def below(self, other: "Spent") -> bool:
        """Whether this holds less than `other` in anything: charges, steps, RDP at an order."""
        return (self.charges < other.charges or self.steps < other.steps
                or any(_less(mine, theirs) for mine, theirs in zip(self.rdp, other.rdp)))

    def lacking(self, other: "Spent") -> np.ndarray:
        """The RDP `other` holds beyond this, order by order (0 where it holds no more, no bound
        where it has none: alone, the charges it stands for bound nothing there)."""
        mine, theirs = np.array(self.rdp), np.array(other.rdp)
        with np.errstate(invalid="ignore"):  # inf − inf is not taken
            gap = np.where(theirs > mine, theirs - mine, 0.0)
        return np.where(np.isinf(theirs), np.inf, gap)

    def most(self, other: "Spent") -> "Spent":
        return Spent(max(self.charges, other.charges), max(self.steps, other.steps),
                     tuple(float(x) for x in np.maximum(self.rdp, other.rdp)))

    def epsilon(self, delta: float) -> float:
        return rdp_epsilon(np.array(self.rdp), delta)

    def to_json(self) -> dict:
        return dict(charges=self.charges, steps=self.steps, rdp=curve_to_json(self.rdp), updated=_now())

    @classmethod
    def from_json(cls, entry: dict) -> "Spent":
        return cls(int(entry["charges"]), int(entry["steps"]), tuple(float(x) for x in entry["rdp"]))

    def said(self, delta: float) -> str:
        return f"ε = {self.epsilon(delta):.3f} in {self.charges} charges ({self.steps} steps)"


def _less(mine: float, theirs: float) -> bool:
    if mine == math.inf:
        return False
    return theirs == math.inf or mine < theirs - TOLERANCE * max(1.0, theirs)


def state_id(state: StateFolder, make: bool = True) -> str | None:
    """The state folder's identity (`state-id` in it, made here where missing unless `make` is
    False, then None): a copy carries it, so the record knows a restored copy as the folder it
    was taken from."""
    raw = state.read_bytes(STATE_ID)
    if raw is None and not make:
        return None
    if raw is None:
        with state.lock(STATE_ID + ".lock"):
            raw = state.read_bytes(STATE_ID)
            if raw is None:
                raw = secrets.token_hex(16).encode() + b"\n"
                state.write_atomic(STATE_ID, raw)
    found = raw.decode(errors="replace").strip()
    if not re.fullmatch(r"[0-9a-f]{32}", found):
        raise DataError(f"{state.path / STATE_ID}: not a state folder's id (32 hexadecimal digits); it names the "
                        f"folder in the owner's record, so it is left as it is: restore it, or remove it knowingly")
    return found


class Records:
    """The owner's record folder, held open (a StateFolder: its files are reached through its
    descriptor, never through a link). `accepted` lists, for the owner's log, what `accept` raised."""

    def __init__(self, folder: StateFolder):
        self.folder = folder
        self.accepted: list[str] = []

    @classmethod
    def open(cls, root) -> "Records":
        """The folder at `root` (made 0700 where missing); StateFolderError, saying record-dir, where refused."""
        try:
            return cls(state_folder(root, private=True))
        except StateFolderError as e:
            raise StateFolderError(str(e).replace("state-dir=", "record-dir=", 1)) from None

    def _read(self, name: str):
        try:
            return self.folder.read_json(name)
        except ValueError:
            raise DataError(f"{self.folder.path / name}: the owner's record does not parse; it is left as it is "
                            f"(restore it from the owner's state home's backup, or remove it knowingly)") from None

    # -- what a data set spent --------------------------------------------------------------------
    def spent(self, fingerprint: str) -> dict[str, Spent]:
        """What the record holds of this data's charges, by the id of the folder that made them."""
        name = spent_name(fingerprint)
        return _spent_of(self._read(name), self.folder.path / name)

    def tied(self, state: StateFolder) -> list[str]:
        """The data sets the record knows this state folder charged (its id made here if missing)."""
        sid = state_id(state)
        prints = sorted(n[len("spent-"):-len(".json")] for n in os.listdir(self.folder.fd)
                        if n.startswith("spent-") and n.endswith(".json"))
        return [fingerprint for fingerprint in prints if sid in self.spent(fingerprint)]

    @contextmanager
    def guard(self, fingerprint: str, ledger: PrivacyFilter, state: StateFolder, accept: bool = False):
        """Held around a charge, under the ledger's lock: the ledger checked against its record
        (StateRolledBack where it is behind; with `accept`, raised to it), and once the block
        ends without an exception (the ledger written in it), the record raised to the ledger."""
        with self.folder.lock(spent_name(fingerprint)[:-len(".json")] + ".lock"):
            kept = self.spent(fingerprint)
            record = expected(kept, state_id(state, make=False), bool(ledger.entries))
            if record is not None:
                self._check(fingerprint, ledger, record, state, accept)
            yield
            self._raise(fingerprint, Spent.of(ledger), kept, state_id(state))

    def _check(self, fingerprint: str, ledger: PrivacyFilter, record: Spent, state: StateFolder, accept: bool):
        found = Spent.of(ledger)
        if not found.below(record):
            return
        said = spent_refusal(fingerprint, found, record, state, self.folder, ledger.max_delta)
        if not accept:
            raise StateRolledBack(said)
        ledger.restore(found.lacking(record), max(0, record.charges - found.charges),
                       max(0, record.steps - found.steps))
        self.accepted.append(f"accepted a restored state folder ({state.path}) for data {fingerprint}: its ledger held "
                             f"{found.said(ledger.max_delta)}, the record {record.said(ledger.max_delta)}; the "
                             f"ledger now holds {Spent.of(ledger).said(ledger.max_delta)}")

    def _raise(self, fingerprint: str, now: Spent, kept: dict[str, Spent], sid: str) -> None:
        raised = now if sid not in kept else now.most(kept[sid])
        if kept.get(sid) == raised:
            return
        folders = {**kept, sid: raised}
        self.folder.write_json(spent_name(fingerprint), dict(format=FORMAT, fingerprint=fingerprint, updated=_now(),
                                                             folders={k: v.to_json() for k, v in folders.items()}))

    # -- the rounds a state folder joined ----------------------------------------------------------
    @contextmanager
    def joined(self, state: StateFolder, found: dict, accept: bool = False):
        """Held around a join: the folder's rounds joined (`found`, run|experiment → round)
        checked against the record (StateRolledBack where one is lower; with `accept`, raised
        in `found`); on leaving without an exception, the record raised to `found` as the block
        left it (before the caller writes it to the folder)."""
        sid = state_id(state)
        name = f"joined-{sid}.json"
        with self.folder.lock(f"joined-{sid}.lock"):
            kept = self._joined(name)
            had = {run: int(found.get(run, 0)) for run in kept}
            behind = {run: (had[run], last) for run, last in kept.items() if had[run] < last}
            if behind and not accept:
                raise StateRolledBack(joined_refusal(behind, state, self.folder))
            if behind:
                found.update({run: last for run, (_, last) in behind.items()})
                runs = ", ".join(f"{run}: {was} → {last}" for run, (was, last) in behind.items())
                self.accepted.append(f"accepted a restored state folder ({state.path}): its rounds joined raised to "
                                     f"the record's ({runs})")
            yield found
            raised = {**kept, **{run: max(int(r), kept.get(run, 0)) for run, r in found.items()}}
            if raised != kept:
                self.folder.write_json(name, dict(format=FORMAT, rounds=raised, updated=_now()))

    def _joined(self, name: str) -> dict:
        kept = self._read(name) or {"format": FORMAT, "rounds": {}}
        try:
            rounds = {str(k): int(v) for k, v in kept["rounds"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            rounds = None
        if rounds is None or kept.get("format") != FORMAT:
            raise DataError(f"{self.folder.path / name}: not an owner's record this fedsd reads; it is left as it is")
        return rounds


    # -- a multi-round secure-aggregation run's counters and the wrap key of its kept secrets ------
    def wrap_key(self, state: StateFolder) -> bytes:
        """The key that seals what this state folder keeps of its multi-round runs
        (fedsd.secure.secagg_runs.RunMember.sealed): 32 bytes from the OS, made on first use, kept
        here, outside the folder, so that a copy of the folder holds no usable secret."""
        name = f"wrap-{state_id(state)}"
        with self.folder.lock(name + ".lock"):
            key = self.folder.read_bytes(name)
            if key is None:
                key = secrets.token_bytes(32)
                self.folder.write_atomic(name, key)
        if len(key) != 32:
            raise DataError(f"{self.folder.path / name}: not a 32-byte key; it is left as it is")
        return key

    @contextmanager
    def run_counters(self, state: StateFolder, run: str, found: dict):
        """Held around a multi-round run's message: the counters of `run` (run|experiment) the
        folder holds (`found`: submitted, answered, dealt, seen, and viewed as [round, digest hex])
        raised to the record's, yielded to be raised further; on leaving without an exception, the
        record raised to them, before the caller writes them to the folder and replies. Never
        lowered; a folder behind its record simply takes the record's (its secrets for those
        rounds are then never used or revealed), so no refusal is needed."""
        name = f"runs-{state_id(state)}.json"
        with self.folder.lock(f"runs-{state_id(state)}.lock"):
            kept = (self._read(name) or {}).get("runs", {})
            counters = highest(found, kept.get(run, {}))
            yield counters
            raised = highest(counters, kept.get(run, {}))
            if raised != highest(kept.get(run, {})):  # nothing written for a run that raised nothing
                self.folder.write_json(name, dict(format=FORMAT, runs={**kept, run: raised}, updated=_now()))


COUNTERS = ("submitted", "answered", "dealt", "seen")


def highest(*found: dict) -> dict:
    """The highest of each counter (a missing one: 0), and the view of the latest round."""
    raised = {k: max(int(f.get(k, 0)) for f in found) for k in COUNTERS}
    views = [list(f["viewed"]) for f in found if isinstance(f.get("viewed"), (list, tuple)) and len(f["viewed"]) == 2]
    raised["viewed"] = max(views, key=lambda v: int(v[0]), default=[0, ""])
    return raised


def spent_name(fingerprint: str) -> str:
    return f"spent-{fingerprint}.json"


def expected(kept: dict[str, Spent], sid: str | None, holds_a_ledger: bool) -> Spent | None:
    """What a folder's ledger must hold at least: what the record holds for the folder (by its
    id); for a folder it does not know that holds a ledger already (a copy made before the folder
    had an id), the most any folder charged; nothing for a fresh folder."""
    if sid in kept:
        return kept[sid]
    if not holds_a_ledger or not kept:
        return None
    most = next(iter(kept.values()))
    for spent in kept.values():
        most = most.most(spent)
    return most


def _spent_of(kept, where) -> dict[str, Spent]:
    if kept is None:
        return {}
    try:
        folders = {str(sid): Spent.from_json(entry) for sid, entry in kept["folders"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        folders = None
    if folders is None or kept.get("format") != FORMAT or any(len(f.rdp) != len(RDP_ORDERS) for f in folders.values()):
        raise DataError(f"{where}: not an owner's record this fedsd reads; it is left as it is")
    return folders


def read_spent(root: Path, fingerprint: str) -> dict[str, Spent]:
    """The record of this data's charges in the record folder `root`, by folder id, read only
    (`fedsd ledger`): nothing is made, and a link is not followed."""
    path = Path(root) / spent_name(fingerprint)
    raw = read_nofollow(path)
    try:
        return _spent_of(None if raw is None else json.loads(raw), path)
    except ValueError as e:
        raise DataError(f"{path}: not an owner's record this fedsd reads ({e})") from None


def read_state_id(state_dir: Path) -> str | None:
    """The state folder's id, read only (None where it has none)."""
    raw = read_nofollow(Path(state_dir) / STATE_ID)
    return None if raw is None else raw.decode(errors="replace").strip()


def read_tied(root: Path, state_dir: Path) -> list[str]:
    """The data sets whose record in `root` knows the state folder at `state_dir` (by its id),
    read only; none where either has none."""
    sid, root = read_state_id(state_dir), Path(root)
    if sid is None or not root.is_dir():
        return []
    prints = sorted(p.name[len("spent-"):-len(".json")] for p in root.glob("spent-*.json"))
    return [fingerprint for fingerprint in prints if sid in read_spent(root, fingerprint)]


def spent_refusal(fingerprint: str, found: Spent, record: Spent, state: StateFolder, records: StateFolder,
                  delta: float) -> str:
    """What the owner is told of a ledger behind its record (never the server)."""
    more = max(0.0, record.epsilon(delta) - found.epsilon(delta))
    return (f"state-dir={state.path} is older than the owner's record (a restored copy?): for data {fingerprint} "
            f"its ledger holds {found.said(delta)}, the owner's record ({records.path}) {record.said(delta)}. "
            f"Charged on from this folder, the {max(0, record.charges - found.charges)} charge(s) made since its "
            f"copy would be spent again: ε = {more:.3f} (at δ = {delta:g}) its ledger would not count. Refused; "
            f"to accept the restore knowingly, start the service with {ACCEPT}, which adds those charges back into "
            f"the ledger (nothing is spent twice)")


def joined_refusal(behind: dict, state: StateFolder, records: StateFolder) -> str:
    runs = ", ".join(f"{run}: round {had} in the folder, {last} in the record" for run, (had, last) in behind.items())
    return (f"state-dir={state.path} is older than the owner's record (a restored copy?): the last rounds it "
            f"joined ({runs}; the owner's record in {records.path}) are below the record's, so it could join a round "
            f"again and release it twice. Refused; to accept the restore knowingly, start the service with {ACCEPT}, "
            f"which raises them to the record's")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
