"""Gradient rules of elementwise ops: arithmetic with broadcasting, unary math and
activations, variadic Sum/Mean/Max/Min, Clip.

Broadcast inputs get their gradient summed back to their own shape
(:func:`unbroadcast`). Kinks (Relu, LeakyRelu and Abs at 0, Clip at its bounds)
take the derivative of the right-hand branch for Relu/LeakyRelu (0 for Relu at
0), 0 for Abs at 0 (Sign), and pass the gradient at the Clip bounds. Max/Min ties
split the gradient equally among the tied inputs.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from tensoropt.rules.grad._common import in_dtype, mask, unbroadcast
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

Grads = list[ir.Value | None]


def _to_input(ctx: GradContext, index: int, grad: ir.Value) -> ir.Value:
    """Sum a gradient of the output's (broadcast) shape back to input ``index``."""
    return unbroadcast(ctx.b, grad, ctx.out_shape(), ctx.shape(index))


def _scalar(ctx: GradContext, value: float) -> ir.Value:
    """A scalar constant of the forward output's float dtype."""
    return ctx.b.scalar_like(value, ctx.node.outputs[0])


def _add(ctx: GradContext) -> Grads:
    g = ctx.grad_outputs[0]
    return [_to_input(ctx, i, g) if ctx.needs[i] else None for i in range(2)]


def _sub(ctx: GradContext) -> Grads:
    g, b = ctx.grad_outputs[0], ctx.b
    ga = _to_input(ctx, 0, g) if ctx.needs[0] else None
    gb = _to_input(ctx, 1, b.op("Neg", [g])) if ctx.needs[1] else None
    return [ga, gb]


def _mul(ctx: GradContext) -> Grads:
    g, b = ctx.grad_outputs[0], ctx.b
    x, y = ctx.inputs[0], ctx.inputs[1]
    ga = _to_input(ctx, 0, b.op("Mul", [g, y])) if ctx.needs[0] else None
    gb = _to_input(ctx, 1, b.op("Mul", [g, x])) if ctx.needs[1] else None
    return [ga, gb]


def _div(ctx: GradContext) -> Grads:
    # y = a / b: da = g / b, db = -g * y / b = -(g / b) * y.
    g, b = ctx.grad_outputs[0], ctx.b
    g_over_b = b.op("Div", [g, ctx.inputs[1]])
    ga = _to_input(ctx, 0, g_over_b) if ctx.needs[0] else None
    gb = None
    if ctx.needs[1]:
        gb = _to_input(ctx, 1, b.op("Neg", [b.op("Mul", [g_over_b, ctx.outputs[0]])]))
    return [ga, gb]


def _pow(ctx: GradContext) -> Grads:
    """y = a ** e. da = g e a^(e-1); de = g y log(a) where a > 0 (0 elsewhere)."""
    g, b = ctx.grad_outputs[0], ctx.b
    a, e = ctx.inputs[0], ctx.inputs[1]
    dtype = in_dtype(ctx, 0)
    ga = gb = None
    if ctx.needs[0]:
        const_e = ctx.const_input(1)
        if const_e is not None:
            e_val = np.asarray(const_e).astype(dtype)
            e_f, e_m1 = b.const(e_val), b.const(e_val - 1)
        else:
            e_f = e if e.dtype == a.dtype else b.op("Cast", [e], {"to": int(a.dtype)})
            e_m1 = b.op("Sub", [e_f, _scalar(ctx, 1.0)])
        local = b.op("Mul", [e_f, b.op("Pow", [a, e_m1])])
        ga = _to_input(ctx, 0, b.op("Mul", [g, local]))
    if ctx.needs[1]:
        positive = b.op("Greater", [a, _scalar(ctx, 0.0)])
        safe_a = b.op("Where", [positive, a, _scalar(ctx, 1.0)])
        local = b.op("Mul", [ctx.outputs[0], b.op("Log", [safe_a])])
        gb = _to_input(ctx, 1, b.op("Mul", [g, local]))
    return [ga, gb]


def _unary(local_fn) -> GradRule:
    """A rule ``dx = g * local(ctx)`` for one-input ops."""

    def rule(ctx: GradContext) -> Grads:
        g = ctx.grad_outputs[0]
        return [ctx.b.op("Mul", [g, local_fn(ctx)])]

    rule.__doc__ = local_fn.__doc__
    return rule


def _sqrt(ctx: GradContext) -> Grads:
    # d sqrt(x) = 1 / (2 y)
    b = ctx.b
    return [b.op("Div", [ctx.grad_outputs[0], b.op("Mul", [ctx.outputs[0], _scalar(ctx, 2.0)])])]


def _reciprocal(ctx: GradContext) -> Grads:
    # d (1/x) = -y^2
    b, y = ctx.b, ctx.outputs[0]
    return [b.op("Neg", [b.op("Mul", [ctx.grad_outputs[0], b.op("Mul", [y, y])])])]


def _neg(ctx: GradContext) -> Grads:
    return [ctx.b.op("Neg", [ctx.grad_outputs[0]])]


