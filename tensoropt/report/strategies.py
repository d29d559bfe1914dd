"""How the chosen strategies change along one device count's frontier.

For each frontier point (fastest first) and each weight unit (graph order), the kind of
parallelism the plan gives the unit: data parallel, tensor parallel, replicated, or a mix
over a 2-D mesh. Kinds come from the search (``MeshSearch.strategy_kinds``, made by
``cost.summary.unit_kind``) and are normalised across the meshes of one device count so
that ``dp=2 x dp=4`` on a 2x4 mesh reads as ``dp=8``, like the 1-D mesh's.

The sentences are derived from this matrix: units are grouped by their role (node name
with layer numbers and the op type removed, so a projection's MatMul and bias Add share
one), and each group is described by where
along the frontier its units first leave the strategy they have in the fastest plan.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from tensoropt.errors import TensorOptError
from tensoropt.report.analysis import Point
from tensoropt.search.driver import Exploration

REPLICATED = "replicated"


@dataclass(frozen=True, slots=True)
class UnitRow:
    name: str  # the forward node that roots the unit
    op: str
    role: str  # the name with numbers replaced by '#' and the op suffix removed


@dataclass(frozen=True, slots=True)
class Track:
    """Kinds of every weight unit at every frontier point of one device count."""

    devices: int
    points: tuple[Point, ...]  # fastest first
    units: tuple[UnitRow, ...]  # weight units in graph order
    kinds: tuple[tuple[str, ...], ...]  # kinds[u][i]: unit u at point i (normalised)


@dataclass(frozen=True, slots=True)
class GroupChange:
    """One group of units and how it changes from the fastest to the least-memory plan."""

    role: str
    ops: str  # op types of the group's units, most common first ("MatMul+Add")
    units: tuple[str, ...]  # every unit of the group, graph order
    changed: tuple[str, ...]  # units whose kind at the least-memory point differs from the fastest
    fast_state: str  # kinds of the group in the fastest plan, e.g. "dp=8 (36), tp=8 (36)"
    lean_state: str  # the same at the least-memory point
    first_point: int  # first point where a unit differs from its fastest kind (-1: never)
    settle_point: int  # median point from which changed units keep their final kind (-1: none)
    detours: int  # units with the same kind at both ends but another one in between


def normal_kind(kind: str, devices: int) -> str:
    """``tp=4 x dp=2`` style with tp first, dp degrees multiplied, redundancy stated."""
    if kind == REPLICATED:
        return REPLICATED
    tp = dp = 1
    for part in kind.split(" x "):
        name, _, degree = part.partition("=")
        if name == "tp":
            tp *= int(degree)
        elif name == "dp":
            dp *= int(degree)
    parts = [f"tp={tp}"] if tp > 1 else []
    parts += [f"dp={dp}"] if dp > 1 else []
    text = " x ".join(parts) or REPLICATED
    spare = devices // (tp * dp)
    return text if spare <= 1 else f"{text}, {spare}x redundant"


def kind_order(kind: str) -> tuple[int, int, int, str]:
    """Sort key: replicated, then by tensor-parallel degree, then data-parallel degree."""
    tp = _degree(kind, "tp")
    dp = _degree(kind, "dp")
    return (kind != REPLICATED, tp, dp, kind)


def _degree(kind: str, name: str) -> int:
    match = re.search(rf"\b{name}=(\d+)", kind)
    return int(match.group(1)) if match else 1


def role_of(name: str, op: str) -> str:
    """``h12/mlp/fc_in/MatMul`` -> ``h#/mlp/fc_in``: where in a block, not which block."""
    stem = name[: -len(op) - 1] if name.endswith("/" + op) else name
    return re.sub(r"\d+", "#", stem) or op


