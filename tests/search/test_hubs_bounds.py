"""Hub splitting and exact bound pruning (docs/design/search.md, "Hub-structured graphs"):
both must leave the frontier unchanged, point for point, against brute force."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from search_strategies import assert_choices_exact, hub_problems, problems, values

from tensoropt.ir.costs import CostProblem
from tensoropt.search import BlockMode, Pruning, solve
from tensoropt.search.bounds import Bound
from tensoropt.search.hubs import find_splits
from tensoropt.search.prepared import prepare
from tests.helpers.exhaustive import exhaustive_frontier


@settings(max_examples=40, deadline=None)
@given(hub_problems())
def test_hub_problems_equal_enumeration(problem: CostProblem) -> None:
    expected = exhaustive_frontier(problem)
    prep = prepare(problem)
    splits = find_splits(prep, list(prep.edges), prep.n_units)
    assert any(s.unit == 0 for s in splits)
    for pruning in Pruning:
        for blocks in (BlockMode.OFF, BlockMode.AUTO):
            result = solve(problem, pruning=pruning, blocks=blocks)
            assert values(result) == expected
            assert_choices_exact(problem, result)
            assert any("hub" in note for note in result.stats.blocks)


@settings(max_examples=20, deadline=None)
@given(hub_problems(), st.integers(0, 80))
def test_hub_problems_with_budget(problem: CostProblem, k: int) -> None:
    budget = k / 4
    expected = exhaustive_frontier(problem, budget)
    result = solve(problem, memory_budget=budget, pruning=Pruning.ALWAYS)
    assert values(result) == expected
    assert_choices_exact(problem, result)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_bound_pruning_equals_enumeration(problem: CostProblem) -> None:
    expected = exhaustive_frontier(problem)
    for blocks in BlockMode:
        result = solve(problem, pruning=Pruning.ALWAYS, blocks=blocks)
        assert values(result) == expected
        assert_choices_exact(problem, result)


@settings(max_examples=60, deadline=None)
@given(problems(max_units=6), st.integers(0, 30))
def test_bound_pruning_with_budget(problem: CostProblem, k: int) -> None:
    budget = k / 4
    result = solve(problem, memory_budget=budget, pruning=Pruning.ALWAYS)
    assert values(result) == exhaustive_frontier(problem, budget)


@settings(max_examples=40, deadline=None)
@given(hub_problems())
def test_pruning_modes_are_deterministic(problem: CostProblem) -> None:
    assert (
        solve(problem, pruning=Pruning.ALWAYS).points
        == solve(problem, pruning=Pruning.ALWAYS).points
    )


def test_bound_keeps_ties_and_drops_strictly_dominated() -> None:
    # One incumbent at (10, 10); the rest adds at least (1, 2) to entry 0, nothing to 1.
    bound = Bound(np.array([1.0, 0.0]), np.array([2.0, 0.0]), np.array([10.0]), np.array([10.0]))
    g = np.array([0, 0, 0, 1, 1])
    t = np.array([9.0, 9.5, 8.0, 10.0, 10.0])
    m = np.array([8.0, 8.0, 9.0, 10.0, 11.0])
    # (9, 8) + (1, 2) = (10, 10): a tie, kept (it may be the incumbent's own plan).
    # (9.5, 8) + (1, 2) = (10.5, 10): strictly dominated. (8, 9) + (1, 2) = (9, 11): faster.
    # Entry 1: (10, 10) ties; (10, 11) strictly dominated.
    assert bound.keep(g, t, m).tolist() == [True, False, True, True, False]


def test_no_split_without_a_shared_coarse_partition() -> None:
    # A chain has no hub: nothing is split.
    from tensoropt.search.synthetic import transformer_problem

    prep = prepare(transformer_problem(2, (4,)))
    assert find_splits(prep, list(prep.edges), prep.n_units) == []


def test_convex_bound_drops_only_covered_regions() -> None:
    # Staircase (0, 10), (10, 0): its one finite corner is (10, 10). The rest adds nothing
    # to the ideal point but at least 8 to t + m (weight (1, 1)).
    bound = Bound(
        np.zeros(1),
        np.zeros(1),
        np.array([0.0, 10.0]),
        np.array([10.0, 0.0]),
        np.array([[8.0]]),
        np.array([[1.0, 1.0]]),
    )
    g = np.zeros(4, dtype=np.int64)
    t = np.array([6.0, 5.0, 1.0, 6.0])
    m = np.array([6.0, 5.0, 1.0, 4.0])
    # (6, 6): t + m >= 20 = corner's 20: every plan is >= an incumbent, and none is one.
    # (5, 5): t + m >= 18 < 20: plans below the corner remain. (1, 1): likewise.
    # (6, 4): t + m >= 18: kept; the ideal test alone would keep all four.
    assert bound.keep(g, t, m).tolist() == [False, True, True, True]
    ideal = Bound(np.zeros(1), np.zeros(1), bound.inc_t, bound.inc_m)
    assert ideal.keep(g, t, m).all()


def test_convex_bound_needs_every_corner_cut() -> None:
    # Incumbents (0, 10), (5, 5), (10, 0): corners (5, 10) and (10, 5), both t + m = 15.
    inc_t, inc_m = np.array([0.0, 5.0, 10.0]), np.array([10.0, 5.0, 0.0])
    w = np.array([[1.0, 1.0]])
    g = np.zeros(3, dtype=np.int64)
    t, m = np.array([3.0, 3.0, 3.0]), np.array([3.0, 3.0, 3.0])
    lb = np.full(1, 1.5)
    # Ideal point (4.5, 4.5); t + m of every plan >= 6 + lb_w.
    expect = {8.9: True, 9.0: False, 14.0: False}  # t + m >= 14.9 keeps; 15, 20 cut both
    for lb_w, kept in expect.items():
        bound = Bound(lb, lb, inc_t, inc_m, np.array([[lb_w]]), w)
        assert bound.keep(g, t, m).tolist() == [kept] * 3
    # Two channels, each cutting one corner: w = (2, 1) gives b = 9 + x against corners
    # 20 and 25; w = (1, 2) gives b = 9 + y against 25 and 20. Both corners must be cut.
    two = np.array([[2.0, 1.0], [1.0, 2.0]])
    bound = Bound(lb, lb, inc_t, inc_m, np.array([[11.0], [10.0]]), two)
    assert bound.keep(g, t, m).tolist() == [True] * 3  # (10, 5) still open: 20 > 19
    bound = Bound(lb, lb, inc_t, inc_m, np.array([[11.0], [11.0]]), two)
    assert bound.keep(g, t, m).tolist() == [False] * 3


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_convex_bound_drops_only_dominated_regions(seed: int) -> None:
    # Random staircase, bounds and weights (small integers: exact arithmetic). Any dropped
    # point's region must hold only points strictly dominated by an incumbent; sampled
    # on a grid that includes the region's corners.
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 6))
    inc_t = np.cumsum(rng.integers(1, 4, k)).astype(float)
    inc_m = np.cumsum(rng.integers(1, 4, k))[::-1].astype(float)
    w = rng.integers(1, 4, (int(rng.integers(1, 4)), 2)).astype(float)
    n = 30
    lb_w = rng.integers(0, 30, (len(w), n)).astype(float)
    bound = Bound(np.zeros(n), np.zeros(n), inc_t, inc_m, lb_w, w)
    g = np.arange(n)
    t = rng.integers(0, 15, n).astype(float)
    m = rng.integers(0, 15, n).astype(float)
    keep = bound.keep(g, t, m)
    grid = np.arange(0.0, 40.0)
    xt, xm = np.meshgrid(grid, grid)
    xt, xm = xt.ravel(), xm.ravel()
    for i in np.flatnonzero(~keep):
        inside = (xt >= t[i]) & (xm >= m[i])
        for c in range(len(w)):
            inside &= w[c, 0] * xt + w[c, 1] * xm >= w[c, 0] * t[i] + w[c, 1] * m[i] + lb_w[c, i]
        ge = (xt[inside, None] >= inc_t) & (xm[inside, None] >= inc_m)
        eq = (xt[inside, None] == inc_t) & (xm[inside, None] == inc_m)
        assert (ge & ~eq).any(axis=1).all()