def _log(ctx: GradContext) -> Grads:
    return [ctx.b.op("Div", [ctx.grad_outputs[0], ctx.inputs[0]])]


def _exp_local(ctx: GradContext) -> ir.Value:
    """exp' = y"""
    return ctx.outputs[0]


def _abs_local(ctx: GradContext) -> ir.Value:
    """|x|' = sign(x)"""
    return ctx.b.op("Sign", [ctx.inputs[0]])


def _tanh_local(ctx: GradContext) -> ir.Value:
    """tanh' = 1 - y^2"""
    b, y = ctx.b, ctx.outputs[0]
    return b.op("Sub", [_scalar(ctx, 1.0), b.op("Mul", [y, y])])


def _sigmoid_local(ctx: GradContext) -> ir.Value:
    """sigmoid' = y (1 - y)"""
    b, y = ctx.b, ctx.outputs[0]
    return b.op("Mul", [y, b.op("Sub", [_scalar(ctx, 1.0), y])])


def _erf_local(ctx: GradContext) -> ir.Value:
    """erf' = 2/sqrt(pi) exp(-x^2)"""
    b, x = ctx.b, ctx.inputs[0]
    e = b.op("Exp", [b.op("Neg", [b.op("Mul", [x, x])])])
    return b.op("Mul", [e, _scalar(ctx, 2.0 / math.sqrt(math.pi))])


def _gelu_local(ctx: GradContext) -> ir.Value:
    """Gelu' for approximate='none' (exact) and 'tanh'."""
    b, x = ctx.b, ctx.inputs[0]

    def mul(u: ir.Value, v: ir.Value | float) -> ir.Value:
        return b.op("Mul", [u, v if isinstance(v, ir.Value) else _scalar(ctx, v)])

    def add(u: ir.Value, v: ir.Value | float) -> ir.Value:
        return b.op("Add", [u, v if isinstance(v, ir.Value) else _scalar(ctx, v)])

    x2 = mul(x, x)
    if ctx.attr("approximate", "none") == "tanh":
        # y = x/2 (1 + t), t = tanh(c (x + k x^3)); y' = (1+t)/2 + x/2 (1-t^2) c (1 + 3k x^2)
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        t = b.op("Tanh", [mul(add(x, mul(mul(x2, x), k)), c)])
        sech2 = b.op("Sub", [_scalar(ctx, 1.0), mul(t, t)])
        d_inner = mul(add(mul(x2, 3 * k), 1.0), c)
        return add(mul(add(t, 1.0), 0.5), mul(mul(x, 0.5), mul(sech2, d_inner)))
    # y = x Phi(x); y' = Phi(x) + x phi(x)
    cdf = mul(add(b.op("Erf", [mul(x, 1 / math.sqrt(2))]), 1.0), 0.5)
    pdf = mul(b.op("Exp", [mul(x2, -0.5)]), 1 / math.sqrt(2 * math.pi))
    return add(cdf, mul(x, pdf))


def _sin_local(ctx: GradContext) -> ir.Value:
    """sin' = cos"""
    return ctx.b.op("Cos", [ctx.inputs[0]])


def _cos_local(ctx: GradContext) -> ir.Value:
    """cos' = -sin"""
    return ctx.b.op("Neg", [ctx.b.op("Sin", [ctx.inputs[0]])])


def _softplus_local(ctx: GradContext) -> ir.Value:
    """softplus' = sigmoid(x)"""
    return ctx.b.op("Sigmoid", [ctx.inputs[0]])


def _elu_local(ctx: GradContext) -> ir.Value:
    """elu' = 1 for x > 0, y + alpha otherwise"""
    b = ctx.b
    alpha = _scalar(ctx, float(ctx.attr("alpha", 1.0)))
    positive = b.op("Greater", [ctx.inputs[0], _scalar(ctx, 0.0)])
    return b.op("Where", [positive, _scalar(ctx, 1.0), b.op("Add", [ctx.outputs[0], alpha])])


def _hard_sigmoid_local(ctx: GradContext) -> ir.Value:
    """alpha inside the linear band 0 < alpha x + beta < 1, else 0"""
    b, x = ctx.b, ctx.inputs[0]
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    z = b.op("Add", [b.op("Mul", [x, _scalar(ctx, alpha)]), _scalar(ctx, beta)])
    inside = b.op(
        "And", [b.op("Greater", [z, _scalar(ctx, 0.0)]), b.op("Less", [z, _scalar(ctx, 1.0)])]
    )
    return b.op("Where", [inside, _scalar(ctx, alpha), _scalar(ctx, 0.0)])


def _hard_swish_local(ctx: GradContext) -> ir.Value:
    """y = x hardsigmoid(x; 1/6, 1/2): 0 below -3, 1 above 3, (2x + 3)/6 between"""
    b, x = ctx.b, ctx.inputs[0]
    ramp = b.op("Add", [b.op("Mul", [x, _scalar(ctx, 1.0 / 3.0)]), _scalar(ctx, 0.5)])
    low = b.op("Where", [b.op("Less", [x, _scalar(ctx, -3.0)]), _scalar(ctx, 0.0), ramp])
    return b.op("Where", [b.op("Greater", [x, _scalar(ctx, 3.0)]), _scalar(ctx, 1.0), low])


