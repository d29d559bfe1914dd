"""Frontier algebra, batched: many small Pareto frontiers stored back to back.

A :class:`Table` holds N frontiers (the entries of a factor table) in CSR form: entry k owns
positions ``offsets[k]:offsets[k+1]`` of the flat arrays ``t`` (time), ``m`` (memory) and
``prov`` (back-pointer node ids). Inside an entry, points are sorted by time ascending and
memory strictly descending: no point dominates another and no two are equal.

The two operations of Frontier Tracking, ``⊕`` (Minkowski sum, then prune) and ``∪`` (union,
then prune), are done for all entries of a factor product at once by :func:`sum_entries`:
given pairs of entries (a_k of table A, b_k of table B) and an output group g_k, it keeps the
non-dominated sums a + b of each group, with points over the memory budget dropped. Several
pairs sharing a group is the union. The compiled kernel (:mod:`tensoropt.search.paretosum`)
does it without forming every sum.

Pruning is exact: ordered by (time, memory, input order), a point is kept iff its memory is
strictly below the memory of every earlier point of its group. Equal points therefore keep
the first one in input order (for sums, the candidate order of
:mod:`tensoropt.search.paretosum`), which is a deterministic function of the problem, so
solving the same problem twice returns the same choices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tensoropt.search.jit import compiled
from tensoropt.search.paretosum import pareto_sums
from tensoropt.search.provenance import Provenance

# Stand-ins for B when `sum_entries` has none (one empty entry, never read).
_NO_B_T = np.zeros(1, dtype=np.float64)
_NO_B_OFF = np.zeros(2, dtype=np.int64)


class PointFilter(Protocol):
    """Drops candidate points that cannot reach the final frontier (e.g. a
    :class:`tensoropt.search.bounds.Bound`). The frontier algebra only calls ``keep``,
    so it does not depend on how the bounds are computed."""

    def keep(self, g: np.ndarray, t: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Mask of the points (output entry g, time t, memory m) to keep."""
        ...


