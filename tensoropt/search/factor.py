"""Factors whose entries are frontiers, and the products that variable elimination needs.

A :class:`Factor` maps every joint strategy assignment of its `scope` (sorted unit indices)
to a frontier. Unit costs are unary factors whose points carry LEAF back-pointers; edge
tables are binary factors whose points carry none. Multiplying factors is the frontier ``⊕``
entry by entry, and eliminating a unit is ``∪`` over its strategies, both done by
:func:`tensoropt.search.frontier.sum_entries` for the whole table at once.

A factor may be *symbolic* (``table is None``): it then only tracks scope and depth. Running
the elimination symbolically first gives the number of filtering steps along any path of the
computation (`depth`), which the epsilon mode needs before it runs for real.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tensoropt.search import memory
from tensoropt.search.frontier import Filter, Table, sum_entries
from tensoropt.search.provenance import Provenance

if TYPE_CHECKING:
    from tensoropt.search.bounds import Bound

# bytes a kept frontier point holds: its time, memory and provenance id in the table
# (8 bytes each) and its provenance node (a kind byte and two ids)
POINT_BYTES = 8 + 8 + 8 + 17


@dataclass(slots=True)
class Factor:
    """A frontier table over the joint strategies of `scope` (C order over `shape`)."""

    scope: tuple[int, ...]
    shape: tuple[int, ...]
    table: Table | None
    depth: int = 0
    # epsilon mode: lows[j] is the sum of the least times of the leaves (unit, edge and
    # composed-piece factors) that lie j filtering steps below this factor's output
    # (docs/design/search.md, "Completion slack"); empty where none is known
    lows: tuple[float, ...] = ()

    @property
    def n_entries(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class Context:
    """Everything one search run shares: the provenance arena, the filter and statistics."""

    prov: Provenance
    flt: Filter
    symbolic: bool = False
    bounding: bool = False  # bound pruning allowed (:mod:`tensoropt.search.bounds`)
    # the bounds' own incumbents (weighted-sum decodes of this problem) join `external`;
    # epsilon mode takes `external` only (their plans are returned elsewhere)
    own_incumbents: bool = True
    bound_trigger: int = 0  # ... once a step's inputs hold this many points
    convex_bounds: bool = False  # ... with weighted (convex) lower bounds too
    # (time, memory) of plans of other problems that join the bounds' incumbents
    external: tuple[np.ndarray, np.ndarray] | None = None
    max_frontier: int = 0
    max_scope: int = 0
    max_entries: int = 0
    products: int = 0
    notes: list[str] = field(default_factory=list)


def _ravel(coords: np.ndarray, shape: tuple[int, ...], n: int) -> np.ndarray:
    if not shape:
        return np.zeros(n, dtype=np.int64)
    return np.ravel_multi_index(tuple(coords), shape).astype(np.int64)


def multiply(
    ctx: Context,
    a: Factor,
    b: Factor | None,
    eliminate: frozenset[int] = frozenset(),
    bound: Bound | None = None,
) -> Factor:
    """The product a ⊗ b (b None: a alone), with the units `eliminate` summed out by ∪.
    `bound` (over the output entries) drops points that cannot reach the frontier.

    The work is proportional to the sum, over the joint assignments of both scopes, of the
    products of the two entries' frontier sizes: exponential only in the joint scope size.
    """
    dims = dict(zip(a.scope, a.shape, strict=True))
    if b is not None:
        dims.update(zip(b.scope, b.shape, strict=True))
    joint = tuple(sorted(dims))
    jshape = tuple(dims[v] for v in joint)
    out = tuple(v for v in joint if v not in eliminate)
    oshape = tuple(dims[v] for v in out)
    depth = max(a.depth, b.depth if b is not None else 0) + 1
    lows = _deeper(a.lows, b.lows if b is not None else ())
    ctx.max_scope = max(ctx.max_scope, len(joint))
    ctx.max_entries = max(ctx.max_entries, math.prod(jshape))
    if ctx.symbolic or a.table is None:
        return Factor(out, oshape, None, depth, lows)
    n = math.prod(jshape)
    coords = np.indices(jshape, dtype=np.int64).reshape(len(joint), n)
    pos = {v: i for i, v in enumerate(joint)}
    ia = _ravel(coords[[pos[v] for v in a.scope]], a.shape, n)
    group = _ravel(coords[[pos[v] for v in out]], oshape, n)
    flt = ctx.flt.at(lows)
    if b is None:
        table = sum_entries(a.table, ia, None, None, group, math.prod(oshape), ctx.prov, flt, bound)
    else:
        assert b.table is not None
        ib = _ravel(coords[[pos[v] for v in b.scope]], b.shape, n)
        table = sum_entries(
            a.table, ia, b.table, ib, group, math.prod(oshape), ctx.prov, flt, bound
        )
    ctx.products += 1
    # the frontiers just grew: stop before the machine runs out
    memory.made(POINT_BYTES * len(table.t))
    if table.n_entries:
        ctx.max_frontier = max(ctx.max_frontier, int(table.sizes.max()))
    return Factor(out, oshape, table, depth, lows)


def _deeper(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    """The ``lows`` of a product of factors with ``a`` and ``b``: one step deeper."""
    n = max(len(a), len(b))
    return (0.0, *((a[j] if j < len(a) else 0.0) + (b[j] if j < len(b) else 0.0) for j in range(n)))


def product_order(factors: list[Factor]) -> list[int]:
    """Indices of `factors` in the order `multiply_all` multiplies them."""
    return sorted(range(len(factors)), key=lambda i: (factors[i].n_entries, factors[i].scope))


def multiply_all(
    ctx: Context,
    factors: list[Factor],
    eliminate: frozenset[int] = frozenset(),
    bounds: list[Bound | None] | None = None,
) -> Factor:
    """Product of several factors, smallest tables first; `eliminate` is summed out last.

    bounds: one per product (max(n - 1, 1) of them, in order), or None.
    """
    if not factors:
        raise AssertionError("multiply_all needs at least one factor")
    todo = [factors[i] for i in product_order(factors)]
    bnd = bounds if bounds is not None else [None] * max(len(todo) - 1, 1)
    acc = todo[0]
    if len(todo) == 1:
        return multiply(ctx, acc, None, eliminate, bnd[0]) if eliminate else acc
    for p, f in enumerate(todo[1:-1]):
        acc = multiply(ctx, acc, f, frozenset(), bnd[p])
    return multiply(ctx, acc, todo[-1], eliminate, bnd[-1])


def translate(ctx: Context, f: Factor, offset: int) -> Factor:
    """The same factor for the block `offset` units later: scope and back-pointers move."""
    scope = tuple(v + offset for v in f.scope)
    if f.table is None:
        return Factor(scope, f.shape, None, f.depth, f.lows)
    return Factor(scope, f.shape, f.table.shifted(ctx.prov, offset), f.depth, f.lows)
