"""Reading the torch call an exported node came from (``ir/torch_calls``)."""

from __future__ import annotations

import onnx_ir as ir

from tensoropt.ir.torch_calls import FX_NODE_KEY, aten_call, float_arg, int_arg


def _node(text: str | None) -> ir.Node:
    node = ir.Node("", "Gather", [])
    if text is not None:
        node.metadata_props[FX_NODE_KEY] = text
    return node


def test_positional_arguments_split_at_the_top_level_only():
    node = _node(
        "%conv : [num_users=1] = call_function[target=torch.ops.aten.convolution.default]"
        "(args = (%x, %p_w, None, [2, 2], [(0, 1), 1], False, -1, 0.25), kwargs = {})"
    )
    op, args = aten_call(node)
    assert op == "convolution.default"
    assert args == ["%x", "%p_w", "None", "[2, 2]", "[(0, 1), 1]", "False", "-1", "0.25"]
    call = aten_call(node)
    assert int_arg(call, "convolution.default", 6) == -1
    assert float_arg(call, "convolution.default", 7) == 0.25
    assert int_arg(call, "convolution.default", 2) is None  # None is no int
    assert int_arg(call, "embedding.default", 6) is None  # another op
    assert float_arg(call, "convolution.default", 8) is None  # past the end


def test_a_node_without_a_recorded_call_has_none():
    assert aten_call(_node(None)) is None
    assert aten_call(_node("%x : [num_users=1] = placeholder[target=x]")) is None
    assert int_arg(None, "embedding.default", 2) is None
