"""Epsilon thinning keeps a cover of every group that no smaller subset matches."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoropt.search.factor import Context, Factor, multiply
from tensoropt.search.frontier import Filter, epsilon_thin
from tensoropt.search.provenance import Provenance
from tensoropt.search.solver import completion_spread


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


@settings(max_examples=200, deadline=None)
@given(
    lows=st.lists(st.integers(0, 50), min_size=2, max_size=12),
    picks=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99), st.booleans()), max_size=40),
    delta=st.sampled_from([1e-4, 0.01, 0.2]),
)
def test_completion_spread_spends_exactly_the_budget(lows, picks, delta):
    """On a random tree of products, the worst error the filtering steps may add to a
    plan whose leaves all take their least times (each step k adds delta * (p.time +
    c * L_k), compounded by (1 + delta) per step above it) equals the budget
    ((1 + delta)^D - 1) * T: computed here by walking the tree, against the spread c
    that the factors' ``lows`` give."""
    ctx = Context(Provenance(1), Filter(), symbolic=True)
    # live: (factor, the tree: ("leaf", low) or ("node", children))
    live = [
        (Factor((i,), (1,), None, lows=(float(x),)), ("leaf", float(x))) for i, x in enumerate(lows)
    ]
    for a, b, alone in [*picks, *[(0, 1, False)] * (len(lows) - 1)]:
        if alone:
            f, tree = live.pop(a % len(live))
            live.append((multiply(ctx, f, None), ("node", [tree])))
        elif len(live) > 1:
            fa, ta = live.pop(a % len(live))
            fb, tb = live.pop(b % len(live))
            live.append((multiply(ctx, fa, fb), ("node", [ta, tb])))
    ((top, tree),) = live
    c = completion_spread(top.lows, top.depth, delta)
    worst, leaves_at = [], []

    def walk(node, above: int) -> float:  # returns L: the least times below
        kind, body = node
        if kind == "leaf":
            leaves_at.append((body, above))
            return body
        low = sum(walk(child, above + 1) for child in body)
        worst.append((1 + delta) ** above * delta * c * low)
        return low

    total = walk(tree, 0)
    assert top.depth == max(d for _, d in leaves_at)
    worst += [x * ((1 + delta) ** d - 1) for x, d in leaves_at]
    budget = ((1 + delta) ** top.depth - 1) * total
    assert math.fsum(worst) <= budget * (1 + 1e-9)
    if c > 0:
        assert math.fsum(worst) >= budget * (1 - 1e-6)
