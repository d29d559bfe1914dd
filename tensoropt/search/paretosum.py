"""Pareto sums of staircases without forming every pair (compiled with numba).

`sum_entries` needs, for each output group g, the non-dominated points of
``∪_k A[ia[k]] ⊕ B[ib[k]]`` over the pairs k of g. Forming all |A| x |B| candidates and
sorting them costs in proportion to the candidates; on the GPT-3 175B shape most groups
hold 16k-256k candidates of which a few hundred survive.

Here each pair is cut into *runs*: one point of the shorter entry plus every point of the
longer one. Both entries are sorted by time with memory strictly falling, so a run is
itself sorted by time with memory not rising. A heap merges a group's runs by the key
(time, memory, candidate index) and keeps a popped point iff its memory is strictly below
the least memory kept so far (the running minimum M); the budget is a second bound on
memory. After each pop its run jumps, by binary search, to its first point with memory
below M: every point it passes is dominated by a kept one (or over budget) and would be
dropped anyway. The work then follows the points kept and the runs, not the pairs.

The candidate index is the position a candidate has in `frontier._pairs`'s order (pairs
in group order, the fast offset walking the entry chosen by `a_fast`), so ties (equal
time and memory) keep the same point the sort-based pruning keeps: the kept points are
exactly ``prune_groups`` of all candidates (property-tested in tests/search).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _less(t1, m1, i1, t2, m2, i2):
    if t1 != t2:
        return t1 < t2
    if m1 != m2:
        return m1 < m2
    return i1 < i2


@njit(cache=True, inline="always")
def _point(at, am, bt, bm, a0, b0, has_b, moving_a, s, f):
    """Time and memory of run point f (the fixed entry's point s plus the moving one's f),
    added in the order `sum_entries` adds them (A's value first)."""
    i_a = f if moving_a else s
    i_b = s if moving_a else f
    if has_b:
        return at[a0 + i_a] + bt[b0 + i_b], am[a0 + i_a] + bm[b0 + i_b]
    return at[a0 + i_a], am[a0 + i_a]


@njit(cache=True)
def _settle(at, am, bt, bm, a0, b0, has_b, moving_a, s, f, n_moving):
    """The least key of a run from point f on. Rounding can give neighbouring points of a
    run equal times (memory then falls): the least key is the first point of the equal-time
    block with the block's least memory; the points before it are strictly dominated."""
    t0, m_best = _point(at, am, bt, bm, a0, b0, has_b, moving_a, s, f)
    best = f
    j = f + 1
    while j < n_moving:
        t, m = _point(at, am, bt, bm, a0, b0, has_b, moving_a, s, j)
        if t != t0:
            break
        if m < m_best:
            m_best, best = m, j
        j += 1
    return best


@njit(cache=True)
def _sift_down(ht, hm, hi, hr, n, pos):
    t, m, i, r = ht[pos], hm[pos], hi[pos], hr[pos]
    while True:
        c = 2 * pos + 1
        if c >= n:
            break
        if c + 1 < n and _less(ht[c + 1], hm[c + 1], hi[c + 1], ht[c], hm[c], hi[c]):
            c += 1
        if not _less(ht[c], hm[c], hi[c], t, m, i):
            break
        ht[pos], hm[pos], hi[pos], hr[pos] = ht[c], hm[c], hi[c], hr[c]
        pos = c
    ht[pos], hm[pos], hi[pos], hr[pos] = t, m, i, r


@njit(cache=True, inline="always")
def _index(base, na, nb, a_fast, moving_a, s, f):
    """The candidate's position in `frontier._pairs` order: the tie-breaker."""
    i_a = f if moving_a else s
    i_b = s if moving_a else f
    if a_fast:
        return base + i_b * na + i_a
    return base + i_a * nb + i_b


@njit(cache=True)
def _jump(at, am, bt, bm, a0, b0, has_b, moving_a, s, lo, n_moving, bound):
    """The run's least key among its points from lo on whose memory is below `bound`
    (n_moving if none). Memory does not rise along a run, so the first such point is found
    by galloping from lo (it is usually near) and then a binary search; every point passed
    is dominated by a kept one or over budget."""
    if lo >= n_moving:
        return n_moving
    if _point(at, am, bt, bm, a0, b0, has_b, moving_a, s, lo)[1] >= bound:
        # Invariant: point lo is not below the bound.
        step = 1
        while (
            lo + step < n_moving
            and _point(at, am, bt, bm, a0, b0, has_b, moving_a, s, lo + step)[1] >= bound
        ):
            lo += step
            step *= 2
        hi = min(lo + step, n_moving)  # below the bound, or the end
        lo += 1
        while lo < hi:
            mid = (lo + hi) // 2
            if _point(at, am, bt, bm, a0, b0, has_b, moving_a, s, mid)[1] < bound:
                hi = mid
            else:
                lo = mid + 1
        if lo == n_moving:
            return lo
    return _settle(at, am, bt, bm, a0, b0, has_b, moving_a, s, lo, n_moving)


@njit(cache=True)
def _grow(arr, cap):
    grown = np.empty(cap, np.int64)
    grown[: len(arr)] = arr
    return grown


@njit(cache=True)
def pareto_sums(at, am, aoff, ia, bt, bm, boff, ib, has_b, group, a_fast, budget):
    """Kept (position in A, position in B, group) of every group, sorted by (group, time).

    Entries must be staircases (time rising, memory strictly falling) and `group`
    non-decreasing over the pairs. Without B (has_b False) each pair is one entry of A
    and the position in B repeats the one in A. `budget`: points with memory above it are
    dropped before pruning, as in `sum_entries`.
    """
    n_pairs = len(ia)
    cap = 1024
    out_a = np.empty(cap, np.int64)
    out_b = np.empty(cap, np.int64)
    out_g = np.empty(cap, np.int64)
    n_out = 0
    # Per pair: entry sizes and the index of its first candidate in `_pairs` order.
    sa = np.empty(n_pairs, np.int64)
    sb = np.empty(n_pairs, np.int64)
    base = np.empty(n_pairs, np.int64)
    total = 0
    for k in range(n_pairs):
        sa[k] = aoff[ia[k] + 1] - aoff[ia[k]]
        sb[k] = boff[ib[k] + 1] - boff[ib[k]] if has_b else 1
        base[k] = total
        total += sa[k] * sb[k]
    # The inclusive budget as a strict bound: m <= budget iff m < nextafter(budget, inf).
    limit = np.nextafter(budget, np.inf)
    start = 0
    while start < n_pairs:
        stop = start
        while stop < n_pairs and group[stop] == group[start]:
            stop += 1
        n_runs = 0
        for k in range(start, stop):
            n_runs += min(sa[k], sb[k])
        # Run r: pair run_k[r], point run_s[r] of the shorter entry (fixed), and the
        # longer entry (moving) from its point run_f[r] on.
        run_k = np.empty(n_runs, np.int64)
        run_s = np.empty(n_runs, np.int64)
        run_f = np.empty(n_runs, np.int64)
        # The heap of run heads, keyed (time, memory, candidate index).
        ht = np.empty(n_runs, np.float64)
        hm = np.empty(n_runs, np.float64)
        hi = np.empty(n_runs, np.int64)
        hr = np.empty(n_runs, np.int64)
        n_heap = 0
        r = 0
        best = limit  # the running minimum M of memory kept in this group
        for k in range(start, stop):
            a0 = aoff[ia[k]]
            b0 = boff[ib[k]] if has_b else 0
            moving_a = sa[k] >= sb[k]
            n_fixed = sb[k] if moving_a else sa[k]
            n_moving = sa[k] if moving_a else sb[k]
            for s in range(n_fixed):
                run_k[r], run_s[r] = k, s
                f = _jump(at, am, bt, bm, a0, b0, has_b, moving_a, s, 0, n_moving, best)
                if f < n_moving:
                    run_f[r] = f
                    ht[n_heap], hm[n_heap] = _point(at, am, bt, bm, a0, b0, has_b, moving_a, s, f)
                    hi[n_heap] = _index(base[k], sa[k], sb[k], a_fast, moving_a, s, f)
                    hr[n_heap] = r
                    n_heap += 1
                r += 1
        for pos in range(n_heap // 2 - 1, -1, -1):
            _sift_down(ht, hm, hi, hr, n_heap, pos)
        while n_heap > 0:
            r = hr[0]
            k, s, f = run_k[r], run_s[r], run_f[r]
            a0 = aoff[ia[k]]
            b0 = boff[ib[k]] if has_b else 0
            moving_a = sa[k] >= sb[k]
            n_moving = sa[k] if moving_a else sb[k]
            if hm[0] < best:
                best = hm[0]
                if n_out == cap:
                    cap *= 2
                    out_a, out_b, out_g = _grow(out_a, cap), _grow(out_b, cap), _grow(out_g, cap)
                i_a = f if moving_a else s
                out_a[n_out] = a0 + i_a
                out_b[n_out] = b0 + (s if moving_a else f) if has_b else a0 + i_a
                out_g[n_out] = group[k]
                n_out += 1
            f = _jump(at, am, bt, bm, a0, b0, has_b, moving_a, s, f + 1, n_moving, best)
            if f < n_moving:
                run_f[r] = f
                ht[0], hm[0] = _point(at, am, bt, bm, a0, b0, has_b, moving_a, s, f)
                hi[0] = _index(base[k], sa[k], sb[k], a_fast, moving_a, s, f)
            else:
                n_heap -= 1
                ht[0], hm[0], hi[0], hr[0] = ht[n_heap], hm[n_heap], hi[n_heap], hr[n_heap]
            if n_heap > 0:
                _sift_down(ht, hm, hi, hr, n_heap, 0)
        start = stop
    return out_a[:n_out].copy(), out_b[:n_out].copy(), out_g[:n_out].copy()
