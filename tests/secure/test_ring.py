"""fedsd.secure.ring: the parameters of the design's table, one ring for every owner, and the view
check against brute force (every set of the server's members on small rings)."""
import itertools

import pytest

from fedsd.secure.ring import Graph, graph_parameters, leaking_cut, neighbourhood, ring_order, sparse_threshold


@pytest.mark.parametrize("n,colluders,dropout,k,t", [(100, 5, 0.05, 16, 12), (100, 10, 0.1, 30, 21),
                                                     (1000, 10, 0.05, 40, 28), (1000, 20, 0.05, 50, 36),
                                                     (1000, 50, 0.05, 88, 70)])
def test_the_parameters_of_the_design_table(n, colluders, dropout, k, t):
    graph = graph_parameters(n, colluders, dropout)
    assert graph == Graph(k, t, False)
    assert t >= colluders + 1 and 2 * t > k + 1 + colluders and 3 * t > 2 * (k + 1)


def test_a_cohort_too_small_for_a_ring_gets_the_complete_graph():
    assert graph_parameters(4, 0, 0.1) == Graph(3, 0, True)
    assert graph_parameters(10, 1, 0.05) == Graph(4, 4, False)  # one dropped of ten: a ring of 5 survives it


@pytest.mark.parametrize("bad", [(-1, 0, 0.0), (10, -1, 0.0), (10, 1, 0.5), (10, 1, float("nan")), (True, 0, 0.0)])
def test_impossible_parameters_are_refused(bad):
    with pytest.raises(ValueError, match="graph parameters"):
        graph_parameters(*bad)


def test_every_owner_derives_one_ring_and_neighbourhoods_are_mutual():
    cohort = list(range(3, 203, 2))
    order = ring_order(b"round-7", cohort, 16)
    assert sorted(order) == cohort and order == ring_order(b"round-7", list(reversed(cohort)), 16)
    assert order != ring_order(b"round-8", cohort, 16) and order != ring_order(b"round-7", cohort, 18)
    hoods = {m: neighbourhood(order, m, 16) for m in cohort}
    assert all(len(h) == 17 and m in h for m, h in hoods.items())
    assert all(m in hoods[j] for m, h in hoods.items() for j in h)


def _components(order, kept, k):
    """Connected components of H(n, k) restricted to `kept`, by search."""
    n, position = len(order), {m: i for i, m in enumerate(order)}
    left, parts = set(kept), []
    while left:
        stack, part = [left.pop()], set()
        while stack:
            m = stack.pop()
            part.add(m)
            for j in list(left):
                d = abs(position[m] - position[j])
                if min(d, n - d) <= k // 2:
                    left.discard(j)
                    stack.append(j)
        parts.append(part)
    return parts


def _leaks_by_brute_force(order, survivors, k, colluders, honest):
    for size in range(colluders + 1):
        for server in itertools.combinations(sorted(survivors), size):
            parts = _components(order, set(survivors) - set(server), k)
            if len(parts) >= 2 and min(len(p) for p in parts) < honest:
                return True
    return False


@pytest.mark.parametrize("seed", range(40))
def test_the_view_check_finds_exactly_the_cuts_brute_force_finds(seed):
    import random

    rng = random.Random(seed)
    n, k = rng.choice([(12, 4), (14, 4), (16, 6), (13, 2)])
    order = ring_order(seed.to_bytes(2, "big"), list(range(n)), k)
    survivors = {m for m in order if rng.random() > 0.25}
    colluders, honest = rng.randint(0, 3), rng.randint(1, 6)
    found = leaking_cut(order, survivors, k, colluders, honest) is not None
    assert found == _leaks_by_brute_force(order, survivors, k, colluders, honest)


def test_an_arc_cut_off_by_dropping_its_borders_is_refused():
    """The server declares dropped the k/2 owners each side of an arc of 6 (attack C): with one member
    of its own left over, the arc's 6 survivors may hold 5 honest ones, below t = 6; with the borders
    kept, no cut exists."""
    k, order = 8, list(range(40))
    arc = set(range(10, 16))
    dropped = set(range(6, 10)) | set(range(16, 20))
    survivors = set(order) - dropped
    assert leaking_cut(order, survivors, k, colluders=1, honest=6) is not None
    assert leaking_cut(order, survivors, k, colluders=0, honest=6) is None  # 6 honest: the sum of t
    assert leaking_cut(order, set(order), k, colluders=1, honest=6) is None
    assert arc <= survivors


def test_the_threshold_rule():
    assert sparse_threshold(50, 20) == 36 and sparse_threshold(16, 5) == 12 and sparse_threshold(4, 10) == 11
