"""Partition an annotated, redistributed training step into per-device graphs.

Pre: a graph whose every value has a layout and every conversion is inserted
(``insert_redistribution``). Post, in two stages:

1. :func:`localize` (rank-independent, on the IR): each node gets its local
   attributes and constant inputs from its sharding rule, outputs that the rule
   scales (e.g. a mean over a sharded dim) get a ``Mul``, and every value gets its
   local shape. Collectives get their local output ``shape`` attribute.
2. :func:`lower_for_rank` (on the serialized proto, cheap per rank): initializers
   and sharded Constant values become the rank's slice (external-data initializers
   through a :class:`WeightSink`, which streams the bytes), ``ShardSlice`` becomes a
   ``Slice``, ``ZeroUnlessFirst`` a ``Mul`` by 1 or 0, and collectives get their
   ``group`` of global ranks.

Collectives stay as ``ai.tensoropt`` nodes. So that each device file loads in
onnxruntime on its own, the model carries a local function per collective whose
body is a stand-in of the right shape and dtype (zeros); tensoropt's runtime
never runs those bodies, it executes the collectives itself.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from tensoropt.ir.builder import ROLE_KEY, UNIT_KEY, static_shape
from tensoropt.ir.external import Block
from tensoropt.ir.layout import Layout, Partial, Shard, local_shape, slice_for
from tensoropt.ir.mesh import Mesh
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.annotate import Annotation
from tensoropt.passes.insert_redistribution import COLLECTIVES, DOMAIN

_COLLECTIVE_ATTRS = {
    "AllReduce": ["group", "shape"],
    "AllGather": ["group", "axis", "shape"],
    "ReduceScatter": ["group", "axis", "shape"],
    "AllToAll": ["group", "split_axis", "concat_axis", "shape"],
}


@dataclass(frozen=True, slots=True)
class LocalTemplate:
    """The rank-independent local graph and what each rank must fill in."""

    proto: onnx.ModelProto
    mesh: Mesh
    initializer_layouts: Mapping[str, Layout]
    constant_layouts: Mapping[str, Layout]  # Constant node name -> output layout


def _set_attributes(node: ir.Node, attributes: Mapping) -> None:
    """Make the node's attributes ``attributes``, touching only the ones that changed."""
    original = sa.op_view(node).attributes
    for key in list(node.attributes):
        if key not in attributes:
            del node.attributes[key]
    for key, value in attributes.items():
        if key in original and _same_attr(original[key], value):
            continue
        if isinstance(value, np.ndarray):
            value = ir.tensor(value, name=f"{node.name}_{key}")
        node.attributes[key] = ir.convenience.convert_attribute(key, value)


def _same_attr(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    return a == b


def _constant_before(graph: ir.Graph, anchor: ir.Node, array: np.ndarray, name: str):
    tensor = ir.tensor(np.asarray(array), name=name)
    node = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], name=name, num_outputs=1)
    node.metadata_props.update(
        {
            ROLE_KEY: anchor.metadata_props.get(ROLE_KEY, ""),
            UNIT_KEY: anchor.metadata_props.get(UNIT_KEY, ""),
        }
    )
    out = node.outputs[0]
    out.name = name
    out.dtype = tensor.dtype
    out.shape = ir.Shape(list(np.asarray(array).shape))
    graph.insert_before(anchor, node)
    return out


def _scale_output(graph: ir.Graph, node: ir.Node, j: int, scale: float, layouts) -> None:
    out = node.outputs[j]
    uses = list(out.uses())
    const = ir.tensor(np.asarray(scale, dtype=out.dtype.numpy()), name=f"{node.name}__scale{j}")
    cnode = ir.Node(
        "",
        "Constant",
        [],
        [ir.AttrTensor("value", const)],
        num_outputs=1,
        name=f"{node.name}__scale{j}_c",
    )
    mul = ir.Node("", "Mul", [out, cnode.outputs[0]], name=f"{node.name}__scale{j}", num_outputs=1)
    for n in (cnode, mul):
        n.metadata_props.update(dict(node.metadata_props))
    graph.insert_after(node, [cnode, mul])
    scaled = mul.outputs[0]
    scaled.dtype = out.dtype
    scaled.shape = out.shape
    scaled.name = f"{out.name}__scaled"
    layouts[scaled] = layouts[out]
    for use in uses:
        use.node.replace_input_with(use.idx, scaled)
    if out.is_graph_output():
        index = list(graph.outputs).index(out)
        name = out.name
        out.name = f"{name}__unscaled"
        scaled.name = name
        graph.outputs[index] = scaled


