"""Pruning one group of candidates: the sampled pre-filter keeps exactly what a full sort
keeps (the same indices, ties included)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoropt.search import frontier
from tests.helpers.exhaustive import pareto


def _staircase(rng: np.random.Generator, n: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    t = np.sort(rng.integers(0, span, n)).astype(np.float64)
    m = np.sort(rng.integers(0, span, n))[::-1].astype(np.float64)
    return t, m


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    sizes=st.tuples(st.integers(40, 300), st.integers(40, 300)),
    span=st.sampled_from([20, 500, 10**6]),
    fast_a=st.booleans(),
)
def test_the_sampled_prefilter_keeps_what_a_full_sort_keeps(seed, sizes, span, fast_a):
    """Minkowski sums of two staircases, as `sum_entries` makes them (sorted runs, with
    equal times and equal points when the span is small)."""
    rng = np.random.default_rng(seed)
    (at, am), (bt, bm) = _staircase(rng, sizes[0], span), _staircase(rng, sizes[1], span)
    if fast_a:
        t, m = (at[None, :] + bt[:, None]).ravel(), (am[None, :] + bm[:, None]).ravel()
    else:
        t, m = (at[:, None] + bt[None, :]).ravel(), (am[:, None] + bm[None, :]).ravel()
    kept = frontier._prune_one(t, m)
    assert np.array_equal(kept, frontier._sorted_prune(t, m))
    points = list(zip(t.tolist(), m.tolist(), strict=True))
    assert sorted(zip(t[kept].tolist(), m[kept].tolist(), strict=True)) == pareto(points)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(frontier.SAMPLED, 3 * frontier.SAMPLED))
def test_the_prefilter_on_unsorted_points_with_many_ties(seed, n):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, 40, n).astype(np.float64)
    m = rng.integers(0, 40, n).astype(np.float64)
    kept = frontier._prune_one(t, m)
    assert np.array_equal(kept, frontier._sorted_prune(t, m))
