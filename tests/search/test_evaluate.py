"""The compiled evaluation is math.fsum bit for bit, and the relaxation's weighted minima
are the numpy ones."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoropt.search import evaluate
from tests.search.search_strategies import problems


def _kernel_sum(values: list[float]) -> tuple[float, bool]:
    """One row whose terms are ``values``: one single-strategy unit per value."""
    n = len(values)
    i64 = np.int64
    out, ok = np.empty(1), np.empty(1, dtype=np.bool_)
    evaluate._row_sums(
        np.zeros((1, n), dtype=i64), np.asarray(values, dtype=np.float64),
        np.arange(n, dtype=i64), np.zeros(0, dtype=i64), np.zeros(0, dtype=i64),
        np.zeros(0, dtype=i64), np.zeros(0, dtype=i64), out, ok,
    )  # fmt: skip
    return float(out[0]), bool(ok[0])


# sums whose correct rounding needs every partial, and the half-even fix across them
HARD = [
    [1e-16, 1.0, 1e16],
    [1.0, 1e100, 1.0, -1e100],
    [2.0**53, 1.0, -(2.0**-60)],
    [2.0**53, 1.0, 2.0**-60],
    [1e308, 1e308, -1e308],  # an intermediate sum above the largest float
    [0.1] * 10,
    [1.0, -1.0, 1e-300, 1e-310],
    [-0.0, -0.0],
    [],
]


@pytest.mark.parametrize("values", HARD)
def test_hard_sums_are_correctly_rounded(values):
    try:
        want = math.fsum(values)
    except OverflowError:
        assert not _kernel_sum(values)[1]  # left to math.fsum, which raises
        return
    got, ok = _kernel_sum(values)
    assert ok
    assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
_scaled = st.builds(
    lambda m, e: math.ldexp(m, e), st.integers(-(2**53), 2**53), st.integers(-80, 80)
)


@given(st.lists(st.one_of(_floats, _scaled), max_size=60))
@settings(max_examples=600, deadline=None)
def test_row_sum_is_math_fsum(values):
    try:
        want = math.fsum(values)
    except OverflowError:
        assert not _kernel_sum(values)[1]
        return
    got, ok = _kernel_sum(values)
    assert ok and got == want


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_special_values_are_left_to_math_fsum(bad):
    assert not _kernel_sum([1.0, bad, 2.0])[1]


@given(problem=problems(), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_relaxed_lows_are_the_weighted_table_minima(problem, seed):
    """The compiled minima over each table, summed over units then edges, against numpy
    on the same tables (each weight's sum in the same order, so the same float)."""
    rng = np.random.default_rng(seed)
    wt, wm = rng.random(7), rng.random(7)
    tables = [
        (
            np.array([s.time_s for s in u.strategies]),
            np.array([s.memory_bytes for s in u.strategies]),
        )
        for u in problem.units
    ] + [(np.asarray(e.time_s).ravel(), np.asarray(e.memory_bytes).ravel()) for e in problem.edges]
    want = np.zeros(len(wt))
    for t, m in tables:
        want += (wt[:, None] * t[None, :] + wm[:, None] * m[None, :]).min(axis=1)
    got = evaluate.relaxed_lows(evaluate.flat_tables(problem), wt, wm)
    assert got.tolist() == want.tolist()


def test_shared_edge_tables_are_flattened_once():
    """Repeated layers' edges share their table objects: one copy in the flat arrays,
    each edge still read at its own units' strategies."""
    from tensoropt.ir.costs import CostProblem, Edge, Strategy, Unit

    units = tuple(
        Unit(f"u{i}", tuple(Strategy(f"s{k}", float(i + k), float(k)) for k in range(2)))
        for i in range(4)
    )
    t = ((0.0, 1.0), (2.0, 3.0))
    m = ((4.0, 5.0), (6.0, 7.0))
    problem = CostProblem(units, tuple(Edge(i, i + 1, t, m) for i in range(3)), 2, (2,))
    flat = evaluate.flat_tables(problem)
    assert flat.times.size == 4 * 2 + 4  # four unit tables, one edge table
    choices = np.array([[0, 1, 0, 1], [1, 1, 0, 0]], dtype=np.int64)
    times, memories = evaluate.evaluate_rows(problem, choices)
    for row, tt, mm in zip(choices.tolist(), times.tolist(), memories.tolist(), strict=True):
        assert (tt, mm) == problem.evaluate(row)