def localize(model: ir.Model, ann: Annotation, layouts: dict[ir.Value, Layout]) -> LocalTemplate:
    """Stage 1 (see module doc). Mutates ``model``; returns the serialized template."""
    graph = model.graph
    mesh = ann.mesh
    global_shapes = {v: static_shape(v) for v in layouts}
    constant_layouts: dict[str, Layout] = {}
    for node in list(graph):
        strategy = ann.strategies.get(node)
        if strategy is None:
            continue
        local = sa.localize(node, strategy, mesh)
        _set_attributes(node, local.attributes)
        sa.forget_view(node)
        for i, array in enumerate(local.const_inputs):
            if array is not None:
                name = f"{node.name}__local_in{i}"
                node.replace_input_with(i, _constant_before(graph, node, array, name))
        for j, scale in enumerate(local.output_scale):
            if scale is not None and scale != 1:
                _scale_output(graph, node, j, scale, layouts)
        if node.op_type == "Constant" and node.domain == "":
            layout = layouts[node.outputs[0]]
            if _needs_slicing(layout):
                constant_layouts[node.name] = layout
    for value, layout in layouts.items():
        shape = global_shapes.get(value) or static_shape(value)
        value.shape = ir.Shape(list(local_shape(shape, layout, mesh, value.name or "value")))
    for node in graph:
        if node.domain == DOMAIN and node.op_type in COLLECTIVES:
            node.attributes["shape"] = ir.AttrInt64s("shape", list(static_shape(node.outputs[0])))
    init_layouts = {
        name: layouts[v] for name, v in graph.initializers.items() if _needs_slicing(layouts[v])
    }
    _add_stand_in_functions(model)
    proto = ir.serde.serialize_model(model)
    return LocalTemplate(proto, mesh, init_layouts, constant_layouts)


def _needs_slicing(layout: Layout) -> bool:
    return any(isinstance(p, (Shard, Partial)) for p in layout.placements)


def _add_stand_in_functions(model: ir.Model) -> None:
    model.opset_imports[DOMAIN] = 1
    model.graph.opset_imports[DOMAIN] = 1


def stand_in_functions(opset: int) -> list[onnx.FunctionProto]:
    """Local functions so device files load in onnxruntime: zeros of the output shape."""
    functions = []
    for op, attrs in _COLLECTIVE_ATTRS.items():
        const = helper.make_node("Constant", [], ["s"])
        ref = onnx.AttributeProto(
            name="value_ints", ref_attr_name="shape", type=onnx.AttributeProto.INTS
        )
        const.attribute.append(ref)
        body = [
            const,
            helper.make_node("ConstantOfShape", ["s"], ["z"]),
            helper.make_node("CastLike", ["z", "x"], ["y"]),
        ]
        functions.append(
            helper.make_function(
                DOMAIN, op, ["x"], ["y"], body, [helper.make_opsetid("", opset)], attributes=attrs
            )
        )
    return functions


class WeightSink(Protocol):
    """Gives an external-data initializer of a device graph its rank's bytes."""

    def place(self, tensor: onnx.TensorProto, block: Block, zeros: bool) -> None:
        """Make ``tensor`` hold ``block`` of its global value (zeros if ``zeros``)."""


def shard_block(
    global_shape: Sequence[int], layout: Layout | None, mesh: Mesh, coords: Sequence[int]
) -> tuple[Block, bool]:
    """The block of the global tensor the rank at ``coords`` holds, and whether it is zeros.

    The CONTRACTS slicing rule (as :func:`slice_for`): each ``S(d)`` axis in order
    splits the current range of dim ``d`` into equal pieces; a ``Partial`` axis keeps
    the value on coordinate 0 and zeros elsewhere.
    """
    lo = [0] * len(global_shape)
    hi = list(global_shape)
    zeros = False
    for axis, p in enumerate(layout.placements if layout is not None else ()):
        c = coords[axis]
        if isinstance(p, Shard):
            piece = (hi[p.dim] - lo[p.dim]) // mesh.shape[axis]
            lo[p.dim] += c * piece
            hi[p.dim] = lo[p.dim] + piece
        elif isinstance(p, Partial) and c != 0:
            zeros = True
    return tuple(slice(a, b) for a, b in zip(lo, hi, strict=True)), zeros


