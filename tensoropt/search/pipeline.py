"""Pipelined points of the search (``search --axes ...,stages``).

A pipelined plan is a micro-batched plan of one mesh (the stages' mesh) cut into P stages
at block starts, each stage on its own copy of the mesh (P x mesh.size devices), priced by
``cost.pipeline`` exactly as ``compile`` prices it. For every micro-batched problem the
search solves (mesh M, k micro-batches, its ZeRO stage and recomputation), and every
stage count P with P x M.size among the searched device counts:

- each point of that problem's frontier is an intra-op plan (a strategy per unit); its
  :class:`~tensoropt.cost.pipeline.PipelineTerms` price any cut of it;
- the exact frontier over cuts (:func:`tensoropt.search.stages.plan_frontier`)
  gives, for that intra-op plan, every non-dominated (step time, memory per device) over
  the cuts at the allowed positions: every block start when the model has at most
  :data:`MAX_POSITIONS` - 1 blocks, else that many evenly spread ones;
- the non-dominated points over all intra-op plans form the frontier of the pipelined
  problem (M, k, P), labelled ``pp=P x (...)``, which merges with the others.

What this leaves out, stated in the guarantee of each pipelined result: a stage's
intra-op plan is one of the plans on the frontier of the whole micro-batched problem, or
the Megatron reference plan, whose cuts join the others so that the ``megatron+pp``
reference is always matched or dominated (the plan of one stage is not searched on its
own, and every stage runs the same mesh shape), and the schedule is 1F1B (GPipe's step
prices the same and holds more).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.cost.model import MeshProblem, ProblemFamily, SearchGraph, gathered_bound
from tensoropt.cost.pipeline import (
    PipelineTerms,
    SegmentTables,
    held_micro_batches,
    split_flat,
    stage_link,
)
from tensoropt.ir.costs import FrontierPoint
from tensoropt.ir.plan import ZeroStage
from tensoropt.passes.stages import Segments, step_segments
from tensoropt.search.frontier import prune_groups
from tensoropt.search.jit import compiled
from tensoropt.search.stages import PipelinePoint, Staircase, pareto, plan_frontier

MAX_POSITIONS = 65
"""Cut positions the dynamic program tries at most (both ends included)."""
SCHEDULE = "1f1b"


def positions(segments: int) -> list[int]:
    """The allowed cut positions: every block start, or evenly spread ones."""
    if segments + 1 <= MAX_POSITIONS:
        return list(range(segments + 1))
    steps = MAX_POSITIONS - 1
    return sorted({round(i * segments / steps) for i in range(steps + 1)})


def segments_of(graph: SearchGraph) -> Segments:
    return step_segments(graph.graph, graph.data_inputs, graph.params)


def pipelined(
    graph: SearchGraph,
    family: ProblemFamily,
    choices,
    chosen: dict,
    zero: ZeroStage,
    recompute: bool,
    profile: ClusterProfile,
    frontier: Sequence[FrontierPoint],
    counts: Sequence[int],
    memory_budget: float | None,
    extra: Sequence[Sequence[int]] = (),
    fastest: dict | None = None,
    segments: Segments | None = None,
    slot: MeshProblem | None = None,
    regions: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None,
    tables: SegmentTables | None = None,
) -> dict[int, tuple[list[PipelinePoint], list[tuple[int, ...]]]]:
    """Per stage count P in ``counts``: the non-dominated pipelined points over the
    intra-op plans of ``frontier`` (points of ``family``'s problem with ``zero`` and
    ``recompute``), and the choice of each. Empty when the model has too few blocks.
    ``extra``: more choices (reference plans), whose points join the others and whose
    fastest cut per P also goes to ``fastest`` (P -> [(point, choice)]).
    ``segments``: ``segments_of(graph)``, when already found; ``slot``: the family's
    problem with one more micro-batch slot and without activations (:func:`slot_problem`),
    when already built; ``tables``: the ``SegmentTables`` of the family's problem with
    ``zero`` (without the recompute working set), when already made.

    ``regions`` (:func:`beaten` of the points already made at P x mesh devices,
    elsewhere, by the :class:`CutBound` of the problem whose frontier this is): a plan
    at or beyond a corner of P's region, whose every cut into P stages one of them
    strictly dominates, is not cut into P stages. The points left out are dominated by
    points that are made anyway, so the frontier they merge into is the same."""
    fastest = {} if fastest is None else fastest
    segments = segments_of(graph) if segments is None else segments
    counts = [p for p in counts if 2 <= p <= segments.count]
    if not counts or not (frontier or extra):  # a reference is priced on its own too
        return {}
    if tables is None:
        if slot is None:
            m = family.micro_batches
            slot = slot_problem(graph, family, choices, chosen, zero, profile, m + 1, 0.0)
        tables = segment_tables(
            graph, family, profile, segments, family.problem(zero_all=zero), slot
        )
    plain = tables.plain
    allowed = [c for c in positions(segments.count) if c not in segments.tied]
    out: dict[int, tuple[list[PipelinePoint], list[tuple[int, ...]]]] = {}
    chosen_points = list(frontier) + [FrontierPoint(0.0, 0.0, c) for c in extra]
    found: dict[int, list[PipelinePoint]] = {}
    # per P, the frontier of the cuts found so far: a plan's cuts that it equals or
    # dominates are not kept (the Pareto set below is the same)
    held = {p: Staircase() for p in counts}
    regions = regions or {}
    for n, point in enumerate(chosen_points):
        extra_choice = n >= len(frontier)  # its fastest cut is wanted whatever beats it
        wanted = counts
        if not extra_choice and regions:
            at = (point.time_s, point.memory_bytes)
            wanted = [p for p in counts if p not in regions or not _inside(regions[p], *at)]
            if not wanted:
                continue
        ws = family.working_set_of(plain, point.choice) if recompute else 0.0
        terms = tables.terms(point.choice, ws)
        choice = tuple(point.choice)
        incumbents = None if extra_choice else held
        for p, points in cut_frontiers(
            terms, wanted, allowed, memory_budget, choice, incumbents
        ).items():
            if extra_choice and points:
                fastest.setdefault(p, []).append((points[0], choice))
            # every plan's cuts join the frontier, the reference plans' too: a reference
            # pipelined point is then always matched or dominated
            found.setdefault(p, []).extend(points)
            if not extra_choice:
                held[p].add(points)
    # each point's stage payloads are its intra-op plan's choice
    out = {}
    for p, points in found.items():
        kept = pareto(points)
        out[p] = (kept, [q.plans[0] for q in kept])
    return out


def segment_tables(
    graph: SearchGraph,
    family: ProblemFamily,
    profile: ClusterProfile,
    segments: Segments,
    plain: MeshProblem,
    slot: MeshProblem,
) -> SegmentTables:
    """The ``SegmentTables`` of ``plain`` (one of ``family``'s problems) cut at
    ``segments``, its times with one more slot and memories without activations from
    ``slot`` (:func:`slot_problem`)."""
    segment_of = [segments.segment_of(u.root.name) for u in graph.units.units]
    return SegmentTables(
        graph, plain, slot, slot, segment_of, segments.count, profile, family.plan_mesh
    )


def cut_frontiers(
    terms, counts, allowed, memory_budget=None, payload=None, incumbents=None
) -> dict[int, list[PipelinePoint]]:
    """Per stage count: the exact (T, M) frontier over the cuts of one intra-op plan
    (every stage's payload: ``payload``), from its stage prices at every pair of allowed
    positions (:func:`~tensoropt.search.stages.plan_frontier`); with ``incumbents``
    (P -> :class:`~tensoropt.search.stages.Staircase`), the points none of P's equals
    or dominates."""
    out = {}
    for p in counts:
        taus, mems = stage_grids(terms, allowed, p, SCHEDULE)
        held = None if incumbents is None else incumbents[p]
        out[p] = plan_frontier(allowed, taus, mems, payload, memory_budget, held)
    return out


def stage_grids(
    terms: PipelineTerms, positions: Sequence[int], stages: int, schedule: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per stage s, the time and memory of ``terms.stage(positions[i], positions[j], s,
    stages, schedule)`` at [s, i, j] for every (i, j) a cut into ``stages`` stages can
    give stage s: the first stage starts at position 0, the last ends at the last
    position, and each stage holds at least one segment, so stage s spans
    s <= i < j <= n - stages + s (n positions). The same float operations in the same
    order as ``stage``, in one compiled loop. For 2 stages that is 2 n entries of the
    n^2 a full grid holds. The other entries are left unset (``np.empty``): no cut
    reads them, and :func:`~tensoropt.search.stages.plan_frontier` reads only what a
    cut can use (filling them took as long as the loop on the GPT-3 175B default)."""
    pos = np.asarray(positions, dtype=np.int64)
    links = [stage_link(terms.profile, s, terms.mesh.size) for s in range(stages)]
    held = [held_micro_batches(s, terms.micro_batches, stages, schedule) for s in range(stages)]
    taus = np.empty((stages, len(pos), len(pos)))
    mems = np.empty_like(taus)
    _grids(
        terms.a, terms.b, terms.base, terms.act, terms.fwd_bytes, terms.fwd_count,
        terms.bwd_bytes, terms.bwd_count, pos,
        np.array([link.alpha_s for link in links], dtype=np.float64),
        np.array([link.bandwidth for link in links], dtype=np.float64),
        np.array(held, dtype=np.float64), float(terms.micro_batches + stages - 1),
        float(terms.constant), terms.segments, taus, mems,
    )  # fmt: skip
    return taus, mems


@compiled()
def _grids(
    a, b, base, act, fwd_bytes, fwd_count, bwd_bytes, bwd_count, pos, alpha, bandwidth,
    held, slots, constant, segments, taus, mems,
):  # fmt: skip
    """:func:`stage_grids`' loop: stage s sends forward over its own link (``alpha[s]``,
    ``bandwidth[s]``) and its gradients back over stage s - 1's; entries outside
    s <= x < y <= n - stages + s, and the first stage's with x > 0 and the last's with
    y < n - 1, are left as they are (no cut reads them)."""
    stages, n = taus.shape[0], pos.size
    for s in range(stages):
        x_stop = 1 if s == 0 else n - stages + s
        y_first = n - 1 if s == stages - 1 else s + 1
        for x in range(s, x_stop):
            i = pos[x]
            bwd = 0.0
            if s > 0 and i > 0:
                bwd = bwd_count[i] * alpha[s - 1] + bwd_bytes[i] / bandwidth[s - 1]
            for y in range(max(x + 1, y_first), n - stages + s + 1):
                j = pos[y]
                p2p = 0.0
                if j < segments:
                    p2p += fwd_count[j] * alpha[s] + fwd_bytes[j] / bandwidth[s]
                if i > 0:
                    p2p += bwd
                per_micro = a[j] - a[i] + p2p
                taus[s, x, y] = slots * per_micro + (b[j] - b[i])
                stash = act[j] - act[i] + (fwd_bytes[i] if i > 0 else 0.0)
                mems[s, x, y] = base[j] - base[i] + held[s] * stash + constant


def starts_of(segments: Segments, cuts: Sequence[int]) -> tuple[str, ...]:
    """The start blocks of a point's stages 1..P-1."""
    return tuple(segments.blocks[c].name for c in cuts[1:-1])


def pipeline_search(search, variant, points, picks, segments: Segments, summaries):
    """``search`` (a micro-batched problem's) as the pipelined search of ``variant``."""
    from tensoropt.search.solver import SearchResult

    result = search.result
    frontier = tuple(
        FrontierPoint(q.time_s, q.memory_bytes, choice)
        for q, choice in zip(points, picks, strict=True)
    )
    devices = search.mesh.size * variant.stages
    guarantee = (
        f"pipelined ({variant.stages} stages, {SCHEDULE}): for each plan of the "
        f"{search.mesh} frontier with {variant.micro_batches} micro-batches (and the "
        f"Megatron plan there), the exact Pareto set over cuts at "
        f"{len(positions(segments.count))} positions"
    )
    return dataclasses.replace(
        search,
        problem=None,  # its step is its slowest stage's, not a sum of the problem's entries
        result=SearchResult(
            devices,
            result.mesh,
            frontier,
            result.epsilon,
            result.memory_budget,
            None,
            guarantee,
            result.stats,
        ),
        references={},
        reference_summaries={},
        summaries=tuple(summaries),
        variant=variant,
        stage_starts=tuple(starts_of(segments, q.cuts) for q in points),
    )


# relative slack on the stage problem's incumbents: their corners are bounds of float
# sums, and a plan they cannot dominate by more than rounding is kept
_BOUND_SLACK = 1e-9


def slot_family(
    graph: SearchGraph,
    family: ProblemFamily,
    choices,
    chosen: dict,
    profile: ClusterProfile,
    slots: int,
    scale: float,
) -> ProblemFamily:
    """``family`` priced with ``slots`` micro-batch slots and its activations scaled by
    ``scale``, on the family's unit programs (:func:`slot_problem`); its problems of
    every ZeRO stage share its prices, as the family's own do."""
    return ProblemFamily(
        graph, family.plan_mesh, profile, micro_batches=family.micro_batches, choices=choices,
        chosen=chosen, slots=slots, saved_scale=scale, like=family,
    )  # fmt: skip


def slot_problem(
    graph: SearchGraph,
    family: ProblemFamily,
    choices,
    chosen: dict,
    zero: ZeroStage,
    profile: ClusterProfile,
    slots: int,
    scale: float,
):
    """``family``'s micro-batched problem priced with ``slots`` micro-batch slots and its
    activations scaled by ``scale``, on the family's unit programs: one more slot gives
    what :func:`pipelined` splits per-micro-batch time from, scale 0 what it splits
    ``base`` from. No time reads the scale and no memory the slots (``cost.model``'s
    ``_Pricer``), so one problem with m + 1 slots and scale 0 serves as both: its times
    are those of the problem with one more slot, its memories those of the one without
    activations, float for float (``test_one_slot_problem_prices_both``)."""
    found = slot_family(graph, family, choices, chosen, profile, slots, scale)
    return found.problem(zero_all=zero)


@dataclasses.dataclass(frozen=True, slots=True)
class CutBound:
    """Lower bounds on every cut of any plan X of a micro-batched problem (m micro-batches)
    into P stages, from X's step time t_X and memory m_X in that problem; what the stage
    problems' incumbents rest on (:func:`stage_incumbents`). In the terms of
    ``cost.pipeline`` (a_X, b_X the plan's per-micro-batch and per-step time, BASE and
    ACT its stages' summed base and activation bytes, g the constant every stage holds):

    - time: the stages' times sum to at least (m + P - 1) a_X + b_X (sends cost >= 0),
      so T >= (t_X + (P - 1) a_X) / P, with a_X >= ``per_micro_floor`` (the sum of the
      least per-micro-batch entries; 0 by default, which assumes a_X >= 0) and
      a_X = (t_X - b_X) / m >= (t_X - ``per_step_ceiling``) / m;
    - memory: stage s holds base_s + h_s act_s + g, h_s the micro-batches it holds
      (``held_micro_batches``), so M >= g + the least level L over any split of BASE and
      ACT into nonnegative per-stage parts with base_s + h_s act_s <= L (a linear
      program solved greedily: activations go to the stages that hold the fewest
      micro-batches first). That level grows when bytes move from BASE to ACT, and
      ACT >= A (``act_floor``), BASE + ACT = m_X - g, so M >= g + L(m_X - g - A, A).
      Without ``levels`` (an entry that may sum to a negative stage base, or the
      recompute working set, which the activation floor folds in), the bound of the
      sums instead: the stages' memories sum to at least m_X + A, M >= (m_X + A) / P.

    Each bound is monotone, so a point (T0, M0) made at P x mesh devices dominates every
    cut of a plan with t_X >= :meth:`time_threshold` and m_X >= :meth:`memory_threshold`."""

    micro_batches: int
    act_floor: float
    gathered: float = 0.0
    per_micro_floor: float = 0.0
    per_step_ceiling: float = float("inf")
    levels: bool = False

    def time_threshold(self, stages: int, t0: np.ndarray) -> np.ndarray:
        """Per step time in ``t0``: the least t_X from which every cut into ``stages``
        stages takes at least that long."""
        p, m = stages, self.micro_batches
        t0 = np.asarray(t0, dtype=np.float64)
        out = p * t0 - (p - 1) * self.per_micro_floor
        if np.isfinite(self.per_step_ceiling):
            out = np.minimum(out, (m * p * t0 + (p - 1) * self.per_step_ceiling) / (m + p - 1))
        return out

    def memory_threshold(self, stages: int, m0: np.ndarray) -> np.ndarray:
        """Per memory in ``m0``: the least m_X from which every cut into ``stages``
        stages holds at least that much per device."""
        p, a, g = stages, self.act_floor, self.gathered
        m0 = np.asarray(m0, dtype=np.float64)
        sums = p * m0 - a
        if not self.levels:
            return sums
        held = np.sort(
            [held_micro_batches(s, self.micro_batches, p, SCHEDULE) for s in range(p)]
        ).astype(np.float64)
        reach = np.concatenate([[0.0], np.cumsum(1.0 / held)])  # per level, of stages full
        level = m0 - g
        with np.errstate(divide="ignore", invalid="ignore"):
            full = np.searchsorted(reach, a / level, side="right") - 1
            full = np.clip(full, 0, p)
            # the activations' least summed h_s act_s at this level: `full` stages filled
            # up to the level, the rest on the next stage
            rest = a - level * reach[full]
            spent = level * full + np.where(full < p, held[np.minimum(full, p - 1)] * rest, 0.0)
            levels = g + a + p * level - spent
        # a level no split reaches (every plan holds more) or none at all: any plan
        levels = np.where((level <= 0) | (a > level * reach[-1]), 0.0, levels)
        return np.minimum(sums, levels)


def cut_bound(
    plain: MeshProblem,
    bare: MeshProblem,
    more: MeshProblem,
    graph: SearchGraph,
    recompute: bool = False,
    tables: SegmentTables | None = None,
) -> CutBound | None:
    """The :class:`CutBound` of ``plain``'s plans (a micro-batched problem, with the
    recompute working set in its entries when ``recompute``; ``bare``: the same without
    activations, ``more``: with one more micro-batch slot, both of the same family),
    from each unit's and edge's entries split as ``SegmentTables`` splits them (``tables``:
    those of the same three problems, when already made); None when an entry holds less
    with its activations than without (the activation floor A, the sum of the least
    activation entries, is then no bound)."""
    m = plain.micro_batches
    if tables is None:
        (a, b, base, act), sizes, _ = split_flat(plain, more, bare)
        starts = np.cumsum([0, *sizes], dtype=np.int64)[:-1]
    else:
        (a, b, base, act), starts = tables.entries()
    least_act = np.minimum.reduceat(act, starts)
    if least_act.min() < 0:
        return None
    # summed in the entries' order (np.cumsum adds one after the other)
    floor = float(np.cumsum(least_act)[-1])
    least_a = float(np.cumsum(np.minimum.reduceat(a, starts))[-1])
    most_b = float(np.cumsum(np.maximum.reduceat(b, starts))[-1])
    bases = np.minimum.reduceat(base, starts).tolist()
    gathered = 0.0
    if any(pr.zero is ZeroStage.PARAMETERS for ps in plain.programs for pr in ps):
        gathered = gathered_bound(graph)
    # every stage's base is a sum of nonnegative entries (unit 0's less the constant)
    levels = not recompute and bases[0] >= gathered and min(bases[1:], default=0.0) >= 0
    return CutBound(m, floor, gathered, least_a, most_b, levels)


def stage_incumbents(
    made: Mapping[int, Sequence[tuple[float, float]]],
    bound: CutBound,
    regions: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Incumbents for a stage problem solved for its pipelines only, from the points
    ``made[P]`` (time, memory) already found at the device count of each stage count P
    it feeds; None when a count has none. A point Q at P x M devices dominates every cut
    of a plan X at or beyond (``bound.time_threshold(P, Q.t)``,
    ``bound.memory_threshold(P, Q.m)``) (:class:`CutBound`); X is useless when that
    holds for every P. The corners are those of the intersection of the P regions
    (``regions``: :func:`beaten` of ``made``, found here when not given)."""
    regions = beaten(made, bound) if regions is None else regions
    region = None
    for p in made:
        stair = regions.get(p)
        if stair is None:
            return None
        if region is not None:  # a point in both regions: at or beyond a corner of each
            grid = np.union1d(region[0], stair[0])
            need = np.maximum(_floor_at(*region, grid), _floor_at(*stair, grid))
            finite = np.isfinite(need)
            stair = _staircase(grid[finite], need[finite])
        region = stair
    if region is None or not region[0].size:
        return None
    return region


def beaten(
    known: Mapping[int, Sequence[tuple[float, float]]], bound: CutBound
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per stage count P with points in ``known`` (made at its device count), the
    corners at or beyond which a plan's every cut into P stages is strictly worse than
    one of those points in both time and memory: each point's thresholds
    (:class:`CutBound`), pushed out by a relative slack (each bound grows strictly with
    the plan's time and memory)."""
    out = {}
    for p, points in known.items():
        if len(points):
            q = np.asarray(points, dtype=np.float64).reshape(-1, 2)
            t = np.maximum(0.0, bound.time_threshold(p, q[:, 0])) * (1 + _BOUND_SLACK)
            m = np.maximum(0.0, bound.memory_threshold(p, q[:, 1])) * (1 + _BOUND_SLACK)
            out[p] = _staircase(t, m)
    return out


def _inside(region: tuple[np.ndarray, np.ndarray], time_s: float, memory: float) -> bool:
    """Whether (time_s, memory) is at or beyond a corner of ``region``."""
    return bool(_floor_at(*region, np.array([time_s]))[0] <= memory)


def _staircase(t: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Pareto corners of (t, m), time ascending (``frontier.prune_groups``)."""
    keep = prune_groups(np.zeros(t.size, dtype=np.int64), t, m)
    return t[keep], m[keep]


def _floor_at(times: np.ndarray, memories: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Per time in ``at``, the least memory of the staircase's corners at that time or
    before (inf before the first)."""
    i = np.searchsorted(times, at, side="right") - 1
    return np.where(i >= 0, memories[np.maximum(i, 0)], np.inf)
