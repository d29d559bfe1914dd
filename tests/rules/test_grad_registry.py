"""The gradient registry as a whole: every rule has a finite-difference test, tied
uses accumulate, non-differentiable ops stop the gradient, unknown ops are refused."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from grad_harness import GradCase, check_gradients, distinct, normal
from onnx import TensorProto, helper

from tensoropt.errors import UnsupportedOpError
from tensoropt.rules.grad import GRAD_RULES, build_registry
from tensoropt.rules.grad.api import GradRegistry

CASE_MODULES = (
    "test_grad_elementwise",
    "test_grad_matmul",
    "test_grad_reduce",
    "test_grad_shape",
    "test_grad_gather",
    "test_grad_nn",
    "test_grad_conv",
    "test_grad_misc",
)

REQUIRED = {
    "MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Exp",
    "Log", "Abs", "Tanh", "Erf", "Gelu", "Sigmoid", "Relu", "LeakyRelu", "Softmax",
    "LogSoftmax", "LayerNormalization", "ReduceMean", "ReduceSum", "ReduceMax", "Reshape",
    "Transpose", "Split", "Slice", "Concat", "Unsqueeze", "Squeeze", "Expand", "Flatten",
    "Gather", "GatherND", "GatherElements", "Where", "Cast", "Identity", "Dropout", "Conv",
    "MaxPool", "AveragePool", "GlobalAveragePool", "BatchNormalization", "Max", "Min", "Clip",
    "Sum", "Mean", "Einsum", "Trilu", "CumSum", "Tile",
}  # fmt: skip

NON_DIFFERENTIABLE = {
    "Shape", "Size", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or",
    "Not", "IsNaN", "IsInf", "ArgMax", "ArgMin", "Range", "ConstantOfShape", "Constant",
    "OneHot", "NonZero", "Sign", "Floor", "Ceil", "Round", "Mod",
}  # fmt: skip


def _tested_ops() -> set[str]:
    ops: set[str] = set()
    for name in CASE_MODULES:
        ops.update(importlib.import_module(name).CASES)
    return ops


def test_every_rule_has_a_finite_difference_test():
    untested = GRAD_RULES.differentiable() - _tested_ops()
    assert not untested, f"gradient rules without a finite-difference case: {sorted(untested)}"


def test_every_tested_op_has_a_rule():
    assert _tested_ops() <= GRAD_RULES.differentiable()


def test_registry_holds_the_required_ops():
    assert GRAD_RULES.differentiable() >= REQUIRED
    assert GRAD_RULES.non_differentiable() >= NON_DIFFERENTIABLE
    assert not GRAD_RULES.differentiable() & GRAD_RULES.non_differentiable()


def test_build_registry_is_fresh_and_complete():
    again = build_registry()
    assert again is not GRAD_RULES
    assert again.supported() == GRAD_RULES.supported()


def test_registering_an_op_twice_is_refused():
    registry = GradRegistry()
    registry.register("Foo")(lambda ctx: [])
    with pytest.raises(ValueError, match="Foo"):
        registry.register("Foo")(lambda ctx: [])


def _case(nodes, inputs, outputs=("y",)) -> GradCase:
    return GradCase(nodes=tuple(nodes), inputs=inputs, outputs=tuple(outputs))


@pytest.mark.parametrize(
    "nodes",
    [
        [helper.make_node("Mul", ["x", "x"], ["y"])],
        [helper.make_node("Add", ["x", "x"], ["y"])],
        [helper.make_node("Div", ["x", "x"], ["q"]), helper.make_node("Mul", ["q", "x"], ["y"])],
        [
            helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
            helper.make_node("MatMul", ["x", "xt"], ["y"]),
        ],
        [
            helper.make_node("Tanh", ["x"], ["t"]),
            helper.make_node("Exp", ["t"], ["e"]),
            helper.make_node("Mul", ["t", "e"], ["m"]),
            helper.make_node("Concat", ["m", "x", "t"], ["y"], axis=0),
        ],
    ],
    ids=["mul_x_x", "add_x_x", "div_then_mul", "matmul_x_xT", "diamond"],
)
def test_tied_uses_accumulate(nodes):
    x = normal(np.random.default_rng(0), (3, 3)) + 3.0  # away from 0 for Div
    check_gradients(_case(nodes, {"x": x}))


def test_comparison_and_shape_paths_carry_no_gradient():
    """y = x * float(x > 0) reshaped by Shape(x): only the direct x path differentiates."""
    x = distinct(np.random.default_rng(1), [(2, 3)], gap=0.2)[0]
    nodes = [
        helper.make_node(
            "Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.DOUBLE, [], [0.0])
        ),
        helper.make_node("Greater", ["x", "zero"], ["pos"]),
        helper.make_node("Cast", ["pos"], ["mask"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["x", "mask"], ["m"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Flatten", ["m"], ["flat"], axis=0),
        helper.make_node("Reshape", ["flat", "shape"], ["y"]),
    ]
    check_gradients(_case(nodes, {"x": x}))


def test_argmax_index_path_carries_no_gradient():
    x = distinct(np.random.default_rng(2), [(4, 3)])[0]
    nodes = [
        helper.make_node("ArgMax", ["x"], ["i"], axis=0, keepdims=0),
        helper.make_node("Gather", ["x", "i"], ["y"], axis=0),
    ]
    check_gradients(_case(nodes, {"x": x}))


def test_op_without_rule_is_refused_with_its_name():
    x = normal(np.random.default_rng(0), (3, 3))
    case = _case([helper.make_node("Det", ["x"], ["y"])], {"x": x})
    with pytest.raises(UnsupportedOpError, match="Det"):
        check_gradients(case)
