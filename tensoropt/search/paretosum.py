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
memory. After each pop its run jumps (galloping, then a binary search) to its first point
with memory below M: every point it passes is dominated by a kept one (or over budget) and would be
dropped anyway. The work then follows the points kept and the runs, not the pairs.

Candidate order, which breaks ties (equal time and memory): pairs in group order; within
pair k (entry sizes na, nb), the sum of A's point i and B's point j has position
``base_k + j * na + i`` when `a_fast` (A's offset moves fastest), else
``base_k + i * nb + j``, with base_k the candidates of the pairs before it. The kept points
are exactly those of forming every candidate in that order and pruning them with
``frontier.prune_groups`` (property-tested in tests/search/test_paretosum.py).

On the GPT-3 175B default search the calls pop about two heads per kept point (184 M
pops, 90 M kept, 30 runs per group on average in the 1229 calls over 4 ms). Rejected,
measured on those calls: a heap of run indices, each run's key kept with the run (one
integer moved per level instead of four values), was no faster: 1.02x and 1.08x the
time in two runs, where an identical copy of this kernel measured 0.99x and 1.05x.
"""

from __future__ import annotations

import numpy as np

from tensoropt.search.jit import compiled


@compiled(inline="always")
def _less(t1, m1, i1, t2, m2, i2):
    if t1 != t2:
        return t1 < t2
    if m1 != m2:
        return m1 < m2
    return i1 < i2


@compiled()
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


@compiled()
def _head(mt, mm, off, n, ft, fm, lo, bound):
    """A run's least key from its point lo on among the points with memory below `bound`,
    or n if there is none. The run's points are (ft + mt[off + f], fm + mm[off + f]): IEEE
    addition is commutative, so these are the sums `sum_entries` forms.

    Memory does not rise along a run, so the first point below the bound is found by
    galloping from lo (it is usually near) and a binary search; every point passed is
    dominated by a kept one or over budget. Rounding can give neighbouring points equal
    times (memory then falls): the least key is the first point of the equal-time block
    with the block's least memory, and the points before it are strictly dominated.
    """
    if lo >= n:
        return n
    if fm + mm[off + lo] >= bound:
        step = 1  # invariant: point lo is not below the bound
        while lo + step < n and fm + mm[off + lo + step] >= bound:
            lo += step
            step *= 2
        hi = min(lo + step, n)  # below the bound, or the end
        lo += 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fm + mm[off + mid] < bound:
                hi = mid
            else:
                lo = mid + 1
        if lo == n:
            return n
    t0 = ft + mt[off + lo]
    m_best = fm + mm[off + lo]
    best = lo
    j = lo + 1
    while j < n and ft + mt[off + j] == t0:
        m = fm + mm[off + j]
        if m < m_best:
            m_best, best = m, j
        j += 1
    return best


@compiled()
def _grow(arr, cap):
    grown = np.empty(cap, np.int64)
    grown[: len(arr)] = arr
    return grown


@compiled()
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
    # Per pair: entry sizes and the position of its first candidate (base_k).
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
    # The most runs of one group: the run and heap arrays are allocated once, that long.
    most, runs, start = 0, 0, 0
    for k in range(n_pairs):
        if group[k] != group[start]:
            most, runs, start = max(most, runs), 0, k
        runs += min(sa[k], sb[k])
    most = max(most, runs)
    # Run r: one point of a pair's shorter entry (fixed: time run_ft, memory run_fm,
    # position run_fp) plus the longer entry (moving: positions run_off + f, f < run_n,
    # in A when run_ma), from point run_f on. Its candidate index is
    # run_i0 + f * run_di.
    run_ft = np.empty(most, np.float64)
    run_fm = np.empty(most, np.float64)
    run_fp = np.empty(most, np.int64)
    run_off = np.empty(most, np.int64)
    run_n = np.empty(most, np.int64)
    run_ma = np.empty(most, np.bool_)
    run_i0 = np.empty(most, np.int64)
    run_di = np.empty(most, np.int64)
    run_f = np.empty(most, np.int64)
    # The heap of run heads, keyed (time, memory, candidate index).
    ht = np.empty(most, np.float64)
    hm = np.empty(most, np.float64)
    hi = np.empty(most, np.int64)
    hr = np.empty(most, np.int64)
    start = 0
    while start < n_pairs:
        stop = start
        while stop < n_pairs and group[stop] == group[start]:
            stop += 1
        n_heap = 0
        r = 0
        best = limit  # the running minimum M of memory kept in this group
        for k in range(start, stop):
            a0 = aoff[ia[k]]
            b0 = boff[ib[k]] if has_b else 0
            moving_a = sa[k] >= sb[k]
            n_fixed = sb[k] if moving_a else sa[k]
            for s in range(n_fixed):
                if moving_a:
                    run_off[r], run_n[r], run_fp[r] = a0, sa[k], b0 + s
                    run_ft[r] = bt[b0 + s] if has_b else 0.0
                    run_fm[r] = bm[b0 + s] if has_b else 0.0
                    # f walks A: i_a = f, i_b = s.
                    run_i0[r] = base[k] + (s * sa[k] if a_fast else s)
                    run_di[r] = 1 if a_fast else sb[k]
                else:
                    run_off[r], run_n[r], run_fp[r] = b0, sb[k], a0 + s
                    run_ft[r], run_fm[r] = at[a0 + s], am[a0 + s]
                    # f walks B: i_a = s, i_b = f.
                    run_i0[r] = base[k] + (s if a_fast else s * sb[k])
                    run_di[r] = sa[k] if a_fast else 1
                run_ma[r] = moving_a
                mt, mm = (at, am) if moving_a else (bt, bm)
                f = _head(mt, mm, run_off[r], run_n[r], run_ft[r], run_fm[r], 0, best)
                if f < run_n[r]:
                    run_f[r] = f
                    ht[n_heap] = run_ft[r] + mt[run_off[r] + f]
                    hm[n_heap] = run_fm[r] + mm[run_off[r] + f]
                    hi[n_heap] = run_i0[r] + f * run_di[r]
                    hr[n_heap] = r
                    n_heap += 1
                r += 1
        for pos in range(n_heap // 2 - 1, -1, -1):
            _sift_down(ht, hm, hi, hr, n_heap, pos)
        g = group[start]
        while n_heap > 0:
            r = hr[0]
            f = run_f[r]
            moving_a = run_ma[r]
            if hm[0] < best:
                best = hm[0]
                if n_out == cap:
                    cap *= 2
                    out_a, out_b, out_g = _grow(out_a, cap), _grow(out_b, cap), _grow(out_g, cap)
                if moving_a:
                    out_a[n_out] = run_off[r] + f
                    out_b[n_out] = run_fp[r] if has_b else run_off[r] + f
                else:
                    out_a[n_out] = run_fp[r]
                    out_b[n_out] = run_off[r] + f
                out_g[n_out] = g
                n_out += 1
            mt, mm = (at, am) if moving_a else (bt, bm)
            off, n = run_off[r], run_n[r]
            f = _head(mt, mm, off, n, run_ft[r], run_fm[r], f + 1, best)
            if f < n:
                run_f[r] = f
                ht[0] = run_ft[r] + mt[off + f]
                hm[0] = run_fm[r] + mm[off + f]
                hi[0] = run_i0[r] + f * run_di[r]
            else:
                n_heap -= 1
                ht[0], hm[0], hi[0], hr[0] = ht[n_heap], hm[n_heap], hi[n_heap], hr[n_heap]
            if n_heap > 0:
                _sift_down(ht, hm, hi, hr, n_heap, 0)
        start = stop
    return out_a[:n_out].copy(), out_b[:n_out].copy(), out_g[:n_out].copy()
