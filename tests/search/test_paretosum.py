"""The compiled Pareto sum keeps exactly what forming every candidate and sorting keeps:
the same positions in A and B, the same groups, in the same order, ties included."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensoropt.search import frontier
from tensoropt.search.paretosum import pareto_sums
from tensoropt.search.provenance import Provenance
from tests.helpers.exhaustive import pareto


def _table(
    rng: np.random.Generator, n_entries: int, span: int, offset: float, scale: float
) -> frontier.Table:
    """Strict staircases of times and memories offset + scale * integer (exact in
    float64)."""
    ts, ms, sizes = [], [], []
    for _ in range(n_entries):
        n = int(rng.integers(0, 40))
        t = np.unique(rng.integers(0, span, n)).astype(np.float64)
        m = np.unique(rng.integers(0, span, len(t))).astype(np.float64)[::-1]
        n = min(len(t), len(m))
        ts.append(offset + t[:n] * scale)
        ms.append(offset + (m[-n:] if n else m[:0]) * scale)
        sizes.append(n)
    offsets = np.zeros(n_entries + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    t = np.concatenate(ts) if ts else np.zeros(0)
    m = np.concatenate(ms) if ms else np.zeros(0)
    return frontier.Table(offsets, t, m, np.arange(len(t), dtype=np.int64))


def _listing(sa: np.ndarray, sb: np.ndarray, a_fast: bool):
    """Every candidate of pairs with entry sizes (sa, sb), in the kernel's candidate order
    (tensoropt/search/paretosum.py): pair index, offset in A, offset in B of each sum."""
    c = sa * sb
    pair = np.repeat(np.arange(len(c), dtype=np.int64), c)
    local = np.arange(int(c.sum()), dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)
    if a_fast:
        na = sa[pair]
        return pair, local % na, local // na
    nb = sb[pair]
    return pair, local // nb, local % nb


def _reference(A, ia, B, ib, group, budget):
    """What `sum_entries` did before the kernel: every candidate, then `prune_groups`."""
    order = np.argsort(group, kind="stable")
    ia, group = ia[order], group[order]
    sa = A.sizes[ia]
    sb = B.sizes[ib[order]] if B is not None else np.ones_like(sa)
    a_fast = bool(sa.sum() >= sb.sum())
    pair, la, lb = _listing(sa, sb, a_fast)
    pa = A.offsets[ia][pair] + la
    t, m = A.t[pa], A.m[pa]
    if B is not None:
        pb = B.offsets[ib[order]][pair] + lb
        t, m = t + B.t[pb], m + B.m[pb]
    else:
        pb = pa
    g = group[pair]
    fits = m <= budget
    pa, pb, g, t, m = pa[fits], pb[fits], g[fits], t[fits], m[fits]
    keep = frontier.prune_groups(g, t, m)
    return (pa[keep], pb[keep], g[keep]), (ia, group, a_fast)


def _kernel(A, B, ia, group, ib, a_fast, budget):
    if B is None:
        return pareto_sums(
            A.t,
            A.m,
            A.offsets,
            ia,
            np.zeros(1),
            np.zeros(1),
            np.zeros(2, dtype=np.int64),
            np.zeros(len(ia), dtype=np.int64),
            False,
            group,
            a_fast,
            budget,
        )
    return pareto_sums(
        A.t, A.m, A.offsets, ia, B.t, B.m, B.offsets, ib, True, group, a_fast, budget
    )


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    span=st.sampled_from([8, 30, 1000, 10**6]),
    offset=st.sampled_from([0.0, 2.0**52]),
    with_b=st.booleans(),
    budget=st.sampled_from([math.inf, 0.5, 0.8]),
)
def test_the_kernel_keeps_what_sorting_every_candidate_keeps(seed, span, offset, with_b, budget):
    rng = np.random.default_rng(seed)
    # With the offset, A's values sit where the float64 spacing is 1 and B's are
    # quarters: their sums round, so neighbouring points of one run can be equal.
    A = _table(rng, int(rng.integers(1, 8)), span, offset, 1.0)
    B = _table(rng, int(rng.integers(1, 8)), span, 0.0, 0.25 if offset else 1.0) if with_b else None
    n_pairs = int(rng.integers(1, 20))
    ia = rng.integers(0, A.n_entries, n_pairs)
    ib = rng.integers(0, B.n_entries, n_pairs) if B is not None else None
    group = rng.integers(0, 4, n_pairs)
    cut = budget if budget == math.inf else offset + budget * span * (2 if with_b else 1)
    (pa, pb, g), (ia_s, group_s, a_fast) = _reference(A, ia, B, ib, group, cut)
    order = np.argsort(group, kind="stable")
    ib_s = ib[order] if ib is not None else None
    ka, kb, kg = _kernel(A, B, ia_s, group_s, ib_s, a_fast, float(cut))
    assert np.array_equal(ka, pa)
    assert np.array_equal(kb, pb)
    assert np.array_equal(kg, g)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), sizes=st.tuples(st.integers(1, 300), st.integers(1, 300)))
def test_sum_entries_returns_the_pareto_set_of_the_sums(seed, sizes):
    """One pair: the kept points are the Pareto set of every a + b (an independent check
    that does not go through `prune_groups`)."""
    rng = np.random.default_rng(seed)

    def stair(n):
        t = np.cumsum(rng.integers(1, 50, n)).astype(np.float64)
        m = np.cumsum(rng.integers(1, 50, n))[::-1].astype(np.float64)
        return frontier.Table(np.array([0, n]), t, m, np.zeros(n, dtype=np.int64))

    A, B = stair(sizes[0]), stair(sizes[1])
    one = np.zeros(1, dtype=np.int64)
    out = frontier.sum_entries(A, one, B, one, one, 1, Provenance(), frontier.Filter())
    sums = [
        (a + b, c + d) for a, c in zip(A.t, A.m, strict=True) for b, d in zip(B.t, B.m, strict=True)
    ]
    assert list(zip(out.t.tolist(), out.m.tolist(), strict=True)) == pareto(sums)


@pytest.mark.slow
def test_the_kernels_run_where_numba_cannot_write_a_cache():
    """With no cache location numba refuses ``cache=True``; the kernels then compile in
    the process (here: numba told to look only inside zip files)."""
    code = (
        "import numpy as np\n"
        "from tensoropt.search import bounds, frontier, paretosum\n"
        "from tensoropt.search.provenance import Provenance\n"
        "assert type(paretosum.pareto_sums._cache).__name__ == 'NullCache'\n"
        "assert type(bounds._all_corners_cut._cache).__name__ == 'NullCache'\n"
        "A = frontier.Table(np.array([0, 2]), np.array([1.0, 2.0]), np.array([2.0, 1.0]),"
        " np.zeros(2, dtype=np.int64))\n"
        "one = np.zeros(1, dtype=np.int64)\n"
        "out = frontier.sum_entries(A, one, A, one, one, 1, Provenance(), frontier.Filter())\n"
        "print(out.t.tolist(), out.m.tolist())\n"
    )
    env = dict(os.environ, NUMBA_CACHE_LOCATOR_CLASSES="ZipCacheLocator")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[2.0, 3.0, 4.0] [4.0, 3.0, 2.0]"
