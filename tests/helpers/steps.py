"""Build zoo models and their training steps for tests."""

from __future__ import annotations

import os
import tempfile

import onnx

from tensoropt.cli.common import supported_ops
from tensoropt.ir.importer import ImportOptions, export_model, import_model
from tensoropt.models import build_model
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tensoropt.rules.grad import GRAD_RULES

# zoo models whose partitioned equivalence cases take 15-30 s each: the equivalence
# tests run them on fewer meshes or stages (their data-parallel split is resnet50's)
HEAVY_MODELS = ("inception_v3", "wide_resnet")


def import_proto(proto: onnx.ModelProto):
    """Import an in-memory model through the real file path of the importer."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save(proto, path)
        return import_model(path, ImportOptions(supported_ops=supported_ops(GRAD_RULES)))


def step_proto(proto: onnx.ModelProto, options: TrainingOptions | None = None):
    """(training-step ModelProto, TrainingStep) for an in-memory forward model."""
    step = build_training_step(import_proto(proto), options or TrainingOptions())
    return export_model(step.model), step


def zoo_step(name: str, options: TrainingOptions | None = None, **knobs):
    return step_proto(build_model(name, "tiny", **knobs), options)
