"""A model that names a value as the training step names its own (``loss``, ``labels``)
trains and shards: the model's value is renamed, the step's is defined once."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensoropt.cli import main


def _own_loss_model(path, loss_name: str = "loss") -> None:
    """MatMul, then the model's own SoftmaxCrossEntropyLoss whose output is ``loss_name``."""
    w = numpy_helper.from_array(np.random.RandomState(0).randn(4, 3).astype(np.float32), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [8])
    out = helper.make_tensor_value_info(loss_name, TensorProto.FLOAT, [])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["logits"], name="mm"),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], [loss_name], name="sce"),
    ]
    graph = helper.make_graph(nodes, "g", [x, y], [out], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_a_models_own_value_named_loss_trains_and_shards(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    _own_loss_model(path)
    assert main(["train", str(path), "--steps", "2"]) == 0, capsys.readouterr().err
    out = tmp_path / "o"
    assert main(["compile", str(path), "--devices", "2", "-o", str(out)]) == 0
    assert main(["run", str(out), "--steps", "3", "--verify", "--threads", "1"]) == 0


@pytest.mark.parametrize("name", ["loss", "labels"])
def test_an_input_with_the_steps_name_is_refused(tmp_path, capsys, name):
    """A graph input the step would define again cannot be renamed (it is fed by name)."""
    path = tmp_path / "m.onnx"
    x = helper.make_tensor_value_info(name, TensorProto.FLOAT, [8, 4])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [8, 3])
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "W")
    node = helper.make_node("MatMul", [name, "W"], ["logits"], name="mm")
    graph = helper.make_graph([node], "g", [x], [out], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    capsys.readouterr()
    assert main(["train", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"input or initializer {name!r}" in err[0], err
