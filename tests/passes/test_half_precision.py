"""A float16 model trains: an embedding's gradient (a ScatterND add, which onnxruntime's
CPU kernels do not run in float16) accumulates in float32 and is cast back once
(``rules/grad/gather._added``); the step equals a float64 reference rounded to float16,
and a data-parallel plan verifies against the single-device step."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from tensoropt.passes.loss import LossKind
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
from tensoropt.passes.training_step import TrainingOptions
from tensoropt.runtime.run import run_steps
from tensoropt.runtime.single import StepSession
from tests.helpers.compile import compile_model
from tests.helpers.steps import step_proto

VOCAB, WIDTH, CLASSES, BATCH, SEQ = 6, 4, 5, 4, 8


def _model(rng) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float16)
    weight = rng.standard_normal((WIDTH, CLASSES)).astype(np.float16)
    nodes = [
        h.make_node("Gather", ["table", "ids"], ["x"], name="embed"),
        h.make_node("MatMul", ["x", "weight"], ["y"], name="project"),
        h.make_node("Cast", ["y"], ["logits"], name="widen", to=T.FLOAT),
    ]
    graph = h.make_graph(
        nodes,
        "half",
        [h.make_tensor_value_info("ids", T.INT64, [BATCH, SEQ])],
        [h.make_tensor_value_info("logits", T.FLOAT, [BATCH, SEQ, CLASSES])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(weight, "weight")],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)]), table, weight


def test_a_float16_embedding_trains_and_its_gradient_sums_in_float32():
    rng = np.random.default_rng(0)
    model, table, weight = _model(rng)
    ids = rng.integers(0, 2, (BATCH, SEQ))  # every row read many times over
    labels = rng.integers(0, CLASSES, (BATCH, SEQ))
    sgd = OptimizerOptions(OptimizerKind.SGD, lr=1.0, momentum=0.0)
    proto, _ = step_proto(model, TrainingOptions(LossKind.CE, sgd))
    session = StepSession(proto)
    state = session.initial_state()
    loss, new = session.step(state, {"ids": ids, "labels": labels})

    # float64 reference: mean cross entropy over every position
    x = table.astype(np.float64)[ids]
    logits = x @ weight.astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want_loss = -np.log(np.take_along_axis(p, labels[..., None], -1)).mean()
    dlogits = (p - np.eye(CLASSES)[labels]) / (BATCH * SEQ)
    dx = dlogits @ weight.astype(np.float64).T
    dtable = np.zeros((VOCAB, WIDTH))
    np.add.at(dtable, ids, dx)
    assert loss == pytest.approx(want_loss, rel=1e-3)  # the logits rounded to float16 once
    assert new["table"].dtype == np.float16
    got = table.astype(np.float64) - new["table"].astype(np.float64)
    # one float16 rounding of the summed gradient (and of the update), not one per row
    np.testing.assert_allclose(got, dtable, rtol=5e-3, atol=2e-3)
    assert np.abs(dtable[2:]).max() == 0 and np.abs(got[2:]).max() == 0
    # the scatter itself adds float32 (onnxruntime would otherwise have to insert the
    # casts itself, which it does in one session and not in a rank's segments)
    typed = onnx.shape_inference.infer_shapes(proto)
    types = {v.name: v.type.tensor_type.elem_type for v in typed.graph.value_info}
    scatters = [n for n in typed.graph.node if n.op_type == "ScatterND"]
    assert scatters and all(types[n.input[2]] == T.FLOAT for n in scatters)


def test_a_data_parallel_plan_of_a_float16_embedding_verifies(tmp_path):
    model, _, _ = _model(np.random.default_rng(1))
    compile_model(model, "data-parallel", "2", tmp_path / "out")
    report = run_steps(tmp_path / "out", 3, "local", verify=True, threads=1).verify
    assert report is not None and len(report.per_step) == 3
    assert report.max_rel_error_loss <= 1e-4, report.to_json()
    assert report.max_rel_error_params <= 1e-4, report.to_json()
