"""Cost problems: the data the Frontier Tracking search consumes and the `--dump-costs` file.

A cost problem is a set of decision units, each with a list of strategies that cost
(time, memory), and edges whose tables cost (time, memory) for every pair of strategies of
their two units. A plan picks one strategy per unit; its objective is the plain sum of the
chosen unit costs and the chosen edge entries, in both coordinates. Because the objective is
exactly additive, the Pareto frontier over all plans can be computed by dynamic programming
and checked point by point by anyone who reads the dumped file.

Everything here is frozen data plus JSON (de)serialisation. Malformed input raises
:class:`tensoropt.errors.PlanError` naming the offending field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tensoropt.errors import PlanError

COSTS_SCHEMA = "tensoropt.costs/1"

Table = tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True)
class Strategy:
    """One legal strategy of a unit with its own (time, memory) cost."""

    label: str
    time_s: float
    memory_bytes: float


@dataclass(frozen=True, slots=True)
class Unit:
    """A decision unit (one forward op, its gradients and its parameter update)."""

    name: str
    strategies: tuple[Strategy, ...]


@dataclass(frozen=True, slots=True)
class Edge:
    """Redistribution cost between two units: tables are |S(src)| x |S(dst)|."""

    src: int
    dst: int
    time_s: Table
    memory_bytes: Table


@dataclass(frozen=True, slots=True)
class BlockHint:
    """`count` consecutive identical blocks of `units_per_block` units from `first_unit`.

    A hint from the cost model: the search checks it against the tables and raises
    :class:`PlanError` if the blocks are not identical or do not connect only through a
    boundary. Without a hint the search detects repeated blocks by itself.
    """

    first_unit: int
    units_per_block: int
    count: int


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    """A Pareto-optimal plan: its objective and one strategy index per unit."""

    time_s: float
    memory_bytes: float
    choice: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CostProblem:
    """All units, edges and the (devices, mesh) they were costed for.

    Costs must be finite and nonnegative (both the memory budget and the epsilon
    approximation rely on it). Construction validates shapes and values.
    """

    units: tuple[Unit, ...]
    edges: tuple[Edge, ...] = ()
    devices: int = 1
    mesh: tuple[int, ...] = (1,)
    blocks: tuple[BlockHint, ...] = field(default=())

    def __post_init__(self) -> None:
        _validate_parts(self.units, self.edges, self.devices, self.mesh, self.blocks, "problem")

    def evaluate(self, choice: Sequence[int]) -> tuple[float, float]:
        """Objective (time, memory) of a full choice vector, correctly rounded (math.fsum).

        fsum makes the value independent of summation order, so every solver that reads
        the same tables gets the same number for the same plan.
        """
        if len(choice) != len(self.units):
            raise PlanError(
                f"choice has {len(choice)} entries, expected one per unit ({len(self.units)})"
            )
        ts: list[float] = []
        ms: list[float] = []
        for i, (unit, s) in enumerate(zip(self.units, choice, strict=True)):
            if not 0 <= s < len(unit.strategies):
                raise PlanError(
                    f"choice[{i}] = {s} is not a strategy index of unit {unit.name!r} "
                    f"(it has {len(unit.strategies)})"
                )
            ts.append(unit.strategies[s].time_s)
            ms.append(unit.strategies[s].memory_bytes)
        for e in self.edges:
            ts.append(e.time_s[choice[e.src]][choice[e.dst]])
            ms.append(e.memory_bytes[choice[e.src]][choice[e.dst]])
        return math.fsum(ts), math.fsum(ms)


@dataclass(frozen=True, slots=True)
class CostRecord:
    """One problem of a `--dump-costs` file with the frontier the search returned for it."""

    problem: CostProblem
    frontier: tuple[FrontierPoint, ...] = ()
    epsilon: float | None = None


# ----------------------------------------------------------------------------- validation


def _check_cost(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanError(f"{where}: expected a number, found {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0.0:
        raise PlanError(f"{where}: expected a finite nonnegative cost, found {value!r}")
    return v


def _check_table(table: Any, rows: int, cols: int, where: str) -> None:
    if not isinstance(table, tuple | list) or len(table) != rows:
        found = len(table) if isinstance(table, tuple | list) else type(table).__name__
        raise PlanError(f"{where}: expected {rows} rows (strategies of src), found {found}")
    for r, row in enumerate(table):
        if not isinstance(row, tuple | list) or len(row) != cols:
            found = len(row) if isinstance(row, tuple | list) else type(row).__name__
            raise PlanError(
                f"{where}[{r}]: expected {cols} entries (strategies of dst), found {found}"
            )
    # Tables run to millions of entries: check them at once, and entry by entry only to
    # name the first bad one.
    kinds = {type(v) for row in table for v in row}
    if kinds <= {float, int}:
        values = np.asarray(table, dtype=np.float64).reshape(rows, cols)
        if np.isfinite(values).all() and (values >= 0.0).all():
            return
    for r, row in enumerate(table):
        for c, v in enumerate(row):
            _check_cost(v, f"{where}[{r}][{c}]")


def _plain_costs(units: tuple[Unit, ...]) -> bool:
    """Whether every unit has strategies and every unit cost is a finite nonnegative
    float (checked as one array; the cost model builds hundreds of problems)."""
    values = [v for u in units for s in u.strategies for v in (s.time_s, s.memory_bytes)]
    if not all(u.strategies for u in units) or not all(isinstance(v, float) for v in values):
        return False
    array = np.array(values, dtype=np.float64)
    return bool(np.isfinite(array).all() and (array >= 0.0).all())


def _validate_parts(
    units: tuple[Unit, ...],
    edges: tuple[Edge, ...],
    devices: int,
    mesh: tuple[int, ...],
    blocks: tuple[BlockHint, ...],
    where: str,
) -> None:
    if not units:
        raise PlanError(f"{where}.units: a cost problem needs at least one unit, found none")
    if not _plain_costs(units):  # name the first bad entry
        for i, u in enumerate(units):
            if not u.strategies:
                raise PlanError(f"{where}.units[{i}] ({u.name!r}): a unit needs >= 1 strategy")
            for k, s in enumerate(u.strategies):
                _check_cost(s.time_s, f"{where}.units[{i}].strategies[{k}].time_s")
                _check_cost(s.memory_bytes, f"{where}.units[{i}].strategies[{k}].memory_bytes")
    n = len(units)
    sizes = [len(u.strategies) for u in units]
    checked: set[tuple[int, int, int]] = set()  # tables shared by several edges: once
    for j, e in enumerate(edges):
        src, dst = e.src, e.dst
        if type(src) is not int or type(dst) is not int or not (0 <= src < n and 0 <= dst < n):
            for name, idx in (("src", src), ("dst", dst)):
                if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
                    raise PlanError(f"{where}.edges[{j}].{name}: expected a unit index in [0, {n})")
        rows, cols = sizes[src], sizes[dst]
        key = (id(e.time_s), rows, cols)  # the edges hold the tables: ids stay theirs
        if key not in checked:
            _check_table(e.time_s, rows, cols, f"{where}.edges[{j}].time_s")
            checked.add(key)
        key = (id(e.memory_bytes), rows, cols)
        if key not in checked:
            _check_table(e.memory_bytes, rows, cols, f"{where}.edges[{j}].memory_bytes")
            checked.add(key)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"{where}.devices: expected a positive integer, found {devices!r}")
    if not mesh or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in mesh):
        raise PlanError(f"{where}.mesh: expected positive integer axis sizes, found {mesh!r}")
    for j, b in enumerate(blocks):
        if b.units_per_block < 1 or b.count < 1 or b.first_unit < 0:
            raise PlanError(f"{where}.blocks[{j}]: sizes must be positive, found {b}")
        if b.first_unit + b.units_per_block * b.count > n:
            raise PlanError(f"{where}.blocks[{j}]: {b} runs past the last unit ({n} units)")


# ----------------------------------------------------------------------------- JSON


def _req(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise PlanError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    if key not in obj:
        raise PlanError(f"{where}.{key}: required field is missing")
    return obj[key]


def _req_list(obj: Any, key: str, where: str) -> list[Any]:
    value = _req(obj, key, where)
    if not isinstance(value, list):
        raise PlanError(f"{where}.{key}: expected a list, found {type(value).__name__}")
    return value


def _req_int(obj: Any, key: str, where: str) -> int:
    value = _req(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{where}.{key}: expected an integer, found {value!r}")
    return value


def _table_from_json(obj: Any, key: str, where: str) -> Table:
    rows = _req_list(obj, key, where)
    out = []
    for r, row in enumerate(rows):
        if not isinstance(row, list):
            raise PlanError(f"{where}.{key}[{r}]: expected a list, found {type(row).__name__}")
        out.append(tuple(_check_cost(v, f"{where}.{key}[{r}][{c}]") for c, v in enumerate(row)))
    return tuple(out)


def _unit_from_json(obj: Any, where: str) -> Unit:
    name = _req(obj, "name", where)
    if not isinstance(name, str):
        raise PlanError(f"{where}.name: expected a string, found {name!r}")
    strategies = []
    for k, s in enumerate(_req_list(obj, "strategies", where)):
        sw = f"{where}.strategies[{k}]"
        label = _req(s, "label", sw)
        if not isinstance(label, str):
            raise PlanError(f"{sw}.label: expected a string, found {label!r}")
        t = _check_cost(_req(s, "time_s", sw), f"{sw}.time_s")
        m = _check_cost(_req(s, "memory_bytes", sw), f"{sw}.memory_bytes")
        strategies.append(Strategy(label, t, m))
    return Unit(name, tuple(strategies))


def _frontier_from_json(obj: Any, where: str, n_units: int) -> tuple[FrontierPoint, ...]:
    if "frontier" not in obj:
        return ()
    points = []
    for k, p in enumerate(_req_list(obj, "frontier", where)):
        pw = f"{where}.frontier[{k}]"
        t = _check_cost(_req(p, "time_s", pw), f"{pw}.time_s")
        m = _check_cost(_req(p, "memory_bytes", pw), f"{pw}.memory_bytes")
        choice = _req_list(p, "choice", pw)
        if len(choice) != n_units or any(
            isinstance(c, bool) or not isinstance(c, int) for c in choice
        ):
            raise PlanError(f"{pw}.choice: expected {n_units} integer strategy indices")
        points.append(FrontierPoint(t, m, tuple(choice)))
    return tuple(points)


def record_from_json(obj: Any, where: str = "problems[0]") -> CostRecord:
    """Parse one entry of the `problems` list; raises PlanError naming the bad field."""
    units = tuple(
        _unit_from_json(u, f"{where}.units[{i}]")
        for i, u in enumerate(_req_list(obj, "units", where))
    )
    edges = []
    for j, e in enumerate(_req_list(obj, "edges", where) if "edges" in obj else []):
        ew = f"{where}.edges[{j}]"
        edges.append(
            Edge(
                _req_int(e, "src", ew),
                _req_int(e, "dst", ew),
                _table_from_json(e, "time_s", ew),
                _table_from_json(e, "memory_bytes", ew),
            )
        )
    mesh = _req_list(obj, "mesh", where)
    raw_blocks = _req_list(obj, "blocks", where) if "blocks" in obj else []
    blocks = tuple(
        BlockHint(
            _req_int(b, "first_unit", f"{where}.blocks[{j}]"),
            _req_int(b, "units_per_block", f"{where}.blocks[{j}]"),
            _req_int(b, "count", f"{where}.blocks[{j}]"),
        )
        for j, b in enumerate(raw_blocks)
    )
    devices = _req_int(obj, "devices", where)
    _validate_parts(units, tuple(edges), devices, tuple(mesh), blocks, where)
    problem = CostProblem(units, tuple(edges), devices, tuple(mesh), blocks)
    eps = obj.get("epsilon")
    if eps is not None:
        eps = _check_cost(eps, f"{where}.epsilon")
    return CostRecord(problem, _frontier_from_json(obj, where, len(units)), eps)


def record_to_json(record: CostRecord) -> dict[str, Any]:
    """One entry of the `problems` list (floats are written with repr: exact round trip)."""
    p = record.problem
    out: dict[str, Any] = {
        "devices": p.devices,
        "mesh": list(p.mesh),
        "units": [
            {
                "name": u.name,
                "strategies": [
                    {"label": s.label, "time_s": s.time_s, "memory_bytes": s.memory_bytes}
                    for s in u.strategies
                ],
            }
            for u in p.units
        ],
        "edges": [
            {
                "src": e.src,
                "dst": e.dst,
                "time_s": [list(r) for r in e.time_s],
                "memory_bytes": [list(r) for r in e.memory_bytes],
            }
            for e in p.edges
        ],
        "frontier": [
            {"time_s": f.time_s, "memory_bytes": f.memory_bytes, "choice": list(f.choice)}
            for f in record.frontier
        ],
    }
    if p.blocks:
        out["blocks"] = [
            {"first_unit": b.first_unit, "units_per_block": b.units_per_block, "count": b.count}
            for b in p.blocks
        ]
    if record.epsilon is not None:
        out["epsilon"] = record.epsilon
    return out


def costs_to_json(records: Sequence[CostRecord]) -> dict[str, Any]:
    """The whole `--dump-costs` document."""
    return {"schema": COSTS_SCHEMA, "problems": [record_to_json(r) for r in records]}


def costs_from_json(doc: Any) -> tuple[CostRecord, ...]:
    """Parse a `--dump-costs` document; raises PlanError naming the bad field."""
    schema = _req(doc, "schema", "costs")
    if schema != COSTS_SCHEMA:
        raise PlanError(f"costs.schema: expected {COSTS_SCHEMA!r}, found {schema!r}")
    problems = _req_list(doc, "problems", "costs")
    return tuple(record_from_json(p, f"problems[{i}]") for i, p in enumerate(problems))


def dump_costs(records: Sequence[CostRecord], path: str | Path) -> None:
    """Write a `--dump-costs` file (atomically: temp file, then rename)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(costs_to_json(records), allow_nan=False), encoding="utf-8")
    tmp.replace(target)


def load_costs(path: str | Path) -> tuple[CostRecord, ...]:
    """Read a `--dump-costs` file; raises PlanError on a missing, non-JSON or malformed file."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"{source}: cannot read the costs file ({exc.strerror})") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{source}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    try:
        return costs_from_json(doc)
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from exc
