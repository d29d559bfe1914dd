"""Trainable policy on torch.onnx (dynamo) provenance metadata."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tensoropt.passes.loss import LossKind
from tensoropt.passes.training_step import TrainingOptions
from tests.helpers.steps import step_proto

KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
FOLDED = "pkg.onnxscript.optimizer.folded_from"


def _model(meta: dict[str, dict[str, str]]):
    """y = ((x * cos_table) @ W) * scale + b; every initializer float, rank >= 1."""
    rng = np.random.default_rng(0)
    inits = {
        "cos_table": rng.uniform(-1, 1, (3, 4)),
        "W": rng.standard_normal((4, 2)),
        "scale": rng.standard_normal((2,)),
        "b": rng.standard_normal((2,)),
    }
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "cos_table"], ["r"]),
            helper.make_node("MatMul", ["r", "W"], ["h"]),
            helper.make_node("Mul", ["h", "scale"], ["s"]),
            helper.make_node("Add", ["s", "b"], ["y"]),
        ],
        "m",
        [x],
        [y],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    for name, props in meta.items():
        info = helper.make_tensor_value_info(name, TensorProto.FLOAT, list(inits[name].shape))
        helper.set_metadata_props(info, props)
        graph.value_info.append(info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _trained(meta) -> set[str]:
    _, step = step_proto(_model(meta), TrainingOptions(loss=LossKind.MSE))
    return set(step.signature.params)


def test_without_metadata_every_float_initializer_is_trained():
    assert _trained({}) == {"cos_table", "W", "scale", "b"}


def test_torch_buffers_are_frozen_and_parameters_trained():
    meta = {"scale": {KIND: "BUFFER"}, "W": {KIND: "PARAMETER"}}
    assert _trained(meta) == {"cos_table", "W", "b"}


def test_constants_folded_from_sin_or_cos_are_frozen():
    meta = {
        "cos_table": {FOLDED: "['arange', 'cos', 'inv_freq', 'mul', 'val_3']"},
        "W": {FOLDED: "['layers.0.q_proj.weight']"},  # a folded Transpose: still trained
        "scale": {FOLDED: "['sin_2', 'val_7']"},
    }
    assert _trained(meta) == {"W", "b"}


def test_constants_folded_from_an_activation_or_anonymous_values_are_frozen():
    """No parameter is a function of an activation (``r``, made by the graph's Mul: only
    its shape was read, as for an attention scale 1/sqrt(d)), nor of the exporter's
    anonymous values, tensor constructors and torch ops alone (a ``torch.zeros`` mask
    base made in forward, nn.LSTM's zero initial state, an ALiBi table)."""
    meta = {
        "scale": {FOLDED: "['r', 'val_43', 'val_44']"},
        "b": {FOLDED: "['val_8', 'val_10']"},
        "W": {FOLDED: "['layers.0.q_proj.weight', 'val_2']"},  # a parameter's torch name
        "cos_table": {FOLDED: "['val_0', 'zeros_2', 'val_14']"},  # torch.zeros in forward
    }
    assert _trained(meta) == {"W"}
    # torch's ops name what they make (BLOOM's ALiBi table: full, pow, arange, mul,
    # repeat): frozen; a name that is no such op may be a top-level parameter: trained
    alibi = "['full', 'pow_1', 'arange', 'mul', 'unsqueeze_1', 'repeat', 'val_2']"
    assert "cos_table" not in _trained({"cos_table": {FOLDED: alibi}})
    assert "cos_table" not in _trained({"cos_table": {FOLDED: "['where', 'val_1']"}})
    assert "cos_table" in _trained({"cos_table": {FOLDED: "['temperature', 'val_1']"}})
