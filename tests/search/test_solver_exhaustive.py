"""The search against brute-force enumeration: same frontier, point for point."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from search_strategies import assert_choices_exact, block_chains, problems, values

from tensoropt.ir.costs import BlockHint, CostProblem
from tensoropt.search import BlockMode, solve
from tests.helpers.exhaustive import all_plans, exhaustive_frontier, pareto


@settings(max_examples=200, deadline=None)
@given(problems())
def test_exact_frontier_equals_enumeration(problem: CostProblem) -> None:
    expected = exhaustive_frontier(problem)
    for mode in BlockMode:
        result = solve(problem, blocks=mode)
        assert values(result) == expected
        assert_choices_exact(problem, result)
        assert result.epsilon is None and result.guarantee.startswith("exact")


@settings(max_examples=120, deadline=None)
@given(block_chains())
def test_repeated_blocks_equal_enumeration(case) -> None:
    problem, (first, size, count) = case
    expected = exhaustive_frontier(problem)
    hinted = CostProblem(problem.units, problem.edges, blocks=(BlockHint(first, size, count),))
    by_hint = solve(hinted, blocks=BlockMode.ALWAYS)
    assert by_hint.stats.blocks, "a valid hint of >= 3 blocks must be composed"
    detected = solve(problem, blocks=BlockMode.ALWAYS)
    for result in (by_hint, detected):
        assert values(result) == expected
        assert_choices_exact(problem, result)


@settings(max_examples=100, deadline=None)
@given(problems(max_units=6), st.integers(0, 30).map(lambda k: k / 4))
def test_budget_is_exact_frontier_filtered(problem: CostProblem, budget: float) -> None:
    expected = exhaustive_frontier(problem, budget)
    result = solve(problem, memory_budget=budget)
    assert values(result) == expected
    assert all(p.memory_bytes <= budget for p in result.points)
    assert_choices_exact(problem, result)


@settings(max_examples=100, deadline=None)
@given(problems(max_units=6), st.sampled_from([0.01, 0.1, 0.5, 2.0]))
def test_epsilon_guarantee_against_exact(problem: CostProblem, eps: float) -> None:
    result = solve(problem, epsilon=eps)
    exact = pareto([(p.time_s, p.memory_bytes) for p in all_plans(problem)])
    got = values(result)
    assert got == pareto(got), "epsilon points must themselves be non-dominated"
    assert_choices_exact(problem, result)
    assert result.epsilon == eps and "epsilon" in result.guarantee
    # Rounding slack: the (1 + eps) products are computed in floating point (1 ulp each).
    slack = 1 + 1e-12
    for t, m in exact:
        assert any(q_m <= m and q_t <= (1 + eps) * t * slack for q_t, q_m in got), (t, m)
    # Memory is never approximated: the least-memory point is exact.
    assert min(q_m for _, q_m in got) == exact[-1][1]


@settings(max_examples=60, deadline=None)
@given(problems(max_units=6), st.sampled_from([0.05, 0.5]), st.integers(0, 30))
def test_epsilon_with_budget(problem: CostProblem, eps: float, k: int) -> None:
    budget = k / 4
    exact = exhaustive_frontier(problem, budget)
    result = solve(problem, epsilon=eps, memory_budget=budget)
    got = values(result)
    assert all(m <= budget for _, m in got)
    assert bool(got) == bool(exact)
    for t, m in exact:
        assert any(q_m <= m and q_t <= (1 + eps) * t * (1 + 1e-12) for q_t, q_m in got)


@settings(max_examples=40, deadline=None)
@given(problems())
def test_solve_is_deterministic(problem: CostProblem) -> None:
    assert solve(problem).points == solve(problem).points


def test_infeasible_budget_gives_empty_frontier() -> None:
    from tensoropt.ir.costs import Strategy, Unit

    problem = CostProblem((Unit("a", (Strategy("R", 1.0, 5.0), Strategy("S", 2.0, 3.0))),))
    assert solve(problem, memory_budget=2.0).points == ()
    assert values(solve(problem, memory_budget=3.0)) == [(2.0, 3.0)]
    assert not math.isinf(solve(problem).stats.seconds)
