"""What a report says, as data: derived from one :class:`Exploration`, no plotting, no text.

Every query here is answered from the merged frontier over (devices, time, memory) or
from the per-device-count frontiers. Both are exact sets of non-dominated plans (within
the stated epsilon), so "the fastest plan that fits C bytes" or "the fewest devices that
reach T seconds" over the merged points is the answer over all plans of the search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tensoropt.search.driver import (
    PLAIN,
    REFERENCE_NAMES,
    Exploration,
    MeshSearch,
    Variant,
    device_frontier,
    mesh_label,
)
from tensoropt.search.driver import (
    reference_gaps as _gaps_at,  # the name is this module's, for device counts together
)

GIB = 2**30
STANDARD_CAPACITIES_GIB = (16, 24, 32, 40, 48, 80, 141)


@dataclass(frozen=True, slots=True)
class Point:
    """One plan of the search: where it is, what it costs, what it does."""

    devices: int
    mesh: tuple[int, ...]
    index: int  # into the mesh search's frontier
    time_s: float
    memory_bytes: float
    summary: str
    variant: Variant = PLAIN  # the memory axes of its problem

    @property
    def mesh_text(self) -> str:
        return mesh_label(self.mesh, self.variant.stages)


@dataclass(frozen=True, slots=True)
class Reference:
    """A hand-written plan (data-parallel, Megatron) on its best mesh of a device count."""

    name: str
    devices: int
    mesh: tuple[int, ...]
    time_s: float
    memory_bytes: float
    summary: str


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """The fastest plan that fits ``capacity`` bytes per device, over all device counts."""

    capacity: float
    best: Point | None  # None: nothing fits
    fewest: Point | None  # the plan with the fewest devices that fits (fastest of those)


@dataclass(frozen=True, slots=True)
class TargetRow:
    """The fewest devices that reach ``target_s``, with and without a capacity limit."""

    target_s: float
    by_capacity: tuple[Point | None, ...]  # aligned with the capacities asked for


@dataclass(frozen=True, slots=True)
class BaselineRow:
    """A device count's reference plans against its frontier."""

    devices: int
    fastest: Point
    leanest: Point
    references: tuple[Reference, ...]
    # per reference: the least memory of a frontier point at most as slow as it
    lean_at_reference_time: tuple[Point, ...]


def _point(search: MeshSearch, index: int) -> Point:
    p = search.result.points[index]
    return Point(
        devices=search.devices,
        mesh=tuple(search.mesh.shape),
        index=index,
        time_s=p.time_s,
        memory_bytes=p.memory_bytes,
        summary=search.summaries[index],
        variant=search.variant,
    )


def device_counts(exp: Exploration) -> list[int]:
    return sorted({s.devices for s in exp.searches})


def device_frontiers(exp: Exploration) -> dict[int, list[Point]]:
    """Per device count, its frontier over all its meshes, fastest first."""
    out = {}
    for d in device_counts(exp):
        out[d] = [_point(s, exp.index_of(s, p)) for s, p in device_frontier(exp, d)]
    return out


def merged_points(exp: Exploration) -> list[Point]:
    """The frontier over (devices, time, memory)."""
    return [_point(exp.source_of(m), m.index) for m in exp.merged]


def sample_indices(count: int, limit: int) -> list[int]:
    """Up to ``limit`` evenly spaced indices of ``count`` rows, both ends included."""
    if count <= limit:
        return list(range(count))
    if limit < 2:
        return [0]
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)})


def references(exp: Exploration) -> dict[int, tuple[Reference, ...]]:
    """Per device count, each reference plan on the mesh where it is fastest."""
    out: dict[int, tuple[Reference, ...]] = {}
    for d in device_counts(exp):
        found = []
        for name in REFERENCE_NAMES:
            best = None
            for s in exp.searches:
                if s.devices != d or name not in s.references:
                    continue
                t, m, _ = s.references[name]
                if best is None or t < best.time_s:
                    summary = s.reference_summaries.get(name, "")
                    best = Reference(name, d, tuple(s.mesh.shape), t, m, summary)
            if best is not None:
                found.append(best)
        out[d] = tuple(found)
    return out


