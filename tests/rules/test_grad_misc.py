"""Finite-difference property tests of Where, Cast, Identity, Dropout, Trilu, CumSum."""

from __future__ import annotations

import numpy as np
import onnx
from grad_harness import (
    Const,
    GradCase,
    broadcastable_to,
    build_grad_model,
    make_model,
    make_runner,
    node_case,
    normal,
    rng_of,
    shapes,
)
from hypothesis import strategies as st
from onnx import TensorProto, helper


@st.composite
def _where(draw):
    """Broadcast condition, x and y; the condition constant or a bool input."""
    rng = rng_of(draw)
    out = draw(shapes(0, 3))
    cond = rng.random(draw(broadcastable_to(out))) < 0.5
    x, y = normal(rng, draw(broadcastable_to(out))), normal(rng, draw(broadcastable_to(out)))
    return node_case("Where", [Const(cond) if draw(st.booleans()) else cond, x, y])


@st.composite
def _cast(draw):
    """float64 -> float64 passes the gradient; int -> float64 carries none (the int input
    feeds a Mul with a float input, which still gets its gradient)."""
    rng = rng_of(draw)
    shape = draw(shapes(0, 3))
    if draw(st.booleans()):
        return node_case("Cast", [normal(rng, shape)], {"to": TensorProto.DOUBLE})
    ints = rng.integers(-3, 4, shape).astype(np.int64)
    nodes = (
        helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["kf", "x"], ["y"]),
    )
    return GradCase(nodes=nodes, inputs={"k": ints, "x": normal(rng, shape)}, outputs=("y",))


@st.composite
def _identity(draw):
    rng = rng_of(draw)
    return node_case("Identity", [normal(rng, draw(shapes(0, 3)))])


@st.composite
def _dropout(draw):
    """Inactive forms: no extra inputs, a ratio, training_mode false, ratio 0 in training."""
    rng = rng_of(draw)
    x = normal(rng, draw(shapes(1, 3)))
    form = draw(st.sampled_from(["plain", "ratio", "eval", "train_ratio0"]))
    args = {
        "plain": [x],
        "ratio": [x, Const(np.asarray(0.3))],
        "eval": [x, Const(np.asarray(0.3)), Const(np.asarray(False))],
        "train_ratio0": [x, Const(np.asarray(0.0)), Const(np.asarray(True))],
    }[form]
    outputs = draw(st.sampled_from([1, 2]))
    return node_case("Dropout", args, num_outputs=outputs, loss_outputs=[0])


@st.composite
def _trilu(draw):
    rng = rng_of(draw)
    shape = (*draw(shapes(0, 1)), draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    args = [normal(rng, shape)]
    if draw(st.booleans()):
        args.append(Const(np.asarray(draw(st.integers(-3, 3)), dtype=np.int64)))
    return node_case("Trilu", args, {"upper": draw(st.integers(0, 1))})


@st.composite
def _cumsum(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 3))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    attrs = {"exclusive": draw(st.integers(0, 1)), "reverse": draw(st.integers(0, 1))}
    return node_case("CumSum", [normal(rng, shape), Const(np.asarray(axis, dtype=np.int64))], attrs)


CASES = {
    "Where": _where(),
    "Cast": _cast(),
    "Identity": _identity(),
    "Dropout": _dropout(),
    "Trilu": _trilu(),
    "CumSum": _cumsum(),
}


def _gradient_run(case: GradCase, seed: int = 0):
    gm = build_grad_model(case, make_model(case), np.random.default_rng(seed))
    runner, _ = make_runner(gm.proto)
    names = [o.name for o in gm.proto.graph.output]
    return gm, dict(zip(names, runner(dict(case.inputs)), strict=True))


def test_cast_to_float32_passes_the_gradient_back_as_float64():
    """d/dx of sum(float32(x) * R) is R (rounded to float32), returned as float64."""
    x = normal(np.random.default_rng(0), (3, 2))
    case = node_case("Cast", [x], {"to": TensorProto.FLOAT})
    gm, out = _gradient_run(case)
    assert out["grad__x0"].dtype == np.float64
    np.testing.assert_array_equal(out["grad__x0"], gm.weights["y0"].astype(np.float64))
    onnx.checker.check_model(gm.proto, full_check=True)


def test_active_dropout_uses_the_mask():
    """Training-mode Dropout: dx = g * mask / (1 - ratio), with the node's own mask."""
    x = normal(np.random.default_rng(0), (4, 5))
    case = node_case(
        "Dropout",
        [x, Const(np.asarray(0.25)), Const(np.asarray(True))],
        {"seed": 7},
        num_outputs=2,
        loss_outputs=[0],
    )
    gm, out = _gradient_run(case)
    mask = out["y1"]
    assert 0 < mask.sum() < mask.size
    np.testing.assert_allclose(out["grad__x0"], gm.weights["y0"] * mask / 0.75, rtol=1e-12)
