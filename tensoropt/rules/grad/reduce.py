"""Gradient rules of the Reduce* family.

Axes come from the ``axes`` input (opset 18+, and ReduceSum from 13) or the
``axes`` attribute (older forms); absent or empty axes mean "all axes" unless
``noop_with_empty_axes`` is set, in which case the op is the identity.
ReduceMax/ReduceMin split the gradient equally among tied extrema (as JAX and
torch.amax do), so the rule is symmetric and deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tensoropt.rules.grad._common import const_ints, expand_to, normalize_axes, reduce_sum
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

Grads = list[ir.Value | None]


@dataclass(frozen=True, slots=True)
class _Reduction:
    """The static facts of one reduction node."""

    in_shape: tuple[int, ...]
    axes: tuple[int, ...] | None  # None: the node is the identity (noop_with_empty_axes)
    keepdims: bool

    @property
    def count(self) -> int:
        assert self.axes is not None
        return int(np.prod([self.in_shape[a] for a in self.axes], dtype=np.int64))


def _reduction(ctx: GradContext) -> _Reduction:
    shape = ctx.shape(0)
    axes = const_ints(ctx, 1, "axes")
    if axes is None and "axes" in ctx.node.attributes:
        axes = [int(a) for a in ctx.attr("axes")]
    keepdims = bool(ctx.attr("keepdims", 1))
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return _Reduction(shape, None, keepdims)
        axes = list(range(len(shape)))
    return _Reduction(shape, tuple(normalize_axes(axes, len(shape))), keepdims)


def _kept(ctx: GradContext, red: _Reduction, value: ir.Value) -> ir.Value:
    """``value`` (of the reduced output's shape) with the reduced axes kept as 1."""
    if red.keepdims or not red.axes:
        return value
    return ctx.b.op("Unsqueeze", [value, ctx.b.ints(list(red.axes))])


def _reduce_sum(ctx: GradContext) -> Grads:
    red = _reduction(ctx)
    g = ctx.grad_outputs[0]
    if red.axes is None:
        return [g]
    return [expand_to(ctx.b, _kept(ctx, red, g), red.in_shape)]


def _reduce_mean(ctx: GradContext) -> Grads:
    red = _reduction(ctx)
    g = ctx.grad_outputs[0]
    if red.axes is None:
        return [g]
    b = ctx.b
    scaled = b.op("Mul", [_kept(ctx, red, g), b.scalar_like(1.0 / red.count, ctx.inputs[0])])
    return [expand_to(b, scaled, red.in_shape)]


def _reduce_extremum(ctx: GradContext) -> Grads:
    """Gradient to every position equal to the extremum, split among ties."""
    red = _reduction(ctx)
    g = ctx.grad_outputs[0]
    if red.axes is None:
        return [g]
    b, x = ctx.b, ctx.inputs[0]
    hit = b.op("Equal", [x, _kept(ctx, red, ctx.outputs[0])])
    mask = b.op("Cast", [hit], {"to": int(x.dtype)})
    count = reduce_sum(b, mask, red.axes, keepdims=True)
    share = b.op("Div", [_kept(ctx, red, g), count])
    return [b.op("Mul", [mask, share])]


def _local_rule(local_fn) -> GradRule:
    """A rule ``dx = expand(g) * local(ctx, y_kept)`` for smooth reductions."""

    def rule(ctx: GradContext) -> Grads:
        red = _reduction(ctx)
        g = ctx.grad_outputs[0]
        if red.axes is None:
            return [ctx.b.op("Mul", [g, local_fn(ctx, ctx.outputs[0], identity=True)])]
        y_kept = _kept(ctx, red, ctx.outputs[0])
        return [ctx.b.op("Mul", [_kept(ctx, red, g), local_fn(ctx, y_kept, identity=False)])]

    return rule


def _sum_square_local(ctx: GradContext, y_kept: ir.Value, identity: bool) -> ir.Value:
    # y = sum x^2 (identity form: y = x^2): dy/dx = 2x
    b = ctx.b
    return b.op("Mul", [ctx.inputs[0], b.scalar_like(2.0, ctx.inputs[0])])


def _l1_local(ctx: GradContext, y_kept: ir.Value, identity: bool) -> ir.Value:
    # y = sum |x| (identity form: |x|): sign(x)
    return ctx.b.op("Sign", [ctx.inputs[0]])


def _l2_local(ctx: GradContext, y_kept: ir.Value, identity: bool) -> ir.Value:
    # y = sqrt(sum x^2) (identity form: |x|): x / y
    if identity:
        return ctx.b.op("Sign", [ctx.inputs[0]])
    return ctx.b.op("Div", [ctx.inputs[0], y_kept])


def _log_sum_exp_local(ctx: GradContext, y_kept: ir.Value, identity: bool) -> ir.Value:
    # y = log(sum exp x) (identity form: x): exp(x - y)
    b = ctx.b
    if identity:
        return b.scalar_like(1.0, ctx.inputs[0])
    return b.op("Exp", [b.op("Sub", [ctx.inputs[0], y_kept])])


_RULES: tuple[tuple[str, GradRule], ...] = (
    ("ReduceSum", _reduce_sum),
    ("ReduceMean", _reduce_mean),
    ("ReduceMax", _reduce_extremum),
    ("ReduceMin", _reduce_extremum),
    ("ReduceSumSquare", _local_rule(_sum_square_local)),
    ("ReduceL1", _local_rule(_l1_local)),
    ("ReduceL2", _local_rule(_l2_local)),
    ("ReduceLogSumExp", _local_rule(_log_sum_exp_local)),
)


def register_into(registry: GradRegistry) -> None:
    """Add this family's rules to ``registry``."""
    for op_type, rule in _RULES:
        registry.register(op_type)(rule)
