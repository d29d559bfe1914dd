"""Hub splitting: a unit that touches many others only through a coarse function of its
strategy gets that function as a separate variable.

Why: the cost model places a parameter read by several units with its first reader (the
owner) and gives every other reader an edge from the owner. An LSTM's recurrent weight is
read by all time steps, so the owner is a hub whose strategy stays in the scope of every
factor of the time sweep. Those edges only depend on the *layout of the parameter* under
the owner's strategy (3 layouts for 5..10 strategies), not on the whole strategy.

What: for a unit v with at least MIN_DEGREE neighbours, the largest group of neighbours
whose edge tables have the same row-equality partition of v's strategies (when it is
coarser than v's domain and the group has >= 2 members) is rewired to a new variable c
(domain: the classes) with one row per class, and a constraint factor over (v, c)
holds (0, 0) where c = class(v) and nothing (an empty, infeasible entry) elsewhere.
Plans of the new factor graph are the old plans, with c determined by v, and every plan
keeps its value: the search stays exact. c carries no back-pointers, so recovery is
unchanged. The elimination then keeps c (not v) in the sweep's scope, and the tables
shrink by dim(v) / dim(c).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensoropt.search.factor import Context, Factor
from tensoropt.search.frontier import Table
from tensoropt.search.prepared import Prepared

MIN_DEGREE = 8


@dataclass(frozen=True, slots=True)
class HubSplit:
    """One split: unit `unit` gets class variable `var` (domain size = classes)."""

    unit: int
    var: int
    labels: np.ndarray  # class of each strategy of `unit`
    neighbours: tuple[int, ...]  # units whose edge now goes to `var`


def _labels(rows: np.ndarray) -> np.ndarray:
    """Class of each row (first-occurrence numbering of equal rows)."""
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    return rank[inverse.reshape(-1)]


def _rows(prep: Prepared, v: int, w: int) -> np.ndarray:
    key = (min(v, w), max(v, w))
    t, m = prep.edges[key]
    if key[0] != v:
        t, m = t.T, m.T
    return np.concatenate([t, m], axis=1)


def find_splits(prep: Prepared, edges: list[tuple[int, int]], first_var: int) -> list[HubSplit]:
    """The hub splits of the edges `edges` (keys of prep.edges); new variables are numbered
    from `first_var`. A unit is split at most once; a split neighbour is never a hub."""
    nbrs: dict[int, list[int]] = {}
    for a, b in edges:
        nbrs.setdefault(a, []).append(b)
        nbrs.setdefault(b, []).append(a)
    splits: list[HubSplit] = []
    touched: set[int] = set()
    for v in sorted(nbrs, key=lambda u: (-len(nbrs[u]), u)):
        if len(nbrs[v]) < MIN_DEGREE or v in touched:
            continue
        by_partition: dict[bytes, list[int]] = {}
        for w in sorted(nbrs[v]):
            if w not in touched:
                by_partition.setdefault(_labels(_rows(prep, v, w)).tobytes(), []).append(w)
        if not by_partition:
            continue
        key, coarse = max(by_partition.items(), key=lambda kv: (len(kv[1]), -max(kv[0])))
        labels = np.frombuffer(key, dtype=np.int64)
        if len(coarse) < 2 or labels.max() + 1 >= prep.dims[v]:
            continue
        splits.append(HubSplit(v, first_var + len(splits), labels, tuple(coarse)))
        touched.add(v)
        touched.update(coarse)
    return splits


def split_factors(ctx: Context, prep: Prepared, split: HubSplit) -> list[Factor]:
    """The constraint factor (unit, var) and the rewired edges (neighbour, var)."""
    n_cls = int(split.labels.max()) + 1
    dim = prep.dims[split.unit]
    out = [_constraint(ctx, split, dim, n_cls)]
    reps = np.array([int(np.flatnonzero(split.labels == c)[0]) for c in range(n_cls)])
    for w in split.neighbours:
        shape = (prep.dims[w], n_cls)
        if ctx.symbolic:
            out.append(Factor((w, split.var), shape, None))
            continue
        key = (min(split.unit, w), max(split.unit, w))
        t, m = prep.edges[key]
        if key[0] == split.unit:
            t, m = t.T, m.T  # rows: strategies of w, columns: strategies of the unit
        table = Table.scalars(t[:, reps].ravel(), m[:, reps].ravel())
        out.append(Factor((w, split.var), shape, table))
    return out


def _constraint(ctx: Context, split: HubSplit, dim: int, n_cls: int) -> Factor:
    shape = (dim, n_cls)
    scope = (split.unit, split.var)
    if ctx.symbolic:
        return Factor(scope, shape, None)
    hit = (split.labels[:, None] == np.arange(n_cls)[None, :]).ravel()
    offsets = np.concatenate([[0], np.cumsum(hit)]).astype(np.int64)
    k = int(hit.sum())
    table = Table(offsets, np.zeros(k), np.zeros(k), np.zeros(k, dtype=np.int64))
    return Factor(scope, shape, table)
