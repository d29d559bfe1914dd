"""In-place optimizer updates: a step-phase segment writes ``w__new`` over ``w``.

A training step returns every parameter and optimizer state anew (``w`` in,
``w__new`` out, carried to the next step). Run as is, a rank holds both copies of its
whole training state at the end of the step. A device framework updates in place,
and so does the runtime where it is safe: in the *step phase* of a micro-batched or
pipelined plan (``runtime.micro``, ``runtime.pipeline``), the segment that produces
``w__new`` gets ``w``'s own buffer as that output (onnxruntime I/O binding), so the
state is held once. The cost model prices exactly this (``cost.model.param_bytes``).

Overwriting ``w`` while the segment runs is safe when, within that segment, every
node that reads ``w`` (or a view of it that onnxruntime may alias: Reshape, Flatten,
Squeeze, Unsqueeze, Identity) is an ancestor of the node that produces ``w__new``, so
it has run before the write, or is that producer itself and elementwise (out[i] is
written after in[i] is read); and when nothing after the segment reads ``w``: no
later segment or collective, and no graph output. :func:`mark_in_place` checks this
on the graph and records the pairs on the segment (``Segment.in_place``); anything
else keeps its own output buffer. The runtime binds an output in place only to a
writable C-contiguous array (``RankProgram.run_segment``).

The micro phase and an unphased step keep their outputs: there the backward reads
``w`` after the update could run (``dX = dY W^T`` is no ancestor of ``w``'s update).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from onnx import ModelProto

from tensoropt.runtime.split import SplitPlan, subgraph_reads

# An output of these may alias their first input inside onnxruntime.
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
# A producer of these may read the buffer it overwrites: each element is read before
# the same element is written.
ELEMENTWISE_OPS = frozenset({"Add", "Sub", "Mul", "Div"})


def in_place_pairs(
    model: ModelProto, outputs, carry: Mapping[str, str], later: set[str]
) -> tuple[tuple[str, str], ...]:
    """The (output, input) pairs of ``model`` whose output can overwrite its input.

    ``carry`` maps a step output to the state input it replaces; ``later`` holds every
    name read after this segment."""
    graph = model.graph
    nodes = list(graph.node)
    inputs = {i.name for i in graph.input}
    produced = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    readers: dict[str, list[int]] = {}
    for k, node in enumerate(nodes):
        for name in {*node.input, *subgraph_reads(node)}:
            if name:
                readers.setdefault(name, []).append(k)
    pairs = []
    for out in outputs:
        src = carry.get(out)
        p = produced.get(out)
        if src is None or p is None or src not in inputs or src in later:
            continue
        if _safe(nodes, readers, produced, src, p, set(outputs)):
            pairs.append((out, src))
    return tuple(pairs)


def _safe(nodes, readers, produced, src: str, p: int, outputs: set[str]) -> bool:
    aliases, reading = {src}, set()
    todo = [src]
    while todo:
        v = todo.pop()
        for k in readers.get(v, ()):
            reading.add(k)
            node = nodes[k]
            if node.op_type in VIEW_OPS and node.input and node.input[0] == v:
                for o in node.output:
                    if o and o not in aliases:
                        aliases.add(o)
                        todo.append(o)
    if aliases & outputs - {src} or (src in outputs):
        return False  # a view of the state leaves the segment
    if p in reading:
        node = nodes[p]
        if node.op_type not in ELEMENTWISE_OPS or any(
            i in aliases and i != src for i in node.input
        ):
            return False
    before = _ancestors(nodes, produced, p)
    return all(k == p or k in before for k in reading)


def _ancestors(nodes, produced, p: int) -> set[int]:
    seen: set[int] = set()
    todo = [p]
    while todo:
        node = nodes[todo.pop()]
        for name in {*node.input, *subgraph_reads(node)}:
            k = produced.get(name)
            if k is not None and k not in seen:
                seen.add(k)
                todo.append(k)
    return seen


def mark_in_place(plan: SplitPlan, carry: Mapping[str, str]) -> SplitPlan:
    """``plan`` with each segment's in-place pairs recorded (a step-phase plan)."""
    stages = list(plan.stages)
    later: set[str] = set(plan.outputs)
    for i in range(len(stages) - 1, -1, -1):
        stage = stages[i]
        for call in stage.collectives:
            later.add(call.input)
        seg = stage.segment
        if seg is not None:
            pairs = in_place_pairs(seg.model, seg.outputs, carry, later)
            if pairs:
                seg = dataclasses.replace(seg, in_place=pairs)
                stages[i] = dataclasses.replace(stage, segment=seg)
            later |= set(seg.inputs)
    return dataclasses.replace(plan, stages=tuple(stages))


def in_place_outputs(plan: SplitPlan) -> dict[str, str]:
    """Every (output -> input) pair of ``plan`` written in place."""
    return {o: i for s in plan.stages if s.segment is not None for o, i in s.segment.in_place}
