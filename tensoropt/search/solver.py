"""`solve`: the Pareto frontier of one cost problem, with a strategy per unit for each point.

Pipeline: normalise the tables (:mod:`prepared`), find repeated blocks and compose them
(:mod:`blocks`), eliminate every remaining unit (:mod:`elimination`), multiply what is left
into a single frontier, then recover each point's choice vector from its back-pointers and
re-evaluate it with :meth:`CostProblem.evaluate` (correctly rounded sums, so the reported
numbers are exactly what anyone gets from the dumped tables).

Epsilon mode (see docs/design/search.md for the proof). The repeated blocks are composed
exactly, as in the exact mode, and each composed piece (a run of blocks) is then thinned
once: a point p of an entry is dropped when a kept point q of the same entry has
q.memory <= p.memory and q.time <= (1 + delta_b) * p.time, with
delta_b = (1 + epsilon) ** PIECE_SHARE - 1. A plan's time is a sum with one part per
piece, so covering every part costs the factor 1 + delta_b once, not once per piece.
Every filtering step around them (the pruning at the end of each factor product) may
drop points the same way with delta, plus a completion slack of delta * c times the
least time of the product's leaves (`completion_spread`: the budget that the steps near
the leaves leave unspent). Along any path of the computation at most D such steps happen
(D = `filter_depth`, computed by running the elimination around the composed blocks
symbolically first), and sums preserve a relative error, so with
delta = ((1 + epsilon) / (1 + delta_b)) ** (1 / D) - 1 the result satisfies:

    for every plan P (in particular every exact frontier point) there is a returned point Q
    with Q.memory <= P.memory and Q.time <= (1 + epsilon) * P.time.

Memory is never approximated: the minimum-memory point is exact, and a memory budget stays
exact too (a point that fits is represented by one that also fits).

With incumbents (plans of other problems, e.g. the other meshes of a device count), the
bounds drop a partial plan all of whose completions an incumbent strictly dominates, and the
guarantee holds for the returned points and the incumbents together: a plan is covered by a
kept point or, once its cover is dropped, by the incumbent that dominates the cover's
completions. The bounds' own incumbents (weighted-sum decodes) are left out in this mode:
their plans are not returned, so covering through them would compound.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tensoropt.errors import PlanError
from tensoropt.ir.costs import CostProblem, FrontierPoint
from tensoropt.search.blocks import (
    MAX_PORT_DIM,
    Region,
    auto_regions,
    chain_pieces,
    detect_regions,
    hinted_regions,
    port_dim,
    worthwhile,
)
from tensoropt.search.bounds import Dominated, beyond
from tensoropt.search.elimination import eliminate
from tensoropt.search.evaluate import evaluate_rows, flat_tables, relaxed_lows
from tensoropt.search.factor import Context, Factor, multiply_all
from tensoropt.search.frontier import Filter, prune_groups
from tensoropt.search.hubs import find_splits, split_factors
from tensoropt.search.prepared import Prepared, least_time, prepare
from tensoropt.search.provenance import Provenance

log = logging.getLogger(__name__)


class BlockMode(enum.Enum):
    """Repeated blocks: AUTO uses the hints (or, without hints, detected regions) where they
    lower the estimated work; ALWAYS uses them wherever they are valid; OFF never."""

    AUTO = "auto"
    ALWAYS = "always"
    OFF = "off"


class Pruning(enum.Enum):
    """Exact bound pruning (:mod:`bounds`, exact mode only): AUTO starts it once a step's
    inputs hold BOUND_TRIGGER frontier points (small problems never pay for it); ALWAYS
    from the first step (tests); OFF never. Results do not depend on it."""

    AUTO = "auto"
    ALWAYS = "always"
    OFF = "off"


BOUND_TRIGGER = 10000

PIECE_SHARE = 0.5
"""Epsilon mode: the share of log(1 + epsilon) that thins each composed piece of repeated
blocks once (module docstring); the filtering steps around them share the rest."""


@dataclass(frozen=True, slots=True)
class SearchStats:
    """What the search did: sizes that bound its cost, and its wall-clock time."""

    elimination_width: int  # largest joint scope of a factor product, minus one
    max_table_entries: int  # largest joint table (entries) formed
    max_frontier: int  # largest frontier of any factor entry
    products: int  # factor products computed
    filter_depth: int  # filtering steps along the longest computation path
    blocks: tuple[str, ...]  # one line per composed repeated-block region
    seconds: float


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The frontier of one (devices, mesh) problem.

    points: sorted by time ascending, memory strictly descending. Exact mode (epsilon None):
    exactly the non-dominated objective values of all plans (under the budget if given).
    Epsilon mode: see `guarantee`.
    """

    devices: int
    mesh: tuple[int, ...]
    points: tuple[FrontierPoint, ...]
    epsilon: float | None
    memory_budget: float | None
    delta: float | None  # per-step slack used in epsilon mode
    guarantee: str
    stats: SearchStats


