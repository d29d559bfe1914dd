"""Epsilon thinning keeps a cover of every group that no smaller subset matches."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoropt.search.frontier import epsilon_thin


def _covers(t: list[float], kept: set[int], ratio: float) -> bool:
    """Whether every point of one frontier (time ascending, so memory falling) has a
    kept point at or after it within ``ratio`` times its time."""
    return all(
        any(j in kept and t[j] <= t[i] * ratio for j in range(i, len(t))) for i in range(len(t))
    )


@settings(max_examples=300, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.integers(0, 80), min_size=1, max_size=9, unique=True), min_size=1, max_size=4
    ),
    delta=st.sampled_from([0.01, 0.1, 0.3, 1.0]),
)
def test_thinning_keeps_a_least_cover(groups, delta):
    times = [sorted(k / 8 for k in ks) for ks in groups]
    g = np.repeat(np.arange(len(times)), [len(t) for t in times])
    t = np.concatenate([np.array(x) for x in times])
    keep = epsilon_thin(g, t, delta)
    at = 0
    for tg in times:
        kept = {i for i in range(len(tg)) if keep[at + i]}
        at += len(tg)
        assert len(tg) - 1 in kept  # nothing has less memory than the last point
        assert _covers(tg, kept, 1.0 + delta)
        least = next(
            n
            for n in range(1, len(tg) + 1)
            if any(
                _covers(tg, set(s), 1.0 + delta) for s in itertools.combinations(range(len(tg)), n)
            )
        )
        assert len(kept) == least


def test_thinning_an_empty_table_keeps_nothing():
    assert epsilon_thin(np.zeros(0, dtype=np.int64), np.zeros(0), 0.1).shape == (0,)
