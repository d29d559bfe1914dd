"""A cost problem as numpy arrays, normalised for the search.

Normalisation is exact bookkeeping, not approximation: an edge from a unit to itself only
ever uses its diagonal, which is added to the unit's costs; every other edge is oriented from
the lower to the higher unit index (transposing its tables), and parallel edges are merged by
adding their tables (edge elimination on scalars).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensoropt.ir.costs import CostProblem
from tensoropt.search.factor import Context, Factor
from tensoropt.search.frontier import Table


@dataclass(frozen=True, slots=True)
class Prepared:
    """Unit cost vectors and merged edge tables keyed by (low unit, high unit)."""

    dims: tuple[int, ...]
    unit_t: tuple[np.ndarray, ...]
    unit_m: tuple[np.ndarray, ...]
    edges: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]

    @property
    def n_units(self) -> int:
        return len(self.dims)

    def unit_factor(self, ctx: Context, i: int) -> Factor:
        """Unary factor of unit i; its points carry LEAF back-pointers."""
        lows = least_time(self.unit_t[i])
        if ctx.symbolic:
            return Factor((i,), (self.dims[i],), None, lows=lows)
        leaves = ctx.prov.leaves(i, self.dims[i])
        table = Table.scalars(self.unit_t[i], self.unit_m[i], leaves)
        return Factor((i,), (self.dims[i],), table, lows=lows)

    def edge_factor(self, ctx: Context, key: tuple[int, int]) -> Factor:
        """Binary factor of a merged edge; its points carry no back-pointer."""
        a, b = key
        shape = (self.dims[a], self.dims[b])
        t, m = self.edges[key]
        table = None if ctx.symbolic else Table.scalars(t.ravel(), m.ravel())
        return Factor(key, shape, table, lows=least_time(t))


def least_time(t: np.ndarray) -> tuple[float, ...]:
    """A leaf factor's ``lows`` (``Factor.lows``): its least time, none for an empty
    table."""
    return (float(t.min()),) if t.size else ()


def prepare(problem: CostProblem) -> Prepared:
    """Numpy view of `problem` with self-loops folded and parallel edges merged."""
    unit_t = [np.array([s.time_s for s in u.strategies], dtype=np.float64) for u in problem.units]
    unit_m = [
        np.array([s.memory_bytes for s in u.strategies], dtype=np.float64) for u in problem.units
    ]
    edges: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for e in problem.edges:
        t = np.array(e.time_s, dtype=np.float64).reshape(len(unit_t[e.src]), len(unit_t[e.dst]))
        m = np.array(e.memory_bytes, dtype=np.float64).reshape(t.shape)
        if e.src == e.dst:
            unit_t[e.src] = unit_t[e.src] + np.diag(t)
            unit_m[e.src] = unit_m[e.src] + np.diag(m)
            continue
        key = (e.src, e.dst)
        if e.src > e.dst:
            key, t, m = (e.dst, e.src), t.T, m.T
        if key in edges:
            t0, m0 = edges[key]
            t, m = t0 + t, m0 + m
        edges[key] = (np.ascontiguousarray(t), np.ascontiguousarray(m))
    dims = tuple(len(t) for t in unit_t)
    return Prepared(dims, tuple(unit_t), tuple(unit_m), edges)
