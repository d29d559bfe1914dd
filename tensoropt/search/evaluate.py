"""A cost problem's tables as flat arrays, and the compiled loops that read them.

`CostProblem.evaluate` sums one plan's terms with ``math.fsum``: the correctly rounded
sum, independent of the order of the terms, so every solver reading the same tables
gets the same float for the same plan. :func:`evaluate_rows` gives that float for many
plans at once: `_row_sums` runs the algorithm of CPython's ``math.fsum`` (Shewchuk's
non-overlapping partials, then the half-even correction across partials) over each
row's gathered terms. Its result is the correctly rounded sum, which is unique, so it
is bit for bit what ``math.fsum`` returns; rows with a non-finite term or an
intermediate overflow are left to ``math.fsum`` itself (its special values and errors).

:func:`relaxed_lows` is the relaxation behind ``solver.surely_dominated``: per weight
pair (wt, wm), the sum over tables of each table's least ``wt * t + wm * m``.

Repeated layers share their table objects (``cost.model`` builds one per distinct
edge), so the flattening converts each distinct table once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensoropt.ir.costs import CostProblem
from tensoropt.search.jit import compiled

# Partials a finite sum can hold: they do not overlap, so at most the exponent range
# over the mantissa width (2098 / 53 < 40) of them are nonzero at once.
_PARTIALS = 64


@dataclass(frozen=True, slots=True)
class FlatTables:
    """Every unit's and edge's (time, memory) entries in two flat arrays.

    A unit's table starts at ``unit_at[u]`` (one entry per strategy); an edge's at
    ``edge_at[e]``, row-major over (strategy of ``src``, strategy of ``dst``), with
    ``edge_cols[e]`` columns. ``table_at`` and ``table_size`` place the distinct tables;
    ``tables`` lists, in the order ``CostProblem.evaluate`` adds them (units, then edges),
    the distinct table of each unit and edge."""

    times: np.ndarray
    memories: np.ndarray
    unit_at: np.ndarray
    edge_at: np.ndarray
    edge_cols: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    table_at: np.ndarray
    table_size: np.ndarray
    tables: np.ndarray


def flat_tables(problem: CostProblem) -> FlatTables:
    times: list[np.ndarray] = []
    memories: list[np.ndarray] = []
    where: dict[tuple[int, int], int] = {}  # ids of a table pair -> its distinct index
    table_at: list[int] = []
    table_size: list[int] = []
    tables: list[int] = []
    size = 0

    def place(t, m, key) -> int:
        nonlocal size
        found = where.get(key)
        if found is None:
            ta = np.asarray(t, dtype=np.float64).ravel()
            table_at.append(size)
            table_size.append(ta.size)
            size += ta.size
            times.append(ta)
            memories.append(np.asarray(m, dtype=np.float64).ravel())
            found = where[key] = len(where)
        tables.append(found)
        return table_at[found]

    unit_at = []
    for u in problem.units:
        t = [s.time_s for s in u.strategies]
        m = [s.memory_bytes for s in u.strategies]
        unit_at.append(place(t, m, (id(u.strategies), 0)))
    edge_at, edge_cols = [], []
    for e in problem.edges:
        # the tables stay alive in the problem, so their ids are theirs for this call
        edge_at.append(place(e.time_s, e.memory_bytes, (id(e.time_s), id(e.memory_bytes))))
        edge_cols.append(len(e.time_s[0]) if len(e.time_s) else 0)
    empty = np.empty(0, dtype=np.float64)
    i64 = np.int64
    return FlatTables(
        np.concatenate(times) if times else empty,
        np.concatenate(memories) if memories else empty,
        np.asarray(unit_at, dtype=i64),
        np.asarray(edge_at, dtype=i64),
        np.asarray(edge_cols, dtype=i64),
        np.asarray([e.src for e in problem.edges], dtype=i64),
        np.asarray([e.dst for e in problem.edges], dtype=i64),
        np.asarray(table_at, dtype=i64),
        np.asarray(table_size, dtype=i64),
        np.asarray(tables, dtype=i64),
    )


@compiled(inline="always")
def _add(p, n, x):
    """Add ``x`` to the partials p[:n]; return their new count (-1: ``x`` is not finite,
    or the sum overflows)."""
    if not np.isfinite(x):
        return -1
    i = 0
    for j in range(n):
        y = p[j]
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        yr = hi - x
        lo = y - yr
        if lo != 0.0:
            p[i] = lo
            i += 1
        x = hi
    if x != 0.0:
        if not np.isfinite(x):
            return -1
        p[i] = x
        i += 1
    return i


@compiled(inline="always")
def _round(p, n):
    """The correctly rounded sum of the partials p[:n] (CPython's fsum ending)."""
    hi = 0.0
    lo = 0.0
    if n > 0:
        n -= 1
        hi = p[n]
        while n > 0:
            x = hi
            n -= 1
            y = p[n]
            hi = x + y
            yr = hi - x
            lo = y - yr
            if lo != 0.0:
                break
        if n > 0 and ((lo < 0.0 and p[n - 1] < 0.0) or (lo > 0.0 and p[n - 1] > 0.0)):
            y = lo * 2.0
            x = hi + y
            yr = x - hi
            if y == yr:
                hi = x
    return hi


@compiled()
def _row_sums(choices, values, unit_at, edge_at, edge_cols, edge_src, edge_dst, out, ok):
    p = np.empty(_PARTIALS)
    n_units = unit_at.size
    for r in range(choices.shape[0]):
        row = choices[r]
        n = 0
        for u in range(n_units):
            n = _add(p, n, values[unit_at[u] + row[u]])
            if n < 0:
                break
        for e in range(edge_at.size if n >= 0 else 0):
            n = _add(p, n, values[edge_at[e] + row[edge_src[e]] * edge_cols[e] + row[edge_dst[e]]])
            if n < 0:
                break
        ok[r] = n >= 0
        out[r] = _round(p, n) if n >= 0 else 0.0


def evaluate_rows(problem: CostProblem, choices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(times, memories) of every row of ``choices``, each equal to
    ``problem.evaluate(row)``."""
    flat = flat_tables(problem)
    choices = np.ascontiguousarray(choices, dtype=np.int64).reshape(len(choices), -1)
    out = []
    for values in (flat.times, flat.memories):
        sums = np.empty(len(choices))
        ok = np.empty(len(choices), dtype=np.bool_)
        _row_sums(
            choices, values, flat.unit_at, flat.edge_at, flat.edge_cols, flat.edge_src,
            flat.edge_dst, sums, ok,
        )  # fmt: skip
        out.append((sums, ok))
    (times, t_ok), (memories, m_ok) = out
    for r in np.flatnonzero(~(t_ok & m_ok)):  # special values: math.fsum's own answer
        times[r], memories[r] = problem.evaluate(tuple(choices[r].tolist()))
    return times, memories


@compiled()
def _lows(times, memories, table_at, table_size, tables, wt, wm, out):
    least = np.empty((table_at.size, wt.size))
    for k in range(table_at.size):
        start = table_at[k]
        for w in range(wt.size):
            low = np.inf
            for i in range(start, start + table_size[k]):
                v = wt[w] * times[i] + wm[w] * memories[i]
                if v < low:
                    low = v
            least[k, w] = low
    for w in range(wt.size):
        total = 0.0
        for k in tables:
            total += least[k, w]
        out[w] = total


def relaxed_lows(flat: FlatTables, wt: np.ndarray, wm: np.ndarray) -> np.ndarray:
    """Per weight pair k: the sum over the units and edges, in order, of the least
    ``wt[k] * time + wm[k] * memory`` of their table's entries."""
    out = np.empty(len(wt))
    _lows(
        flat.times, flat.memories, flat.table_at, flat.table_size, flat.tables,
        np.ascontiguousarray(wt, dtype=np.float64), np.ascontiguousarray(wm, dtype=np.float64),
        out,
    )  # fmt: skip
    return out
