"""Finite-difference property tests of MatMul, Gemm and Einsum gradients."""

from __future__ import annotations

import numpy as np
from grad_harness import (
    GradCase,
    broadcastable_to,
    build_grad_model,
    check_gradients,
    make_model,
    node_case,
    normal,
    rng_of,
    shapes,
)
from hypothesis import strategies as st
from onnx import helper


@st.composite
def _matmul(draw):
    """N-D batched with broadcasting, 1-D operands on either side."""
    rng = rng_of(draw)
    n, k, m = (draw(st.integers(1, 4)) for _ in range(3))
    batch = draw(shapes(0, 2, 1, 3))
    a_1d, b_1d = draw(st.booleans()), draw(st.booleans())
    a_shape = (k,) if a_1d else (*draw(broadcastable_to(batch)), n, k)
    b_shape = (k,) if b_1d else (*draw(broadcastable_to(batch)), k, m)
    return node_case("MatMul", [normal(rng, a_shape), normal(rng, b_shape)])


@st.composite
def _gemm(draw):
    rng = rng_of(draw)
    m, n, k = (draw(st.integers(1, 4)) for _ in range(3))
    ta, tb = draw(st.integers(0, 1)), draw(st.integers(0, 1))
    attrs = {"transA": ta, "transB": tb}
    if draw(st.booleans()):
        attrs["alpha"] = draw(st.sampled_from([0.5, 2.0, -1.5]))
    args = [normal(rng, (k, m) if ta else (m, k)), normal(rng, (n, k) if tb else (k, n))]
    if draw(st.booleans()):
        args.append(normal(rng, draw(broadcastable_to((m, n)))))
        if draw(st.booleans()):
            attrs["beta"] = draw(st.sampled_from([0.5, 3.0]))
    return node_case("Gemm", args, attrs)


_EQUATIONS = [
    "ij,jk->ik",
    "bij,bjk->bik",
    "ij->ji",
    "ijk->ik",
    "i,j->ij",
    "bhqd,bhkd->bhqk",
    "ij,jk->i",
    "ij,jk,kl->il",
    "ijk,ik->ij",
]


@st.composite
def _einsum(draw):
    rng = rng_of(draw)
    equation = draw(st.sampled_from(_EQUATIONS))
    letters = sorted(set(equation) - set(",->"))
    sizes = {c: draw(st.integers(1, 3)) for c in letters}
    terms = equation.split("->")[0].split(",")
    args = [normal(rng, tuple(sizes[c] for c in t)) for t in terms]
    return node_case("Einsum", args, {"equation": equation})


CASES = {"MatMul": _matmul(), "Gemm": _gemm(), "Einsum": _einsum()}


def test_linear_weight_gradient_is_one_2d_matmul():
    """[b, s, k] @ [k, n]: the weight gradient folds the batch into rows (no batched
    product followed by a ReduceSum)."""
    rng = np.random.default_rng(0)
    case = node_case("MatMul", [normal(rng, (2, 3, 4)), normal(rng, (4, 5))], frozen=[0])

    gm = build_grad_model(case, make_model(case), rng)
    backward = [n.op_type for n in gm.new_nodes if n.metadata_props["tensoropt.role"] == "backward"]
    assert backward.count("MatMul") == 1
    assert "ReduceSum" not in backward
    check_gradients(case)


def test_matmul_with_its_own_transpose_accumulates():
    """y = x @ x^T uses x twice; both contributions must add up."""
    x = normal(np.random.default_rng(3), (3, 4))
    nodes = (
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "xt"], ["y"]),
    )
    check_gradients(GradCase(nodes=nodes, inputs={"x": x}, outputs=("y",)))