def reference_gaps(exp: Exploration) -> dict[int, dict[str, str]]:
    """Per device count, the reference plans the searched axes call for that no mesh
    holds, each with why (``search.driver.reference_gaps``: the search's tables say
    the same)."""
    return {d: found for d in device_counts(exp) if (found := _gaps_at(exp, d))}


# -- memory capacity -> fastest plan ---------------------------------------------------
def capacity_steps(exp: Exploration) -> list[Point]:
    """The step function capacity -> best time: the points where it improves.

    Sorted by memory; each point is the fastest plan of all plans using at most its
    memory (ties in time go to fewer devices). Between two steps the best time is flat.
    """
    points = sorted(merged_points(exp), key=lambda p: (p.memory_bytes, p.time_s, p.devices))
    steps: list[Point] = []
    for p in points:
        if steps and p.time_s >= steps[-1].time_s:
            continue
        steps.append(p)
    return steps


def fastest_under(points: Sequence[Point], capacity: float) -> Point | None:
    fits = [p for p in points if p.memory_bytes <= capacity]
    return min(fits, key=lambda p: (p.time_s, p.devices, p.memory_bytes), default=None)


def fewest_under(
    points: Sequence[Point], capacity: float, target_s: float = math.inf
) -> Point | None:
    """The plan with the fewest devices within ``capacity`` and ``target_s`` (fastest)."""
    fits = [p for p in points if p.memory_bytes <= capacity and p.time_s <= target_s]
    return min(fits, key=lambda p: (p.devices, p.time_s, p.memory_bytes), default=None)


def _round_sig(x: float, up: bool) -> float:
    """``x`` to two significant digits, rounded up or down."""
    if x <= 0:
        return x
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    q = x / scale
    q = math.ceil(q - 1e-9) if up else math.floor(q + 1e-9)
    return q * scale


def capacities(exp: Exploration, model_points: int = 4) -> list[float]:
    """The standard capacities plus a few spread over the model's own range, in bytes.

    The model's range runs from the least memory any plan needs to the memory of the
    fastest plan (more memory buys nothing beyond it).
    """
    points = merged_points(exp)
    out = {c * GIB for c in STANDARD_CAPACITIES_GIB}
    if points:
        lo = min(p.memory_bytes for p in points)
        hi = max(p.memory_bytes for p in points)
        out.add(_round_sig(lo, up=True))
        for i in range(1, model_points):
            out.add(_round_sig(lo * (hi / lo) ** (i / (model_points - 1)), up=True))
    return sorted(out)


def capacity_table(exp: Exploration, caps: Sequence[float]) -> list[CapacityRow]:
    points = merged_points(exp)
    return [CapacityRow(c, fastest_under(points, c), fewest_under(points, c)) for c in caps]


# -- step-time target -> fewest devices ------------------------------------------------
def time_targets(exp: Exploration, count: int = 8) -> list[float]:
    """Targets from the fastest plan overall to the slowest plan on the frontier (at
    least the fastest plan on the fewest devices), evenly spaced on a log scale."""
    points = merged_points(exp)
    if not points:
        return []
    lo = min(p.time_s for p in points)
    fewest = min(p.devices for p in points)
    hi = max(min(p.time_s for p in points if p.devices == fewest), *(p.time_s for p in points))
    if hi <= lo * (1 + 1e-9):
        return [_round_sig(lo, up=True)]
    raw = [lo * (hi / lo) ** (i / (count - 1)) for i in range(count)]
    return sorted({_round_sig(t, up=True) for t in raw})


