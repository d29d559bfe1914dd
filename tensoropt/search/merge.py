"""Merge per-(devices, mesh) frontiers into one frontier over (devices, time, memory).

A point (d, t, m) is kept iff no other point has d' <= d, t' <= t and m' <= m with at least
one strict inequality; equal points are kept once (the first by (devices, mesh, index)).
Device counts are processed in increasing order against a staircase of everything seen with
fewer devices, so the work is a sort plus one binary search per point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensoropt.cost.summary import replicates_all
from tensoropt.ir.costs import FrontierPoint
from tensoropt.search.frontier import prune_groups
from tensoropt.search.solver import SearchResult


@dataclass(frozen=True, slots=True)
class MergedPoint:
    """A point of the merged frontier and where it came from (index into that frontier)."""

    devices: int
    mesh: tuple[int, ...]
    index: int
    time_s: float
    memory_bytes: float
    variant: Any = None  # the problem's search.driver.Variant (None: keyed by mesh alone)


def _points(value: SearchResult | Sequence[FrontierPoint]) -> Sequence[FrontierPoint]:
    return value.points if isinstance(value, SearchResult) else value


def merge_frontiers(
    results: Mapping[tuple, SearchResult | Sequence[FrontierPoint]],
) -> tuple[MergedPoint, ...]:
    """The (devices, time, memory) non-dominated points, sorted by devices then time.
    Keys are (devices, mesh) or (devices, mesh, variant)."""
    rows = [
        (key[0], key[1], k, p.time_s, p.memory_bytes, key[2] if len(key) > 2 else None)
        for key in sorted(results)
        for k, p in enumerate(_points(results[key]))
    ]
    if not rows:
        return ()
    dev = np.array([r[0] for r in rows])
    t = np.array([r[3] for r in rows], dtype=np.float64)
    m = np.array([r[4] for r in rows], dtype=np.float64)
    st_t = np.zeros(0)
    st_m = np.zeros(0)
    out: list[MergedPoint] = []
    for d in np.unique(dev):
        idx = np.flatnonzero(dev == d)
        idx = idx[prune_groups(np.zeros(len(idx), dtype=np.int64), t[idx], m[idx])]
        if len(st_t):
            pos = np.searchsorted(st_t, t[idx], side="right") - 1
            covered = (pos >= 0) & (st_m[np.maximum(pos, 0)] <= m[idx])
            idx = idx[~covered]
        out += [MergedPoint(*rows[i]) for i in idx]
        all_t = np.concatenate([st_t, t[idx]])
        all_m = np.concatenate([st_m, m[idx]])
        keep = prune_groups(np.zeros(len(all_t), dtype=np.int64), all_t, all_m)
        st_t, st_m = all_t[keep], all_m[keep]
    return tuple(out)


def fewer_devices(
    frontiers: Mapping[int, Sequence[tuple[float, float]]],
) -> Callable[[int, float, float], int | None]:
    """``f(d, time, memory)``: the fewest devices below ``d`` whose frontier (in
    ``frontiers``: per device count, its (time, memory) points, fastest first and memory
    falling) holds a point at most as slow and as large; None when no smaller count
    does. The point of least memory among those at most as slow is the last one at or
    below the time: one binary search per smaller count."""
    stairs = {
        d: (np.array([t for t, _ in points]), np.array([m for _, m in points]))
        for d, points in sorted(frontiers.items())
    }

    def fewer(d: int, time_s: float, memory: float) -> int | None:
        for c, (times, memories) in stairs.items():
            if c >= d:
                return None
            k = int(np.searchsorted(times, time_s, side="right")) - 1
            if k >= 0 and memories[k] <= memory:
                return c
        return None

    return fewer


def fewer_note(count: int | None, summary: str) -> str:
    """What a table row of a plan with ``summary`` adds when a plan on ``count`` fewer
    devices matches it (:func:`fewer_devices`): " (no better than N devices)"; nothing
    when none does, or when the summary says the plan replicates all work (its own "no
    faster than 1 device" says more, whichever smaller count was searched)."""
    if count is None or replicates_all(summary):
        return ""
    return f" (no better than {count} device{'s' if count != 1 else ''})"
