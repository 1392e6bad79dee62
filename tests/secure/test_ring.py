"""fedsd.secure.ring: the parameters of the design's table, and one ring for every owner."""
import pytest

from fedsd.secure.ring import Graph, graph_parameters, neighbourhood, ring_order, sparse_threshold


@pytest.mark.parametrize("n,colluders,honest,dropout,k,t", [(100, 5, 5, 0.05, 30, 21), (100, 10, 10, 0.1, 60, 41),
                                                            (1000, 10, 10, 0.05, 88, 60), (1000, 20, 20, 0.05, 130, 88),
                                                            (1000, 50, 50, 0.05, 246, 165), (1000, 0, 10, 0.05, 42, 29),
                                                            (100, 0, 10, 0.05, 16, 12)])
def test_the_parameters_of_the_design_table(n, colluders, honest, dropout, k, t):
    graph = graph_parameters(n, colluders, honest, dropout)
    assert graph == Graph(k, t, False)
    assert t >= honest + colluders and 2 * t > k + 1 + colluders and 3 * t > 2 * (k + 1) and t <= k + 1 - colluders


def test_a_cohort_too_small_for_a_ring_gets_the_complete_graph():
    assert graph_parameters(4, 0, 1, 0.1) == Graph(3, 0, True)
    assert graph_parameters(10, 1, 1, 0.05) == Graph(6, 5, False)  # one dropped of ten and one silent member


@pytest.mark.parametrize("bad", [(-1, 0, 1, 0.0), (10, -1, 1, 0.0), (10, 1, 1, 0.5), (10, 1, 1, float("nan")),
                                 (True, 0, 1, 0.0), (10, 1, -2, 0.0)])
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


def test_the_threshold_rule():
    assert sparse_threshold(16, 5, 5) == 12 and sparse_threshold(50, 20, 20) == 40 and sparse_threshold(4, 10, 1) == 11
