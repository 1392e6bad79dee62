"""The ring of sparse secure aggregation (docs/design/sparse-secure-aggregation.md): a round's
cohort placed around a ring by a permutation every owner recomputes from the round and the cohort,
each owner sharing with and masking with the k members nearest it (the Harary graph H(n, k) of
Bell et al., CCS 2020, its nodes permuted as FCP's `secret_sharing_harary_graph` does); the degree
and threshold from public numbers alone (`graph_parameters`); and the check an owner makes of a
view before it signs it (`leaking_cut`): that no F survivors cut the ring into a part of fewer than
its t honest ones.

Pure functions of public inputs: nothing here is secret, and every owner computes the same.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np

CORRECTNESS_BITS = 20  # an honest server's round abandoned by chance with probability at most 2^-20


@dataclass(frozen=True)
class Graph:
    """k: the neighbours an owner shares with and masks with (itself not counted); threshold: the
    shares of a secret that rebuild it; complete: every member is every other's neighbour."""
    k: int
    threshold: int
    complete: bool


def sparse_threshold(k: int, colluders: int) -> int:
    """The Shamir threshold on a neighbourhood of k + 1: above F (F members never rebuild an owner's
    secrets), above (k + 1 + F) / 2 (two views cannot both reach it) and above 2(k + 1) / 3."""
    return max(colluders + 1, 2 * (k + 1) // 3 + 1, (k + 1 + colluders) // 2 + 1)


@functools.lru_cache(maxsize=256)
def graph_parameters(n: int, colluders: int, dropout: float) -> Graph:
    """The smallest even k (and its threshold) for a cohort of n with at most F = `colluders` of the
    server's members and a fraction `dropout` of members dropping at random, such that an honest
    server's round goes through with probability 1 − 2^-20: every owner keeps its threshold of
    neighbours, and no two windows of k/2 ring positions hold F or fewer survivors between them
    (the view check's cut). The complete graph where no k + 1 < n does (small cohorts)."""
    from scipy.stats import hypergeom  # a heavy import, needed only here

    for name, value in (("cohort", n), ("colluders", colluders)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"graph parameters: the {name} is an integer ≥ 0, not {value!r}")
    if not 0 <= dropout < 0.5 or not math.isfinite(dropout):
        raise ValueError(f"graph parameters: the dropout rate is in [0, 0.5), not {dropout!r}")
    dropped = math.ceil(dropout * n)
    budget = 2.0 ** -CORRECTNESS_BITS
    for k in range(2, n - 1, 2):
        t = sparse_threshold(k, colluders)
        if t > k + 1:
            continue
        if hypergeom(n - 1, dropped, k).sf(k + 1 - t) > budget / n:  # more than k + 1 − t neighbours dropped
            continue
        if hypergeom(n, n - dropped, k).cdf(colluders) * n * n / 2 > budget:  # two windows of ≤ F survivors
            continue
        return Graph(k, t, False)
    return Graph(max(n - 1, 0), 0, True)


def ring_order(round_id: bytes, cohort: list[int], k: int) -> list[int]:
    """The cohort in ring order: each member at the rank of SHA-256 of the round, the cohort's
    digest, k and its id (ties, which SHA-256 does not give, broken by id)."""
    members = sorted(cohort)
    cohort_hash = hashlib.sha256(b"".join(m.to_bytes(8, "big") for m in members)).digest()
    prefix = b"fedsd-secagg|ring|" + bytes(round_id) + b"|" + cohort_hash + k.to_bytes(4, "big")
    return sorted(members, key=lambda m: (hashlib.sha256(prefix + m.to_bytes(8, "big")).digest(), m))


def neighbourhood(order: list[int], member: int, k: int) -> list[int]:
    """`member` and the k members nearest it on the ring (k/2 each side), sorted by id."""
    n, p = len(order), order.index(member)
    if k + 1 >= n:
        return sorted(order)
    return sorted(order[(p + d) % n] for d in range(-(k // 2), k // 2 + 1))


def leaking_cut(order: list[int], survivors: set[int] | frozenset[int], k: int, colluders: int,
                honest: int) -> tuple[int, int] | None:
    """A way for F = `colluders` survivors to cut the ring of survivors so that one part holds
    between 1 and `honest` − 1 honest inputs, as (first window's start, second's), or None.

    On H(n, k) two survivors are neighbours when at most k/2 positions apart, so the survivors the
    server's members leave fall apart exactly where k/2 consecutive positions hold none of them: a
    gap is a window of k/2 positions whose survivors are all the server's. One gap leaves a path;
    two make two arcs, and more only make smaller arcs, each between two of them: so pairs of
    windows are every cut. A pair costing c ≤ F of the server's members, with a survivors on one
    arc (and some on the other), leaks when a − (F − c) < t: the server's remaining F − c members
    may sit in that arc too."""
    n, w = len(order), k // 2
    if k + 1 >= n or w == 0:
        return None
    alive = np.array([m in survivors for m in order], dtype=np.int64)
    # survivors in positions [i, j) of the ring laid out twice: before[j] − before[i]
    before = np.concatenate([[0], np.cumsum(np.concatenate([alive, alive]))])
    start = np.arange(n)
    cost = before[start + w] - before[start]  # survivors in the window starting at p
    p, q = np.meshgrid(start, start, indexing="ij")
    gap = (q - p) % n  # the second window starts this far after the first
    fits = (gap >= w) & (n - gap >= w) & (cost[p] + cost[q] <= colluders)
    arc = before[p + gap] - before[p + w]  # survivors strictly between the windows, going forward
    other = before[p + n] - before[p] - cost[p] - cost[q] - arc
    spare = colluders - cost[p] - cost[q]
    leak = fits & (arc >= 1) & (other >= 1) & (arc - spare < honest)
    if not leak.any():
        return None
    i, j = np.argwhere(leak)[0]
    return int(i), int(j)
