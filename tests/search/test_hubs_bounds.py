"""Hub splitting and exact bound pruning (docs/design/search.md, "Hub-structured graphs"):
both must leave the frontier unchanged, point for point, against brute force."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from search_strategies import hub_problems, problems

from tensoropt.ir.costs import CostProblem
from tensoropt.search import BlockMode, Pruning, solve
from tensoropt.search.bounds import Bound
from tensoropt.search.exhaustive import exhaustive_frontier
from tensoropt.search.hubs import find_splits
from tensoropt.search.prepared import prepare


def values(result) -> list[tuple[float, float]]:
    return [(p.time_s, p.memory_bytes) for p in result.points]


def assert_choices_exact(problem: CostProblem, result) -> None:
    for p in result.points:
        assert problem.evaluate(p.choice) == (p.time_s, p.memory_bytes)


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
