"""The plan is the program: what the cost model priced against what compile emitted."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import onnx
from onnx import helper

from tensoropt.cli.common import search_graph
from tensoropt.cost.model import MeshProblem, priced_collectives
from tensoropt.passes.partition import group_over

COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")


def search_args(path: str | Path, optimizer: str = "sgd") -> argparse.Namespace:
    return argparse.Namespace(
        model=str(path),
        input_shape=None,
        trainable=None,
        freeze=None,
        optimizer=optimizer,
        momentum=0.9,
        lr=0.01,
        loss="auto",
    )


def graph_of(path: str | Path, optimizer: str = "sgd"):
    return search_graph(search_args(path, optimizer))


def emitted(model: onnx.ModelProto) -> Counter:
    """(kind, group, input bytes) of every collective of one device graph."""
    shapes = {}
    for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        tt = vi.type.tensor_type
        size = 1
        for d in tt.shape.dim:
            size *= d.dim_value
        itemsize = helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize
        shapes[vi.name] = size * itemsize
    for t in model.graph.initializer:
        size = 1
        for d in t.dims:
            size *= d
        shapes[t.name] = size * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    found = Counter()
    for node in model.graph.node:
        if node.domain != "ai.tensoropt" or node.op_type not in COLLECTIVES:
            continue
        group = next(tuple(a.ints) for a in node.attribute if a.name == "group")
        found[(node.op_type, group, shapes[node.input[0]])] += 1
    return found


def priced(mp: MeshProblem, choice, rank: int = 0) -> Counter:
    """The same multiset as the cost model priced it for ``rank``."""
    return Counter(
        (c.kind, tuple(group_over(mp.mesh, rank, list(c.axes))), c.in_bytes)
        for c in priced_collectives(mp, choice)
    )
