"""Shape inference without the weights (importer and training step) changes nothing
but its cost: the step graph is byte-identical to inference over the full weights."""

from __future__ import annotations

import onnx
import pytest

import tensoropt.ir.importer as importer
import tensoropt.passes.training_step as training_step
from tensoropt.ir.importer import SHAPE_ONLY_BYTES, export_model, without_large_weights
from tensoropt.models import build_model
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tests.helpers.steps import import_proto


def _big_gpt() -> onnx.ModelProto:
    # wte 512 x 128 float32 = 256 KiB: above the shape-only threshold
    return build_model("gpt", "tiny", hidden=128, heads=4, vocab=512)


def test_large_float_initializers_are_data_free_and_small_ones_kept():
    model = _big_gpt()
    light = without_large_weights(model)
    assert [t.name for t in light.graph.initializer] == [t.name for t in model.graph.initializer]
    stripped = 0
    for full, stub in zip(model.graph.initializer, light.graph.initializer, strict=True):
        assert list(stub.dims) == list(full.dims) and stub.data_type == full.data_type
        if stub.data_location == onnx.TensorProto.EXTERNAL:
            stripped += 1
            assert len(full.raw_data) > SHAPE_ONLY_BYTES and not stub.raw_data
        else:
            assert stub == full
    assert stripped >= 1
    assert list(light.graph.node) == list(model.graph.node)
    assert light.opset_import == model.opset_import and light.ir_version == model.ir_version
    assert light.metadata_props == model.metadata_props


def test_imported_shapes_equal_full_weight_inference():
    model = _big_gpt()
    full = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    ours = importer._infer(onnx.ModelProto.FromString(model.SerializeToString()), "m.onnx")
    assert list(ours.graph.value_info) == list(full.graph.value_info)
    assert list(ours.graph.output) == list(full.graph.output)
    assert list(ours.graph.initializer) == list(model.graph.initializer)  # weights intact


@pytest.mark.parametrize("kind", [OptimizerKind.SGD, OptimizerKind.ADAM])
def test_training_step_is_byte_identical_to_full_weight_inference(kind, monkeypatch):
    options = TrainingOptions(optimizer=OptimizerOptions(kind, lr=1e-3))
    light = export_model(build_training_step(import_proto(_big_gpt()), options).model)
    monkeypatch.setattr(training_step, "_detach_large_weights", lambda graph: {})
    monkeypatch.setattr(importer, "without_large_weights", lambda model: model)
    full = export_model(build_training_step(import_proto(_big_gpt()), options).model)
    assert light.SerializeToString() == full.SerializeToString()
