"""Incumbents for exact bound pruning (docs/design/search.md, "Hub-structured graphs"):
every incumbent must be the value of a real plan (else the pruning could drop frontier
points), and the staircase must reach the least w.(t, m) of every weight. The pruning that
uses them is compared with brute force point for point in test_hubs_bounds.py."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from search_strategies import hub_problems, problems

from tensoropt.ir.costs import CostProblem
from tensoropt.search.bounds import Schedule, _incumbents
from tensoropt.search.elimination import _plan, elimination_order
from tensoropt.search.factor import Context
from tensoropt.search.frontier import Filter
from tensoropt.search.hubs import find_splits, split_factors
from tensoropt.search.prepared import prepare
from tensoropt.search.provenance import Provenance
from tests.helpers.exhaustive import all_plans, pareto


def _schedule(problem: CostProblem):
    """The full elimination schedule of `problem` (hubs split) and its leaf tables."""
    prep = prepare(problem)
    ctx = Context(Provenance(), Filter())
    splits = find_splits(prep, list(prep.edges), prep.n_units)
    rewired = {(min(h.unit, w), max(h.unit, w)) for h in splits for w in h.neighbours}
    factors = [prep.unit_factor(ctx, i) for i in range(prep.n_units)]
    factors += [prep.edge_factor(ctx, k) for k in prep.edges if k not in rewired]
    for h in splits:
        factors += split_factors(ctx, prep, h)
    dims = {v: d for f in factors for v, d in zip(f.scope, f.shape, strict=True)}
    order, _ = elimination_order((f.scope for f in factors), dims, set(dims))
    steps, scopes, roots = _plan(factors, order)
    leaves = {i: f.table for i, f in enumerate(factors) if f.table is not None}
    return Schedule(steps, scopes, dims, roots), leaves


FRACS = [0.125, 0.25, 0.5, 0.75, 0.875]  # dyadic: exact scores


def _weights(fracs: list[float]) -> np.ndarray:
    return np.array([[f, 1.0 - f] for f in fracs])


def _check(problem: CostProblem, fracs: list[float]) -> None:
    sched, leaves = _schedule(problem)
    inc_t, inc_m = _incumbents(sched, leaves, _weights(fracs))
    plans = {(p.time_s, p.memory_bytes) for p in all_plans(problem)}
    got = list(zip(inc_t.tolist(), inc_m.tolist(), strict=True))
    # Dyadic costs: the DP's sums are exact, so every incumbent is some plan's value.
    assert set(got) <= plans
    assert got == pareto(got)  # a staircase
    # The least w.(t, m) over all plans is reached for every weight (the root's decode).
    for f in fracs:
        best = min(f * t + (1 - f) * m for t, m in plans)
        assert min(f * t + (1 - f) * m for t, m in got) == best


@settings(max_examples=60, deadline=None)
@given(problems(), st.lists(st.sampled_from(FRACS), min_size=1, max_size=3))
def test_incumbents_are_plans(problem: CostProblem, fracs: list[float]) -> None:
    _check(problem, fracs)


@settings(max_examples=25, deadline=None)
@given(hub_problems(steps=6), st.lists(st.sampled_from([0.25, 0.5, 0.75]), min_size=1))
def test_incumbents_are_plans_with_hubs(problem: CostProblem, fracs: list[float]) -> None:
    _check(problem, fracs)