def lower_for_rank(template: LocalTemplate, rank: int, weights: WeightSink) -> onnx.ModelProto:
    """Stage 2 (see module doc): the device graph of ``rank``.

    The template holds no weight bytes: every initializer stored as external data
    (a data-free stand-in) gets its rank's block through ``weights``; small inline
    initializers are sliced here.
    """
    mesh = template.mesh
    coords = mesh.coords(rank)
    proto = copy.deepcopy(template.proto)
    graph = proto.graph
    for init in graph.initializer:
        layout = template.initializer_layouts.get(init.name)
        if init.data_location == onnx.TensorProto.EXTERNAL:
            if layout is not None:  # an uneven split is a ShardingError, as in slice_for
                local_shape(tuple(init.dims), layout, mesh, init.name)
            block, zeros = shard_block(tuple(init.dims), layout, mesh, coords)
            weights.place(init, block, zeros)
        elif layout is not None:
            piece = slice_for(numpy_helper.to_array(init), layout, mesh, coords, init.name)
            init.CopyFrom(numpy_helper.from_array(piece, init.name))
    shapes = _value_shapes(graph)
    new_nodes = []
    for node in graph.node:
        new_nodes.extend(_lower_node(node, rank, coords, mesh, template, shapes))
    del graph.node[:]
    graph.node.extend(new_nodes)
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    del proto.functions[:]
    proto.functions.extend(stand_in_functions(opset))
    return proto


def _value_shapes(graph: onnx.GraphProto) -> dict[str, list[int]]:
    shapes = {}
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        shapes[vi.name] = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    return shapes


def _attr(node: onnx.NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    raise KeyError(name)


def _lower_node(node, rank, coords, mesh, template, shapes) -> list[onnx.NodeProto]:
    if node.domain == DOMAIN and node.op_type in COLLECTIVES:
        axes = _attr(node, "mesh_axis")
        axes = [axes] if isinstance(axes, int) else list(axes)
        kept = [a for a in node.attribute if a.name != "mesh_axis"]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.append(helper.make_attribute("group", group_over(mesh, rank, axes)))
        return [node]
    if node.domain == DOMAIN and node.op_type == "ShardSlice":
        axis, dim = _attr(node, "mesh_axis"), _attr(node, "axis")
        size = shapes[node.output[0]][dim]
        start = coords[axis] * size
        consts = [
            _int_const(f"{node.name}__{k}", [v])
            for k, v in (("s", start), ("e", start + size), ("a", dim))
        ]
        slice_node = helper.make_node(
            "Slice",
            [node.input[0], *(c.output[0] for c in consts)],
            list(node.output),
            name=node.name,
        )
        slice_node.metadata_props.extend(node.metadata_props)
        return [*consts, slice_node]
    if node.domain == DOMAIN and node.op_type == "ZeroUnlessFirst":
        keep = coords[_attr(node, "mesh_axis")] == 0
        if keep:
            ident = helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name)
            ident.metadata_props.extend(node.metadata_props)
            return [ident]
        zero = helper.make_node(
            "Sub", [node.input[0], node.input[0]], list(node.output), name=node.name
        )
        zero.metadata_props.extend(node.metadata_props)
        return [zero]
    if node.op_type == "Constant" and node.name in template.constant_layouts:
        layout = template.constant_layouts[node.name]
        attr = next(a for a in node.attribute if a.name == "value")
        array = numpy_helper.to_array(attr.t)
        piece = slice_for(array, layout, mesh, coords, node.name)
        attr.t.CopyFrom(numpy_helper.from_array(piece, attr.t.name))
    return [node]


def group_over(mesh: Mesh, rank: int, axes) -> list[int]:
    """Global ranks that share ``rank``'s coordinates off ``axes`` (row-major over axes)."""
    mine = mesh.coords(rank)
    fixed = [a for a in range(mesh.ndim) if a not in axes]
    return [r for r in range(mesh.size) if all(mesh.coords(r)[a] == mine[a] for a in fixed)]


def _int_const(name: str, values) -> onnx.NodeProto:
    return helper.make_node(
        "Constant",
        [],
        [name],
        name=name,
        value=numpy_helper.from_array(np.asarray(values, dtype=np.int64), name),
    )
