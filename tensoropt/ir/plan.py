"""Plan: one sharding strategy per decision unit, serialisable and hand-editable.

A unit is named by its forward ONNX node name (CONTRACTS: ``tensoropt.unit``). A unit's
strategy is either

- explicit layouts of the node's inputs and outputs (one placement per mesh axis each;
  ``null`` for an absent optional input), which is what people write by hand, or
- an ``index`` into the deterministic strategy list that the sharding registry enumerates
  for that node on this mesh (``tensoropt.rules.sharding.registry.strategies_nd``), which is
  compact for searched plans.

When both are given they must agree (checked where the node is known, by
``registry.resolve_unit``). Units not listed get the plan's ``default``.

Memory-for-time choices, each optional (absent means off): a unit's ``zero`` stage
(:class:`ZeroStage`) for the parameters it places, the plan's ``micro_batches`` (gradient
accumulation over that many micro-batches per step) and ``recompute`` (names of the blocks
whose forward runs again in the backward).

Pipeline stages, optional: ``pipeline.starts`` names the blocks (``block_<i>``, as
``recompute`` names them) where stages 1, 2, ... begin, so a plan with P - 1 starts runs
P stages, each on a sub-mesh of its own of the plan's mesh shape (P x mesh.size devices),
its ``micro_batches`` micro-batches under ``pipeline.schedule`` (``1f1b`` or ``gpipe``).

File format (``schema`` ``tensoropt.plan/1``)::

    {"schema": "tensoropt.plan/1",
     "source": "search --pick fastest",
     "mesh": {"shape": [2, 4], "axis_names": ["dp", "tp"]},
     "default": "data-parallel",
     "units": {"MatMul_0": {"inputs": ["S(0)R", "RS(1)"], "outputs": ["S(0)S(1)"]},
               "Add_3": {"index": 2, "zero": 3}},
     "micro_batches": 4,
     "recompute": ["block_0", "block_1"],
     "pipeline": {"starts": ["block_8"], "schedule": "1f1b"}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tensoropt.errors import PlanError
from tensoropt.ir.layout import Layout
from tensoropt.ir.mesh import Mesh

PLAN_SCHEMA = "tensoropt.plan/1"
SCHEDULES = ("1f1b", "gpipe")
"""Pipeline schedules: one-forward-one-backward (PipeDream-flush), or every forward first."""


class DefaultStrategy(Enum):
    """What units that a plan does not list get.

    ``DATA_PARALLEL``: values derived from data inputs have dim 0 sharded on mesh axis 0,
    parameters and everything else are replicated. ``REPLICATED``: everything is replicated.
    Turning either into per-node strategies needs the graph, so it is done by the passes.
    """

    DATA_PARALLEL = "data-parallel"
    REPLICATED = "replicated"


class ZeroStage(IntEnum):
    """How much of a unit's parameter state is sharded over its data-parallel mesh axes.

    The axes are those where the unit's parameter is replicated while its op splits the
    batch. ``OPTIMIZER`` (ZeRO-1): optimizer state sharded, gradient reduce-scattered, the
    update runs on the shard and the new parameter is all-gathered. ``GRADIENTS`` (ZeRO-2):
    in addition only the gradient shard stays resident across micro-batches. ``PARAMETERS``
    (ZeRO-3, FSDP): in addition the parameter is stored as a shard and all-gathered for its
    forward use and again for its backward use.
    """

    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


@dataclass(frozen=True, slots=True)
class UnitStrategy:
    """The strategy of one decision unit: explicit layouts, an enumeration index, or both,
    and the ZeRO stage of the parameters the unit places."""

    inputs: tuple[Layout | None, ...] | None = None
    outputs: tuple[Layout, ...] | None = None
    index: int | None = None
    zero: ZeroStage = ZeroStage.NONE

    def __post_init__(self) -> None:
        if (self.inputs is None) != (self.outputs is None):
            raise PlanError("unit strategy: give both 'inputs' and 'outputs', or neither")
        if self.inputs is None and self.index is None:
            raise PlanError("unit strategy: give 'inputs' and 'outputs', or an 'index'")
        if self.index is not None and (isinstance(self.index, bool) or self.index < 0):
            raise PlanError(f"unit strategy: index must be an integer >= 0, found {self.index}")

    @property
    def explicit(self) -> bool:
        """True when the layouts are written out."""
        return self.inputs is not None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.inputs is not None and self.outputs is not None:
            out["inputs"] = [None if lay is None else str(lay) for lay in self.inputs]
            out["outputs"] = [str(lay) for lay in self.outputs]
        if self.index is not None:
            out["index"] = self.index
        if self.zero is not ZeroStage.NONE:
            out["zero"] = int(self.zero)
        return out

    @classmethod
    def from_json(cls, obj: object, mesh: Mesh, where: str) -> UnitStrategy:
        if not isinstance(obj, dict):
            raise PlanError(f"{where}: expected an object, found {type(obj).__name__}")
        unknown = set(obj) - {"inputs", "outputs", "index", "zero"}
        if unknown:
            raise PlanError(
                f"{where}: unknown keys {sorted(unknown)}; allowed: inputs, outputs, index, zero"
            )
        zero = _zero(obj.get("zero", 0), f"{where}.zero")
        index = obj.get("index")
        if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
            raise PlanError(f"{where}.index: expected an integer, found {index!r}")
        inputs = _layouts(obj.get("inputs"), mesh, f"{where}.inputs", allow_null=True)
        outputs = _layouts(obj.get("outputs"), mesh, f"{where}.outputs", allow_null=False)
        try:
            return cls(inputs, outputs, index, zero)  # type: ignore[arg-type]
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None


def _layouts(
    obj: object, mesh: Mesh, where: str, allow_null: bool
) -> tuple[Layout | None, ...] | None:
    if obj is None:
        return None
    if not isinstance(obj, list):
        raise PlanError(f"{where}: expected a list of placement strings, found {obj!r}")
    out: list[Layout | None] = []
    for i, item in enumerate(obj):
        if item is None and allow_null:
            out.append(None)
            continue
        layout = Layout.parse(item, f"{where}[{i}]")
        if layout.ndim != mesh.ndim:
            raise PlanError(
                f"{where}[{i}]: {item!r} has {layout.ndim} placements but the mesh {mesh} has "
                f"{mesh.ndim} axes; give one placement per mesh axis"
            )
        out.append(layout)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Plan:
    """A strategy per decision unit on one mesh. ``source`` says who made it (free text)."""

    mesh: Mesh
    units: Mapping[str, UnitStrategy]
    source: str = ""
    default: DefaultStrategy = DefaultStrategy.DATA_PARALLEL
    # Mesh axes that shard dim 0 of the data inputs (outermost first); None: data inputs
    # take the layout their first listed consumer reads them in (searched plans).
    data_axes: tuple[int, ...] | None = (0,)
    # Each step's global batch runs as this many micro-batches whose gradients are
    # accumulated; gradients are synchronised and parameters updated once per step.
    micro_batches: int = 1
    # Names of the recomputed blocks: only a block's input is kept for the backward, and
    # its forward runs again inside the backward.
    recompute: tuple[str, ...] = ()
    # Pipeline stages: the blocks where stages 1, 2, ... begin (empty: one stage), and
    # the order each stage runs its micro-batches' forwards and backwards in.
    stages: tuple[str, ...] = ()
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", MappingProxyType(dict(self.units)))
        object.__setattr__(self, "recompute", tuple(self.recompute))
        object.__setattr__(self, "stages", tuple(self.stages))
        if len(set(self.stages)) != len(self.stages):
            raise PlanError("plan pipeline.starts: a block is listed twice; list each once")
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"plan pipeline.schedule: expected one of {', '.join(SCHEDULES)}, "
                f"found {self.schedule!r}"
            )
        if isinstance(self.micro_batches, bool) or not (
            isinstance(self.micro_batches, int) and self.micro_batches >= 1
        ):
            raise PlanError(
                f"plan micro_batches: expected an integer >= 1, found {self.micro_batches!r}"
            )
        if len(set(self.recompute)) != len(self.recompute):
            raise PlanError("plan recompute: a block is listed twice; list each block once")
        for name, unit in self.units.items():
            _check_unit_axes(name, unit, self.mesh)
        if self.data_axes is not None:
            object.__setattr__(self, "data_axes", tuple(self.data_axes))
            bad = [a for a in self.data_axes if not 0 <= a < self.mesh.ndim]
            if bad:
                raise PlanError(
                    f"plan data_axes {list(self.data_axes)}: axes {bad} are not axes of "
                    f"the mesh {self.mesh}"
                )

    @property
    def num_stages(self) -> int:
        """Pipeline stages: 1 for a plan without stages."""
        return len(self.stages) + 1

    @property
    def world_size(self) -> int:
        """Devices the plan runs on: one sub-mesh per stage."""
        return self.num_stages * self.mesh.size

    def unit(self, name: str) -> UnitStrategy | None:
        """The listed strategy of unit ``name``, or None (then :attr:`default` applies)."""
        return self.units.get(name)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": PLAN_SCHEMA,
            "source": self.source,
            "mesh": self.mesh.to_json(),
            "default": self.default.value,
            "data_axes": None if self.data_axes is None else list(self.data_axes),
        }
        # Written only when they differ from the plain plan, so plain plans read the same.
        if self.micro_batches != 1:
            out["micro_batches"] = self.micro_batches
        if self.recompute:
            out["recompute"] = list(self.recompute)
        if self.stages:
            out["pipeline"] = {"starts": list(self.stages), "schedule": self.schedule}
        out["units"] = {name: self.units[name].to_json() for name in sorted(self.units)}
        return out

    def dumps(self) -> str:
        """Deterministic JSON text (sorted units, two-space indent)."""
        return json.dumps(self.to_json(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps(), encoding="utf-8")

    @classmethod
    def from_json(cls, obj: object, where: str = "plan") -> Plan:
        """Build from parsed JSON; every error names the JSON path that is wrong."""
        if not isinstance(obj, dict):
            raise PlanError(f"{where}: expected a JSON object, found {type(obj).__name__}")
        schema = obj.get("schema")
        if schema != PLAN_SCHEMA:
            raise PlanError(f"{where}.schema: expected {PLAN_SCHEMA!r}, found {schema!r}")
        keys = {"schema", "source", "mesh", "default", "units", "data_axes"}
        unknown = set(obj) - keys - {"micro_batches", "recompute", "pipeline"}
        if unknown:
            raise PlanError(f"{where}: unknown keys {sorted(unknown)}")
        if "mesh" not in obj:
            raise PlanError(f"{where}.mesh: missing; give {{'shape': [...], 'axis_names': [...]}}")
        mesh = Mesh.from_json(obj["mesh"], f"{where}.mesh")
        source = obj.get("source", "")
        if not isinstance(source, str):
            raise PlanError(f"{where}.source: expected a string, found {source!r}")
        default = _default(obj.get("default", DefaultStrategy.DATA_PARALLEL.value), where)
        if "units" not in obj:
            # A plan file lists its units; without the key an edited file would compile
            # as the default strategy everywhere, whatever it meant.
            raise PlanError(
                f"{where}.units: missing; list each unit's strategy, or give {{}} for the "
                "default strategy everywhere"
            )
        units_obj = obj["units"]
        if not isinstance(units_obj, dict):
            raise PlanError(f"{where}.units: expected an object keyed by node name")
        units = {
            name: UnitStrategy.from_json(u, mesh, f"{where}.units[{name!r}]")
            for name, u in units_obj.items()
        }
        axes = obj.get("data_axes", [0])
        if axes is not None and (
            not isinstance(axes, list)
            or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes)
        ):
            raise PlanError(f"{where}.data_axes: expected a list of mesh axes or null")
        micro = obj.get("micro_batches", 1)
        if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
            raise PlanError(f"{where}.micro_batches: expected an integer >= 1, found {micro!r}")
        recompute = obj.get("recompute", [])
        if not isinstance(recompute, list) or not all(isinstance(b, str) for b in recompute):
            raise PlanError(f"{where}.recompute: expected a list of block names")
        starts, schedule = _pipeline(obj.get("pipeline"), f"{where}.pipeline")
        return cls(
            mesh,
            units,
            source,
            default,
            None if axes is None else tuple(axes),
            micro,
            tuple(recompute),
            starts,
            schedule,
        )

    @classmethod
    def loads(cls, text: str, where: str = "plan") -> Plan:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(
                f"{where}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
        return cls.from_json(obj, where)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise PlanError(f"{p}: cannot read plan file: {exc.strerror}") from None
        return cls.loads(text, str(p))


def _default(value: object, where: str) -> DefaultStrategy:
    for d in DefaultStrategy:
        if d.value == value:
            return d
    allowed = ", ".join(d.value for d in DefaultStrategy)
    raise PlanError(f"{where}.default: expected one of {allowed}, found {value!r}")


def _pipeline(obj: object, where: str) -> tuple[tuple[str, ...], str]:
    if obj is None:
        return (), SCHEDULES[0]
    if not isinstance(obj, dict) or set(obj) - {"starts", "schedule"}:
        raise PlanError(f"{where}: expected {{'starts': [block names], 'schedule': '1f1b'}}")
    starts = obj.get("starts", [])
    if not isinstance(starts, list) or not all(isinstance(b, str) for b in starts):
        raise PlanError(f"{where}.starts: expected a list of block names")
    schedule = obj.get("schedule", SCHEDULES[0])
    if schedule not in SCHEDULES:
        raise PlanError(
            f"{where}.schedule: expected one of {', '.join(SCHEDULES)}, found {schedule!r}"
        )
    return tuple(starts), schedule


def _zero(value: object, where: str) -> ZeroStage:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return ZeroStage(value)
    raise PlanError(f"{where}: expected a ZeRO stage 0, 1, 2 or 3, found {value!r}")


def _check_unit_axes(name: str, unit: UnitStrategy, mesh: Mesh) -> None:
    layouts = [*(unit.inputs or ()), *(unit.outputs or ())]
    for layout in layouts:
        if layout is not None and layout.ndim != mesh.ndim:
            raise PlanError(
                f"plan unit {name!r}: layout {layout} has {layout.ndim} placements, mesh "
                f"{mesh} has {mesh.ndim} axes"
            )
