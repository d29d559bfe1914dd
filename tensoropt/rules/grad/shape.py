"""Gradient rules of data-movement ops: Reshape, Flatten, Squeeze, Unsqueeze,
Transpose, Expand, Tile, Concat, Split, Slice, Pad.

Slice with steps != 1 scatters the gradient back without any scatter op: per
axis, a negative step is undone by reversing the gradient, a step k > 1 by
interleaving k-1 zeros (Unsqueeze, Pad, Reshape), and one final Pad places the
block at its start offsets. Every emitted op is linear in the tensor size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tensoropt.rules.grad._common import (
    const_ints,
    float_dtype,
    grad_or_zeros,
    normalize_axis,
    unbroadcast,
    unsupported,
    zeros,
)
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

Grads = list[ir.Value | None]

_INT64_MIN = int(np.iinfo(np.int64).min)


def _reshape_back(ctx: GradContext) -> Grads:
    """Reshape, Flatten, Squeeze, Unsqueeze: the gradient takes the input's shape."""
    g = ctx.grad_outputs[0]
    return [ctx.b.op("Reshape", [g, ctx.b.ints(ctx.shape(0))])]


def _transpose(ctx: GradContext) -> Grads:
    rank = len(ctx.shape(0))
    perm = ctx.attr("perm", None)
    perm = list(range(rank))[::-1] if perm is None else [int(p) for p in perm]
    inverse = [0] * rank
    for i, p in enumerate(perm):
        inverse[p] = i
    return [ctx.b.op("Transpose", [ctx.grad_outputs[0]], {"perm": inverse})]


def _expand(ctx: GradContext) -> Grads:
    return [unbroadcast(ctx.b, ctx.grad_outputs[0], ctx.out_shape(), ctx.shape(0))]


def _tile(ctx: GradContext) -> Grads:
    """out dim i = repeats[i] * d_i: view as [r_0, d_0, r_1, d_1, ...], sum the r axes."""
    b, shape = ctx.b, ctx.shape(0)
    repeats = const_ints(ctx, 1, "repeats")
    if repeats is None:
        raise unsupported(ctx, "a missing repeats input")
    split = [v for r, d in zip(repeats, shape, strict=True) for v in (r, d)]
    viewed = b.op("Reshape", [ctx.grad_outputs[0], b.ints(split)])
    summed = b.op("ReduceSum", [viewed, b.ints(list(range(0, 2 * len(shape), 2)))], {"keepdims": 0})
    return [summed, None]


def _concat(ctx: GradContext) -> Grads:
    b = ctx.b
    rank = len(ctx.out_shape())
    axis = normalize_axis(int(ctx.attr("axis")), rank)
    sizes = [ctx.shape(i)[axis] for i in range(len(ctx.inputs))]
    if len(sizes) == 1:
        return [ctx.grad_outputs[0]]
    parts = b.op(
        "Split",
        [ctx.grad_outputs[0], b.ints(sizes)],
        {"axis": axis},
        num_outputs=len(sizes),
    )
    return [part if need else None for part, need in zip(parts, ctx.needs, strict=True)]


def _split(ctx: GradContext) -> Grads:
    b = ctx.b
    axis = normalize_axis(int(ctx.attr("axis", 0)), len(ctx.shape(0)))
    parts = [grad_or_zeros(ctx, i) for i in range(len(ctx.outputs))]
    grad = parts[0] if len(parts) == 1 else b.op("Concat", parts, {"axis": axis})
    return [grad] + [None] * (len(ctx.inputs) - 1)


@dataclass(frozen=True, slots=True)
class _AxisSlice:
    """One sliced axis, normalised to increasing positions start + j*step, j < count."""

    axis: int
    start: int
    step: int
    count: int
    reversed: bool


def _clamp(start: int, end: int, step: int, dim: int) -> tuple[int, int]:
    """ONNX Slice bounds (differs from Python's slice for negative steps)."""
    start += dim if start < 0 else 0
    end += dim if end < 0 else 0
    if step > 0:
        return min(max(start, 0), dim), min(max(end, 0), dim)
    return min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)


