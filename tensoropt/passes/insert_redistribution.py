"""Insert redistribution ops wherever a producer's layout differs from a consumer's.

Pre: an :class:`Annotation` of the graph. Post: every node input and graph output
has exactly the layout its consumer needs; the conversions are nodes in the
``ai.tensoropt`` domain (template form: collectives carry ``mesh_axis``, local
conversions are ``ShardSlice`` and ``ZeroUnlessFirst``); the partition pass
lowers them per rank. A conversion of one value to one layout is made once and
shared by all consumers that need it. Returns the layouts of every value,
including the new ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import onnx_ir as ir

from tensoropt.ir.builder import ROLE_KEY, UNIT_KEY, static_shape
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.redistribute import plan_redistribution
from tensoropt.passes.annotate import Annotation

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


def _merge_all_reduces(steps):
    """Consecutive all-reduces on different mesh axes become one over all of them."""
    merged: list[tuple[object, tuple[int, ...]]] = []
    for step in steps:
        if merged and step.kind.name == "ALL_REDUCE" and merged[-1][0].kind.name == "ALL_REDUCE":
            first, axes = merged[-1]
            merged[-1] = (first, (*axes, step.mesh_axis))
        else:
            merged.append((step, (step.mesh_axis,)))
    return merged


class _Inserter:
    def __init__(self, graph: ir.Graph, ann: Annotation):
        self.graph = graph
        self.mesh: Mesh = ann.mesh
        self.ann = ann
        self.layouts: dict[ir.Value, Layout] = dict(ann.layouts)
        self.cache: dict[tuple[ir.Value, Layout], ir.Value] = {}
        self.count = 0

    def convert(self, value: ir.Value, need: Layout, anchor: ir.Node | None, unit: str):
        """``value`` in layout ``need``; new nodes go before ``anchor`` (None: at the end)."""
        key = (value, need)
        if key in self.cache:
            return self.cache[key]
        have = self.layouts[value]
        shape = static_shape(value)
        current = value
        tags = {ROLE_KEY: "redistribution", UNIT_KEY: unit}
        for step, axes in _merge_all_reduces(plan_redistribution(have, need, shape, self.mesh)):
            for axis in axes:
                have = _apply(have, dataclasses.replace(step, mesh_axis=axis))
            if all(self.mesh.shape[a] == 1 for a in axes):
                # a mesh axis of size 1: its only member holds the whole value, so the step
                # is the identity; emitting it would split the device graph at a no-op
                continue
            self.count += 1
            node = _step_node(step, current, tags, f"redist_{self.count}")
            if len(axes) > 1:
                node.attributes["mesh_axis"] = ir.AttrInt64s("mesh_axis", list(axes))
            current = self._emit(node, value, anchor, have)
        if have != need:
            raise AssertionError(f"redistribution of {value.name} ended at {have}, not {need}")
        if self.layouts[current] != need:  # only size-1 axes differ: relabel, move nothing
            self.count += 1
            node = ir.Node("", "Identity", [current], name=f"redist_{self.count}",
                           metadata_props=dict(tags), num_outputs=1)  # fmt: skip
            current = self._emit(node, value, anchor, need)
        self.cache[key] = current
        return current

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

    def run(self) -> dict[ir.Value, Layout]:
        for node in list(self.graph):
            strategy = self.ann.strategies.get(node)
            if strategy is None:
                continue
            unit = node.metadata_props.get(UNIT_KEY, node.name or "")
            for i, value in enumerate(node.inputs):
                need = self.ann.input_layout(node, i)
                if value is None or need is None or self.layouts[value] == need:
                    continue
                node.replace_input_with(i, self.convert(value, need, node, unit))
        self._fix_outputs()
        return self.layouts

    def _fix_outputs(self) -> None:
        for k, value in enumerate(list(self.graph.outputs)):
            need = self.ann.required_outputs[value]
            if self.layouts[value] == need:
                continue
            name = value.name
            value.name = f"{name}__pre"
            converted = self.convert(value, need, None, "outputs")
            converted.name = name
            self.graph.outputs[k] = converted


def insert_redistribution(graph: ir.Graph, ann: Annotation) -> dict[ir.Value, Layout]:
    """Insert conversions (see module doc); return the layout of every value."""
    return _Inserter(graph, ann).run()
