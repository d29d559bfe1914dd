"""Annotate every node and value of a training step with a layout, from a plan.

Pre: a training-step model (static shapes, role/unit metadata), a :class:`Plan`.
Post: an :class:`Annotation`: the strategy of every node of every decision unit, the
layout of every value as the unit that holds it holds it, and the layout in which each
unit reads each value it does not make (its entry layouts), such that every node's
strategy is legal for its op.

Two steps:

1. *Completion* (policy): every decision unit's root gets a strategy. Units the plan
   lists take the listed strategy; the others take the legal strategy with the cheapest
   conversion of their inputs, scored (bytes sent, partial outputs, conversions, spread
   of outputs), in graph order over the forward and the loss. Built-in plans seed the
   data inputs (dim 0 sharded over the plan's data axes); searched plans list every unit.
2. *Programs* (mechanism, ``passes.units``): each root strategy decides every other
   layout of its unit. This is the same function the cost model prices, so what the
   search prices is what the partitioner emits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.errors import PlanError, ShardingError
from tensoropt.ir.builder import ROLE_KEY, static_shape
from tensoropt.ir.layout import Layout, Replicate, Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import DefaultStrategy, Plan, UnitStrategy, ZeroStage
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.training_step import StepSignature
from tensoropt.passes.units import (
    ProgramCache,
    StepUnits,
    cheapest,
    group_units,
    replicated,
    state_params,
)
from tensoropt.rules.sharding import MeshSharding

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Annotation:
    """Strategies of every unit node and layouts of every value, on one mesh."""

    mesh: Mesh
    strategies: Mapping[ir.Node, MeshSharding]  # nodes of units (fixed nodes absent)
    layouts: Mapping[ir.Value, Layout]  # as the holder holds it
    required_outputs: Mapping[ir.Value, Layout]
    units: StepUnits
    roots: Mapping[str, MeshSharding]  # unit name -> root strategy
    entries: Mapping[tuple[ir.Value, int], Layout]  # (value, unit) -> entry layout
    # unit name -> ZeRO stage, for the units that use ZeRO
    zero: Mapping[str, ZeroStage] = dataclasses.field(default_factory=dict)
    # (parameter, unit) stored as a ZeRO-3 shard: gathered once per phase of its reads
    regather: frozenset[tuple[ir.Value, int]] = frozenset()

    def input_layout(self, node: ir.Node, i: int) -> Layout | None:
        return sa.input_layout(self.strategies[node], i)

    def output_layout(self, node: ir.Node, j: int) -> Layout:
        return sa.output_layout(self.strategies[node], j)


def data_layout(shape: Sequence[int], mesh: Mesh, axes: Sequence[int]) -> Layout:
    """Dim 0 sharded over ``axes`` (outermost first) as far as it divides."""
    placements = [Replicate()] * mesh.ndim
    size = shape[0] if shape else 1
    for axis in axes:
        if shape and size % mesh.shape[axis] == 0:
            placements[axis] = Shard(0)
            size //= mesh.shape[axis]
    return Layout(tuple(placements))


def step_units(graph: ir.Graph, sig: StepSignature) -> StepUnits:
    """The decision units of a training step (see ``passes.units``)."""
    data = tuple(sig.data_inputs) + ((sig.labels,) if sig.labels else ())
    return group_units(graph, sig.params, data, state_params(sig), dict(sig.carry))


class _Completion:
    """Root strategies for the units a plan does not list (greedy, in graph order)."""

    def __init__(self, graph: ir.Graph, sig: StepSignature, plan: Plan, su: StepUnits, axes):
        self.graph = graph
        self.plan = plan
        self.mesh = plan.mesh
        self.su = su
        self.layouts: dict[ir.Value, Layout] = {}
        self.out_terms: dict = {}
        self.chosen: dict[tuple, MeshSharding] = {}  # (op view, layouts read) -> choice
        data = set(sig.data_inputs) | ({sig.labels} if sig.labels else set())
        # a broadcast of parameters to the batch is laid out like the batch (_batch_like)
        self.batch_axes: tuple[int, ...] = ()
        self.batches: set[int] = set()
        if axes is not None:
            default_dp = plan.default is DefaultStrategy.DATA_PARALLEL
            for value in graph.inputs:
                if value.name in data:
                    dims = axes if default_dp else ()
                    self.layouts[value] = data_layout(static_shape(value), self.mesh, dims)
                    if static_shape(value):
                        self.batches.add(static_shape(value)[0])
            self.batch_axes = tuple(axes) if default_dp else ()
        self.lazy = set(su.params) | set(su.data) - {v.name for v in self.layouts}
        for value in graph.initializers.values():
            if value.name not in self.lazy:
                self.layouts.setdefault(value, replicated(self.mesh))

    def run(self) -> dict[str, MeshSharding]:
        roots: dict[str, MeshSharding] = {}
        for node, root in _forward_nodes(self.graph, self.su):
            strategy = self._choose(node)
            if root:
                roots[node.name] = strategy
            for i, value in enumerate(node.inputs):
                need = sa.input_layout(strategy, i)
                if value is not None and need is not None and value not in self.layouts:
                    self.layouts[value] = need
            for j, value in enumerate(node.outputs):
                self.layouts[value] = sa.output_layout(strategy, j)
        return roots

    def _choose(self, node: ir.Node) -> MeshSharding:
        unit = self.plan.unit(node.name)
        if unit is not None:
            return listed_strategy(node, unit, self.mesh)
        haves = tuple(None if v is None else self.layouts.get(v) for v in node.inputs)
        # The choice depends on the op and the layouts it reads alone, so repeated layers
        # that read the same layouts choose once.
        key = (sa.view_key(node), haves)
        found = self.chosen.get(key)
        if found is not None:
            return found
        cands = sa.candidates(node, self.mesh)
        if not cands:
            raise ShardingError(f"node {node.name!r} ({node.op_type}) has no legal strategy")
        like = self._batch_like(node, haves)
        if like is not None:
            cands = [c for c in cands if c.outputs[0] == like] or cands
        # an input without a layout is a parameter or data input placed by this reader
        found = cheapest(node, cands, haves, self.mesh, self.out_terms, lambda _: True)
        self.chosen[key] = found
        return found

    def _batch_like(self, node: ir.Node, haves) -> Layout | None:
        """The data layout for an ``Expand`` of whole values (parameters, constants) from
        1 to the batch along dim 0, in a data-parallel completion: a
        class token expanded to the batch. Scored by its inputs alone every strategy
        costs nothing there, and the replicated one (the least spread) would gather the
        gradient of every sample in the backward."""
        if node.op_type != "Expand" or not self.batch_axes:
            return None
        if any(h is not None and not _whole(h) for h in haves):  # it reads a split value
            return None
        x, out = static_shape(node.inputs[0]), static_shape(node.outputs[0])
        if len(x) != len(out) or not out or x[0] != 1 or out[0] not in self.batches:
            return None
        return data_layout(out, self.mesh, self.batch_axes)


def _whole(layout: Layout) -> bool:
    return all(isinstance(p, Replicate) for p in layout.placements)


def _forward_nodes(graph: ir.Graph, su: StepUnits) -> tuple[tuple[ir.Node, bool], ...]:
    """The forward and loss nodes of ``graph`` in graph order, each with whether it is
    its unit's root: found once per step's units (a search completes the reference
    plans on every mesh, walking the same graph)."""

    def walk() -> tuple[tuple[ir.Node, bool], ...]:
        out = []
        for node in graph:
            if node.metadata_props.get(ROLE_KEY, "forward") not in ("forward", "loss"):
                continue
            k = su.unit_of.get(node)
            out.append((node, k is not None and su.units[k].root is node))
        return tuple(out)

    return su.once(("forward nodes", graph), walk)


def listed_strategy(node: ir.Node, unit: UnitStrategy, mesh: Mesh) -> MeshSharding:
    """The candidate strategy of ``node`` that a plan's unit entry names."""
    cands = sa.candidates(node, mesh)
    if unit.index is not None:
        if unit.index >= len(cands):
            raise PlanError(
                f"plan unit {node.name!r}: index {unit.index} out of range; node "
                f"{node.op_type} has {len(cands)} strategies on mesh {mesh}"
            )
        return cands[unit.index]
    for cand in cands:
        if sa.matches(cand, unit.inputs, unit.outputs):
            return cand
    shapes = [list(static_shape(v)) if v is not None else None for v in node.inputs]
    raise ShardingError(
        f"plan unit {node.name!r} ({node.op_type}, input shapes {shapes}): layouts "
        f"inputs={[str(x) for x in unit.inputs]} outputs={[str(x) for x in unit.outputs]} "
        f"are not a legal strategy on mesh {mesh} (a split must divide the dimension); "
        "fix the plan file"
    )


