"""Finite-difference property tests of the Reduce* gradient rules."""

from __future__ import annotations

import numpy as np
import pytest
from grad_harness import (
    Const,
    away_from_zero,
    build_grad_model,
    check_gradients,
    distinct,
    make_model,
    make_runner,
    node_case,
    normal,
    rng_of,
    shapes,
)
from hypothesis import strategies as st


def _reduction(op: str, make):
    """Random axes (incl. negative, or absent), keepdims, noop_with_empty_axes."""

    @st.composite
    def case(draw):
        rng = rng_of(draw)
        shape = draw(shapes(1, 4))
        rank = len(shape)
        axes = draw(st.lists(st.integers(0, rank - 1), unique=True, max_size=rank))
        axes = [a - rank if draw(st.booleans()) else a for a in axes]
        attrs = {"keepdims": draw(st.integers(0, 1))}
        if not axes and draw(st.booleans()):
            attrs["noop_with_empty_axes"] = 1
        form = draw(st.sampled_from(["input", "absent"])) if not axes else "input"
        args = [make(rng, shape)]
        if form == "input":
            args.append(Const(np.asarray(axes, dtype=np.int64)))
        return node_case(op, args, attrs)

    return case()


def _distinct(rng, shape):
    return distinct(rng, [shape])[0]


CASES = {
    "ReduceSum": _reduction("ReduceSum", normal),
    "ReduceMean": _reduction("ReduceMean", normal),
    "ReduceMax": _reduction("ReduceMax", _distinct),
    "ReduceMin": _reduction("ReduceMin", _distinct),
    "ReduceSumSquare": _reduction("ReduceSumSquare", normal),
    "ReduceL1": _reduction("ReduceL1", away_from_zero),
    "ReduceL2": _reduction("ReduceL2", away_from_zero),
    "ReduceLogSumExp": _reduction("ReduceLogSumExp", normal),
}


def test_reduce_mean_with_axes_attribute_of_older_opsets():
    """ReduceMean-13 carried axes as an attribute; the rule reads either form."""
    x = normal(np.random.default_rng(0), (2, 3, 4))
    check_gradients(node_case("ReduceMean", [x], {"axes": [0, -1], "keepdims": 0}, opset=17))


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_ties_share_the_gradient_equally(op):
    """Exact ties: every tied position gets g / (number of ties)."""
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    x = x if op == "ReduceMax" else -x

    case = node_case(op, [x, Const(np.array([1]))], {"keepdims": 0})
    gm = build_grad_model(case, make_model(case), np.random.default_rng(0))
    runner, _ = make_runner(gm.proto)
    names = [o.name for o in gm.proto.graph.output]
    grad = dict(zip(names, runner({"x0": x}), strict=True))["grad__x0"]
    weight = gm.weights["y0"]
    ties = (
        (x == x.max(axis=1, keepdims=True))
        if op == "ReduceMax"
        else (x == x.min(axis=1, keepdims=True))
    )
    expected = ties * (weight[:, None] / ties.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(grad, expected, rtol=1e-12)
