"""The ring of sparse secure aggregation (docs/design/sparse-secure-aggregation.md): a round's
cohort placed around a ring by a permutation every owner recomputes from the round and the cohort,
each owner sharing with and masking with the k members nearest it (the Harary graph H(n, k) of
Bell et al., CCS 2020, its nodes permuted as FCP's `secret_sharing_harary_graph` does); the degree
and threshold from public numbers alone (`graph_parameters`).

Pure functions of public inputs: nothing here is secret, and every owner computes the same.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

CORRECTNESS_BITS = 20  # an honest server's round abandoned by chance with probability at most 2^-20


@dataclass(frozen=True)
class Graph:
    """k: the neighbours an owner shares with and masks with (itself not counted); threshold: the
    shares of a secret that rebuild it; complete: every member is every other's neighbour."""
    k: int
    threshold: int
    complete: bool


def sparse_threshold(k: int, colluders: int, honest: int) -> int:
    """The Shamir threshold on a neighbourhood of k + 1: at least t + F (the shares that rebuild an
    owner's b come from at least t honest holders it masked with: the review's bound), above
    (k + 1 + F) / 2 (two views cannot both reach it) and above 2(k + 1) / 3."""
    return max(honest + colluders, colluders + 1, 2 * (k + 1) // 3 + 1, (k + 1 + colluders) // 2 + 1)


@functools.lru_cache(maxsize=256)
def graph_parameters(n: int, colluders: int, honest: int, dropout: float) -> Graph:
    """The smallest even k (and its threshold) for a cohort of n with at most F = `colluders` of the
    server's members, t = `honest` honest inputs in any sum the server learns, and a fraction
    `dropout` of members dropping at random: the threshold at most k + 1 − F (F members that
    withhold their shares leave enough, as `check_threshold` asks), and an honest server's round
    going through with probability 1 − 2^-20 even where F members mask and then fall silent in one
    neighbourhood (no survivor with more than k + 1 − threshold − F of its neighbours dropped, no
    dropped owner with more than k − threshold − F, by the union bound over the owners: sized for
    random dropouts alone, a review's members abandoned 3.6 % of rounds at n = 100, F = 5 after
    the owners paid). The complete graph where no k + 1 < n does (small cohorts)."""
    from scipy.stats import hypergeom  # a heavy import, needed only here

    for name, value in (("cohort", n), ("colluders", colluders), ("honest inputs", honest)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"graph parameters: the {name} is an integer ≥ 0, not {value!r}")
    if not 0 <= dropout < 0.5 or not math.isfinite(dropout):
        raise ValueError(f"graph parameters: the dropout rate is in [0, 0.5), not {dropout!r}")
    dropped = math.ceil(dropout * n)
    for k in range(2, n - 1, 2):
        t = sparse_threshold(k, colluders, honest)
        if t > k + 1 - colluders:
            continue
        # the union bound over the owners: a survivor's b needs t of its k + 1 holders (its own share
        # among them), a dropped owner's s t of its k neighbours, F of whom may be silent
        stuck = (n - dropped) * hypergeom(n - 1, dropped, k).sf(k + 1 - t - colluders)
        if dropped:
            stuck += dropped * hypergeom(n - 1, dropped - 1, k).sf(k - t - colluders)
        if stuck > 2.0 ** -CORRECTNESS_BITS:
            continue
        return Graph(k, t, False)
    return Graph(max(n - 1, 0), 0, True)


def ring_order(round_id: bytes, cohort: list[int], k: int) -> list[int]:
    """The cohort in ring order: each member at the rank of SHA-256 of the round, the cohort's
    digest, k and its id (ties, which SHA-256 does not give, broken by id)."""
    return list(_ring_order(bytes(round_id), tuple(sorted(cohort)), k))


@functools.lru_cache(maxsize=8)
def _ring_order(round_id: bytes, members: tuple, k: int) -> tuple:
    cohort_hash = hashlib.sha256(b"".join(m.to_bytes(8, "big") for m in members)).digest()
    prefix = b"fedsd-secagg|ring|" + round_id + b"|" + cohort_hash + k.to_bytes(4, "big")
    return tuple(sorted(members, key=lambda m: (hashlib.sha256(prefix + m.to_bytes(8, "big")).digest(), m)))


def neighbourhood(order: list[int], member: int, k: int) -> list[int]:
    """`member` and the k members nearest it on the ring (k/2 each side), sorted by id."""
    n, p = len(order), order.index(member)
    if k + 1 >= n:
        return sorted(order)
    return sorted(order[(p + d) % n] for d in range(-(k // 2), k // 2 + 1))


def neighbourhoods(round_id: bytes, cohort: list[int], k: int) -> dict[int, list[int]]:
    """Every member's neighbourhood on the round's ring (member → itself and its k nearest, sorted),
    computed once for a round and cohort however many parties of one process ask: callers must not
    change the lists."""
    return _neighbourhoods(bytes(round_id), tuple(sorted(cohort)), k)


@functools.lru_cache(maxsize=8)
def _neighbourhoods(round_id: bytes, members: tuple, k: int) -> dict[int, list[int]]:
    order = _ring_order(round_id, members, k)
    n, half = len(order), k // 2
    if k + 1 >= n:
        return {m: list(members) for m in members}
    return {m: sorted(order[(p + d) % n] for d in range(-half, half + 1)) for p, m in enumerate(order)}


FLAGS = {"clients": "--clients", "honest": "--honest-clients", "colluders": "--secagg-max-colluders",
         "dropout": "--secagg-dropout", "graph": "--secagg-graph"}


def choose_graph(setting: str, n: int, honest: int, colluders: int, dropout: float, *, most: int, ring_above: int,
                 spelled: str = "{} {}", names: dict | None = None, plain: str = "--secure-sum plain"
                 ) -> Graph | None:
    """The graph a round of n runs on under `setting` (complete | ring | auto: the ring above
    `ring_above`): None for the complete graph, else the ring of `graph_parameters`, each owner at
    most `most` neighbours. ValueError where none fits, naming each setting as `spelled` (name,
    value) with `names` (`fedsd simulate`'s flags by default), and `plain`, the way round it."""
    name = {**FLAGS, **(names or {})}
    clients, t, f, d = (spelled.format(name[key], value) for key, value in
                        (("clients", n), ("honest", honest), ("colluders", colluders), ("dropout", dropout)))
    if not 0 <= dropout < 0.5:
        raise ValueError(f"{d}: a fraction in [0, 0.5)")
    if colluders < 0 or honest + 2 * colluders > n:
        raise ValueError(f"{f}: at most ({clients} - t {honest}) / 2 (t honest inputs in any sum, with F members' "
                         f"shares withheld)")
    if setting == "complete" or (setting == "auto" and n <= ring_above):
        if n > most:
            raise ValueError(f"{clients}: on the complete graph a client shares with every other, and with at most "
                             f"{most}; take {spelled.format(name['graph'], 'ring')} (or auto), or {plain}")
        return None
    graph = graph_parameters(n, colluders, honest, dropout)
    if not graph.complete and graph.k + 1 <= most:
        return graph
    if setting == "auto" and n <= most:
        return None
    raise ValueError(f"{clients}: with {t}, {f} and {d}, no ring below the cohort with at most {most} neighbours a "
                     f"client fits (its threshold is at least t + F and at most k + 1 - F); lower {name['honest']} "
                     f"or {name['colluders']}, or take {plain}")