def _slice_params(ctx: GradContext) -> tuple[list[_AxisSlice], bool]:
    """The normalised per-axis slices and whether the output is empty."""
    shape = ctx.shape(0)
    if "starts" in ctx.node.attributes:  # opset < 10
        starts = [int(v) for v in ctx.attr("starts")]
        ends = [int(v) for v in ctx.attr("ends")]
        axes = ctx.attr("axes", None)
        steps = None
    else:
        starts = const_ints(ctx, 1, "starts")
        ends = const_ints(ctx, 2, "ends")
        axes = const_ints(ctx, 3, "axes")
        steps = const_ints(ctx, 4, "steps")
    axes = list(range(len(starts))) if axes is None else [int(a) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    slices, empty = [], False
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = normalize_axis(axis, len(shape))
        lo, hi = _clamp(start, end, step, shape[axis])
        stride = step
        count = len(range(lo, hi, step))
        empty |= count == 0
        if stride < 0 and count:
            lo, stride = lo + (count - 1) * stride, -stride
        slices.append(_AxisSlice(axis, lo, stride, count, step < 0))
    return slices, empty


def _interleave(b, grad: ir.Value, shape: list[int], axis: int, step: int) -> ir.Value:
    """Put element j of ``axis`` at position j*step with zeros between; updates ``shape``
    (the static shape of ``grad``) to the new length (count-1)*step+1."""
    count, rank = shape[axis], len(shape)
    widened = b.op("Unsqueeze", [grad, b.ints([axis + 1])])
    pads = [0] * (2 * (rank + 1))
    pads[(rank + 1) + axis + 1] = step - 1
    padded = b.op("Pad", [widened, b.ints(pads)])
    shape[axis] = count * step
    merged = b.op("Reshape", [padded, b.ints(shape)])
    shape[axis] = (count - 1) * step + 1
    return b.op("Slice", [merged, b.ints([0]), b.ints([shape[axis]]), b.ints([axis])])


def _slice(ctx: GradContext) -> Grads:
    b, shape = ctx.b, ctx.shape(0)
    rank = len(shape)
    slices, empty = _slice_params(ctx)
    none_rest: Grads = [None] * (len(ctx.inputs) - 1)
    if empty:
        return [zeros(b, shape, float_dtype(ctx.inputs[0])), *none_rest]
    grad = ctx.grad_outputs[0]
    reverse = [s.axis for s in slices if s.reversed and s.count > 1]
    if reverse:
        n = len(reverse)
        grad = b.op(
            "Slice",
            [grad, b.ints([-1] * n), b.ints([_INT64_MIN] * n), b.ints(reverse), b.ints([-1] * n)],
        )
    current = list(ctx.out_shape())
    pads = [0] * (2 * rank)
    for s in slices:
        if s.step > 1 and s.count > 1:
            grad = _interleave(b, grad, current, s.axis, s.step)
        extent = (s.count - 1) * s.step + 1
        pads[s.axis] = s.start
        pads[rank + s.axis] = shape[s.axis] - s.start - extent
    if any(pads):
        grad = b.op("Pad", [grad, b.ints(pads)])
    return [grad, *none_rest]


def _pad(ctx: GradContext) -> Grads:
    """Constant-mode Pad: the gradient is the interior block (negative pads crop,
    so their inverse pads with zeros)."""
    b, shape = ctx.b, ctx.shape(0)
    rank = len(shape)
    mode = ctx.attr("mode", "constant")
    if mode != "constant":
        raise unsupported(ctx, f"Pad mode {mode!r}")
    pads = const_ints(ctx, 1, "pads")
    if pads is None:
        pads = [int(p) for p in ctx.attr("pads")]
    axes = const_ints(ctx, 3, "axes")
    axes = list(range(rank)) if axes is None else [normalize_axis(a, rank) for a in axes]
    full = [0] * (2 * rank)
    for k, axis in enumerate(axes):
        full[axis], full[rank + axis] = pads[k], pads[len(axes) + k]
    out_shape = ctx.out_shape()
    grad = ctx.grad_outputs[0]
    crop = [a for a in range(rank) if full[a] > 0 or full[rank + a] > 0]
    if crop:
        starts = [max(full[a], 0) for a in crop]
        ends = [out_shape[a] - max(full[rank + a], 0) for a in crop]
        grad = b.op("Slice", [grad, b.ints(starts), b.ints(ends), b.ints(crop)])
    if any(p < 0 for p in full):
        grad = b.op("Pad", [grad, b.ints([max(-p, 0) for p in full])])
    grads: Grads = [None] * len(ctx.inputs)
    grads[0] = grad
    return grads


def _no_extra_inputs(rule: GradRule) -> GradRule:
    """Wrap a single-gradient rule so shape/axes inputs get None."""

    def wrapped(ctx: GradContext) -> Grads:
        grads = list(rule(ctx))
        return grads + [None] * (len(ctx.inputs) - len(grads))

    wrapped.__doc__ = rule.__doc__
    return wrapped


_RULES: tuple[tuple[str, GradRule], ...] = (
    ("Reshape", _no_extra_inputs(_reshape_back)),
    ("Flatten", _reshape_back),
    ("Squeeze", _no_extra_inputs(_reshape_back)),
    ("Unsqueeze", _no_extra_inputs(_reshape_back)),
    ("Transpose", _transpose),
    ("Expand", _no_extra_inputs(_expand)),
    ("Tile", _tile),
    ("Concat", _concat),
    ("Split", _split),
    ("Slice", _slice),
    ("Pad", _pad),
)


def register_into(registry: GradRegistry) -> None:
    """Add this family's rules to ``registry``."""
    for op_type, rule in _RULES:
        registry.register(op_type)(rule)
