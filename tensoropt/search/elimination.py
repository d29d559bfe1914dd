"""Variable elimination over the strategy-interaction graph, with frontiers as values.

The interaction graph has one vertex per unit and an edge between units that share a factor.
Eliminating a unit multiplies the factors that contain it and takes the union over its
strategies; the result is a factor over its neighbours. This one operation covers the three
rules of the OptCNN / TensorOpt lineage:

- node elimination: a unit of degree 1 folds into its neighbour's unary factor, a unit of
  degree 2 into an edge factor between its two neighbours (a frontier table);
- edge elimination: factors over the same pair of units are merged by ``⊕`` when they are
  multiplied together;
- the general fallback for residual blocks, attention and branches: any unit, in an order
  that keeps the new factors small.

The order is greedy. Two classic heuristics are computed, min-fill (fewest new graph edges)
and min-weight (smallest new table, which prefers the degree <= 2 node eliminations), and the
one with the smaller total table work (sum over steps of the product of the domain sizes of
the unit and its neighbours) is used. The work is exponential only in the elimination width.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable

from tensoropt.rules.sharding.memo import Memo
from tensoropt.search.bounds import BoundSet, Schedule, Step, compute_bounds
from tensoropt.search.factor import Context, Factor, multiply_all

Key = tuple[int, int, int]


def _graph(scopes: Iterable[tuple[int, ...]], variables: Iterable[int]) -> dict[int, set[int]]:
    adj: dict[int, set[int]] = {v: set() for v in variables}
    for scope in scopes:
        for u in scope:
            adj.setdefault(u, set()).update(w for w in scope if w != u)
    return adj


def _fill(adj: dict[int, set[int]], v: int) -> int:
    nbrs = list(adj[v])
    return sum(1 for i, x in enumerate(nbrs) for y in nbrs[i + 1 :] if y not in adj[x])


def _greedy(
    adj: dict[int, set[int]],
    dims: dict[int, int],
    todo: set[int],
    key: Callable[[dict[int, set[int]], int], Key],
) -> tuple[list[int], int]:
    """Greedy elimination order for `todo` (others stay) and its total table work."""
    adj = {v: set(n) for v, n in adj.items()}
    heap = [(key(adj, v), v) for v in todo]
    heapq.heapify(heap)
    current = {v: k for k, v in heap}
    order: list[int] = []
    work = 0
    left = set(todo)
    while heap:
        k, v = heapq.heappop(heap)
        if v not in left or current[v] != k:
            continue
        nbrs = adj.pop(v)
        work += dims[v] * math.prod(dims[u] for u in nbrs)
        order.append(v)
        left.discard(v)
        for u in nbrs:
            adj[u].discard(v)
            adj[u].update(w for w in nbrs if w != u)
        affected = set(nbrs)
        for u in nbrs:
            affected.update(adj[u])
        for u in affected & left:
            current[u] = key(adj, u)
            heapq.heappush(heap, (current[u], u))
    return order, work


def elimination_order(
    scopes: Iterable[tuple[int, ...]], dims: dict[int, int], todo: set[int]
) -> tuple[list[int], int]:
    """Order in which to eliminate the units `todo` (the others in `scopes` stay) and its
    table work: the sum over steps of the joint table size of the unit and its neighbours.

    A pure function of its arguments, memoised: the problems of one mesh that differ only
    in their entries (ZeRO stages, one family's variants) and the meshes whose units
    offer as many strategies share their factor graphs."""
    scopes = tuple(scopes)
    key = (scopes, tuple(sorted(dims.items())), frozenset(todo))
    found = _ORDERS.get(key)
    if found is None:
        found = _ORDERS.put(key, _elimination_order(scopes, dims, todo))
    order, work = found
    return list(order), work


_ORDERS = Memo(256)  # (scopes, dims, todo) -> (order, work)


def _elimination_order(
    scopes: tuple[tuple[int, ...], ...], dims: dict[int, int], todo: set[int]
) -> tuple[tuple[int, ...], int]:
    adj = _graph(list(scopes), todo)

    def weight(a: dict[int, set[int]], v: int) -> int:
        return dims[v] * math.prod(dims[u] for u in a[v])

    def min_fill(a: dict[int, set[int]], v: int) -> Key:
        return (_fill(a, v), weight(a, v), v)

    def min_weight(a: dict[int, set[int]], v: int) -> Key:
        return (weight(a, v), _fill(a, v), v)

    order, work = min(
        (_greedy(adj, dims, todo, k) for k in (min_weight, min_fill)), key=lambda r: r[1]
    )
    return tuple(order), work


def _plan(
    factors: list[Factor], order: list[int]
) -> tuple[list[Step], dict[int, tuple[int, ...]], list[int]]:
    """The elimination steps for `order` (factor ids: inputs 0..n-1, then one per step),
    the scope of every factor id, and the ids left over at the end."""
    scopes = {i: f.scope for i, f in enumerate(factors)}
    sizes = {i: f.n_entries for i, f in enumerate(factors)}
    dims = {v: d for f in factors for v, d in zip(f.scope, f.shape, strict=True)}
    holding: dict[int, set[int]] = {v: set() for v in dims}
    for i, f in enumerate(factors):
        for v in f.scope:
            holding[v].add(i)
    live = set(scopes)
    steps: list[Step] = []
    for v in order:
        ids = sorted(sorted(holding.pop(v)), key=lambda i: (sizes[i], scopes[i]))
        out = len(scopes)
        scopes[out] = tuple(sorted({u for i in ids for u in scopes[i]} - {v}))
        sizes[out] = math.prod(dims[u] for u in scopes[out])
        for u in scopes[out]:
            holding[u].difference_update(ids)
            holding[u].add(out)
        live.difference_update(ids)
        live.add(out)
        steps.append(Step(tuple(ids), v, out))
    return steps, scopes, sorted(live)


def eliminate(
    ctx: Context, factors: list[Factor], dims: dict[int, int], keep: set[int]
) -> list[Factor]:
    """Eliminate every unit of `factors` not in `keep`; returns the factors left over `keep`.

    With ``ctx.bounding``, once a step's inputs hold ``ctx.bound_trigger``
    points, the remaining steps drop partial plans that cannot reach the frontier
    (:mod:`tensoropt.search.bounds`; needs ``keep`` empty, so that the rest is known)."""
    variables = {v for f in factors for v in f.scope}
    order, _ = elimination_order((f.scope for f in factors), dims, variables - keep)
    steps, scopes, roots = _plan(factors, order)
    live: dict[int, Factor] = dict(enumerate(factors))
    bounds: BoundSet | None = None
    start = -1
    for j, st in enumerate(steps):
        inputs = [live[i] for i in st.inputs]
        if start < 0 and _wants_bounds(ctx, inputs, keep):
            sched = Schedule(steps[j:], scopes, dims, roots)
            leaves = {i: f.table for i, f in live.items() if f.table is not None}
            bounds = compute_bounds(
                sched, leaves, ctx.convex_bounds, ctx.external, own=ctx.own_incumbents
            )
            start = j
            ctx.notes.append(f"bound pruning from step {j} of {len(steps)}")
        for i in st.inputs:
            del live[i]
        n = max(len(inputs) - 1, 1)
        per = [bounds.get((j - start, p)) for p in range(n)] if bounds else None
        live[st.out] = multiply_all(ctx, inputs, frozenset((st.var,)), per)
    return list(live.values())


def _wants_bounds(ctx: Context, inputs: list[Factor], keep: set[int]) -> bool:
    if not ctx.bounding or ctx.symbolic or keep:
        return False
    points = sum(len(f.table.t) for f in inputs if f.table is not None)
    return points >= ctx.bound_trigger
