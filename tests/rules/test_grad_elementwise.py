"""Finite-difference property tests of the elementwise gradient rules."""

from __future__ import annotations

import numpy as np
from grad_harness import (
    Const,
    GradCase,
    away_from_zero,
    broadcastable_to,
    check_gradients,
    distinct,
    node_case,
    normal,
    positive,
    rng_of,
    shapes,
)
from hypothesis import strategies as st
from onnx import helper


@st.composite
def _binary_shapes(draw):
    out = draw(shapes(0, 3))
    a, b = draw(broadcastable_to(out)), draw(broadcastable_to(out))
    return (a, b) if draw(st.booleans()) else (b, a)


def _binary(op: str, make_a=normal, make_b=normal):
    @st.composite
    def case(draw):
        rng = rng_of(draw)
        a, b = draw(_binary_shapes())
        return node_case(op, [make_a(rng, a), make_b(rng, b)])

    return case()


@st.composite
def _pow(draw):
    rng = rng_of(draw)
    a, b = draw(_binary_shapes())
    base = positive(rng, a)
    kind = draw(st.sampled_from(["tensor", "const", "int"]))
    if kind == "tensor":
        return node_case("Pow", [base, rng.uniform(-2, 2, b)])
    if kind == "const":
        exponent = draw(st.sampled_from([2.0, 3.0, 0.5, -1.0, 1.5]))
        return node_case("Pow", [base, Const(np.full(b, exponent))])
    return node_case("Pow", [base, Const(np.full(b, draw(st.integers(-2, 3)), dtype=np.int64))])


def _unary(op: str, make=normal, attrs=None):
    @st.composite
    def case(draw):
        rng = rng_of(draw)
        chosen = {k: draw(v) for k, v in (attrs or {}).items()}
        return node_case(op, [make(rng, draw(shapes(0, 3)))], chosen)

    return case()


def _variadic(op: str, make):
    @st.composite
    def case(draw):
        rng = rng_of(draw)
        out = draw(shapes(0, 3))
        n = draw(st.integers(1, 3))
        in_shapes = [draw(broadcastable_to(out)) for _ in range(n)]
        return node_case(op, make(rng, in_shapes))

    return case()


@st.composite
def _clip(draw):
    """x away from the bounds; bounds absent, constant, or differentiated inputs."""
    rng = rng_of(draw)
    shape = draw(shapes(0, 3))
    lo, hi = rng.uniform(-1.0, -0.2), rng.uniform(0.2, 1.0)
    x = rng.uniform(-2, 2, shape)
    near = (np.abs(x - lo) < 0.05) | (np.abs(x - hi) < 0.05)
    x = np.where(near, 0.0, x)
    args = [x]
    for bound, present in ((lo, draw(st.sampled_from(["none", "const", "input"]))),) + (
        (hi, draw(st.sampled_from(["none", "const", "input"]))),
    ):
        value = np.asarray(bound)
        args.append(None if present == "none" else Const(value) if present == "const" else value)
    while args and args[-1] is None:
        args.pop()
    return node_case("Clip", args)


def _away_from(*kinks: float):
    """Values in [-4, 4] at least 0.05 from every kink."""

    def make(rng, shape):
        x = rng.uniform(-4, 4, shape)
        for kink in kinks:
            x = np.where(np.abs(x - kink) < 0.05, x + 0.1, x)
        return x

    return make


CASES = {
    "Add": _binary("Add"),
    "Sub": _binary("Sub"),
    "Mul": _binary("Mul"),
    "Div": _binary("Div", normal, lambda r, s: away_from_zero(r, s, 0.5)),
    "Pow": _pow(),
    "Sqrt": _unary("Sqrt", positive),
    "Reciprocal": _unary("Reciprocal", positive),
    "Neg": _unary("Neg"),
    "Exp": _unary("Exp"),
    "Log": _unary("Log", positive),
    "Abs": _unary("Abs", away_from_zero),
    "Tanh": _unary("Tanh"),
    "Sigmoid": _unary("Sigmoid"),
    "Erf": _unary("Erf"),
    "Gelu": _unary("Gelu", attrs={"approximate": st.sampled_from(["none", "tanh"])}),
    "Sin": _unary("Sin"),
    "Cos": _unary("Cos"),
    "Softplus": _unary("Softplus"),
    "Elu": _unary("Elu", away_from_zero, {"alpha": st.sampled_from([1.0, 0.5, 2.0])}),
    "HardSigmoid": _unary(
        "HardSigmoid", _away_from(-2.5, 2.5, -1.0, 1.0, 1.5), {"alpha": st.sampled_from([0.2, 0.5])}
    ),
    "HardSwish": _unary("HardSwish", _away_from(-3.0, 3.0)),
    "Relu": _unary("Relu", away_from_zero),
    "LeakyRelu": _unary(
        "LeakyRelu", away_from_zero, {"alpha": st.floats(0.0, 0.5, allow_subnormal=False)}
    ),
    "Sum": _variadic("Sum", lambda rng, ss: [normal(rng, s) for s in ss]),
    "Mean": _variadic("Mean", lambda rng, ss: [normal(rng, s) for s in ss]),
    "Max": _variadic("Max", distinct),
    "Min": _variadic("Min", distinct),
    "Clip": _clip(),
}


def test_max_at_ties_splits_the_gradient():
    """At x0 == x1, Max is kinked; the split rule gives 1/2 to each input, which is
    also the central difference, and the shares add up to g."""
    x = normal(np.random.default_rng(1), (3, 4))
    grads = check_gradients(node_case("Max", [x, x.copy()]))
    np.testing.assert_allclose(grads["x0"], grads["x1"])


def test_max_of_one_value_used_twice_is_the_identity():
    x = normal(np.random.default_rng(2), (2, 3))
    node = helper.make_node("Max", ["x", "x"], ["y"])
    case = GradCase(nodes=(node,), inputs={"x": x}, outputs=("y",))
    check_gradients(case)
