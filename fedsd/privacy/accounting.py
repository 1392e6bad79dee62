"""Privacy planning and accounting with Opacus' accountants (docs/algorithms.md, "Accounting").

σ is calibrated once, for every step the protected data set will ever see; one accountant's
history is kept for the whole run (central, or a client across all its rounds) and the spent ε
is always read from it.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fedsd.clipping import _opacus  # noqa: F401  (first: Opacus without its root-logger handler)
from fedsd.files.atomic import write_json  # atomic: a concurrent reader sees the old file or the new one
from fedsd.files.cache import cache_root
import opacus
from opacus.accountants import create_accountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from opacus.accountants.utils import MAX_SIGMA, get_noise_multiplier

from fedsd.errors import BudgetError, BudgetRefused, FedsdNote, LedgerSpent

EPSILON_TOLERANCE = 0.01
# Rényi orders of every RDP computation here. Opacus' default set stops at 63, and a run whose
# per-step privacy loss is small (small q, long DP-SGD, a small ε) has its best order beyond
# that: Opacus then warns "Optimal order is the largest alpha" and reports a looser ε than the
# mechanism has. Orders to 512 keep the best one inside the set.
RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [80, 96, 128, 192, 256, 384, 512]


# Said once a process, instead of Opacus' "Optimal order is the largest alpha. Please consider
# expanding the range of alphas…" (from every calibration step and every ε it reports), which at a
# very small ε (below about 0.05) comes even with orders to 512.
LOOSE_BOUND = ("at this small ε the RDP accountant's best Rényi order lies beyond the largest it tries (512): "
               "the ε reported is a valid upper bound, looser than the mechanism's (--accountant prv is tighter)")


_loose_bound_said = False


@contextlib.contextmanager
def _largest_order_said_once():
    """Opacus' warning that the best order is the largest, said once in fedsd's words (FedsdNote)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    global _loose_bound_said
    for w in caught:
        if "Optimal order is the largest alpha" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elif not _loose_bound_said:  # once a process (catch_warnings resets the registry that would)
            _loose_bound_said = True
            warnings.warn(LOOSE_BOUND, FedsdNote, stacklevel=3)


def _orders(accountant: str) -> dict:
    """Keyword arguments for an Opacus accountant's get_epsilon (orders exist only for RDP)."""
    return {"alphas": RDP_ORDERS} if accountant == "rdp" else {}


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    """Opacus' convention (len of its Poisson data loader): ⌈n / B⌉ steps at rate q = B / n."""
    return math.ceil(num_samples / batch_size)


@dataclass(frozen=True)
class PrivacyPlan:
    noise_multiplier: float
    sample_rate: float
    planned_steps: int
    epsilon: float
    delta: float
    accountant: str
    # What the data set spends before DP-SGD's first step, as accountant history entries
    # [σ, q, steps] (a run's private feature normalisation: fedsd.data.features); DP-SGD's σ is
    # calibrated so that the two together spend (ε, δ).
    prior: tuple = ()

    def to_dict(self) -> dict:
        planned = dict(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
                       planned_steps=self.planned_steps, epsilon=self.epsilon, delta=self.delta,
                       accountant=self.accountant)
        return {**planned, "prior": [list(p) for p in self.prior]} if self.prior else planned

    @classmethod
    def from_dict(cls, saved: dict) -> "PrivacyPlan":
        return cls(**{**saved, "prior": tuple(tuple(p) for p in saved.get("prior", ()))})

    def history_before_training(self) -> list[list]:
        """The accountant history a data holder starts with: the prior's entries."""
        return [list(p) for p in self.prior]


def calibration_cache_dir() -> Path:
    """Where calibrated σ are kept across processes and runs: FEDSD_CACHE_DIR, else
    ~/.cache/fedsd (XDG_CACHE_HOME respected), folder calibrations/."""
    return cache_root() / "calibrations"


