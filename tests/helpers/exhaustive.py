"""The frontier by enumerating every plan. Exponential; never used by `solve`.

It is the reference the property tests compare the search against, so it is written to be
obviously right rather than fast: every choice vector, evaluated with
:meth:`CostProblem.evaluate`, then the non-dominated set with equal points kept once.
"""

from __future__ import annotations

import itertools

from tensoropt.ir.costs import CostProblem, FrontierPoint


def pareto(values: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Non-dominated (time, memory) values, sorted by time; duplicates kept once."""
    out: list[tuple[float, float]] = []
    for t, m in sorted(set(values)):
        if not out or m < out[-1][1]:
            out.append((t, m))
    return out


def all_plans(problem: CostProblem) -> list[FrontierPoint]:
    """Every plan with its objective."""
    ranges = [range(len(u.strategies)) for u in problem.units]
    return [FrontierPoint(*problem.evaluate(c), c) for c in itertools.product(*ranges)]


def exhaustive_frontier(
    problem: CostProblem, budget: float | None = None
) -> list[tuple[float, float]]:
    """The exact frontier values by brute force (optionally only plans within `budget`)."""
    values = [(p.time_s, p.memory_bytes) for p in all_plans(problem)]
    if budget is not None:
        values = [v for v in values if v[1] <= budget]
    return pareto(values)
