"""Well-formedness of the compile state, checked between passes when verification is on.

Checks, each named in the error by its :class:`Check` value:

- ``topological-order``: every node input is a graph input, an initializer or the
  output of an earlier node; every graph output is produced.
- ``static-shapes``: every value has a known shape of integers.
- ``layouts`` (once annotated, until localize): every value has a layout.
- ``shard-divisibility`` (same span): every layout's ``Shard`` dims divide over the mesh.
- ``strategy-legal`` (same span): each annotated node's strategy is one its op's
  sharding rule offers on the mesh.
- ``collective-groups`` (after localize): lowered per rank, all device graphs issue
  the same collectives in the same order and every member of a group names the same
  group at the same position. That check is the runtime's own pre-check, which lives
  in a higher layer; it reaches the verifier as ``device_check`` (the CLI and the test
  configuration pass :func:`tensoropt.runtime.device_check.check_device_graphs`).

The checks never mutate the state. Layout and strategy checks stop at localize: the
local template gives nodes local attributes and new local constants, which have no
global layout.
"""

from __future__ import annotations

import copy
import enum
import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from tensoropt.errors import ShardingError, TensorOptError
from tensoropt.ir.layout import Layout, local_shape
from tensoropt.ir.mesh import Mesh
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.infra import CompileState, Violation
from tensoropt.passes.partition import LocalTemplate, lower_for_rank

# The runtime's collective-order check over {rank: device graph}; raises TensorOptError.
DeviceCheck = Callable[[Mapping[int, onnx.ModelProto]], None]


class Check(enum.Enum):
    TOPOLOGICAL_ORDER = "topological-order"
    STATIC_SHAPES = "static-shapes"
    LAYOUTS = "layouts"
    SHARD_DIVISIBILITY = "shard-divisibility"
    STRATEGY_LEGAL = "strategy-legal"
    COLLECTIVE_GROUPS = "collective-groups"


def _fail(check: Check, detail: str) -> Violation:
    return Violation(check.value, detail)


def _values(graph: ir.Graph) -> Iterator[ir.Value]:
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        yield from node.outputs


def _name(value: ir.Value) -> str:
    return repr(value.name)


def _node(node: ir.Node) -> str:
    return f"node {node.name!r} ({node.op_type})"


def check_topological_order(graph: ir.Graph) -> None:
    known = {*graph.inputs, *graph.initializers.values()}
    for node in graph:
        for i, value in enumerate(node.inputs):
            if value is not None and value not in known:
                raise _fail(
                    Check.TOPOLOGICAL_ORDER,
                    f"{_node(node)} input {i} reads value {_name(value)}, which no earlier node, "
                    "graph input or initializer provides",
                )
        known.update(node.outputs)
    for value in graph.outputs:
        if value not in known:
            raise _fail(
                Check.TOPOLOGICAL_ORDER, f"graph output {_name(value)} is produced by no node"
            )


def check_static_shapes(graph: ir.Graph) -> None:
    for value in _values(graph):
        shape = value.shape
        if shape is None or not all(isinstance(d, int) for d in shape):
            raise _fail(
                Check.STATIC_SHAPES, f"value {_name(value)} has shape {shape}, not static ints"
            )


def check_layouts(graph: ir.Graph, layouts: Mapping[ir.Value, Layout], mesh: Mesh) -> None:
    for value in _values(graph):
        layout = layouts.get(value)
        if layout is None:
            raise _fail(Check.LAYOUTS, f"value {_name(value)} has no layout")
        if len(layout.placements) != mesh.ndim:
            raise _fail(
                Check.LAYOUTS,
                f"value {_name(value)} has layout {layout} for {len(layout.placements)} mesh "
                f"axes; the mesh {mesh} has {mesh.ndim}",
            )
        try:
            local_shape(tuple(value.shape), layout, mesh, f"value {value.name!r}")  # type: ignore[arg-type]
        except ShardingError as exc:
            raise _fail(Check.SHARD_DIVISIBILITY, str(exc)) from None


def check_strategies(state: CompileState) -> None:
    ann = state.annotation
    assert ann is not None
    graph = state.model.graph
    for node in graph:
        strategy = ann.strategies.get(node)
        if strategy is None:
            continue
        if strategy not in sa.candidates(node, ann.mesh):
            raise _fail(
                Check.STRATEGY_LEGAL,
                f"{_node(node)} has a strategy that its sharding rule does not offer on mesh "
                f"{ann.mesh}",
            )


def device_graphs(template: LocalTemplate) -> dict[int, onnx.ModelProto]:
    """Every rank's device graph without initializer data (enough to check collectives)."""
    proto = copy.deepcopy(template.proto)
    for init in proto.graph.initializer:  # keep the names readable, drop the data
        proto.graph.input.add().name = init.name
    del proto.graph.initializer[:]
    bare = LocalTemplate(proto, template.mesh, {}, {})
    return {r: lower_for_rank(bare, r, {}) for r in range(template.mesh.size)}


@dataclass(frozen=True, slots=True)
class Verifier:
    """All checks that apply to a state (see the module docstring).

    The device graphs of a template are lowered and checked once: a template whose
    mesh and serialised graph equal one that passed (micro-template hands localize's
    on unchanged with one micro-batch) is not checked again; the digest costs about
    1% of the check."""

    device_check: DeviceCheck | None = None
    _passed: set[tuple] = field(default_factory=set, compare=False, repr=False)

    def __call__(self, state: CompileState) -> None:
        graph = state.model.graph
        check_topological_order(graph)
        check_static_shapes(graph)
        if state.template is not None:
            self._check_devices(state.template)
            return
        ann = state.annotation
        if ann is None:
            return
        layouts = state.layouts if state.layouts is not None else ann.layouts
        check_layouts(graph, layouts, ann.mesh)
        check_strategies(state)

    def _check_devices(self, template: LocalTemplate) -> None:
        if self.device_check is None:
            return
        graph = template.proto.SerializeToString(deterministic=True)
        key = (tuple(template.mesh.shape), hashlib.sha256(graph).digest())
        if key in self._passed:
            return
        try:
            self.device_check(device_graphs(template))
        except TensorOptError as exc:
            raise _fail(Check.COLLECTIVE_GROUPS, str(exc)) from None
        self._passed.add(key)