def _exact_guarantee(budget: float | None, external=None) -> str:
    where = "every plan" if budget is None else f"every plan with memory <= {budget!r}"
    if external is not None:
        where += f", less the points that one of {len(external[0])} given plans strictly dominates"
    return f"exact: the points are the Pareto frontier of {where}"


def _eps_guarantee(eps: float, budget: float | None, external=None) -> str:
    where = "every plan" if budget is None else f"every plan with memory <= {budget!r}"
    among = "a returned point"
    if external is not None:
        among = f"a point among the returned ones and the {len(external[0])} given plans"
    return (
        f"epsilon={eps!r}: for {where} P there is {among} Q with "
        f"Q.memory <= P.memory and Q.time <= (1 + {eps!r}) * P.time"
    )


def _pieces(ctx: Context, prep: Prepared, regions: list[Region]) -> list[Factor]:
    """The composed repeated blocks (adaptive squaring, see :mod:`blocks`)."""
    return [f for r in regions for f in chain_pieces(ctx, prep, r, adaptive=True)]


def _guarantee(eps: float | None, budget: float | None, external) -> str:
    if eps is None:
        return _exact_guarantee(budget, external)
    return _eps_guarantee(eps, budget, external)


def _thinned(piece: Factor, delta: float) -> Factor:
    """A composed piece thinned once (epsilon mode), a leaf of the elimination around
    the pieces: its ``lows`` is its least time, which every point it keeps takes."""
    if piece.table is None:
        return Factor(piece.scope, piece.shape, None)
    table = piece.table.thinned(delta)
    return Factor(piece.scope, piece.shape, table, lows=least_time(table.t))


def completion_spread(lows: Sequence[float], depth: int, delta: float) -> float:
    """The spread c of the completion slack (docs/design/search.md, "Completion slack"):
    each filtering step k may also drop p for a point within delta * c * L_k more time,
    L_k the least time of the leaves below k. ``lows[j]``: the least times of the
    leaves j steps below the top (a leaf of unknown least time counts 0); D = ``depth``,
    the most steps along any path. With G(j) = (1 + delta)^j - 1, c spends what the
    leaves above depth D leave of the budget G(D) * T:
    c = sum_j (G(D) - G(j)) lows[j] / sum_j G(j) lows[j]. 0 without leaves, and when a
    least time is negative (the bound then fails)."""
    if not lows or min(lows) < 0.0 or len(lows) > depth + 1:
        return 0.0
    lows = [*lows, *([0.0] * (depth + 1 - len(lows)))]
    grow = [(1.0 + delta) ** j - 1.0 for j in range(depth + 1)]
    used = math.fsum(g * x for g, x in zip(grow, lows, strict=True))
    left = math.fsum((grow[depth] - g) * x for g, x in zip(grow, lows, strict=True))
    if used <= 0.0 or left <= 0.0:
        return 0.0
    return left / used * _ROUNDING


