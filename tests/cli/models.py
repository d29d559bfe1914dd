"""Small hand-built ONNX models for the CLI, compile and collective-count tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 20)]

# The Megatron MLP block of the collective-count tests: x -> MatMul W0 -> MatMul W1
# (+b1) -> Gelu -> MatMul W2 (+b2) -> y. Batch B, width D, inner width H.
B, D, H = 8, 8, 16


def _init(rng: np.random.Generator, name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array((0.3 * rng.standard_normal(shape)).astype(np.float32), name)


def mlp_block(batch: int = B, width: int = D, inner: int = H) -> onnx.ModelProto:
    """x[batch, width] -> W0 -> W1 (+b1) -> Gelu -> W2 (+b2) -> y[batch, width]."""
    rng = np.random.default_rng(0)
    inits = [
        _init(rng, "W0", width, width),
        _init(rng, "W1", width, inner),
        _init(rng, "b1", inner),
        _init(rng, "W2", inner, width),
        _init(rng, "b2", width),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h0"], name="mm0"),
        helper.make_node("MatMul", ["h0", "W1"], ["h1"], name="mm1"),
        helper.make_node("Add", ["h1", "b1"], ["h1b"], name="add1"),
        helper.make_node("Gelu", ["h1b"], ["g"], name="gelu"),
        helper.make_node("MatMul", ["g", "W2"], ["h2"], name="mm2"),
        helper.make_node("Add", ["h2", "b2"], ["y"], name="add2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)


def megatron_block_plan(tp: int) -> dict:
    """The canonical Megatron plan of :func:`mlp_block` on a 1-D tp mesh (plan JSON).

    W1 column-parallel, W2 row-parallel, the output all-reduced before the bias b2;
    W0 and the data stay replicated (default ``replicated``: a plan file cannot carry
    ``data_axes``, see the report).
    """
    return {
        "schema": "tensoropt.plan/1",
        "source": "test: canonical megatron MLP block",
        "mesh": {"shape": [tp], "axis_names": ["tp"]},
        "default": "replicated",
        "units": {
            "mm1": {"inputs": ["R", "S(1)"], "outputs": ["S(1)"]},
            "mm2": {"inputs": ["S(1)", "S(0)"], "outputs": ["P"]},
            "add2": {"inputs": ["R", "R"], "outputs": ["R"]},
        },
    }


def unsupported_ops_model() -> onnx.ModelProto:
    """MatMul, a custom-domain op, two Det nodes and a NonMaxSuppression."""
    rng = np.random.default_rng(1)
    inits = [
        _init(rng, "W", 4, 4),
        numpy_helper.from_array(np.zeros((1, 4, 4), np.float32), "boxes"),
        numpy_helper.from_array(np.zeros((1, 1, 4), np.float32), "scores"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Foo", ["h"], ["f"], domain="com.acme", name="acme_foo"),
        helper.make_node("Det", ["f"], ["d"], name="det_a"),
        helper.make_node("Det", ["h"], ["d2"], name="det_b"),
        helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["sel"], name="nms"),
        helper.make_node("Add", ["d", "d2"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "unsupported",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("sel", TensorProto.INT64, [None, 3]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[*OPSET, helper.make_opsetid("com.acme", 1)])


def dynamic_batch_model() -> onnx.ModelProto:
    """x['batch', 4] -> MatMul W -> y: the batch dimension is a dim_param."""
    rng = np.random.default_rng(2)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "dynamic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [_init(rng, "W", 4, 4)],
    )
    return helper.make_model(graph, opset_imports=OPSET)


def relu_only_model() -> onnx.ModelProto:
    """No initializer at all: nothing to train."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    return helper.make_model(graph, opset_imports=OPSET)


def scaled_model() -> onnx.ModelProto:
    """x -> MatMul W -> Mul scale (a rank-0 float: not trained by default) -> y."""
    rng = np.random.default_rng(3)
    inits = [_init(rng, "W", 4, 3), numpy_helper.from_array(np.float32(1.5), "scale")]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
            helper.make_node("Mul", ["h", "scale"], ["y"], name="mul"),
        ],
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)
