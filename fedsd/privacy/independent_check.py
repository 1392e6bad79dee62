"""An independent check of a deployed run's privacy promise (`fedsd check-privacy`):
no update leaves a client without its cost on that client's disk, and no client spends more
than its owner allows.

It trusts none of fedsd's bookkeeping: it reads the server's result.json (which rounds
aggregated which client's update) and each client's ledger as plain JSON (every charge: σ, q,
steps, the experiment and the round), and recomputes ε with Opacus' RDPAccountant itself, at
orders of its own. For each client it checks that
- every update the server aggregated from it has a charge for that round in its ledger;
- ε of the charges of the updates it released, recomputed, is at most ε of everything its
  ledger holds, which is at most its owner's max-epsilon;
- the ε the client reported to the server is at most what its ledger holds;
and that the run finished every round. A distributed-noise run's record names each client by
its protocol id (its identity key's), which the check derives from the identity key in the
client's state folder; its ledgers' Skellam charges are recomputed at integer orders only. \
It also lists the rounds a client was charged for more
than once (`charged_again`): the safe side, since a client stopped between its charge and its
reply trains the round again and pays again, but a client that had already answered the round
should have sent its kept reply instead (fedsd bench soak fails a run where no fault explains it). \
A ledger it cannot read fails the check, naming the file;
it never passes by default.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from fedsd.errors import DataError

# Its own orders (not fedsd.privacy.accounting's): Opacus' default set, extended where a long run's or a
# small ε's best order lies.
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 96, 128, 256, 512, 1024]
TOLERANCE = 1e-6  # relative: the same arithmetic in another order
# A Skellam charge's orders: the integers 2..256, where the ledger proves its bound (fedsd.secure.distributed_noise)
INTEGER_ORDERS = [a for a in ORDERS if float(a).is_integer() and 2 <= a <= 256]
SKELLAM = "skellam"  # a ledger entry's mechanism under distributed noise (as the ledger writes it)
RESTORED = "restored"  # an entry of charges added back from the owner's record (fedsd.privacy.owner_record)
IDENTITY = "identity.key"  # an owner's Ed25519 private key, 32 raw bytes, in its state folder


def rdp_epsilon(entries: list[dict], delta: float) -> float:
    """ε at `delta` of these charges composed, by Opacus' RDPAccountant. A Skellam charge (a
    distributed-noise round: its Gaussian equivalent z_e bounds the Skellam's RDP at integer
    orders only) restricts every charge to the integer orders, where all of them hold."""
    from opacus.accountants import RDPAccountant

    if not entries:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = [(float(e["noise_multiplier"]), float(e["sample_rate"]), int(e["steps"])) for e in entries]
    skellam = any(e.get("mechanism") == SKELLAM for e in entries)
    return float(accountant.get_epsilon(delta=delta, alphas=INTEGER_ORDERS if skellam else ORDERS))


def read_ledger(path: Path) -> dict:
    """A ledger as plain JSON: its limits and its charges; DataError naming the file otherwise."""
    try:
        state = json.loads(path.read_text())
        if any(e.get("mechanism") == RESTORED for e in state["entries"]):
            raise DataError(f"{path}: holds charges its owner's record added back after a restored state folder was "
                            f"accepted (fedsd data-service --accept-restored-state), as one RDP curve, not charges "
                            f"this check can recompute; the check fails")
        limits = float(state["max_epsilon"]), float(state["max_delta"])
        entries = [dict(e, noise_multiplier=float(e["noise_multiplier"]), sample_rate=float(e["sample_rate"]),
                        steps=int(e["steps"])) for e in state["entries"]]
    except DataError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a readable ledger ({type(e).__name__}: {e}); the check fails") from None
    return dict(max_epsilon=limits[0], max_delta=limits[1], entries=entries)


def client_ledger(state_dir: Path) -> Path:
    """The one ledger in a client's state folder; DataError when there is none or several."""
    found = sorted(Path(state_dir).glob("ledger-*.json"))
    if len(found) != 1:
        raise DataError(f"{state_dir}: {'no ledger' if not found else f'{len(found)} ledgers'} (ledger-*.json) "
                        f"where the client's one data set's ledger should be; the check fails")
    return found[0]


