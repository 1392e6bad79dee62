"""How an owner's padded step is sized under noise=distributed (fedsd.app.client.secure_contribution
computes the step), so that its time tells neither its batch nor its records: the rows a step
is padded to, from public numbers alone (`padded_rows`, at most MAX_PADDED_BYTES of inputs), the
count its draw rate is set from (`records_bound`: the owner's max-records, else the run's
secagg-max-records, never the records it holds) and the rate it draws at (`owner_rate`).
"""
from __future__ import annotations

import logging
import math

from fedsd.app.client.secure_owner import _refused

log = logging.getLogger("fedsd.secure_aggregation")


def padded_rows(plan, bytes_a_row: int = 4, max_records: int | None = None) -> int:
    """The rows an owner's per-sample work covers whatever its Poisson batch: a bound on any batch
    from numbers that are not its data, the Poisson tail of the plan's expected batch E =
    batch-size (the federation's, which every owner checks the plan against), or, where the owner
    set `max-records` K (its own bound on its records, `max_records` here), of q × K when that is
    smaller; never of the records it holds. A time that followed the owner's own bound would tell
    how many records it holds (a review measured +171 ms for 2,000 records against 200 with E = 1,
    where padding fell back to each owner's own). Padded to E, each of the features recipe's ten
    owners computed 8.7k rows for a batch of ~820; with its K it computes ~990. The server's
    secagg-max-records never lowers it: a review found that, set to 1, it left 16 rows, and an
    owner's batch above them (never cut) told its size by its time. A plan whose bound would not
    fit MAX_PADDED_BYTES is refused before the charge, by the plan's numbers alone."""
    from fedsd.secure import sum_bound

    expected = plan.expected_batch if max_records is None else min(plan.expected_batch,
                                                                   plan.sample_rate * max(1, max_records))
    planned = sum_bound.poisson_tail(expected, sum_bound.TAIL)
    if not planned * bytes_a_row <= MAX_PADDED_BYTES:  # refused before the charge (it would fail after it)
        raise _refused(f"distributed noise: the plan's expected batch {plan.expected_batch:.4g} pads each step past "
                       f"the {MAX_PADDED_BYTES >> 30} GiB of inputs an owner computes a step on")
    return math.ceil(planned)


def records_bound(side, own_records: int) -> int:
    """The count an owner's draw rate is set from (owner_rate): its node config's max-records, else
    the run's public secagg-max-records; never the records it holds. A rate set from the owner's
    own count moved with each record (at a server's M just under it, an owner of 19, 20 or 21
    records drew at 0.489, 0.465, 0.442), so a record changed the others' rate: a review computed
    ε 5.25-5.62 spent where 3.72 was charged (q = 0.5, 20 rounds, small owners). An owner whose
    own max-records is below its records is refused before the charge (its own setting, which
    nothing the server sends moves; the reason names no count: that it was refused is the one
    bit the server learns, the same in every round). An owner without one is padded to the
    federation's E (padded_rows) and draws at the rate a batch of M's records fits within it, at
    most q: a server's M only lowers its rate; its batch passes the pad only if it holds more than
    the federation's whole E / q records (clients/README.md)."""
    own = side.node.max_records
    if own and own_records > own:
        log.warning("max-records=%d is below the %d training records of this owner's data: refused", own, own_records)
        raise _refused("this owner's max-records does not fit its data (its owner's log says how)")
    return own or max(1, side.fed.secagg_max_records)  # the server's M only ever lowers the rate (the pad is E's)


def owner_rate(plan, own_records: int, rows: int) -> float:
    """The rate this owner draws its records at, for a count of `own_records` (records_bound's, not
    the records it holds): the plan's q, unless a Poisson batch at q of that count
    could pass the padded `rows` (its records above the federation's B / q: a plan that
    understates E); then the largest rate whose batch stays within them but once in 1e9. Drawing
    at a lower rate than the ledger charges only spends less (a subsampled mechanism's Rényi
    divergence grows with q), and keeps the work, and its time, at the public `rows`."""
    from fedsd.secure import sum_bound

    fits = lambda q: sum_bound.poisson_tail(q * own_records, sum_bound.TAIL) <= rows  # noqa: E731
    if own_records == 0 or fits(plan.sample_rate):
        return plan.sample_rate
    low, high = 0.0, plan.sample_rate
    for _ in range(60):  # bisection on a monotone tail: 2^-60 of q
        low, high = ((low + high) / 2, high) if fits((low + high) / 2) else (low, (low + high) / 2)
    return low


def row_bytes(x) -> int:
    """What one input row of the padded step holds, in bytes."""
    return int(x[0].nbytes) if len(x) else 4


# The most input an owner's padded step holds: far above any step's batch (the papers' largest
# is 8192 for the whole federation), far below one that could not be allocated.
MAX_PADDED_BYTES = 4 << 30
