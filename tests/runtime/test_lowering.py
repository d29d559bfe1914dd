"""Row sums written as a ones-row MatMul for onnxruntime: same values, the first axes only."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from tensoropt.runtime.lowering import lower_row_sums
from tensoropt.runtime.split import split_graph
from tests.helpers.handbuilt import mlp_case


def _reduce_model(
    shape, axes, keepdims=1, *, opset=17, dtype=TensorProto.FLOAT, constant_node=False
) -> onnx.ModelProto:
    """x -> Relu -> ReduceSum(axes) -> y, the axes as an initializer, a Constant node or
    (opset < 13) an attribute."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")]
    inits = []
    attrs = {"keepdims": keepdims}
    if opset < 13:
        nodes.append(helper.make_node("ReduceSum", ["r"], ["y"], name="sum", axes=axes, **attrs))
    else:
        axes_t = numpy_helper.from_array(np.array(axes, np.int64), "axes")
        if constant_node:
            nodes.insert(0, helper.make_node("Constant", [], ["axes"], value=axes_t))
        else:
            inits.append(axes_t)
        nodes.append(helper.make_node("ReduceSum", ["r", "axes"], ["y"], name="sum", **attrs))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", dtype, list(shape))],
        [helper.make_tensor_value_info("y", dtype, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=2, max_size=4),
    outer=st.integers(1, 3),
    keepdims=st.sampled_from([0, 1]),
    negative=st.booleans(),
    form=st.sampled_from(["initializer", "constant", "attribute"]),
)
def test_lowered_row_sum_computes_the_same_values(shape, outer, keepdims, negative, form):
    outer = min(outer, len(shape) - 1)
    rank = len(shape)
    axes = [a - rank if negative else a for a in range(outer)][::-1]
    model = _reduce_model(
        shape,
        axes,
        keepdims,
        opset=11 if form == "attribute" else 17,
        constant_node=form == "constant",
    )
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    lowered = lower_row_sums(model)
    expected = _run(model, x)
    got = _run(lowered, x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    rows = int(np.prod(shape[:outer]))
    if rows > 1 and int(np.prod(shape)) >= 4096:
        assert "ReduceSum" not in _ops(lowered)
        assert _ops(lowered).count("MatMul") == 1
    else:
        assert lowered is model


@pytest.mark.parametrize(
    ("shape", "axes", "dtype"),
    [
        ((16, 64, 8, 8), [0, 2, 3], TensorProto.FLOAT),  # not a run of first axes
        ((8, 64, 256), [2], TensorProto.FLOAT),  # the last axis: already the fast path
        ((8, 64, 256), [0, 1, 2], TensorProto.FLOAT),  # every axis: nothing is kept
        ((8, 64, 256), [0, 1], TensorProto.DOUBLE),  # float32 only
    ],
)
def test_other_reductions_are_kept(shape, axes, dtype):
    model = _reduce_model(shape, axes, dtype=dtype)
    assert lower_row_sums(model) is model


def test_dynamic_shape_is_kept():
    model = _reduce_model(("batch", 64, 256), [0, 1])
    assert lower_row_sums(model) is model


def test_new_names_do_not_collide_with_the_graph():
    model = _reduce_model((4, 64, 256), [0, 1])
    model.graph.initializer.append(
        numpy_helper.from_array(np.zeros(3, np.float32), "rowsum_ones_256")
    )
    lowered = lower_row_sums(model)
    names = [t.name for t in lowered.graph.initializer]
    assert len(names) == len(set(names))
    x = np.random.default_rng(1).standard_normal((4, 64, 256)).astype(np.float32)
    np.testing.assert_allclose(_run(lowered, x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_split_segments_carry_the_lowered_form():
    """A data-parallel step's bias gradients are row sums; the segments onnxruntime runs
    hold them as MatMuls, and the device graph itself keeps its ReduceSums."""
    case = mlp_case(dp=2, tp=1, batch=128, d=16, h=128)
    device = case.devices[0]
    fed = {v.name for v in case.values}
    before = _ops(device).count("ReduceSum")
    plan = split_graph(device, 0, case.world_size, fed)
    ops = [n.op_type for s in plan.stages if s.segment for n in s.segment.model.graph.node]
    lowered = [
        n.name
        for s in plan.stages
        if s.segment
        for n in s.segment.model.graph.node
        if n.name.endswith("__matmul")
    ]
    assert before > 0 and lowered
    assert ops.count("ReduceSum") == before - len(lowered)
    assert _ops(device).count("ReduceSum") == before
