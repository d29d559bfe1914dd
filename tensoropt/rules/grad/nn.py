"""Gradient rules of normalisations: Softmax, LogSoftmax, LayerNormalization,
BatchNormalization.

LayerNormalization and BatchNormalization (training mode) recompute their
statistics from the saved input with standard ops (ReduceMean, Sub, Mul, Sqrt,
Reciprocal) instead of reading the optional Mean/InvStdDev outputs, which
exporters usually drop; only output 0 carries a gradient. ``stash_type`` is
ignored: the backward computes in the input's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.rules.grad._common import normalize_axis, reduce_sum, unbroadcast
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

Grads = list[ir.Value | None]


def _softmax(ctx: GradContext) -> Grads:
    """dx = y * (g - sum(g * y, axis))"""
    b, y, g = ctx.b, ctx.outputs[0], ctx.grad_outputs[0]
    axis = normalize_axis(int(ctx.attr("axis", -1)), len(ctx.shape(0)))
    dot = reduce_sum(b, b.op("Mul", [g, y]), [axis], keepdims=True)
    return [b.op("Mul", [y, b.op("Sub", [g, dot])])]


def _log_softmax(ctx: GradContext) -> Grads:
    """dx = g - exp(y) * sum(g, axis)"""
    b, y, g = ctx.b, ctx.outputs[0], ctx.grad_outputs[0]
    axis = normalize_axis(int(ctx.attr("axis", -1)), len(ctx.shape(0)))
    total = reduce_sum(b, g, [axis], keepdims=True)
    return [b.op("Sub", [g, b.op("Mul", [b.op("Exp", [y]), total])])]


@dataclass(frozen=True, slots=True)
class _Normalized:
    """x_hat = (x - mean) * rstd over ``axes``, recomputed in the backward."""

    x_hat: ir.Value
    rstd: ir.Value


def _normalize(ctx: GradContext, axes: Sequence[int], epsilon: float) -> _Normalized:
    b, x = ctx.b, ctx.inputs[0]
    axes_v = b.ints(list(axes))
    mean = b.op("ReduceMean", [x, axes_v], {"keepdims": 1})
    centered = b.op("Sub", [x, mean])
    var = b.op("ReduceMean", [b.op("Mul", [centered, centered]), axes_v], {"keepdims": 1})
    std = b.op("Sqrt", [b.op("Add", [var, b.scalar_like(epsilon, x)])])
    rstd = b.op("Reciprocal", [std])
    return _Normalized(b.op("Mul", [centered, rstd]), rstd)


def _normalized_input_grad(
    ctx: GradContext, norm: _Normalized, d_hat: ir.Value, axes: Sequence[int]
) -> ir.Value:
    """dx = rstd * (d_hat - mean(d_hat) - x_hat * mean(d_hat * x_hat)) over ``axes``."""
    b = ctx.b
    axes_v = b.ints(list(axes))
    mean_d = b.op("ReduceMean", [d_hat, axes_v], {"keepdims": 1})
    proj = b.op("ReduceMean", [b.op("Mul", [d_hat, norm.x_hat]), axes_v], {"keepdims": 1})
    inner = b.op("Sub", [b.op("Sub", [d_hat, mean_d]), b.op("Mul", [norm.x_hat, proj])])
    return b.op("Mul", [norm.rstd, inner])


def _layer_norm(ctx: GradContext) -> Grads:
    b, g = ctx.b, ctx.grad_outputs[0]
    shape = ctx.shape(0)
    rank = len(shape)
    axis = normalize_axis(int(ctx.attr("axis", -1)), rank)
    axes = list(range(axis, rank))
    norm = _normalize(ctx, axes, float(ctx.attr("epsilon", 1e-5)))
    grads: Grads = [None] * len(ctx.inputs)
    if ctx.needs[0]:
        d_hat = b.op("Mul", [g, ctx.inputs[1]])
        grads[0] = _normalized_input_grad(ctx, norm, d_hat, axes)
    if ctx.needs[1]:
        grads[1] = unbroadcast(b, b.op("Mul", [g, norm.x_hat]), shape, ctx.shape(1))
    if len(ctx.inputs) > 2 and ctx.needs[2]:
        grads[2] = unbroadcast(b, g, shape, ctx.shape(2))
    return grads


def _channel_view(b, value: ir.Value, rank: int) -> ir.Value:
    """A [C] tensor as [C, 1, ..., 1] so it broadcasts against [N, C, ...]."""
    if rank <= 2:
        return value
    return b.op("Unsqueeze", [value, b.ints(list(range(1, rank - 1)))])


def _batch_norm(ctx: GradContext) -> Grads:
    """Inference form: y = scale (x - mean) / sqrt(var + eps) + bias with the given
    statistics. Training form (training_mode=1): batch statistics, recomputed.
    Gradients go to x, scale and bias; mean and var get none."""
    b, g, x = ctx.b, ctx.grad_outputs[0], ctx.inputs[0]
    rank = len(ctx.shape(0))
    epsilon = float(ctx.attr("epsilon", 1e-5))
    reduce_axes = [0, *range(2, rank)]
    scale = _channel_view(b, ctx.inputs[1], rank)
    if int(ctx.attr("training_mode", 0)):
        norm = _normalize(ctx, reduce_axes, epsilon)
    else:
        mean = _channel_view(b, ctx.inputs[3], rank)
        var = _channel_view(b, ctx.inputs[4], rank)
        rstd = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.scalar_like(epsilon, x)])])])
        norm = _Normalized(b.op("Mul", [b.op("Sub", [x, mean]), rstd]), rstd)
    grads: Grads = [None] * len(ctx.inputs)
    if ctx.needs[0]:
        d_hat = b.op("Mul", [g, scale])
        if int(ctx.attr("training_mode", 0)):
            grads[0] = _normalized_input_grad(ctx, norm, d_hat, reduce_axes)
        else:
            grads[0] = b.op("Mul", [d_hat, norm.rstd])
    if ctx.needs[1]:
        grads[1] = reduce_sum(b, b.op("Mul", [g, norm.x_hat]), reduce_axes, keepdims=False)
    if ctx.needs[2]:
        grads[2] = reduce_sum(b, g, reduce_axes, keepdims=False)
    return grads


_RULES: tuple[tuple[str, GradRule], ...] = (
    ("Softmax", _softmax),
    ("LogSoftmax", _log_softmax),
    ("LayerNormalization", _layer_norm),
    ("BatchNormalization", _batch_norm),
)


def register_into(registry: GradRegistry) -> None:
    """Add this family's rules to ``registry``."""
    for op_type, rule in _RULES:
        registry.register(op_type)(rule)