def _schedule(ctx: Context, prep: Prepared, regions: list[Region], pieces: list[Factor]) -> Factor:
    """Eliminate everything around the composed blocks ``pieces``, return the single
    scope-() factor."""
    factors: list[Factor] = list(pieces)
    factors += [
        prep.unit_factor(ctx, i)
        for i in range(prep.n_units)
        if not any(r.covers_unit(i) for r in regions)
    ]
    keys = [key for key in prep.edges if not any(r.covers_edge(*key) for r in regions)]
    covered = {u for r in regions for u in range(prep.n_units) if r.covers_unit(u)}
    splits = find_splits(prep, [k for k in keys if not (set(k) & covered)], prep.n_units)
    rewired = {(min(h.unit, w), max(h.unit, w)) for h in splits for w in h.neighbours}
    factors += [prep.edge_factor(ctx, key) for key in keys if key not in rewired]
    for h in splits:
        factors += split_factors(ctx, prep, h)
    if splits:
        # Hubs: the sweep carries many hub assignments, most of them leading only to
        # dominated plans; the ideal point of the rest is a weak bound there (measured:
        # rnnlm 2x8 82 -> 17 s with the convex one; gpt-medium, no hubs, 27% slower).
        ctx.convex_bounds = ctx.convex_bounds or ctx.bounding
        ctx.notes.append(
            f"{len(splits)} hub(s) split: "
            + ", ".join(
                f"unit {h.unit} ({prep.dims[h.unit]} -> {int(h.labels.max()) + 1} classes, "
                f"{len(h.neighbours)} edges)"
                for h in splits
            )
        )
    dims = {v: d for f in factors for v, d in zip(f.scope, f.shape, strict=True)}
    return multiply_all(ctx, eliminate(ctx, factors, dims, set()))


def _regions(problem: CostProblem, prep: Prepared, mode: BlockMode) -> list[Region]:
    if mode is BlockMode.OFF:
        return []
    if mode is BlockMode.AUTO and not problem.blocks:
        return auto_regions(prep)
    found = hinted_regions(prep, problem.blocks) if problem.blocks else detect_regions(prep)
    if mode is BlockMode.ALWAYS:
        return [r for r in found if port_dim(prep, r) <= MAX_PORT_DIM]
    return worthwhile(prep, found)


def _check_args(memory_budget: float | None, epsilon: float | None) -> None:
    if memory_budget is not None and not (memory_budget >= 0 and math.isfinite(memory_budget)):
        raise PlanError(f"memory budget must be a finite number >= 0, got {memory_budget!r}")
    if epsilon is not None and not (epsilon > 0 and math.isfinite(epsilon)):
        raise PlanError(f"epsilon must be a finite number > 0, got {epsilon!r}")


