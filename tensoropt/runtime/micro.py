"""Run a micro-batched device graph: k micro-steps, their cut values summed, one step.

A micro-batched device graph (``passes.micro``) tags every node with its phase. Here it
becomes two graphs of the same rank: the *micro* graph (nodes of phase ``micro``; its
outputs are the cut values) and the *step* graph (nodes of phase ``step``; its inputs
are the graph's inputs and the cut values, its outputs the graph's outputs). Each is
split at its collectives like any device graph (``runtime.split``). A step feeds the
micro graph k times, each time with micro-batch m of every input the manifest marks
(``micro_dim``: chunk m of that dim of the rank's piece), sums the ``accumulate`` values
over the micro-batches, and feeds the step graph once with the sums, the ``keep``
values of the last micro-batch, and the step's other feeds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from tensoropt.errors import TensorOptError
from tensoropt.passes.micro import PHASE_KEY, MicroCut, Phase
from tensoropt.runtime.collectives import CollectiveCall
from tensoropt.runtime.inplace import mark_in_place
from tensoropt.runtime.split import SplitPlan, split_graph, subgraph_reads

Feeds = Mapping[str, np.ndarray]


@dataclass(frozen=True, slots=True, eq=False)
class PhasedPlan:
    """One rank's micro-batched step: the split micro graph and the split step graph."""

    micro: SplitPlan
    step: SplitPlan
    cut: MicroCut
    micro_dims: Mapping[str, int]  # fed input -> dim of its piece split into micro-batches

    @property
    def rank(self) -> int:
        return self.micro.rank

    @property
    def collectives(self) -> tuple[CollectiveCall, ...]:
        """The collectives of one micro-step, then those of the step phase (a rank issues
        the first group once per micro-batch)."""
        return self.micro.collectives + self.step.collectives

    @property
    def num_segments(self) -> int:
        return self.micro.num_segments + self.step.num_segments


def _phases(graph: onnx.GraphProto, rank: int) -> list[tuple[Phase, ...]]:
    """The phases each node runs in: its tag; a node without a tag and without inputs
    (a constant that lowering made for one rank) runs in each phase that reads it."""
    readers: dict[str, set[Phase]] = {}
    out: list[tuple[Phase, ...]] = [()] * len(graph.node)
    for i in range(len(graph.node) - 1, -1, -1):
        node = graph.node[i]
        value = next((p.value for p in node.metadata_props if p.key == PHASE_KEY), None)
        if value is not None:
            where: tuple[Phase, ...] = (Phase(value),)
        elif not any(node.input):
            where = tuple(p for p in Phase if any(p in readers.get(o, ()) for o in node.output))
        else:
            raise TensorOptError(
                f"rank {rank}: node {node.name!r} has no {PHASE_KEY} metadata but the "
                "manifest says the step is micro-batched; recompile the model"
            )
        out[i] = where
        for name in reads_of([node]):
            readers.setdefault(name, set()).update(where)
    return out


def reads_of(nodes: Iterable[onnx.NodeProto]) -> set[str]:
    """Every name ``nodes`` read, their subgraphs' outer-scope reads included."""
    names: set[str] = set()
    for node in nodes:
        names.update(n for n in node.input if n)
        names |= subgraph_reads(node)
    return names


def phase_models(
    model: onnx.ModelProto, cut: MicroCut, rank: int
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The micro graph and the step graph of one rank's micro-batched device graph."""
    graph = model.graph
    nodes: dict[Phase, list[onnx.NodeProto]] = {Phase.MICRO: [], Phase.STEP: []}
    phases = _phases(graph, rank)
    for node, where in zip(graph.node, phases, strict=True):
        for phase in where:
            nodes[phase].append(node)
    types = {vi.name: vi for vi in [*graph.input, *graph.output, *graph.value_info]}
    crossing = [*cut.accumulate, *cut.keep]
    missing = [n for n in crossing if n not in types]
    if missing:
        raise TensorOptError(
            f"rank {rank}: the device graph has no type for the cut values {missing}; "
            "recompile the model"
        )
    micro_reads = reads_of(nodes[Phase.MICRO])
    step_reads = reads_of(nodes[Phase.STEP]) | {o.name for o in graph.output}
    micro = sub_model(
        model,
        nodes[Phase.MICRO],
        [i for i in graph.input if i.name in micro_reads],
        [types[n] for n in crossing],
        "micro",
    )
    step = sub_model(
        model,
        nodes[Phase.STEP],
        [i for i in graph.input if i.name in step_reads] + [types[n] for n in crossing],
        list(graph.output),
        "step",
    )
    return micro, step


def sub_model(model: onnx.ModelProto, nodes, inputs, outputs, name: str) -> onnx.ModelProto:
    """A model of ``nodes`` of ``model`` with these inputs and outputs (value infos),
    the initializers they read, and ``model``'s value infos, opsets and functions."""
    graph = model.graph
    reads = reads_of(nodes) | {o.name for o in outputs}
    inits = [t for t in graph.initializer if t.name in reads]
    sub = helper.make_graph(
        nodes,
        f"{graph.name}_{name}",
        inputs,
        outputs,
        initializer=inits,
        value_info=graph.value_info,
    )
    out = helper.make_model(
        sub, opset_imports=list(model.opset_import), ir_version=model.ir_version
    )
    out.functions.extend(model.functions)
    return out


def split_phases(
    model: onnx.ModelProto,
    rank: int,
    world_size: int,
    fed: Iterable[str],
    weights: Mapping[str, np.ndarray],
    cut: MicroCut,
    micro_dims: Mapping[str, int],
    carry: Mapping[str, str] | None = None,
) -> PhasedPlan:
    """Split each phase of one rank's graph (``runtime.split``); ``weights`` are the
    rank's shared constants, read once for both phases. ``carry`` (step output -> the
    state input it replaces) marks the step phase's in-place updates
    (``runtime.inplace``)."""
    fed = set(fed) | ({cut.index} if cut.index else set())
    micro, step = phase_models(model, cut, rank)
    micro_plan = split_graph(micro, rank, world_size, fed, weights)
    step_fed = fed | set(cut.accumulate) | set(cut.keep)
    step_plan = mark_in_place(split_graph(step, rank, world_size, step_fed, weights), carry or {})
    return PhasedPlan(micro_plan, step_plan, cut, dict(micro_dims))


def micro_feeds(feeds: Feeds, cut: MicroCut, dims: Mapping[str, int], m: int) -> dict:
    """The feeds of micro-step ``m``: chunk ``m`` of each split input, and the index."""
    k = cut.batches
    out = dict(feeds)
    if cut.index is not None:
        out[cut.index] = np.asarray([m], dtype=np.int64)
    for name, dim in dims.items():
        array = feeds[name]
        size = array.shape[dim] // k
        index = [slice(None)] * array.ndim
        index[dim] = slice(m * size, (m + 1) * size)
        out[name] = np.ascontiguousarray(array[tuple(index)])
    return out


def accumulate(total: dict[str, np.ndarray], outs: Mapping[str, np.ndarray], cut: MicroCut):
    """Add one micro-step's cut values into ``total`` (the first one is taken as is)."""
    for name in cut.accumulate:
        value = outs[name]
        if name in total:
            np.add(total[name], value, out=total[name])
        else:
            total[name] = np.array(value, copy=True)
    for name in cut.keep:
        total[name] = outs[name]
