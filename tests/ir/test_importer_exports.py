"""Importer fixes for torch.onnx (dynamo) exports: folded transposed copies are re-tied,
and equal folded copies of one parameter are one initializer."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.steps import import_proto

FOLDED = "pkg.onnxscript.optimizer.folded_from"


def _tied_model(copy: np.ndarray, folded_from: str):
    """Embedding table E [6, 4] used by Gather, and a folded copy used by MatMul."""
    table = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3, 6])
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
            helper.make_node("MatMul", ["h", "val_9"], ["logits"], name="lm_head"),
        ],
        "tied",
        [ids],
        [out],
        [numpy_helper.from_array(table, "E"), numpy_helper.from_array(copy, "val_9")],
    )
    info = helper.make_tensor_value_info("val_9", TensorProto.FLOAT, list(copy.shape))
    helper.set_metadata_props(info, {FOLDED: folded_from})
    graph.value_info.append(info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), table


def test_transposed_copy_of_a_used_initializer_becomes_a_transpose():
    proto, table = _tied_model(np.zeros((4, 6), np.float32), "['E']")
    proto.graph.initializer[1].CopyFrom(numpy_helper.from_array(table.T.copy(), "val_9"))
    graph = import_proto(proto).graph
    assert "val_9" not in graph.initializers
    producer = graph.node("lm_head").inputs[1].producer()
    assert producer is not None and producer.op_type == "Transpose"
    assert producer.inputs[0] is graph.initializers["E"]
    assert producer.metadata_props["tensoropt.role"] == "forward"


def test_copy_that_is_not_the_transpose_stays_an_initializer():
    table = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    graph = import_proto(_tied_model(table, "['E']")[0]).graph
    assert "val_9" in graph.initializers


def test_copy_folded_from_several_values_stays_an_initializer():
    proto, table = _tied_model(np.zeros((4, 6), np.float32), "['E', 'val_3']")
    proto.graph.initializer[1].CopyFrom(numpy_helper.from_array(table.T.copy(), "val_9"))
    assert "val_9" in import_proto(proto).graph.initializers


def _shared_model(first: np.ndarray, second: np.ndarray, sources=("['w']", "['w']")):
    """Two MatMuls reading two folded copies of one parameter (ALBERT's one layer, run
    once per layer, folds its transposed weight once per use)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "val_1"], ["h"], name="layer_0"),
            helper.make_node("MatMul", ["h", "val_2"], ["y"], name="layer_1"),
        ],
        "shared",
        [x],
        [out],
        [numpy_helper.from_array(first, "val_1"), numpy_helper.from_array(second, "val_2")],
    )
    for name, array, source in zip(("val_1", "val_2"), (first, second), sources, strict=True):
        info = helper.make_tensor_value_info(name, TensorProto.FLOAT, list(array.shape))
        helper.set_metadata_props(info, {FOLDED: source})
        graph.value_info.append(info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_equal_copies_of_one_parameter_are_one_initializer():
    w = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    graph = import_proto(_shared_model(w, w.copy())).graph
    assert "val_2" not in graph.initializers
    assert graph.node("layer_1").inputs[1] is graph.initializers["val_1"]


def test_copies_that_differ_or_come_from_other_sources_stay_apart():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    for proto in (
        _shared_model(w, w.T.copy()),  # other values
        _shared_model(w, w.copy(), ("['w']", "['v']")),  # other sources
        _shared_model(np.ones((4, 4), np.float32), np.ones((4, 4), np.float32)),  # constant
    ):
        assert {"val_1", "val_2"} <= set(import_proto(proto).graph.initializers)


def test_train_mode_dropout_gets_a_mask_output_and_a_gradient():
    """torch train()-mode exports: Dropout(x, ratio, training_mode=True), no mask output."""
    from tensoropt.passes.loss import LossKind
    from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
    from tensoropt.passes.training_step import TrainingOptions
    from tensoropt.runtime.single import StepSession
    from tests.helpers.steps import step_proto

    n, ratio = 64, 0.5
    rng = np.random.default_rng(0)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["h"]),
            helper.make_node("Dropout", ["h", "ratio", "training"], ["y"], name="drop"),
        ],
        "drop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array(ratio, np.float32), "ratio"),
            numpy_helper.from_array(np.array(True), "training"),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    node = import_proto(proto).graph.node("drop")
    assert len(node.outputs) == 2 and node.outputs[0].name == "y"
    sgd = OptimizerOptions(OptimizerKind.SGD, lr=1.0, momentum=0.0)
    step, _ = step_proto(proto, TrainingOptions(loss=LossKind.MSE, optimizer=sgd))
    session = StepSession(step)
    x = rng.uniform(0.5, 1.5, n).astype(np.float32)
    state = session.initial_state()
    _, new = session.step(state, {"x": x, "labels": np.zeros(n, np.float32)})
    grad = state["w"] - new["w"]
    # loss = mean(y^2), y = m * x * w / (1 - p): the gradient is 0 where dropped
    kept = 2 * x * x * w / (1 - ratio) ** 2 / n
    dropped = np.isclose(grad, 0.0, atol=1e-7)
    np.testing.assert_allclose(grad[~dropped], kept[~dropped], rtol=1e-5)
    assert 0 < dropped.sum() < n
