"""Kernel choices for onnxruntime's CPU provider, made on the graphs it runs.

A device graph says what to compute; a few of its ops have a form that onnxruntime
computes far faster than the form the gradient rules emit. This module rewrites them,
on the models handed to onnxruntime only (segment models, calibration cases), so the
written device graphs, their inspection and the plan stay as compiled.

Row sums. ``ReduceSum`` over the first axes of a tensor (a broadcast operand's
gradient: a bias's from ``[batch, seq, hidden]``) takes onnxruntime 1.32's slow path
whenever the reduced rows and the kept columns are both small (below 512 rows and 512
columns, measured): 0.6-0.9 ns per element against 0.07-0.17 ns on either side of that
window (docs/design/runtime.md, "Row sums"). Sharding shrinks both, so exactly the
split plans' bias gradients land in it: gpt small's ``[4, 64, 256] -> [256]`` took
52 us on 2 ranks where the 1-device ``[8, 64, 1024] -> [1024]`` took 40 us.
``MatMul(ones[1, R], X[R, C])`` computes the same sums at the fast rate for every size
measured, so :func:`lower_row_sums` emits ``Reshape -> MatMul -> Reshape`` instead; the
sums then run in the GEMM's order, which changes float32 results in their last bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, TypeProto, helper, numpy_helper

# below this many elements the reduction costs about one kernel dispatch either way
MIN_ELEMENTS = 4096

Shapes = Callable[[str], "tuple[int, ...] | None"]


def _static_shapes(model: onnx.ModelProto, types: Mapping[str, TypeProto] | None) -> Shapes:
    """Static float32 shapes of the model's values: from ``types`` when given, else from
    onnx shape inference of the model."""
    if types is None:
        g = onnx.shape_inference.infer_shapes(model).graph
        types = {vi.name: vi.type for vi in [*g.input, *g.value_info, *g.output]}
    inits = {t.name: t for t in model.graph.initializer}

    def shape(name: str) -> tuple[int, ...] | None:
        if name in inits:
            t = inits[name]
            return tuple(t.dims) if t.data_type == TensorProto.FLOAT else None
        tp = types.get(name)
        if tp is None or not tp.HasField("tensor_type"):
            return None
        tt = tp.tensor_type
        if tt.elem_type != TensorProto.FLOAT or not tt.HasField("shape"):
            return None
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim]
        return tuple(dims) if all(d > 0 for d in dims) else None

    return shape


def _axes(node: NodeProto, consts: Mapping[str, TensorProto]) -> list[int] | None:
    """The node's reduced axes when they are constant; None otherwise."""
    attrs = {a.name: a for a in node.attribute}
    if "axes" in attrs:  # opsets before 13
        return list(attrs["axes"].ints)
    if len(node.input) > 1 and node.input[1]:
        value = consts.get(node.input[1])
        if value is None:
            return None
        return [int(v) for v in numpy_helper.to_array(value).reshape(-1)]
    return None


def _row_sum(node: NodeProto, shape: tuple[int, ...], axes: list[int]) -> tuple[int, int] | None:
    """(rows, columns) when ``node`` sums the first ``len(axes)`` axes of ``shape``."""
    rank = len(shape)
    attrs = {a.name: a for a in node.attribute}
    if not axes or (attrs.get("noop_with_empty_axes") and attrs["noop_with_empty_axes"].i):
        return None
    outer = sorted({a + rank if a < 0 else a for a in axes})
    if outer != list(range(len(outer))) or len(outer) >= rank:
        return None
    rows = int(np.prod(shape[: len(outer)]))
    cols = int(np.prod(shape[len(outer) :]))
    return (rows, cols) if rows > 1 and rows * cols >= MIN_ELEMENTS else None


def lower_row_sums(
    model: onnx.ModelProto, types: Mapping[str, TypeProto] | None = None
) -> onnx.ModelProto:
    """``model`` with every float32 ``ReduceSum`` over the first axes of a static shape
    written as ``Reshape -> MatMul(ones row) -> Reshape``; the model itself when there is
    none. ``types``: the values' types where the caller has them (else inferred here)."""
    graph = model.graph

    def candidate(n: NodeProto) -> bool:
        return n.op_type == "ReduceSum" and n.domain in ("", "ai.onnx")

    if not any(candidate(n) for n in graph.node):
        return model
    shape = _static_shapes(model, types)
    consts = {t.name: t for t in graph.initializer}  # read only where a node's axes are
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    taken |= {i.name for i in graph.input}
    new_inits: dict[str, TensorProto] = {}

    def constant(stem: str, value: np.ndarray) -> str:
        name, i = stem, 0
        while name in taken and name not in new_inits:
            i += 1
            name = f"{stem}_{i}"
        if name not in new_inits:
            new_inits[name] = numpy_helper.from_array(value, name)
            taken.add(name)
        return name

    out: list[NodeProto] = []
    changed = False
    for node in graph.node:
        dims = shape(node.input[0]) if candidate(node) else None
        axes = _axes(node, consts) if dims is not None else None
        rc = _row_sum(node, dims, axes) if axes is not None else None
        if rc is None:
            out.append(node)
            continue
        rows, cols = rc
        keep = {a.name: a.i for a in node.attribute}.get("keepdims", 1)
        outer = len(set(a % len(dims) for a in axes))
        final = ([1] * outer if keep else []) + list(dims[outer:])
        stem = node.name or node.output[0]
        flat, summed = f"{stem}__rows", f"{stem}__rowsum"
        out += [
            helper.make_node(
                "Reshape",
                [
                    node.input[0],
                    constant(f"rowsum_shape_{rows}x{cols}", np.array([rows, cols], np.int64)),
                ],
                [flat],
                name=f"{stem}__reshape_in",
            ),
            helper.make_node(
                "MatMul",
                [constant(f"rowsum_ones_{rows}", np.ones((1, rows), np.float32)), flat],
                [summed],
                name=f"{stem}__matmul",
            ),
            helper.make_node(
                "Reshape",
                [
                    summed,
                    constant("rowsum_out_" + "x".join(map(str, final)), np.array(final, np.int64)),
                ],
                [node.output[0]],
                name=f"{stem}__reshape_out",
            ),
        ]
        changed = True
    if not changed:
        return model
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    del lowered.graph.node[:]
    lowered.graph.node.extend(out)
    lowered.graph.initializer.extend(new_inits.values())
    return lowered