def track(exp: Exploration, devices: int, rows: Sequence[Point]) -> Track:
    """The kinds matrix of ``rows`` (one device count's frontier, fastest first)."""
    searches = [s for s in exp.searches if s.devices == devices]
    if not searches or not rows:
        raise TensorOptError(f"no frontier at {devices} devices to describe")
    first = searches[0]
    if not first.strategy_kinds:
        raise TensorOptError(
            "the search results carry no per-unit detail (MeshSearch.strategy_kinds)"
        )
    weighted = [k for k, w in enumerate(first.unit_weighted) if w]
    units = tuple(
        UnitRow(
            first.unit_names[k], first.unit_ops[k], role_of(first.unit_names[k], first.unit_ops[k])
        )
        for k in weighted
    )
    columns = []
    for p in rows:
        search = exp.source_of(p)
        if search.unit_names != first.unit_names:
            raise TensorOptError(f"meshes of {devices} devices disagree on the units")
        choice = search.result.points[p.index].choice
        columns.append(
            [normal_kind(search.strategy_kinds[k][choice[k]], devices) for k in weighted]
        )
    kinds = tuple(tuple(col[u] for col in columns) for u in range(len(units)))
    return Track(devices, tuple(rows), units, kinds)


def state(kinds: Sequence[str], limit: int = 3) -> str:
    """``dp=8 (36), tp=8 (36)``: a group's kinds with counts, most common first."""
    counts: dict[str, int] = defaultdict(int)
    for k in kinds:
        counts[k] += 1
    ranked = sorted(counts, key=lambda k: (-counts[k], kind_order(k)))
    if len(ranked) == 1:
        return ranked[0]
    text = ", ".join(f"{k} ({counts[k]})" for k in ranked[:limit])
    return text + (f", {len(ranked) - limit} more kinds" if len(ranked) > limit else "")


def _unit_path(series: Sequence[str]) -> tuple[int, int, bool]:
    """(first point off the fastest kind or -1, point from which the final kind holds,
    whether the unit detours: same kind at both ends, another one in between)."""
    off = [i for i, k in enumerate(series) if k != series[0]]
    first = off[0] if off else -1
    unsettled = [i for i, k in enumerate(series) if k != series[-1]]
    settle = unsettled[-1] + 1 if unsettled else 0
    return first, settle, bool(off) and series[-1] == series[0]


def group_changes(tr: Track) -> list[GroupChange]:
    """Per role (a weight op and its bias add share one), ordered by where along the
    frontier the group settles into its least-memory strategy; groups that only detour
    come next, unchanged groups last."""
    groups: dict[str, list[int]] = defaultdict(list)
    for u, row in enumerate(tr.units):
        groups[row.role].append(u)
    out = []
    for role, members in groups.items():
        ops: dict[str, int] = defaultdict(int)
        for u in members:
            ops[tr.units[u].op] += 1
        paths = {u: _unit_path(tr.kinds[u]) for u in members}
        changed = [u for u in members if tr.kinds[u][0] != tr.kinds[u][-1]]
        settles = sorted(paths[u][1] for u in changed)
        firsts = [paths[u][0] for u in members if paths[u][0] >= 0]
        out.append(
            GroupChange(
                role=role,
                ops="+".join(sorted(ops, key=lambda o: -ops[o])),
                units=tuple(tr.units[u].name for u in members),
                changed=tuple(tr.units[u].name for u in changed),
                fast_state=state([tr.kinds[u][0] for u in members]),
                lean_state=state([tr.kinds[u][-1] for u in members]),
                first_point=min(firsts, default=-1),
                settle_point=settles[len(settles) // 2] if settles else -1,
                detours=sum(paths[u][2] for u in members),
            )
        )
    out.sort(key=_change_order)
    return out


def _change_order(g: GroupChange) -> tuple[int, int, str]:
    if g.changed:
        return (0, g.settle_point, g.role)
    if g.first_point >= 0:
        return (1, g.first_point, g.role)
    return (2, 0, g.role)


def layer_ranges(names: Sequence[str]) -> str:
    """``h0..h5, h9, lm_head`` for units named ``h0/...``: numbered names by their first
    number, the others by their name without the op type."""
    prefix_numbers: dict[str, list[int]] = defaultdict(list)
    plain: list[str] = []
    for name in names:
        match = re.match(r"(\D*)(\d+)", name)
        if match:
            prefix_numbers[match.group(1)].append(int(match.group(2)))
        elif (stem := name.rsplit("/", 1)[0]) not in plain:
            plain.append(stem)
    parts = []
    for prefix, numbers in prefix_numbers.items():
        numbers = sorted(set(numbers))
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            parts.append(
                f"{prefix}{start}" if start == prev else f"{prefix}{start}..{prefix}{prev}"
            )
            if n is not None:
                start = prev = n
    return ", ".join([*parts, *plain])