@functools.lru_cache(maxsize=4096)
def plan(epsilon: float, delta: float, num_samples: int, batch_size: int, epochs: int,
         accountant: str = "rdp", cache_dir: str | None = None, prior: tuple = ()) -> PrivacyPlan:
    """Calibrate σ so that `epochs` epochs of Poisson-sampled DP-SGD spend at most (ε, δ),
    after the `prior` accountant entries ((σ, q, steps), tuples) the data set spent first.

    A pure function of its arguments whose binary search costs 0.3–1.5 s (Opacus' RDP at a
    large sample rate is slow), so it is cached in memory and on disk (`cache_dir`, default
    calibration_cache_dir()): clients with the same (n, B, ε, steps) share one search, and a
    Ray worker or a fresh ClientApp process finds the σ its server already calibrated. The
    file is keyed by the arguments, the Opacus version and the RDP orders; what it holds is a
    function of public settings, never of data."""
    args = (epsilon, delta, num_samples, batch_size, epochs, accountant) + ((prior,) if prior else ())
    path = _calibration_file(Path(cache_dir) if cache_dir else calibration_cache_dir(), args)
    if path.is_file():
        try:
            return PrivacyPlan.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # an unreadable entry is calibrated again and rewritten
    calibrated = _calibrate(*args)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, calibrated.to_dict())
    except OSError:
        pass  # a read-only home: the search stays cached in this process only
    return calibrated


def _calibration_file(cache_dir: Path, args: tuple) -> Path:
    key = json.dumps([opacus.__version__, EPSILON_TOLERANCE, RDP_ORDERS, *args])
    return cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _calibrate(epsilon: float, delta: float, num_samples: int, batch_size: int, epochs: int,
               accountant: str, prior: tuple = ()) -> PrivacyPlan:
    q = batch_size / num_samples
    steps = epochs * steps_per_epoch(num_samples, batch_size)
    try:
        with _largest_order_said_once():
            if prior:
                sigma = _noise_multiplier_after(prior, epsilon, delta, q, steps, accountant)
            else:
                sigma = get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=q,
                                             steps=steps, accountant=accountant,
                                             epsilon_tolerance=EPSILON_TOLERANCE, **_orders(accountant))
    except ValueError as e:  # Opacus: "The privacy budget is too low."
        spent = f" after the {AccountantHistory(accountant, list(prior)).epsilon(delta):.3g} spent first" if prior \
            else ""
        raise BudgetError(f"--epsilon: no noise level fits ε={epsilon}, δ={delta} for {steps} steps at "
                          f"sample rate {q:.4g}{spent} ({e}); raise --epsilon or lower --epochs") from e
    return PrivacyPlan(float(sigma), q, steps, epsilon, delta, accountant, tuple(tuple(p) for p in prior))


def _noise_multiplier_after(prior: tuple, epsilon: float, delta: float, sample_rate: float, steps: int,
                            accountant: str) -> float:
    """Opacus' get_noise_multiplier (the same doubling, then bisection to EPSILON_TOLERANCE
    below the target), with the accountant's history starting with `prior`: Opacus' own
    search starts from an empty history."""
    def spent(sigma: float) -> float:
        return AccountantHistory(accountant, [*map(list, prior), [sigma, sample_rate, steps]]).epsilon(delta)

    if AccountantHistory(accountant, list(prior)).epsilon(delta) >= epsilon:
        raise ValueError("The privacy budget is too low.")
    sigma_low, sigma_high, eps_high = 0.0, 10.0, float("inf")
    while eps_high > epsilon:
        sigma_high *= 2
        eps_high = spent(sigma_high)
        if sigma_high > MAX_SIGMA:
            raise ValueError("The privacy budget is too low.")
    while epsilon - eps_high > EPSILON_TOLERANCE:
        sigma = (sigma_low + sigma_high) / 2
        eps = spent(sigma)
        if eps < epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high


@functools.lru_cache(maxsize=4096)
def _rdp_of_one_step(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """Opacus' RDP of one subsampled Gaussian step at RDP_ORDERS. RDP composes by adding, so
    k steps are k times this; cached because a client's round asks for it twice with the same
    (q, σ), and at a large q (a small shard) it costs ~0.1 s."""
    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=RDP_ORDERS)
    rdp.flags.writeable = False
    return rdp


