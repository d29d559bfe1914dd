"""MaxPool with an Indices output splits the batch and channels only when every reader
takes the indices modulo the input's spatial plane (what MaxPool's gradient rule reads):
a split's offsets cancel there, and nowhere else."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from tensoropt.ir.layout import Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.passes.sharding_adapter import candidates, op_view
from tests.helpers.steps import import_proto


def _pool(reader: str, divisor: int) -> onnx.ModelProto:
    pool = helper.make_node(
        "MaxPool", ["x"], ["y", "idx"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
    )
    nodes = [pool, helper.make_node("Constant", [], ["d"], value_int=divisor)]
    if reader == "Mod":
        nodes.append(helper.make_node("Mod", ["idx", "d"], ["i"], name="read"))
    else:
        nodes.append(helper.make_node("Add", ["idx", "d"], ["i"], name="read"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2, 4, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2, 2, 2]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [4, 2, 2, 2]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize(
    ("reader", "divisor", "splits"),
    [("Mod", 16, True), ("Mod", 8, False), ("Add", 16, False)],
)
def test_indices_split_only_where_read_modulo_the_plane(reader, divisor, splits):
    model = import_proto(_pool(reader, divisor))
    node = next(n for n in model.graph if n.op_type == "MaxPool")
    assert op_view(node).reduced_indices is splits
    found = candidates(node, Mesh((2,), ("dp",)))
    batch = [s for s in found if s.inputs[0].placements == (Shard(0),)]
    assert bool(batch) is splits
