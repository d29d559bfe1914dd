"""Gradient rules of the gathers: Gather, GatherND (batch_dims 0), GatherElements; of
the scatters ScatterElements and ScatterND (reduction none or add); and of TopK.

Each gradient scatters the incoming gradient into zeros of the data's shape with
``reduction="add"``, so repeated indices accumulate; a half-precision gradient
(float16, bfloat16) accumulates in float32 and is cast back once (:func:`_added`), as
torch accumulates an embedding's gradient, and onnxruntime's CPU kernels add no
float16. Negative indices are
normalised (index + dim where index < 0) before the scatter: at rule time when
the indices are constant, otherwise with a Less/Add/Where on the indices.

Gather along axis a moves the indexed axis to the front (Transpose) so that one
ScatterND with one-coordinate indices serves every axis; for a = 0 (embedding
lookups) no transpose is emitted. A Gather a torch export made from an
``nn.Embedding(padding_idx=p)`` gives row p no gradient, as torch does (the file's
Gather forgets p; the exporter's record of the call keeps it, ``ir/torch_calls``).

A scatter's updates get the incoming gradient gathered at their positions; its data
gets the gradient where no update landed (reduction none: the scattered positions are
overwritten, so their gradient is zeroed by scattering zeros) or all of it (add). TopK's
values are a GatherElements of its input at the indices it returns: their gradient is
scattered back there (the indices of one slice are distinct); the indices have none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from tensoropt.ir.torch_calls import aten_call, int_arg
from tensoropt.rules.grad._common import float_dtype, normalize_axis, unsupported, zeros
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

Grads = list[ir.Value | None]


def _normalized_indices(ctx: GradContext, dims: Sequence[int] | int) -> ir.Value:
    """Input 1 (indices) with negative entries shifted by ``dims`` (broadcast on the last axis)."""
    b, indices = ctx.b, ctx.inputs[1]
    limits = np.asarray(dims, dtype=np.int64)
    const = ctx.const_input(1)
    if const is not None:
        fixed = np.asarray(const).astype(np.int64)
        return b.const(np.where(fixed < 0, fixed + limits, fixed))
    if indices.dtype != ir.DataType.INT64:
        indices = b.op("Cast", [indices], {"to": int(ir.DataType.INT64)})
    negative = b.op("Less", [indices, b.const(np.int64(0))])
    return b.op("Where", [negative, b.op("Add", [indices, b.const(limits)]), indices])


def _added(ctx: GradContext, op: str, shape, indices: ir.Value, g: ir.Value, attrs) -> ir.Value:
    """``op`` (ScatterND or ScatterElements) of ``g`` added into zeros of ``shape``, in
    the dtype of forward input 0; half-precision in float32, cast back after the sum."""
    b = ctx.b
    dtype = float_dtype(ctx.inputs[0])
    narrow = dtype.itemsize < 4  # float16, bfloat16
    if narrow:
        g = b.op("Cast", [g], {"to": int(ir.DataType.FLOAT)})
    base = zeros(b, shape, np.dtype(np.float32) if narrow else dtype)
    grad = b.op(op, [base, indices, g], {**attrs, "reduction": "add"})
    if narrow:
        grad = b.op("Cast", [grad], {"to": int(ctx.inputs[0].dtype)})
    return grad


def _gather(ctx: GradContext) -> Grads:
    b = ctx.b
    shape, idx_shape = ctx.shape(0), ctx.shape(1)
    rank = len(shape)
    axis = normalize_axis(int(ctx.attr("axis", 0)), rank)
    g = ctx.grad_outputs[0]
    indices = _normalized_indices(ctx, shape[axis])
    padding = _padding_idx(ctx)
    if padding is not None:  # torch's padding row gets no gradient
        hit = b.op("Equal", [indices, b.const(np.int64(padding))])
        keep = b.op("Cast", [b.op("Not", [hit])], {"to": int(ctx.inputs[0].dtype)})
        rest = list(range(len(idx_shape), len(idx_shape) + rank - 1))
        g = b.op("Mul", [g, b.op("Unsqueeze", [keep, b.ints(rest)]) if rest else keep])
    if not idx_shape:  # scalar index: the axis was dropped from the output
        indices = b.op("Reshape", [indices, b.ints([1])])
        g = b.op("Unsqueeze", [g, b.ints([axis])])
        idx_shape = (1,)
    k = len(idx_shape)
    # Bring the index dims of g to the front: [I..., X[:axis]..., X[axis+1:]...]
    if axis:
        perm = list(range(axis, axis + k)) + list(range(axis)) + list(range(axis + k, rank - 1 + k))
        g = b.op("Transpose", [g], {"perm": perm})
    moved = (shape[axis], *shape[:axis], *shape[axis + 1 :])
    coords = b.op("Unsqueeze", [indices, b.ints([k])])
    grad = _added(ctx, "ScatterND", moved, coords, g, {})
    if axis:
        back = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
        grad = b.op("Transpose", [grad], {"perm": back})
    return [grad, None]


def _padding_idx(ctx: GradContext) -> int | None:
    """The ``padding_idx`` of the ``nn.Embedding`` a torch export's Gather came from
    (``ir/torch_calls``: the exported Gather forgets it), None without one; a
    ``scale_grad_by_freq`` embedding is refused."""
    call = aten_call(ctx.node)
    scaled = call is not None and call[0] == "embedding.default" and call[1][3:4] == ["True"]
    if scaled:  # each row's gradient divided by its count in the batch
        raise unsupported(ctx, "nn.Embedding(scale_grad_by_freq=True)")
    padding = int_arg(call, "embedding.default", 2)
    return padding if padding is not None and padding >= 0 else None


def _gather_nd(ctx: GradContext) -> Grads:
    if int(ctx.attr("batch_dims", 0)) != 0:
        raise unsupported(ctx, "batch_dims != 0")
    shape, idx_shape = ctx.shape(0), ctx.shape(1)
    depth = idx_shape[-1]
    indices = _normalized_indices(ctx, shape[:depth])
    return [_added(ctx, "ScatterND", shape, indices, ctx.grad_outputs[0], {}), None]


def _gather_elements(ctx: GradContext) -> Grads:
    shape = ctx.shape(0)
    axis = normalize_axis(int(ctx.attr("axis", 0)), len(shape))
    indices = _normalized_indices(ctx, shape[axis])
    g = ctx.grad_outputs[0]
    return [_added(ctx, "ScatterElements", shape, indices, g, {"axis": axis}), None]


def _reduction(ctx: GradContext) -> str:
    reduction = str(ctx.attr("reduction", "none"))
    if reduction not in ("none", "add"):
        raise unsupported(ctx, f"reduction {reduction!r} (none and add are differentiable here)")
    return reduction


def _scatter_elements(ctx: GradContext) -> Grads:
    shape = ctx.shape(0)
    axis = normalize_axis(int(ctx.attr("axis", 0)), len(shape))
    indices = _normalized_indices(ctx, shape[axis])
    return _scatter(ctx, indices, ("ScatterElements", "GatherElements"), {"axis": axis})


def _scatter_nd(ctx: GradContext) -> Grads:
    shape, idx_shape = ctx.shape(0), ctx.shape(1)
    indices = _normalized_indices(ctx, shape[: idx_shape[-1]])
    return _scatter(ctx, indices, ("ScatterND", "GatherND"), {})


def _scatter(ctx: GradContext, indices: ir.Value, ops: tuple[str, str], attrs) -> Grads:
    """d data: the gradient, with the scattered positions zeroed for reduction none (a
    scatter of zeros there); d updates: the gradient gathered at their positions."""
    b, g = ctx.b, ctx.grad_outputs[0]
    scatter, gather = ops
    reduction = _reduction(ctx)
    grads: Grads = [None, None, None]
    if ctx.needs[0]:
        grads[0] = g
        if reduction == "none":
            cleared = zeros(b, ctx.shape(2), float_dtype(ctx.inputs[2]))
            grads[0] = b.op(scatter, [g, indices, cleared], attrs)
    if ctx.needs[2]:
        grads[2] = b.op(gather, [g, indices], attrs)
    return grads


def _top_k(ctx: GradContext) -> Grads:
    g = ctx.grad_outputs[0]
    if g is None:  # only the indices are used
        return [None, None]
    shape = ctx.shape(0)
    axis = normalize_axis(int(ctx.attr("axis", -1)), len(shape))
    return [_added(ctx, "ScatterElements", shape, ctx.outputs[1], g, {"axis": axis}), None]


_RULES: tuple[tuple[str, GradRule], ...] = (
    ("Gather", _gather),
    ("GatherND", _gather_nd),
    ("GatherElements", _gather_elements),
    ("ScatterElements", _scatter_elements),
    ("ScatterND", _scatter_nd),
    ("TopK", _top_k),
)


def register_into(registry: GradRegistry) -> None:
    """Add this family's rules to ``registry``."""
    for op_type, rule in _RULES:
        registry.register(op_type)(rule)
