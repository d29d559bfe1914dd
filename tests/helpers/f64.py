"""Convert a float32 ONNX model to float64, for finite-difference checks."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper


def _convert_tensor(t: TensorProto) -> None:
    if t.data_type != TensorProto.FLOAT:
        return
    array = numpy_helper.to_array(t).astype(np.float64)
    t.CopyFrom(numpy_helper.from_array(array, t.name))


def _convert_type(vi) -> None:
    tt = vi.type.tensor_type
    if tt.elem_type == TensorProto.FLOAT:
        tt.elem_type = TensorProto.DOUBLE


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every float32 tensor, type and Cast target made float64."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for t in g.initializer:
        _convert_tensor(t)
    for vi in [*g.input, *g.output, *g.value_info]:
        _convert_type(vi)
    for node in g.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                _convert_tensor(attr.t)
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
    return m