def binding_capacities(
    exp: Exploration, caps: Sequence[float], limit: int = 4, prefer: Sequence[float] = ()
) -> list[float]:
    """Capacities that change the fewest-devices answer: fit something, bind somewhere.

    A capacity at or above the memory of every point gives the unlimited answer and is
    left out (the table has an unlimited column). ``prefer`` (e.g. the cluster's own
    device memory) comes first when it binds; the rest is spread over ``caps``; at most
    ``limit`` in all, sorted.
    """
    points = merged_points(exp)
    if not points:
        return []
    lo = min(p.memory_bytes for p in points)
    hi = max(p.memory_bytes for p in points)
    chosen = [c for c in dict.fromkeys(prefer) if lo <= c < hi][:limit]
    useful = [c for c in caps if lo <= c < hi and c not in chosen]
    room = limit - len(chosen)
    if room > 0 and useful:
        chosen += [useful[i] for i in sample_indices(len(useful), room)]
    return sorted(chosen)


def target_table(
    exp: Exploration, targets: Sequence[float], caps: Sequence[float]
) -> list[TargetRow]:
    """Rows of fewest devices per target; the last column is without a capacity limit."""
    points = merged_points(exp)
    limits = [*caps, math.inf]
    return [TargetRow(t, tuple(fewest_under(points, c, t) for c in limits)) for t in targets]


def device_steps(exp: Exploration, capacity: float = math.inf) -> list[Point]:
    """The step function target -> fewest devices: per device count (ascending), its
    fastest plan within ``capacity`` when it beats every smaller count."""
    points = merged_points(exp)
    steps: list[Point] = []
    for d in device_counts(exp):
        best = fastest_under([p for p in points if p.devices == d], capacity)
        if best is None or (steps and best.time_s >= steps[-1].time_s):
            continue
        steps.append(best)
    return steps


# -- reference plans ------------------------------------------------------------------
def baselines(exp: Exploration) -> list[BaselineRow]:
    frontiers = device_frontiers(exp)
    refs = references(exp)
    rows = []
    for d, rows_d in frontiers.items():
        if not rows_d or not refs.get(d):
            continue
        lean = []
        for ref in refs[d]:
            within = [p for p in rows_d if p.time_s <= ref.time_s]
            lean.append(min(within, key=lambda p: p.memory_bytes) if within else rows_d[0])
        rows.append(BaselineRow(d, rows_d[0], rows_d[-1], refs[d], tuple(lean)))
    return rows


# -- what each memory axis buys ---------------------------------------------------------
AXIS_LEVELS = ("split", "+ ZeRO", "+ recompute", "+ micro-batches", "+ pipeline stages")


@dataclass(frozen=True, slots=True)
class AxisRow:
    """Per device count: the least-memory plan using the axes up to each level (split;
    with ZeRO; with recomputation too; with micro-batches too), None where a level has
    no plan (the axis was not searched, or nothing fits the budget)."""

    devices: int
    least: tuple[Point | None, ...]  # aligned with AXIS_LEVELS


def axis_gains(exp: Exploration) -> list[AxisRow]:
    """The least memory per device each cumulative set of axes reaches, None at a level
    whose axis was not searched at that device count (not the level before it again:
    that would say the axis buys nothing). Exact: the search solves the levels in this
    order (``search.driver``), so the points a level leaves out are strictly dominated
    by points of the levels before it."""
    from tensoropt.search.driver import Axis, axis_level

    space = exp.space
    rows = []
    for d in device_counts(exp):
        stages = Axis.STAGES in space.axes and d > space.stages_above
        searched = (True, Axis.ZERO in space.axes, Axis.RECOMPUTE in space.axes,
                    space.shows_micro, stages)  # fmt: skip
        least: list[Point | None] = [None] * len(AXIS_LEVELS)
        for s in exp.searches:
            if s.devices != d or not s.result.points:
                continue
            low = _point(s, len(s.result.points) - 1)
            for level in range(axis_level(s.variant), len(AXIS_LEVELS)):
                if not searched[level]:
                    continue
                best = least[level]
                if best is None or (low.memory_bytes, low.time_s) < (
                    best.memory_bytes,
                    best.time_s,
                ):
                    least[level] = low
        rows.append(AxisRow(d, tuple(least)))
    return rows
