"""Insert redistribution ops wherever a producer's layout differs from a consumer's.

Pre: an :class:`Annotation` of the graph. Post: every node input and graph output
has exactly the layout its consumer needs; the conversions are nodes in the
``ai.tensoropt`` domain (template form: collectives carry ``mesh_axis``, local
conversions are ``ShardSlice`` and ``ZeroUnlessFirst``); the partition pass
lowers them per rank. Returns the layouts of every value, including the new ones.

Conversions follow the decision units (``passes.units``): a value a unit does not make
is converted once to the unit's entry layout (an edge of the cost problem), and a value
the unit holds is converted once per layout its nodes need (the unit's own cost). The
steps are ``units.conversion_steps``, the same the cost model prices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.ir.builder import ROLE_KEY, UNIT_KEY, static_shape
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.ir.vocab import ZERO_GATHER_KEY
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.annotate import Annotation
from tensoropt.passes.units import Phase, conversion_steps, read_phase, scatters_first

DOMAIN = "ai.tensoropt"
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")
TEMPLATE_LOCAL = ("ShardSlice", "ZeroUnlessFirst")


def _apply(layout: Layout, step) -> Layout:
    """The layout after one redistribution step on one mesh axis."""
    placements = list(layout.placements)
    kind = step.kind.name
    axis = step.mesh_axis
    if kind == "ALL_REDUCE" or kind == "ALL_GATHER":
        placements[axis] = Replicate()
    elif kind in ("REDUCE_SCATTER", "LOCAL_SLICE"):
        placements[axis] = Shard(step.dim)
    elif kind == "ALL_TO_ALL":
        placements[axis] = Shard(step.dst_dim)
    elif kind in ("LOCAL_ZERO", "REPLICATE_TO_PARTIAL", "TO_PARTIAL"):
        placements[axis] = Partial()
    else:
        raise AssertionError(f"unknown redistribution step {kind}")
    return Layout(tuple(placements))


def _step_node(step, value: ir.Value, tags: Mapping[str, str], name: str) -> ir.Node:
    kind = step.kind.name
    axis = step.mesh_axis
    if kind == "ALL_REDUCE":
        op, attrs = "AllReduce", {"mesh_axis": axis}
    elif kind == "ALL_GATHER":
        op, attrs = "AllGather", {"mesh_axis": axis, "axis": step.dim}
    elif kind == "REDUCE_SCATTER":
        op, attrs = "ReduceScatter", {"mesh_axis": axis, "axis": step.dim}
    elif kind == "ALL_TO_ALL":
        op = "AllToAll"
        attrs = {"mesh_axis": axis, "split_axis": step.dst_dim, "concat_axis": step.src_dim}
    elif kind == "LOCAL_SLICE":
        op, attrs = "ShardSlice", {"mesh_axis": axis, "axis": step.dim}
    else:
        op, attrs = "ZeroUnlessFirst", {"mesh_axis": axis}
    return ir.Node(
        DOMAIN,
        op,
        [value],
        [ir.convenience.convert_attribute(k, v) for k, v in attrs.items()],
        name=name,
        metadata_props=dict(tags),
        num_outputs=1,
    )


@dataclass(frozen=True, slots=True)
class Planned:
    """A conversion the inserter makes: ``value`` (a graph value) from ``have`` to ``need``,
    for the unit named ``unit``."""

    value: ir.Value
    have: Layout
    need: Layout
    unit: str


@dataclass(frozen=True, slots=True, eq=False)
class _Token:
    """Stands for a converted value when conversions are only planned."""

    source: ir.Value


class _Inserter:
    def __init__(self, graph: ir.Graph, ann: Annotation, dry: bool = False):
        self.graph = graph
        self.mesh: Mesh = ann.mesh
        self.ann = ann
        self.su = ann.units
        self.dry = dry
        self.planned: list[Planned] = []
        self.layouts: dict = dict(ann.layouts)
        self.views: dict = {}
        self.cache: dict = {}
        self.count = 0

    def convert(
        self,
        src,
        need: Layout,
        anchor: ir.Node | None,
        unit: str,
        phase: Phase = Phase.ANY,
        k: int | None = None,
    ):
        """``src`` in layout ``need``; new nodes go before ``anchor`` (None: at the end).
        ``phase``: the reads a ZeRO-3 parameter's conversion serves (tagged on its nodes).
        ``k``: the unit the conversion is made for (its ZeRO stage orders the steps)."""
        value = src.source if isinstance(src, _Token) else src
        have = self.layouts[src]
        self.planned.append(Planned(value, have, need, unit))
        if self.dry:
            token = _Token(value)
            self.layouts[token] = need
            return token
        current = value
        tags = {ROLE_KEY: "redistribution", UNIT_KEY: unit}
        if phase is not Phase.ANY:
            tags[ZERO_GATHER_KEY] = phase.value
        first = self._scatters_first(k)
        for cs in conversion_steps(have, need, static_shape(value), self.mesh, value.name, first):
            for axis in cs.axes:
                have = _apply(have, dataclasses.replace(cs.step, mesh_axis=axis))
            self.count += 1
            node = _step_node(cs.step, current, tags, f"redist_{self.count}")
            if len(cs.axes) > 1:
                node.attributes["mesh_axis"] = ir.AttrInt64s("mesh_axis", list(cs.axes))
            current = self._emit(node, value, anchor, have)
        if self.layouts[current] != need:  # only size-1 axes differ: relabel, move nothing
            self.count += 1
            node = ir.Node("", "Identity", [current], name=f"redist_{self.count}",
                           metadata_props=dict(tags), num_outputs=1)  # fmt: skip
            current = self._emit(node, value, anchor, need)
        return current

    def _scatters_first(self, k: int | None) -> bool:
        if k is None:
            return False
        return scatters_first(self.ann.zero.get(self.su.units[k].root.name, ZeroStage.NONE))

    def _emit(self, node: ir.Node, source: ir.Value, anchor, layout: Layout) -> ir.Value:
        """Insert ``node`` (converting ``source``) before ``anchor``; its output's value."""
        out = node.outputs[0]
        out.name = f"{source.name}__r{self.count}"
        out.dtype = source.dtype
        out.shape = ir.Shape(static_shape(source))
        if anchor is None:
            self.graph.append(node)
        else:
            self.graph.insert_before(anchor, node)
        self.layouts[out] = layout
        return out

    def view(self, value: ir.Value, k: int, anchor: ir.Node) -> ir.Value:
        """``value`` as unit ``k`` reads it: converted once to the unit's entry layout."""
        key = (value, k)
        found = self.views.get(key)
        if found is None:
            need = self.ann.entries.get(key, self.layouts[value])
            unit = _tag(anchor, self.su.units[k].root.name)
            found = self.views[key] = (
                value
                if self.layouts[value] == need
                else self.convert(value, need, anchor, unit, k=k)
            )
        return found

    def run(self) -> dict[ir.Value, Layout]:
        for node in list(self.graph):
            strategy = self.ann.strategies.get(node)
            k = self.su.unit_of.get(node)
            if strategy is None or k is None:
                continue
            unit = _tag(node, self.su.units[k].root.name)
            for i, value in enumerate(node.inputs):
                need = sa.input_layout(strategy, i)
                if value is None or need is None:
                    continue
                made = value.producer() is not None and self.su.unit_of.get(value.producer()) == k
                src = value if made else self.view(value, k, node)
                if self.layouts[src] != need:
                    # a ZeRO-3 parameter is gathered for its forward and its backward reads
                    regather = (value, k) in self.ann.regather
                    phase = read_phase(node) if regather else Phase.ANY
                    key = (value, k, need, phase)
                    if key not in self.cache:
                        self.cache[key] = self.convert(src, need, node, unit, phase, k)
                    src = self.cache[key]
                if src is not value and not self.dry:
                    node.replace_input_with(i, src)
        self._fix_outputs()
        return self.layouts

    def _fix_outputs(self) -> None:
        for index, value in enumerate(list(self.graph.outputs)):
            need = self.ann.required_outputs[value]
            if self.layouts[value] == need:
                continue
            producer = value.producer()
            k = self.su.unit_of.get(producer) if producer is not None else None
            key = (value, k, need, Phase.ANY)
            converted = self.cache.get(key)
            if converted is None:
                unit = self.su.units[k].root.name if k is not None else "outputs"
                converted = self.convert(value, need, None, unit, k=k)
            if self.dry:
                continue
            name = value.name
            value.name = f"{name}__pre"
            converted.name = name
            self.graph.outputs[index] = converted


def insert_redistribution(graph: ir.Graph, ann: Annotation) -> dict[ir.Value, Layout]:
    """Insert conversions (see module doc); return the layout of every value."""
    return _Inserter(graph, ann).run()


def _tag(node: ir.Node, root: str) -> str:
    """The unit tag of a conversion: that of the node it is made for (a follower's own
    name, or the root's); the decision unit that pays for it is ``root``'s."""
    return node.metadata_props.get(UNIT_KEY) or root


def planned_conversions(graph: ir.Graph, ann: Annotation) -> list[Planned]:
    """The conversions :func:`insert_redistribution` would insert, graph left unchanged."""
    inserter = _Inserter(graph, ann, dry=True)
    inserter.run()
    return inserter.planned
