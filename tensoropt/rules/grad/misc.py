"""Gradient rules of the remaining ops (Where, Cast, Identity, Dropout, Trilu,
CumSum) and the list of ops that carry no gradient.

Dropout is differentiated as the identity when it is inactive (no
training_mode input, or training_mode constant false, or ratio 0), which is how
exported inference graphs use it. When it is active, the gradient is
g * mask / (1 - ratio) using the node's mask output; an active Dropout without
a mask output (or with a non-constant ratio) is refused.
"""

from __future__ import annotations

import onnx_ir as ir

from tensoropt.rules.grad._common import mask, unbroadcast, unsupported
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

Grads = list[ir.Value | None]

_FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}

NON_DIFFERENTIABLE: tuple[str, ...] = (
    "Shape",
    "Size",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "And",
    "Or",
    "Not",
    "Xor",
    "IsNaN",
    "IsInf",
    "ArgMax",
    "ArgMin",
    "Range",
    "ConstantOfShape",
    "Constant",
    "OneHot",
    "NonZero",
    "Sign",
    "Floor",
    "Ceil",
    "Round",
    "Mod",
    "EyeLike",
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Bernoulli",
    "Multinomial",
)


def _where(ctx: GradContext) -> Grads:
    b, g, cond = ctx.b, ctx.grad_outputs[0], ctx.inputs[0]
    like = ctx.outputs[0]
    grads: Grads = [None, None, None]
    if ctx.needs[1]:
        grads[1] = unbroadcast(b, mask(b, cond, g, like), ctx.out_shape(), ctx.shape(1))
    if ctx.needs[2]:
        other = mask(b, b.op("Not", [cond]), g, like)
        grads[2] = unbroadcast(b, other, ctx.out_shape(), ctx.shape(2))
    return grads


def _cast(ctx: GradContext) -> Grads:
    """float -> float passes the gradient (cast back); anything else has none."""
    source, target = ctx.inputs[0].dtype, ctx.outputs[0].dtype
    if source not in _FLOAT_TYPES or target not in _FLOAT_TYPES:
        return [None]
    g = ctx.grad_outputs[0]
    return [g if source == target else ctx.b.op("Cast", [g], {"to": int(source)})]


def _identity(ctx: GradContext) -> Grads:
    return [ctx.grad_outputs[0]]


def _dropout_active(ctx: GradContext) -> bool:
    inputs = list(ctx.inputs) + [None] * (3 - len(ctx.inputs))
    if inputs[2] is None:
        return False
    training = ctx.const_input(2)
    if training is None:
        raise unsupported(ctx, "a non-constant training_mode input")
    if not bool(training):
        return False
    ratio = 0.5 if inputs[1] is None else ctx.const_input(1)
    if ratio is None:
        raise unsupported(ctx, "a non-constant ratio in training mode")
    return float(ratio) != 0.0


def _dropout(ctx: GradContext) -> Grads:
    grads: Grads = [None] * len(ctx.inputs)
    g = ctx.grad_outputs[0]
    if not _dropout_active(ctx):
        grads[0] = g
        return grads
    if len(ctx.outputs) < 2 or ctx.outputs[1] is None:
        raise unsupported(ctx, "an active (training-mode) Dropout without a mask output")
    b = ctx.b
    ratio = 0.5 if len(ctx.inputs) < 2 or ctx.inputs[1] is None else float(ctx.const_input(1))
    mask = b.op("Cast", [ctx.outputs[1]], {"to": int(ctx.outputs[0].dtype)})
    scale = b.scalar_like(1.0 / (1.0 - ratio), ctx.outputs[0])
    grads[0] = b.op("Mul", [b.op("Mul", [g, mask]), scale])
    return grads


def _trilu(ctx: GradContext) -> Grads:
    inputs = [ctx.grad_outputs[0], *ctx.inputs[1:]]
    upper = int(ctx.attr("upper", 1))
    return [ctx.b.op("Trilu", inputs, {"upper": upper})] + [None] * (len(ctx.inputs) - 1)


def _cumsum(ctx: GradContext) -> Grads:
    """The adjoint of a (reverse) cumulative sum is the opposite-direction cumsum."""
    attrs = {
        "exclusive": int(ctx.attr("exclusive", 0)),
        "reverse": 1 - int(ctx.attr("reverse", 0)),
    }
    return [ctx.b.op("CumSum", [ctx.grad_outputs[0], ctx.inputs[1]], attrs), None]


_RULES: tuple[tuple[str, GradRule], ...] = (
    ("Where", _where),
    ("Cast", _cast),
    ("Identity", _identity),
    ("Dropout", _dropout),
    ("Trilu", _trilu),
    ("CumSum", _cumsum),
)


def register_into(registry: GradRegistry) -> None:
    """Add this family's rules and the non-differentiable ops to ``registry``."""
    for op_type, rule in _RULES:
        registry.register(op_type)(rule)
    registry.mark_non_differentiable(NON_DIFFERENTIABLE)
