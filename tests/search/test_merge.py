"""Merging frontiers across device counts equals brute-force 3-D dominance."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tensoropt.ir.costs import FrontierPoint
from tensoropt.search import merge_frontiers
from tests.helpers.exhaustive import pareto

VAL = st.integers(0, 12).map(lambda k: k / 2)


@st.composite
def frontiers(draw):
    out = {}
    for d in draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4, unique=True)):
        for mesh in draw(
            st.lists(st.sampled_from([(d,), (1, d), (d, 1)]), min_size=1, max_size=2, unique=True)
        ):
            pts = pareto(draw(st.lists(st.tuples(VAL, VAL), max_size=6)))
            out[(d, mesh)] = [FrontierPoint(t, m, (k,)) for k, (t, m) in enumerate(pts)]
    return out


def brute(results) -> set[tuple[int, float, float]]:
    pts = {(d, p.time_s, p.memory_bytes) for (d, _), ps in results.items() for p in ps}
    return {
        a
        for a in pts
        if not any(b != a and all(x <= y for x, y in zip(b, a, strict=True)) for b in pts)
    }


@settings(max_examples=200, deadline=None)
@given(frontiers())
def test_merge_matches_brute_force(results) -> None:
    merged = merge_frontiers(results)
    got = [(p.devices, p.time_s, p.memory_bytes) for p in merged]
    assert len(got) == len(set(got)), "equal points are kept once"
    assert set(got) == brute(results)
    assert got == sorted(got)
    for p in merged:
        src = results[(p.devices, p.mesh)][p.index]
        assert (src.time_s, src.memory_bytes) == (p.time_s, p.memory_bytes)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([1, 2, 4, 8]), st.lists(st.tuples(VAL, VAL), max_size=6), min_size=1
    ),
    st.sampled_from([2, 4, 8, 16]),
    VAL,
    VAL,
)
def test_fewer_devices_names_the_fewest_count_that_matches(raw, d, t, m):
    """``fewer_devices`` against a scan of every point of every smaller count."""
    from tensoropt.search.merge import fewer_devices

    fronts = {c: sorted(pareto(points)) for c, points in raw.items()}
    want = next(
        (c for c in sorted(fronts) if c < d and any(a <= t and b <= m for a, b in fronts[c])),
        None,
    )
    assert fewer_devices(fronts)(d, t, m) == want
