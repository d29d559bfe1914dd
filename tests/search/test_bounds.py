"""The bounds' compiled pieces against their plain numpy definitions."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoropt.search.bounds import _entry_argmins


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_entry_argmins_pick_the_first_least_score_as_a_stable_sort(data) -> None:
    """Per weight and entry, the point of least w_t t + w_m m, the first of ties (times and
    memories from a few values, so that ties and empty entries occur): what a stable
    sort by (entry, score) puts first."""
    sizes = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=8))
    n = sum(sizes)
    pick = st.lists(st.sampled_from([0.0, 1.0, 2.5, 3.0]), min_size=n, max_size=n)
    t, m = np.array(data.draw(pick)), np.array(data.draw(pick))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    weights = np.array(
        data.draw(st.lists(st.sampled_from([0.25, 0.5, 1.0]), min_size=2, max_size=6))
    )
    weights = weights[: len(weights) // 2 * 2].reshape(-1, 2)
    found = _entry_argmins(offsets, t, m, weights)
    group = np.repeat(np.arange(len(sizes)), sizes)
    for c, (wt, wm) in enumerate(weights):
        score = wt * t + wm * m
        order = np.lexsort((score, group))
        for e, size in enumerate(sizes):
            want = order[np.searchsorted(group[order], e)] if size else -1
            assert found[c, e] == want