def complete_plan(
    graph: ir.Graph,
    sig: StepSignature,
    plan: Plan,
    data_axes: Sequence[int] | None,
    su: StepUnits | None = None,
) -> dict[str, MeshSharding]:
    """A root strategy for every decision unit (step 1 of the module doc)."""
    su = su or step_units(graph, sig)
    return _Completion(graph, sig, plan, su, data_axes).run()


def annotate_roots(
    graph: ir.Graph,
    su: StepUnits,
    roots: Mapping[str, MeshSharding],
    mesh: Mesh,
    cache: ProgramCache | None = None,
    zero: Mapping[str, ZeroStage] | None = None,
) -> Annotation:
    """Every layout of the step from one root strategy per unit (step 2). ``cache``: the
    programs already computed for these units on this mesh (e.g. by the cost model).
    ``zero``: the ZeRO stage of the units that use ZeRO (unit name -> stage)."""
    cache = cache or ProgramCache(su, mesh)
    zero = {name: z for name, z in (zero or {}).items() if z is not ZeroStage.NONE}
    strategies: dict[ir.Node, MeshSharding] = {}
    layouts: dict[ir.Value, Layout] = {}
    entries: dict[tuple[ir.Value, int], Layout] = {}
    regather: set[tuple[ir.Value, int]] = set()
    rep = replicated(mesh)
    programs = []
    for k, unit in enumerate(su.units):
        stage = zero.get(unit.root.name, ZeroStage.NONE)
        program = cache.program(k, roots[unit.root.name], stage)
        programs.append(program)
        if stage is ZeroStage.PARAMETERS:
            regather.update((unit.externals[z.index], k) for z in program.shards)
        for node, strategy in zip(unit.nodes, program.strategies, strict=True):
            strategies[node] = strategy
            for j, value in enumerate(node.outputs):
                layouts[value] = strategy.outputs[j]
        for x, value in enumerate(unit.externals):
            entries[(value, k)] = program.entries[x]
    for node in su.fixed:
        for value in node.outputs:
            layouts[value] = rep
    placed = dict(su.owner)
    for state, param in su.state_param.items():
        if param in su.owner:
            placed[state] = su.owner[param]
    stored = [*graph.inputs, *graph.initializers.values()]
    for value in stored:
        k = placed.get(value.name)
        if k is not None and (value, k) in entries:
            layouts[value] = entries[(value, k)]
        else:
            layouts.setdefault(value, rep)
    required = {}
    for value, carried in su.required.items():
        if carried is None:
            required[value] = rep
        else:
            required[value] = layouts[graph.initializers[carried]]
    return Annotation(
        mesh, strategies, layouts, required, su, dict(roots), entries, zero, frozenset(regather)
    )