def protocol_name(state_dir: Path) -> int:
    """The id a distributed-noise run's record names this owner by: its identity key's
    (fedsd.secure.identity.protocol_id, a hash of the public key); DataError without one."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from fedsd.secure.identity import protocol_id

    path = Path(state_dir) / IDENTITY
    try:
        public = Ed25519PrivateKey.from_private_bytes(path.read_bytes()).public_key()
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not the owner's identity key ({type(e).__name__}); a distributed-noise run names "
                        f"its clients by it; the check fails") from None
    return protocol_id(public.public_bytes(Encoding.Raw, PublicFormat.Raw))


def check_client(client: int, ledger_path: Path, rounds: list[dict], experiment: str, run_delta: float,
                 name: int | None = None, ledger: dict | None = None) -> dict:
    """One client's facts and the problems found, from its ledger and the server's rounds (the
    ε it reported, at the run's δ, against its ledger's at that δ). `name`: how the rounds name
    it (a distributed-noise run: its protocol id); its partition id otherwise. `ledger`: the file
    as read_ledger read it, when the caller has it already."""
    name = client if name is None else name
    ledger = read_ledger(ledger_path) if ledger is None else ledger
    delta = ledger["max_delta"]
    run_charges = [e for e in ledger["entries"] if e.get("run") == experiment and "round" in e]
    charged = {int(e["round"]): e for e in run_charges}
    times = Counter(int(e["round"]) for e in run_charges)
    released = [r["round"] for r in rounds if name in r.get("trained", [])]
    problems = [f"client {client}, round {r}: the server aggregated an update that is not charged in {ledger_path}"
                for r in released if r not in charged]
    eps_released = rdp_epsilon([charged[r] for r in released if r in charged], delta)
    eps_ledger = rdp_epsilon(ledger["entries"], delta)
    reported = max((float(r["client_epsilon"][str(name)]) for r in rounds if str(name) in r.get("client_epsilon", {})),
                   default=0.0)
    if eps_released > eps_ledger * (1 + TOLERANCE):
        problems.append(f"client {client}: ε of its released updates {eps_released:.4f} exceeds its ledger's "
                        f"{eps_ledger:.4f}")
    if eps_ledger > ledger["max_epsilon"] * (1 + TOLERANCE):
        problems.append(f"client {client}: its ledger holds ε = {eps_ledger:.4f}, above its owner's max-epsilon "
                        f"{ledger['max_epsilon']:g}")
    at_run_delta = rdp_epsilon(ledger["entries"], run_delta)
    if reported > at_run_delta * (1 + 1e-3) + 1e-9:
        problems.append(f"client {client}: reported ε = {reported:.4f} to the server, more than its ledger holds "
                        f"at the run's δ ({at_run_delta:.4f}): a charge is missing from its disk")
    return dict(ledger=str(ledger_path), named=name, released_rounds=released, charged_rounds=sorted(charged),
                charged_again={str(r): n for r, n in sorted(times.items()) if n > 1},
                epsilon_released=eps_released, epsilon_ledger=eps_ledger, epsilon_reported=reported,
                max_epsilon="inf" if math.isinf(ledger["max_epsilon"]) else ledger["max_epsilon"],
                problems=problems)


def check_run(run_dir: Path, state_dirs: dict[int, Path]) -> dict:
    """The whole check: {passed, finished, clients: {k: facts}, problems}. Raises DataError
    (the check fails loudly) when a ledger or the result cannot be read."""
    path = Path(run_dir) / "result.json"
    try:
        result = json.loads(path.read_text())
        rounds, experiment = result["rounds"], result["experiment_id"]
        planned = int(result["federation"]["rounds"])
        distributed = result["federation"].get("noise") == "distributed"
        unit = result["federation"].get("privacy_unit", "record")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a finished run's result ({type(e).__name__}: {e}); the check fails") from None
    problems = []
    finished = [r["round"] for r in rounds] == list(range(1, planned + 1))
    if not finished:
        problems.append(f"the run did not finish its {planned} rounds: {[r['round'] for r in rounds]}")
    clients = {}
    ledgers = {k: client_ledger(state_dirs[k]) for k in range(int(result["num_clients"])) if k in state_dirs}
    read = {k: read_ledger(path) for k, path in ledgers.items()}  # each file read once
    # named by protocol id when the server's record says so, or when any ledger holds a Skellam charge of this run
    distributed = distributed or any(e.get("mechanism") == SKELLAM and e.get("run") == experiment
                                     for ledger in read.values() for e in ledger["entries"])
    names = {k: protocol_name(state_dirs[k]) if distributed else k for k in ledgers}
    problems += unmatched_names(rounds, names)
    for k in range(int(result["num_clients"])):
        if k not in state_dirs:
            raise DataError(f"client {k}: no state folder given; the check fails. {STATE_FOLDERS}")
        clients[k] = check_client(k, ledgers[k], rounds, experiment, float(result["delta"]), names[k], read[k])
        if distributed:
            clients[k]["problems"] += charges_below_plan(k, state_dirs[k], experiment, read[k]["entries"], unit)
        problems += clients[k]["problems"]
    return dict(passed=not problems, finished=finished, experiment_id=experiment, clients=clients, problems=problems)


def unmatched_names(rounds: list[dict], names: dict[int, int]) -> list[str]:
    """Every client the record names must be exactly one of the given owners (a name matching
    none would leave its rounds unchecked: a stale or replaced identity key, a wrong folder)."""
    problems = []
    if len(set(names.values())) < len(names):
        problems.append("two owners' state folders hold the same identity: their ledgers cannot be told apart")
    known = {str(n) for n in names.values()}
    for r in rounds:
        for name in [*r.get("trained", []), *r.get("client_epsilon", {})]:
            if str(name) not in known:
                problems.append(f"round {r.get('round')}: the record names client {name}, none of the given "
                                f"owners (its ledger is not checked)")
    return sorted(set(problems))


def charges_below_plan(client: int, state_dir: Path, experiment: str, entries: list[dict],
                       unit: str = "record") -> list[str]:
    """Under distributed noise, each of this run's charges against the plan the owner pinned
    when it admitted the run (<experiment>/client-<k>-plan.json): a charge at less than the
    plan's Gaussian equivalent z_e (z_e / 2 at client level: one record moves the update by 2S),
    or at a smaller q, under-counts what the round cost."""
    from fedsd.secure import distributed_noise

    charges = [e for e in entries if e.get("run") == experiment]
    if not charges:  # an owner that took part in no round admitted no plan
        return []
    path = Path(state_dir) / experiment / f"client-{client}-plan.json"
    try:
        pinned = json.loads(path.read_text())
        plan, _ = distributed_noise.from_settings(dict(pinned))
    except (OSError, ValueError) as e:
        return [f"client {client}: {path}: not the plan it admitted ({type(e).__name__}); its charges cannot be "
                f"checked against it"]
    if pinned.get("privacy-unit", "record") != unit:
        return [f"client {client}: {path} admitted privacy-unit {pinned.get('privacy-unit', 'record')!r}, the run "
                f"was {unit!r}"]
    least = plan.gaussian_equivalent() / (2 if unit == "client" else 1)
    return [f"client {client}, round {e.get('round')}: charged at z = {e['noise_multiplier']:.4g}, q = "
            f"{e['sample_rate']:.4g}, {e['steps']} step(s); its admitted plan costs one step a round at z = "
            f"{least:.4g}, q = {plan.sample_rate:.4g}" for e in charges
            if e["noise_multiplier"] > least * (1 + 1e-9) or e["sample_rate"] < plan.sample_rate * (1 - 1e-9)
            or e["steps"] != 1]


# What the check reads of each client, and how it is told where: said whenever a client's is missing.
STATE_FOLDERS = ("Each client's state folder is its owner's state-dir (the data service's node config), holding its "
                 "ledger-*.json and, under distributed noise, identity.key and <experiment>/client-K-plan.json; give "
                 "one per client, K its partition-id: --state 0=/srv/owner-0/state --state 1=... (owners run by "
                 "hand), or --work DIR, a fedsd deploy-local --work folder, where client K's is DIR/client-state/K "
                 "(DIR/nodes/K/state under --isolate)")


def deployment_candidates(work: Path, k: int) -> tuple[Path, Path]:
    """Where client k's state folder is in a deploy-local --work folder (with --isolate: its owner's)."""
    return Path(work) / "client-state" / str(k), Path(work) / "nodes" / str(k) / "state"


def clients_state_dirs(work: Path | None, given: dict[int, Path], num_clients: int) -> dict[int, Path]:
    """Every client's state folder: those `given` (client → folder), the others found in a
    deploy-local --work folder. DataError naming the first client without one, where it was
    looked for, and how to give it (STATE_FOLDERS)."""
    state_dirs = deployment_state_dirs(Path(work), num_clients) if work else {}
    state_dirs.update(given)
    missing = [k for k in range(num_clients) if k not in state_dirs]
    if missing:
        looked = (f" --work {work} has neither "
                  + " nor ".join(map(str, deployment_candidates(work, missing[0]))) + ";" if work else "")
        raise DataError(f"client {missing[0]} (of the run's {num_clients}): no state folder;{looked} the check fails. "
                        f"{STATE_FOLDERS}")
    return state_dirs


def deployment_state_dirs(work: Path, num_clients: int) -> dict[int, Path]:
    """Each client's state folder found in a deploy-local --work folder (`deployment_candidates`)."""
    found = {}
    for k in range(num_clients):
        for candidate in deployment_candidates(work, k):
            if candidate.is_dir():
                found[k] = candidate
                break
    return found