@dataclass(slots=True)
class Table:
    """N frontiers back to back (see module docstring)."""

    offsets: np.ndarray  # int64, N + 1
    t: np.ndarray  # float64
    m: np.ndarray  # float64
    prov: np.ndarray  # int64 node ids

    @property
    def n_entries(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @staticmethod
    def scalars(t: np.ndarray, m: np.ndarray, prov: np.ndarray | None = None) -> Table:
        """One single-point frontier per entry (unit strategies, edge entries)."""
        n = len(t)
        ids = np.zeros(n, dtype=np.int64) if prov is None else prov
        return Table(
            np.arange(n + 1, dtype=np.int64),
            np.ascontiguousarray(t, dtype=np.float64),
            np.ascontiguousarray(m, dtype=np.float64),
            ids,
        )

    def thinned(self, delta: float) -> Table:
        """Each frontier thinned by :func:`epsilon_thin`: every dropped point has a kept one
        of its entry with no more memory and at most (1 + delta) times its time."""
        g = np.repeat(np.arange(self.n_entries), self.sizes)
        keep = epsilon_thin(g, self.t, delta)
        offsets = np.zeros(self.n_entries + 1, dtype=np.int64)
        np.cumsum(np.bincount(g[keep], minlength=self.n_entries), out=offsets[1:])
        return Table(offsets, self.t[keep], self.m[keep], self.prov[keep])

    def shifted(self, prov: Provenance, offset: int) -> Table:
        """The same frontiers whose back-pointers move every unit index by `offset`."""
        return Table(self.offsets, self.t, self.m, prov.shift(self.prov, offset))


@dataclass(frozen=True, slots=True)
class Filter:
    """What `sum_entries` drops besides dominated points.

    budget: points with memory above it (sound: costs are nonnegative, so a partial sum
    over budget can only grow). delta: one-sided epsilon slack; a point p is dropped when
    a kept point of the same entry has no more memory and at most
    (1 + delta) * p.time + slack of time. slack: delta * spread * the least time of the
    product's leaves (:meth:`at`; docs/design/search.md, "Completion slack").
    """

    budget: float = math.inf
    delta: float | None = None
    spread: float = 0.0
    slack: float = 0.0

    def at(self, lows: Sequence[float]) -> Filter:
        """This filter for a product whose leaves take at least ``sum(lows)`` of time
        (``Factor.lows``; summed only where the slack is used)."""
        if self.delta is None or not self.spread:
            return self
        return Filter(
            self.budget, self.delta, self.spread, self.delta * self.spread * math.fsum(lows)
        )


def prune_groups(g: np.ndarray, t: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated points of every group, sorted by (group, time).

    `g` must be non-decreasing. Equal points keep the first in input order. Large groups are
    sorted one at a time by time with a stable sort; many small groups are sorted together
    with one lexsort. Sums of staircases go through the kernel of :func:`sum_entries`
    instead; this prunes the other point sets (merged frontiers, the bounds' incumbents).
    """
    n = len(t)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    bounds = np.flatnonzero(np.diff(g)) + 1
    if len(bounds) > 64 and n < 512 * (len(bounds) + 1):
        return _prune_lexsort(g, t, m)
    starts = np.concatenate([[0], bounds])
    stops = np.concatenate([bounds, [n]])
    out = [
        s + _prune_one(t[s:e], m[s:e]) for s, e in zip(starts.tolist(), stops.tolist(), strict=True)
    ]
    return np.concatenate(out)


def _prune_one(t: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Non-dominated indices of one group, by time. A stable sort by time alone suffices:
    of points with equal time, all but the last kept one (the least memory) are dropped."""
    order = np.argsort(t, kind="stable")
    ms = m[order]
    keep = np.empty(len(ms), dtype=bool)
    keep[0] = True
    keep[1:] = ms[1:] < np.minimum.accumulate(ms)[:-1]
    idx = order[keep]
    ts = t[idx]
    last = np.ones(len(idx), dtype=bool)
    last[:-1] = ts[:-1] != ts[1:]
    return idx[last]


def _prune_lexsort(g: np.ndarray, t: np.ndarray, m: np.ndarray) -> np.ndarray:
    order = np.lexsort((m, t, g))
    gs, ms = g[order], m[order]
    # Memory ranks; a stable sort gives equal memories increasing ranks in (g, t) order,
    # so a later equal-memory point is never "strictly below" an earlier one.
    rank = np.empty(len(ms), dtype=np.int64)
    rank[np.argsort(ms, kind="stable")] = np.arange(len(ms), dtype=np.int64)
    # Subtracting group * (n + 1) makes every key of a later group smaller than every key of
    # an earlier one, so one running minimum restarts at each group boundary.
    key = rank - gs.astype(np.int64) * (len(ms) + 1)
    keep = np.empty(len(ms), dtype=bool)
    keep[0] = True
    keep[1:] = key[1:] < np.minimum.accumulate(key)[:-1]
    return order[keep]


def epsilon_thin(g: np.ndarray, t: np.ndarray, delta: float, slack: float = 0.0) -> np.ndarray:
    """Mask of points to keep from pruned frontiers sorted by (group, time).

    Each group is scanned from its last (least-memory) point down: a point p is dropped
    when the representative kept last, which has less memory, takes at most
    (1 + delta) * p.time + slack (checked in floating point, so a rounding error keeps a
    point rather than breaking the guarantee); otherwise p is kept and becomes the
    representative.
    The last point of a group is always kept (nothing has less memory), and a point
    kept is the first one its successor cannot cover, so no smaller subset covers the
    group (the greedy cover from the right is optimal).
    """
    if len(t) == 0:
        return np.zeros(0, dtype=bool)
    return _thin(g, t, 1.0 + delta, slack)


@compiled()
def _thin(g: np.ndarray, t: np.ndarray, ratio: float, slack: float) -> np.ndarray:
    n = len(t)
    keep = np.zeros(n, dtype=np.bool_)
    rep_t = 0.0
    rep_g = g[n - 1] + 1
    for i in range(n - 1, -1, -1):
        if g[i] != rep_g or not (rep_t <= t[i] * ratio + slack):
            keep[i] = True
            rep_t = t[i]
            rep_g = g[i]
    return keep


def sum_entries(
    A: Table,
    ia: np.ndarray,
    B: Table | None,
    ib: np.ndarray | None,
    group: np.ndarray,
    n_groups: int,
    prov: Provenance,
    flt: Filter,
    bound: PointFilter | None = None,
) -> Table:
    """Output entry g = prune( ∪_{k: group[k]=g} A[ia[k]] ⊕ B[ib[k]] ), B=None means A alone.

    bound: also drop points that no completion can bring onto the frontier
    (:mod:`tensoropt.search.bounds`; exact).
    """
    order = np.argsort(group, kind="stable")
    ia, group = ia[order], group[order]
    sa = A.sizes[ia]
    if B is None:
        sb = np.ones_like(sa)
    else:
        assert ib is not None
        ib = ib[order]
        sb = B.sizes[ib]
    a_fast = bool(sa.sum() >= sb.sum())
    if B is None:
        bt, bm, boff, ib_ = _NO_B_T, _NO_B_T, _NO_B_OFF, np.zeros(len(ia), dtype=np.int64)
    else:
        bt, bm, boff, ib_ = B.t, B.m, B.offsets, ib
    pa, pb, g = pareto_sums(
        A.t,
        A.m,
        A.offsets,
        ia,
        bt,
        bm,
        boff,
        ib_,
        B is not None,
        group,
        a_fast,
        float(flt.budget),
    )
    t, m = A.t[pa], A.m[pa]
    if B is not None:
        t, m = t + B.t[pb], m + B.m[pb]
    if bound is not None:  # after pruning: far fewer points to test (exact either way)
        keep = bound.keep(g, t, m)
        pa, pb, g, t, m = pa[keep], pb[keep], g[keep], t[keep], m[keep]
    if flt.delta is not None:
        keep = epsilon_thin(g, t, flt.delta, flt.slack)
        pa, pb, g, t, m = pa[keep], pb[keep], g[keep], t[keep], m[keep]
    ids = A.prov[pa] if B is None else prov.pairs(A.prov[pa], B.prov[pb])
    counts = np.bincount(g, minlength=n_groups)
    offsets = np.zeros(n_groups + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Table(offsets, t, m, ids)