def evaluate_choices(problem: CostProblem, choices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Objectives of many choice vectors at once, each equal to `problem.evaluate(choice)`
    bit for bit: the correctly rounded sum of its terms (:mod:`tensoropt.search.evaluate`,
    compiled), gathered from the tables without holding them per row."""
    return evaluate_rows(problem, choices)


def _exact_points(
    problem: CostProblem, choices: np.ndarray, incumbents: tuple[np.ndarray, np.ndarray] | None
) -> tuple[FrontierPoint, ...]:
    """Re-evaluate every choice exactly, prune, sort by time; drop the points strictly
    dominated by an incumbent."""
    if len(choices) == 0:
        return ()
    t, m = evaluate_choices(problem, choices)
    keep = prune_groups(np.zeros(len(t), dtype=np.int64), t, m)
    if incumbents is not None:
        keep = keep[~strictly_dominated(t[keep], m[keep], *incumbents)]
    rows = choices[keep].tolist()
    return tuple(
        FrontierPoint(float(t[k]), float(m[k]), tuple(row))
        for k, row in zip(keep, rows, strict=True)
    )


# scalarisations of the relaxed lower bound (time weight 0..1, both ends excluded)
RELAXED_WEIGHTS = 31
_ROUNDING = 1.0 - 1e-9  # the relaxed bounds are float sums: lowered to stay bounds


def surely_dominated(problem: CostProblem, inc_t: np.ndarray, inc_m: np.ndarray) -> bool:
    """Whether an incumbent strictly dominates every plan of ``problem``, proved without
    searching it: a relaxation that prices each unit and each edge at its own least
    (nonnegative entries) bounds every plan's (t, m) from below by t >= T, m >= M and
    w.(t, m) >= L_w for RELAXED_WEIGHTS weights w > 0, and :func:`bounds.beyond` tests
    that region against the incumbents' staircase. False whenever the proof does not go
    through (negative entries, no incumbent)."""
    if not len(inc_t) or not problem.units:
        return False
    flat = flat_tables(problem)
    if flat.times.size and (flat.times.min() < 0 or flat.memories.min() < 0):
        return False
    least_t = np.minimum.reduceat(flat.times, flat.table_at)[flat.tables]
    least_m = np.minimum.reduceat(flat.memories, flat.table_at)[flat.tables]
    t_low = math.fsum(least_t.tolist()) * _ROUNDING
    m_low = math.fsum(least_m.tolist()) * _ROUNDING
    frac = np.linspace(0.0, 1.0, RELAXED_WEIGHTS + 2)[1:-1]
    wt, wm = frac / max(t_low, 1e-300), (1.0 - frac) / max(m_low, 1e-300)
    low = relaxed_lows(flat, wt, wm) * _ROUNDING
    return beyond(t_low, m_low, np.stack([wt, wm], axis=1), low, inc_t, inc_m)


def strictly_dominated(
    t: np.ndarray, m: np.ndarray, inc_t: np.ndarray, inc_m: np.ndarray
) -> np.ndarray:
    """Mask of the points (t, m) that some incumbent (inc_t, inc_m) strictly dominates:
    no more time, no more memory, and not equal in both."""
    if not len(inc_t) or not len(t):
        return np.zeros(len(t), dtype=bool)
    keep = prune_groups(np.zeros(len(inc_t), dtype=np.int64), inc_t, inc_m)
    st, sm = inc_t[keep], inc_m[keep]  # staircase: time ascending, memory descending
    j = np.searchsorted(st, t, side="right") - 1  # the least-memory incumbent with time <= t
    jj = np.maximum(j, 0)
    return (j >= 0) & (sm[jj] <= m) & ((st[jj] != t) | (sm[jj] != m))


def restricted(
    result: SearchResult,
    memory_budget: float | None,
    incumbents: tuple[Sequence[float], Sequence[float]] | None,
) -> tuple[SearchResult, np.ndarray]:
    """``result`` (a search without budget and incumbents) as :func:`solve` with
    ``memory_budget`` and ``incumbents`` returns it: its points within the budget and not
    strictly dominated by an incumbent, with that search's guarantee; and the indices of
    the points kept. An exact frontier so restricted is the restricted search's frontier;
    an epsilon one keeps its guarantee (a dropped point's cover is the incumbent that
    dominates it)."""
    _check_args(memory_budget, result.epsilon)
    t = np.array([p.time_s for p in result.points], dtype=np.float64)
    m = np.array([p.memory_bytes for p in result.points], dtype=np.float64)
    keep = np.ones(len(t), dtype=bool)
    if memory_budget is not None:
        keep &= m <= memory_budget
    external = None
    if incumbents is not None:
        external = tuple(np.asarray(x, dtype=np.float64) for x in incumbents)
        keep &= ~strictly_dominated(t, m, *external)
    kept = np.flatnonzero(keep)
    return (
        dataclasses.replace(
            result,
            points=tuple(result.points[i] for i in kept),
            memory_budget=memory_budget,
            guarantee=_guarantee(result.epsilon, memory_budget, external),
        ),
        kept,
    )


def solve(
    problem: CostProblem,
    *,
    memory_budget: float | None = None,
    epsilon: float | None = None,
    blocks: BlockMode = BlockMode.AUTO,
    pruning: Pruning = Pruning.AUTO,
    incumbents: tuple[Sequence[float], Sequence[float]] | None = None,
) -> SearchResult:
    """Pareto frontier over (time, memory) of `problem`, each point with its choice vector.

    memory_budget: drop every plan whose memory exceeds it (points over budget are dropped
    as soon as they appear; sound since costs are nonnegative). The result may be empty.
    epsilon: approximate, with the guarantee stated in the result (module docstring).
    blocks: how repeated blocks are recognised (the result does not depend on it).
    pruning: exact bound pruning (the result does not depend on it); in epsilon mode only
    with incumbents, and only against them.
    incumbents: (times, memories) of plans found elsewhere, e.g. on another mesh of the
    same device count. The points that one of them strictly dominates are left out, and
    partial plans that can only lead to such points are dropped early by the bounds;
    every other frontier point is returned, so the frontier of this problem together
    with the incumbents' is unchanged. With epsilon the guarantee holds for the returned
    points and the incumbents together (module docstring).
    """
    _check_args(memory_budget, epsilon)
    external = None
    if incumbents is not None:
        external = tuple(np.asarray(x, dtype=np.float64) for x in incumbents)
    start = time.perf_counter()
    if external is not None and pruning is not Pruning.OFF and surely_dominated(problem, *external):
        note = ("every plan strictly dominated by an incumbent (surely_dominated)",)
        stats = SearchStats(0, 0, 0, 0, 0, note, time.perf_counter() - start)
        guarantee = _guarantee(epsilon, memory_budget, external)
        return SearchResult(
            problem.devices, problem.mesh, (), epsilon, memory_budget, None, guarantee, stats
        )
    prep = prepare(problem)
    regions = _regions(problem, prep, blocks)
    budget = math.inf if memory_budget is None else float(memory_budget)
    delta = None
    ctx = Context(Provenance(), Filter(budget))
    # The repeated blocks are composed exactly, adaptively as in the exact mode; in
    # epsilon mode each piece is then thinned once with a share of the slack, and the
    # rest is spread over the filtering steps around them (module docstring).
    pieces = _pieces(ctx, prep, regions)
    if epsilon is not None:
        rest = 1.0 + epsilon
        if pieces:
            piece_delta = (1.0 + epsilon) ** PIECE_SHARE - 1.0
            pieces = [_thinned(f, piece_delta) for f in pieces]  # depth 0: leaves
            rest = (1.0 + epsilon) / (1.0 + piece_delta)
        dry = Context(Provenance(1), Filter(budget), symbolic=True)
        shadows = [Factor(f.scope, f.shape, None, lows=f.lows) for f in pieces]
        top = _schedule(dry, prep, regions, shadows)
        delta = rest ** (1.0 / max(top.depth, 1)) - 1.0
        ctx.flt = Filter(budget, delta, completion_spread(top.lows, top.depth, delta))
    # Epsilon mode prunes with the given plans only (module docstring): the bounds' own
    # incumbents are plans this search does not return.
    ctx.bounding = pruning is not Pruning.OFF and (epsilon is None or external is not None)
    ctx.own_incumbents = epsilon is None
    ctx.bound_trigger = 0 if pruning is Pruning.ALWAYS else BOUND_TRIGGER
    ctx.convex_bounds = pruning is Pruning.ALWAYS
    if external is not None and len(external[0]) and pruning is not Pruning.OFF:
        ctx.external = external
        ctx.bound_trigger = 0  # incumbents from elsewhere prune from the first step
        # Epsilon mode prunes with these alone, and the ideal point of the rest is a weak
        # bound against them: the convex channels cut the sweep (docs/design/search.md).
        ctx.convex_bounds = ctx.convex_bounds or epsilon is not None
    try:
        final = _schedule(ctx, prep, regions, pieces)
    except Dominated:  # the scalar DPs of the bounds proved it: every plan is beaten
        note = ("every plan strictly dominated by an incumbent (exact lower bounds)",)
        stats = SearchStats(0, 0, 0, ctx.products, 0, note, time.perf_counter() - start)
        guarantee = _guarantee(epsilon, memory_budget, external)
        return SearchResult(
            problem.devices, problem.mesh, (), epsilon, memory_budget, delta, guarantee, stats
        )
    assert final.table is not None and final.scope == ()
    choices = ctx.prov.recover(final.table.prov, prep.n_units)
    points = _exact_points(problem, choices, external)
    stats = SearchStats(
        elimination_width=max(ctx.max_scope - 1, 0),
        max_table_entries=ctx.max_entries,
        max_frontier=max(ctx.max_frontier, len(points)),
        products=ctx.products,
        filter_depth=final.depth,
        blocks=tuple(ctx.notes),
        seconds=time.perf_counter() - start,
    )
    guarantee = _guarantee(epsilon, memory_budget, external)
    log.debug(
        "solved devices=%d mesh=%s: %d points, %s",
        problem.devices,
        problem.mesh,
        len(points),
        stats,
    )
    return SearchResult(
        problem.devices, problem.mesh, points, epsilon, memory_budget, delta, guarantee, stats
    )
