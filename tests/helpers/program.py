"""The plan is the program: what the cost model priced against what compile emitted."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from tensoropt.cli.common import search_graph
from tensoropt.cost.model import OP_TYPE, MeshProblem, priced_collectives
from tensoropt.ir.builder import static_shape
from tensoropt.passes.insert_redistribution import planned_conversions
from tensoropt.passes.partition import group_over
from tensoropt.passes.units import conversion_steps, itemsize

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


def _sizes(model: onnx.ModelProto) -> dict[str, int]:
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
    return shapes


def emitted(model: onnx.ModelProto) -> Counter:
    """(kind, group, input bytes) of every collective of one device graph."""
    return emitted_per_step(model, 1)


def emitted_per_step(model: onnx.ModelProto, k: int) -> Counter:
    """:func:`emitted` counted as a rank issues them in one step: on a micro-batched
    device graph, those of the micro phase once per micro-batch (``k``)."""
    shapes = _sizes(model)
    found = Counter()
    for node in model.graph.node:
        if node.domain != "ai.tensoropt" or node.op_type not in COLLECTIVES:
            continue
        group = next(tuple(a.ints) for a in node.attribute if a.name == "group")
        phase = next((p.value for p in node.metadata_props if p.key == "tensoropt.phase"), None)
        found[(node.op_type, group, shapes[node.input[0]])] += k if phase == "micro" else 1
    return found


def priced(mp: MeshProblem, choice, rank: int = 0) -> Counter:
    """The same multiset as the cost model priced it for ``rank``."""
    return Counter(
        (c.kind, tuple(group_over(mp.mesh, rank, list(c.axes))), c.in_bytes)
        for c in priced_collectives(mp, choice)
    )


def priced_per_step(mp: MeshProblem, choice, rank: int = 0) -> Counter:
    """:func:`priced` counted per step (``PricedCollective.times``). On a micro mesh the
    groups are those of micro index 0, whose ranks are the plan mesh's."""
    found = Counter()
    for c in priced_collectives(mp, choice):
        found[(c.kind, tuple(group_over(mp.mesh, rank, list(c.axes))), c.in_bytes)] += c.times
    return found


def inserted_collectives(sg, ann):
    """(converted value, (kind, mesh axes, input bytes)) of every collective the
    partitioner inserts for annotation ``ann`` of the search graph ``sg``."""
    for p in planned_conversions(sg.graph, ann):
        isz = itemsize(p.value)
        for cs in conversion_steps(p.have, p.need, static_shape(p.value), ann.mesh):
            if cs.communicates:
                nbytes = int(np.prod(cs.in_shape, dtype=np.int64)) * isz
                yield p.value, (OP_TYPE[cs.step.kind], cs.axes, nbytes)


def inserted(sg, ann) -> Counter:
    """:func:`inserted_collectives` as a multiset, comparable with :func:`priced_axes`."""
    return Counter(key for _, key in inserted_collectives(sg, ann))


def priced_axes(mp: MeshProblem, choice) -> Counter:
    """(kind, mesh axes, input bytes) of every collective the cost model priced."""
    return Counter((c.kind, c.axes, c.in_bytes) for c in priced_collectives(mp, choice))


def covering(problem, points) -> list:
    """Frontier points that between them take every unit's every choice on the frontier
    and every edge's every pair of endpoint choices, fastest and least memory included
    (greedy, deterministic). What the partitioner inserts depends on a unit's strategy
    and on the pair at each edge, so a mismatch of any point shows in one of these:
    resnet50 tiny on 2x2 needs 97 of its 824 points."""

    def features(choice) -> set:
        out = {(u, c) for u, c in enumerate(choice)}
        out |= {(e.src, e.dst, choice[e.src], choice[e.dst]) for e in problem.edges}
        return out

    found = [features(p.choice) for p in points]
    chosen = {0, len(points) - 1}
    left = set().union(*found) - set().union(*(found[i] for i in chosen))
    while left:
        best = max(range(len(points)), key=lambda i: (len(found[i] & left), -i))
        chosen.add(best)
        left -= found[best]
    return [points[i] for i in sorted(chosen)]


def search_of(mp: MeshProblem):
    """Just enough of a plain MeshSearch for ``search.driver.plan_from_choice``."""
    from types import SimpleNamespace

    from tensoropt.search.driver import PLAIN

    return SimpleNamespace(
        mesh=mp.mesh,
        unit_names=tuple(u.node.name for u in mp.units),
        unit_layouts=tuple(
            tuple((tuple(s.inputs), tuple(s.outputs)) for s in u.strategies) for u in mp.units
        ),
        variant=PLAIN,
        unit_zero=(),
        blocks=(),
    )