def _relu(ctx: GradContext) -> Grads:
    b = ctx.b
    positive = b.op("Greater", [ctx.inputs[0], _scalar(ctx, 0.0)])
    return [mask(b, positive, ctx.grad_outputs[0], ctx.node.outputs[0])]


def _leaky_relu(ctx: GradContext) -> Grads:
    b, g = ctx.b, ctx.grad_outputs[0]
    alpha = float(ctx.attr("alpha", 0.01))
    positive = b.op("Greater", [ctx.inputs[0], _scalar(ctx, 0.0)])
    return [b.op("Where", [positive, g, b.op("Mul", [g, _scalar(ctx, alpha)])])]


def _sum(ctx: GradContext) -> Grads:
    g = ctx.grad_outputs[0]
    return [_to_input(ctx, i, g) if need else None for i, need in enumerate(ctx.needs)]


def _mean(ctx: GradContext) -> Grads:
    g = ctx.b.op("Mul", [ctx.grad_outputs[0], _scalar(ctx, 1.0 / len(ctx.inputs))])
    return [_to_input(ctx, i, g) if need else None for i, need in enumerate(ctx.needs)]


def _max_min(ctx: GradContext) -> Grads:
    """Each input equal to the output gets g / (number of inputs equal to it)."""
    b, y, g = ctx.b, ctx.outputs[0], ctx.grad_outputs[0]
    if len(ctx.inputs) == 1:
        return [g]
    dtype_enum = int(y.dtype) if y.dtype is not None else int(ir.DataType.FLOAT)
    masks = [b.op("Cast", [b.op("Equal", [x, y])], {"to": dtype_enum}) for x in ctx.inputs]
    count = masks[0]
    for m in masks[1:]:
        count = b.op("Add", [count, m])
    share = b.op("Div", [g, count])
    return [
        _to_input(ctx, i, b.op("Mul", [share, m])) if need else None
        for i, (m, need) in enumerate(zip(masks, ctx.needs, strict=True))
    ]


def _clip(ctx: GradContext) -> Grads:
    """x passes g where min <= x <= max; min (max) gets the g where x is below (above)."""
    b, x, g = ctx.b, ctx.inputs[0], ctx.grad_outputs[0]
    inputs = list(ctx.inputs) + [None] * (3 - len(ctx.inputs))
    lo, hi = inputs[1], inputs[2]
    if lo is None and "min" in ctx.node.attributes:
        lo = _scalar(ctx, float(ctx.attr("min")))
    if hi is None and "max" in ctx.node.attributes:
        hi = _scalar(ctx, float(ctx.attr("max")))
    keep = None
    if lo is not None:
        keep = b.op("GreaterOrEqual", [x, lo])
    if hi is not None:
        below_hi = b.op("LessOrEqual", [x, hi])
        keep = below_hi if keep is None else b.op("And", [keep, below_hi])
    grads: Grads = [None] * len(ctx.inputs)
    if ctx.needs[0]:
        grads[0] = g if keep is None else mask(b, keep, g, ctx.node.outputs[0])
    for index, bound, cmp in ((1, lo, "Less"), (2, hi, "Greater")):
        if index < len(ctx.needs) and ctx.needs[index] and bound is not None:
            outside = mask(b, b.op(cmp, [x, bound]), g, ctx.node.outputs[0])
            grads[index] = unbroadcast(b, outside, ctx.shape(0), ctx.shape(index))
    return grads


_RULES: tuple[tuple[str, GradRule], ...] = (
    ("Add", _add),
    ("Sub", _sub),
    ("Mul", _mul),
    ("Div", _div),
    ("Pow", _pow),
    ("Sqrt", _sqrt),
    ("Reciprocal", _reciprocal),
    ("Neg", _neg),
    ("Exp", _unary(_exp_local)),
    ("Log", _log),
    ("Abs", _unary(_abs_local)),
    ("Tanh", _unary(_tanh_local)),
    ("Sigmoid", _unary(_sigmoid_local)),
    ("Erf", _unary(_erf_local)),
    ("Gelu", _unary(_gelu_local)),
    ("Sin", _unary(_sin_local)),
    ("Cos", _unary(_cos_local)),
    ("Softplus", _unary(_softplus_local)),
    ("Elu", _unary(_elu_local)),
    ("HardSigmoid", _unary(_hard_sigmoid_local)),
    ("HardSwish", _unary(_hard_swish_local)),
    ("Relu", _relu),
    ("LeakyRelu", _leaky_relu),
    ("Sum", _sum),
    ("Mean", _mean),
    ("Max", _max_min),
    ("Min", _max_min),
    ("Clip", _clip),
)


def register_into(registry: GradRegistry) -> None:
    """Add this family's rules to ``registry``."""
    for op_type, rule in _RULES:
        registry.register(op_type)(rule)