def annotate(
    graph: ir.Graph,
    sig: StepSignature,
    plan: Plan,
    data_axes: Sequence[int] | None = (0,),
) -> Annotation:
    """Complete ``plan`` and lay out the whole step (see the module doc).

    ``data_axes=None`` places data inputs like parameters: by their first reader
    (searched plans decide the data layout through their first units).
    """
    su = step_units(graph, sig)
    for name in plan.units:
        node = next((n for n in su.unit_of if n.name == name), None)
        if node is not None and su.units[su.unit_of[node]].root is not node:
            root = su.units[su.unit_of[node]].root.name
            raise PlanError(
                f"plan unit {name!r}: {node.op_type} node {name!r} is not a decision unit: "
                f"its layout follows unit {root!r}; list {root!r} instead"
            )
    roots = complete_plan(graph, sig, plan, data_axes, su)
    return annotate_roots(graph, su, roots, plan.mesh, zero=plan_zero(plan, su))


def plan_zero(plan: Plan, su: StepUnits) -> dict[str, ZeroStage]:
    """The ZeRO stage of each unit the plan asks it for; a stage on a node that is not a
    decision unit is refused (a follower has no parameters of its own to shard)."""
    roots = {unit.root.name for unit in su.units}
    out = {}
    for name, unit in plan.units.items():
        if unit.zero is ZeroStage.NONE:
            continue
        if name not in roots:
            raise PlanError(
                f"plan unit {name!r}: 'zero' is set on a node that is not a decision unit "
                "of the step; set it on a unit that places parameters"
            )
        out[name] = unit.zero
    return out
