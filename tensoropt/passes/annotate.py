"""Annotate every value of a training-step graph with a layout, from a plan.

Pre: a training-step model (static shapes, role/unit metadata), a :class:`Plan`.
Post: an :class:`Annotation`: one per-axis strategy for every node and one layout
for every value, such that each node's strategy is legal for its op.

How layouts are chosen (DESIGN §2 "annotate"; the mechanism shared by manual and
searched plans):

- Data inputs and labels: dim 0 sharded on the plan's data axis when it divides,
  else replicated. Parameters: the layout the plan gives their first consumer's
  input slot, else replicated. Optimizer state: its parameter's layout.
- Nodes listed in the plan get the listed strategy (explicit layouts or index).
- Every other node (unlisted forward nodes, loss, backward) takes the legal
  strategy with the cheapest conversion of its inputs: (bytes communicated,
  Partial outputs, conversions, less sharded outputs) in that order.
- Optimizer nodes never take or make Partial values, and keep the parameter's
  layout, so a gradient is synchronised once, where the update needs it.
- Graph outputs: ``loss`` replicated, new parameters/state in their old layout.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.errors import PlanError, ShardingError
from tensoropt.ir.builder import ROLE_KEY, static_shape
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import DefaultStrategy, Plan, UnitStrategy
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.autodiff import GRAD_OF_KEY
from tensoropt.passes.training_step import StepSignature

log = logging.getLogger(__name__)

NodeStrategy = tuple  # tuple[OpSharding, ...], one per mesh axis


@dataclass(frozen=True, slots=True)
class Annotation:
    """Layouts of every value and strategies of every node, on one mesh."""

    mesh: Mesh
    strategies: Mapping[ir.Node, NodeStrategy]
    layouts: Mapping[ir.Value, Layout]
    required_outputs: Mapping[ir.Value, Layout]

    def input_layout(self, node: ir.Node, i: int) -> Layout | None:
        return sa.input_layout(self.strategies[node], i)

    def output_layout(self, node: ir.Node, j: int) -> Layout:
        return sa.output_layout(self.strategies[node], j)


def replicated(mesh: Mesh) -> Layout:
    return Layout((Replicate(),) * mesh.ndim)


def data_layout(shape: Sequence[int], mesh: Mesh, axes: Sequence[int]) -> Layout:
    """Dim 0 sharded over ``axes`` (outermost first) as far as it divides."""
    placements = [Replicate()] * mesh.ndim
    size = shape[0] if shape else 1
    for axis in axes:
        if shape and size % mesh.shape[axis] == 0:
            placements[axis] = Shard(0)
            size //= mesh.shape[axis]
    return Layout(tuple(placements))


class _Annotator:
    def __init__(self, graph: ir.Graph, sig: StepSignature, plan: Plan, data_axes, lazy_data: bool):
        self.graph = graph
        self.sig = sig
        self.plan = plan
        self.mesh = plan.mesh
        self.data_axes = tuple(data_axes)
        self.lazy_data = lazy_data
        self.layouts: dict[ir.Value, Layout] = {}
        self.strategies: dict[ir.Node, NodeStrategy] = {}
        self.out_terms: dict = {}

    # -- seeds ---------------------------------------------------------------------
    def seed_inputs(self) -> None:
        data = set(self.sig.data_inputs) | ({self.sig.labels} if self.sig.labels else set())
        default_dp = self.plan.default is DefaultStrategy.DATA_PARALLEL
        for value in self.graph.inputs:
            if value.name in data and not self.lazy_data:
                axes = self.data_axes if default_dp else ()
                self.layouts[value] = data_layout(static_shape(value), self.mesh, axes)
        self.lazy = {self.graph.initializers[n] for n in (*self.sig.params, *self.sig.states)}
        self.owner = _state_owner(self.sig)
        self.states_of: dict[str, list[str]] = {}
        for state, param in self.owner.items():
            self.states_of.setdefault(param, []).append(state)
        self.by_name = {v.name: v for v in _all_values(self.graph)}
        for value in self.graph.initializers.values():
            if value not in self.lazy:
                self.layouts.setdefault(value, replicated(self.mesh))

    # -- strategies ----------------------------------------------------------------
    def _listed(self, node: ir.Node, unit: UnitStrategy) -> NodeStrategy:
        cands = sa.candidates(node, self.mesh)
        if unit.index is not None:
            if unit.index >= len(cands):
                raise PlanError(
                    f"plan unit {node.name!r}: index {unit.index} out of range; node "
                    f"{node.op_type} has {len(cands)} strategies on mesh {self.mesh}"
                )
            return cands[unit.index]
        for cand in cands:
            if sa.matches(cand, unit.inputs, unit.outputs):
                return cand
        shapes = [list(static_shape(v)) if v is not None else None for v in node.inputs]
        raise ShardingError(
            f"plan unit {node.name!r} ({node.op_type}, input shapes {shapes}): layouts "
            f"inputs={[str(x) for x in unit.inputs]} outputs={[str(x) for x in unit.outputs]} "
            f"are not a legal strategy on mesh {self.mesh} (a split must divide the "
            "dimension); fix the plan file"
        )

    def choose(self, node: ir.Node) -> NodeStrategy:
        unit = self.plan.unit(node.name)
        if unit is not None and node.metadata_props.get(ROLE_KEY) == "forward":
            return self._listed(node, unit)
        cands = sa.candidates(node, self.mesh)
        if not cands:
            raise ShardingError(f"node {node.name!r} ({node.op_type}) has no legal strategy")
        role = node.metadata_props.get(ROLE_KEY)
        if role == "optimizer":
            cands = self._optimizer_candidates(node, cands)
        elif role == "backward":
            cands = self._mirror_candidates(node, cands)
        memo: dict = {}
        return min(cands, key=lambda c: self._score(node, c, memo))

    def _optimizer_candidates(self, node: ir.Node, cands):
        no_partial = [c for c in cands if not sa.has_partial(c)]
        param_name = node.metadata_props.get("tensoropt.param")
        if param_name is None or param_name not in self.graph.initializers:
            return no_partial or cands
        param = self.graph.initializers[param_name]
        want = self.layouts.get(param)
        if want is None:
            return no_partial or cands
        pshape = static_shape(param)
        keep = [
            c
            for c in no_partial
            if all(
                static_shape(v) != pshape or sa.output_layout(c, j) == want
                for j, v in enumerate(node.outputs)
            )
        ]
        return keep or no_partial or cands

    def _score(self, node: ir.Node, cand: NodeStrategy, memo: dict | None = None):
        """(bytes converted, partial outputs, conversions, spread of outputs): lower wins."""
        memo = {} if memo is None else memo
        cost = 0.0
        conversions = 0
        for i, value in enumerate(node.inputs):
            need = cand.inputs[i] if i < len(cand.inputs) else None
            if value is None or need is None:
                continue
            have = self.layouts.get(value)
            if have is None:  # a parameter placed by its first consumer
                if need.has_partial:
                    return (float("inf"),)
                continue
            if have != need:
                conversions += 1
                key = (i, need)
                if key not in memo:
                    memo[key] = sa.conversion_bytes(have, need, value, self.mesh)
                cost += memo[key]
        partial, spread = self._output_terms(cand)
        return (cost, partial, conversions, spread)

    def _output_terms(self, cand: NodeStrategy) -> tuple[int, float]:
        cached = self.out_terms.get(cand)
        if cached is None:
            partial = 0
            spread = 0.0
            for layout in cand.outputs:
                partial += sum(isinstance(p, Partial) for p in layout.placements)
                spread += float(
                    math.prod(
                        self.mesh.shape[a]
                        for a, p in enumerate(layout.placements)
                        if isinstance(p, Shard)
                    )
                )
            cached = self.out_terms[cand] = (partial, spread)
        return cached

    def run(self) -> Annotation:
        self.seed_inputs()
        for node in self.graph:
            strategy = self.choose(node)
            self.strategies[node] = strategy
            self._place_lazy_inputs(node, strategy)
            for j, value in enumerate(node.outputs):
                self.layouts[value] = sa.output_layout(strategy, j)
        required = self._required_outputs()
        return Annotation(self.mesh, dict(self.strategies), dict(self.layouts), required)

    def _mirror_candidates(self, node: ir.Node, cands):
        """Backward nodes mirror the forward: a gradient takes its primal's layout.

        Per mesh axis, the gradient of a value placed ``S(d)`` is ``S(d)``, of a
        replicated value ``R`` or a partial sum ``P``, of a partial value ``R``.
        """
        primals = [self._primal_layout(v) for v in node.outputs]
        if all(p is None for p in primals):
            return cands
        keep = [
            c
            for c in cands
            if all(p is None or _mirrors(sa.output_layout(c, j), p) for j, p in enumerate(primals))
        ]
        return keep or cands

    def _primal_layout(self, value: ir.Value) -> Layout | None:
        """For a gradient value: the layout of the value it is the gradient of."""
        name = value.metadata_props.get(GRAD_OF_KEY)
        if not name:
            return None
        primal = self.by_name.get(name)
        return None if primal is None else self.layouts.get(primal)

    def _place_lazy_inputs(self, node: ir.Node, strategy: NodeStrategy) -> None:
        """Parameters (and their optimizer state) take their first consumer's layout."""
        for i, value in enumerate(node.inputs):
            if value is None or value in self.layouts:
                continue
            need = sa.input_layout(strategy, i)
            if need is None or any(isinstance(p, Partial) for p in need.placements):
                raise ShardingError(
                    f"node {node.name!r} ({node.op_type}) would need parameter "
                    f"{value.name!r} as a partial sum; no legal strategy"
                )
            self.layouts[value] = need
            for state in self.states_of.get(value.name, ()):
                if state in self.graph.initializers:
                    self.layouts[self.graph.initializers[state]] = need

    def _required_outputs(self) -> dict[ir.Value, Layout]:
        required = {}
        carry = dict(self.sig.carry)
        for value in self.graph.outputs:
            if value.name in carry:
                required[value] = self.layouts[self.graph.initializers[carry[value.name]]]
            else:
                required[value] = replicated(self.mesh)
        return required


def _no_partial(layout: Layout, mesh: Mesh) -> Layout:
    return Layout(tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements))


def _mirrors(grad: Layout, primal: Layout) -> bool:
    for g, p in zip(grad.placements, primal.placements, strict=True):
        if isinstance(p, Shard):
            if g != p:
                return False
        elif isinstance(p, Partial):
            if not isinstance(g, Replicate):
                return False
        elif isinstance(g, Shard):
            return False
    return True


def _all_values(graph: ir.Graph):
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        yield from node.outputs


def _state_owner(sig: StepSignature) -> dict[str, str]:
    owners = {}
    for p in sig.params:
        for suffix in ("__m", "__v", "__mom"):
            owners[p + suffix] = p
    return owners


def annotate(
    graph: ir.Graph,
    sig: StepSignature,
    plan: Plan,
    data_axes: Sequence[int] | None = (0,),
) -> Annotation:
    """Choose a strategy for every node and a layout for every value (see module doc).

    ``data_axes=None`` places data inputs like parameters: by their first consumer
    (searched plans decide the data layout through their first units).
    """
    lazy = data_axes is None
    return _Annotator(graph, sig, plan, data_axes or (), lazy).run()