class AccountantHistory:
    """One Opacus accountant for a whole run (a data holder's, central or one client's), kept as
    its history of (σ, q, steps), plain data that travels in a client's state between rounds
    and in checkpoints. (The owner's lifetime budget across runs is PrivacyFilter, kept by
    fedsd.privacy.lifetime_ledger.)"""

    def __init__(self, kind: str = "rdp", history: list | None = None):
        self.kind = kind
        self._accountant = create_accountant(kind)
        self._accountant.history = [tuple(h) for h in (history or [])]

    @property
    def history(self) -> list[list]:
        return [list(h) for h in self._accountant.history]

    @property
    def steps(self) -> int:
        return int(sum(h[2] for h in self._accountant.history))

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        self._accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def epsilon(self, delta: float) -> float:
        if not self._accountant.history:
            return 0.0
        if self.kind != "rdp":
            # PRV's subsampled Gaussian takes log(1 − q): −inf, harmlessly, for an entry at q = 1
            # (a release over the whole data set, such as the private feature normalisation)
            with np.errstate(divide="ignore"):
                return float(self._accountant.get_epsilon(delta=delta, **_orders(self.kind)))
        # Opacus' RDPAccountant.get_epsilon, with each (q, σ)'s per-step RDP computed once
        rdp = sum(_rdp_of_one_step(q, sigma) * steps for sigma, q, steps in self._accountant.history)
        with _largest_order_said_once():
            eps, _ = get_privacy_spent(orders=RDP_ORDERS, rdp=rdp, delta=delta)
        return float(eps)

    def epsilon_after(self, steps: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """ε spent if `steps` more steps were taken (asks a scratch copy; this history is unchanged)."""
        scratch = AccountantHistory(self.kind, self.history + [[noise_multiplier, sample_rate, steps]])
        return scratch.epsilon(delta)


GAUSSIAN, SKELLAM = "subsampled-gaussian", "skellam"  # a ledger entry's mechanism (PrivacyFilter)
MIXED = "subsampled-gaussian+skellam"  # a ledger file's, once it holds an entry other than a Gaussian one
# An entry of charges added back from the owner's record after a restored state folder was
# accepted (fedsd.privacy.owner_record): their RDP curve at RDP_ORDERS, as it is, and how many
# charges and steps it stands for.
RESTORED = "restored"
RESTORED_RUN = "(restored state)"  # its experiment: no experiment id can be written so


@functools.lru_cache(maxsize=4096)
def _skellam_rdp_of_one_step(sample_rate: float, gaussian_equivalent: float) -> np.ndarray:
    """One Poisson-subsampled Skellam step's RDP at RDP_ORDERS (fedsd.secure.distributed_noise): the
    subsampled Gaussian's at its Gaussian equivalent z_e at the integer orders where that bound
    is proven (fedsd.secure.distributed_noise.INTEGER_ORDERS, 2 to 256), and no bound (inf) at every
    other order, fractional or beyond 256."""
    from fedsd.secure.distributed_noise import INTEGER_ORDERS

    proven = set(INTEGER_ORDERS)
    at = [i for i, a in enumerate(RDP_ORDERS) if float(a).is_integer() and int(a) in proven]
    rdp = np.full(len(RDP_ORDERS), np.inf)
    rdp[at] = compute_rdp(q=sample_rate, noise_multiplier=gaussian_equivalent, steps=1,
                          orders=[RDP_ORDERS[i] for i in at])
    rdp.flags.writeable = False
    return rdp


def entry_rdp(noise_multiplier: float, sample_rate: float, steps: int, mechanism: str = GAUSSIAN) -> np.ndarray:
    """A ledger entry's RDP at RDP_ORDERS: `steps` steps of its mechanism (for Skellam,
    `noise_multiplier` is the plan's Gaussian equivalent z_e)."""
    if mechanism == SKELLAM:
        return _skellam_rdp_of_one_step(sample_rate, noise_multiplier) * steps
    if mechanism != GAUSSIAN:
        raise BudgetError(f"privacy ledger: an entry of an unknown mechanism {mechanism!r}")
    return _rdp_of_one_step(sample_rate, noise_multiplier) * steps


def _ledger_entry_rdp(entry: dict) -> np.ndarray:
    """A saved ledger entry's RDP at RDP_ORDERS: a restored one's curve as written, else entry_rdp."""
    if entry.get("mechanism") == RESTORED:
        curve = np.array([float(x) for x in entry["rdp"]])
        if curve.shape != (len(RDP_ORDERS),) or np.isnan(curve).any() or (curve < 0).any():
            raise BudgetError("privacy ledger: a restored entry whose RDP curve is not one at this fedsd's orders")
        return curve
    return entry_rdp(entry["noise_multiplier"], entry["sample_rate"], entry["steps"], entry.get("mechanism", GAUSSIAN))


def rdp_epsilon(rdp: np.ndarray, delta: float) -> float:
    """ε at `delta` of an RDP curve at RDP_ORDERS (0 for none spent), converted as Opacus does."""
    if not np.any(rdp):
        return 0.0
    with _largest_order_said_once():
        eps, _ = get_privacy_spent(orders=RDP_ORDERS, rdp=np.asarray(rdp, dtype=float), delta=delta)
    return float(eps)


def curve_to_json(rdp) -> list:
    """An RDP curve as JSON holds it: an order without a bound as "inf"."""
    return [float(x) if math.isfinite(x) else "inf" for x in rdp]


class PrivacyFilter:
    """A data owner's lifetime budget (max ε, max δ) for one data set, across every run and
    every experiment, whatever the server asks: a Rényi privacy filter.

    It keeps everything ever admitted as Opacus RDP history entries (σ, q, steps). A request is
    admitted only if the RDP curve of everything so far plus the request still converts to
    ε ≤ max ε at δ = max δ for some order of a set fixed in advance. That is the condition
    under which adaptively chosen mechanisms (the next run may depend on earlier results)
    compose soundly: Feldman & Zrnic 2021 for one order, Lécuyer 2021 for several at once.
    A run's own ε may still come from a tighter accountant (PRV) for its fixed plan; the
    lifetime check is RDP's. Saved as JSON in the owner's state folder, one file per data
    fingerprint, so new experiment ids, new runs and restarted SuperNodes all continue it.
    """

    def __init__(self, max_epsilon: float, max_delta: float, entries: list | None = None):
        # inf is an owner's explicit "no limit": nothing is refused, everything is still recorded.
        if not max_epsilon > 0:  # also NaN
            raise BudgetError(f"max-epsilon: must be > 0 (or inf for no limit), got {max_epsilon!r}")
        if not 0 < max_delta < 1:
            raise BudgetError(f"max-delta: must be in (0, 1), got {max_delta!r}")
        self.max_epsilon, self.max_delta = float(max_epsilon), float(max_delta)
        # {noise_multiplier, sample_rate, steps, run (the experiment id), time (UTC, ISO 8601), and where
        # known flower_run (Flower's run id) and round}; ledgers written before time was kept have none.
        self.entries = [dict(e) for e in (entries or [])]

    def epsilon(self, extra: list[tuple] = ()) -> float:
        """ε at max δ of everything admitted so far, plus `extra` (σ, q, steps[, mechanism])
        entries: their RDP curves added at the orders RDP_ORDERS, fixed in advance (a Skellam
        entry counts at the integer orders only, fedsd.secure.distributed_noise), converted as Opacus does."""
        if not self.entries and not extra:
            return 0.0
        return rdp_epsilon(self.rdp() + sum((entry_rdp(*x) for x in extra), np.zeros(len(RDP_ORDERS))),
                           self.max_delta)

    def rdp(self) -> np.ndarray:
        """The RDP curve at RDP_ORDERS of everything admitted (zeros for nothing)."""
        return sum((_ledger_entry_rdp(e) for e in self.entries), np.zeros(len(RDP_ORDERS)))

    def charges(self) -> int:
        """How many charges the ledger holds (a restored entry counts the charges it stands for)."""
        return sum(int(e.get("charges", 1)) for e in self.entries)

    def steps(self) -> int:
        return sum(int(e["steps"]) for e in self.entries)

    def restore(self, rdp: np.ndarray, charges: int, steps: int) -> None:
        """Add back charges this ledger lost (a restored copy of its state folder), as one entry
        of their RDP curve: spent, never admitted again (fedsd.privacy.owner_record)."""
        from datetime import datetime, timezone

        self.entries.append(dict(mechanism=RESTORED, rdp=curve_to_json(rdp), charges=int(charges), steps=int(steps),
                                 run=RESTORED_RUN, time=datetime.now(timezone.utc).isoformat(timespec="seconds")))

    def check(self, epsilon: float, delta: float, noise_multiplier: float, sample_rate: float, steps: int,
              mechanism: str = GAUSSIAN) -> None:
        """Raise BudgetRefused, with the reason, unless a run of this (ε, δ) and plan fits."""
        if epsilon > self.max_epsilon * (1 + 1e-9):
            raise BudgetRefused(f"run asks ε={epsilon:g}, this client allows at most {self.max_epsilon:g}")
        if delta > self.max_delta * (1 + 1e-9):
            raise BudgetRefused(f"run asks δ={delta:g}, this client allows at most {self.max_delta:g}")
        what = "Skellam steps at z_e" if mechanism == SKELLAM else "steps at σ"
        self._admit(noise_multiplier, sample_rate, steps,
                    f"this run's {steps} {what}={noise_multiplier:.3f}, q={sample_rate:.3g}", mechanism)

    def _admit(self, noise_multiplier: float, sample_rate: float, steps: int, request: str,
               mechanism: str = GAUSSIAN) -> None:
        """Raise BudgetRefused unless everything so far plus these steps stays within max ε."""
        after = self.epsilon([(noise_multiplier, sample_rate, steps, mechanism)])
        if after > self.max_epsilon * (1 + 1e-9):
            raise LedgerSpent(f"lifetime budget: spent ε={self.epsilon():.3g} of the owner's ε={self.max_epsilon:g}; "
                              f"{request}, composed with what was spent (RDP), would bring it to ε={after:.3f}")

    @property
    def unlimited(self) -> bool:
        return math.isinf(self.max_epsilon)

    def spend(self, noise_multiplier: float, sample_rate: float, steps: int, run: str = "",
              mechanism: str = GAUSSIAN, **facts) -> None:
        """Admit `steps` steps (raises BudgetRefused when they do not fit) and record them, with
        the experiment id `run`, the time, and `facts` (flower_run, round). A Skellam entry
        (mechanism=SKELLAM, noise_multiplier its Gaussian equivalent z_e) says so; a Gaussian
        one is written as ever."""
        from datetime import datetime, timezone

        self._admit(noise_multiplier, sample_rate, steps, f"{steps} more steps", mechanism)
        kind = {"mechanism": SKELLAM} if mechanism == SKELLAM else {}
        self.entries.append(dict(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps, run=run,
                                 time=datetime.now(timezone.utc).isoformat(timespec="seconds"), **kind, **facts))

    def by_experiment(self) -> list[dict]:
        """What each experiment spent, in the order they started: its id, steps, rounds charged,
        first and last charge, Flower's run ids, and the ε of its own entries alone at max δ
        (the ε that experiment's accountant reported, for an RDP run)."""
        groups: dict[str, list[dict]] = {}
        for e in self.entries:
            groups.setdefault(e.get("run", ""), []).append(e)
        return [dict(experiment=run, steps=sum(e["steps"] for e in es),
                     charges=sum(int(e.get("charges", 1)) for e in es),
                     first=es[0].get("time"), last=es[-1].get("time"),
                     flower_runs=sorted({e["flower_run"] for e in es if "flower_run" in e}),
                     epsilon=PrivacyFilter(math.inf, self.max_delta, es).epsilon())
                for run, es in groups.items()]

    def state_dict(self) -> dict:
        # JSON has no infinity: an unlimited budget is written "inf" (float("inf") reads it back).
        # A ledger with a Skellam entry names both mechanisms: an earlier fedsd, which would count
        # that entry as a Gaussian at every order, refuses to read it rather than under-charge.
        mechanism = MIXED if any(e.get("mechanism", GAUSSIAN) != GAUSSIAN for e in self.entries) else GAUSSIAN
        return dict(mechanism=mechanism, accountant="rdp",
                    max_epsilon="inf" if self.unlimited else self.max_epsilon,
                    max_delta=self.max_delta, entries=self.entries)

    @classmethod
    def from_state_dict(cls, state: dict, max_epsilon: float, max_delta: float) -> "PrivacyFilter":
        """The saved ledger under the owner's current limits (a lowered limit applies at once;
        what was spent stays spent)."""
        if state.get("mechanism") not in (GAUSSIAN, MIXED) or state.get("accountant") != "rdp":
            raise BudgetError(f"privacy ledger of an unknown kind: {state.get('mechanism')}/{state.get('accountant')}")
        return cls(max_epsilon, max_delta, state["entries"])
