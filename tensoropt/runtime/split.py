"""Split a per-device graph at its collective nodes into compute segments.

The CPU build of onnxruntime has no collective ops, so the runtime runs each
device graph as an alternation of *stages*: a compute segment (one ONNX model,
run by one InferenceSession) followed by a batch of collectives that the
communicator executes. This module is pure: it turns a ModelProto into a
:class:`SplitPlan` of segment models and collective calls, and creates nothing.

Schedule (as-soon-as-possible levels, which gives the fewest segments):

* a compute node runs in segment ``max(ready_seg(v) for v in its inputs)``;
* a collective runs in the batch after segment ``max(ready_coll(v))``;
* a value made by a compute node in segment L is ready for segment L and for
  batch L; a value made by a collective of batch L is ready for batch L (the
  batch runs in order, so collectives may chain) and for segment L + 1.

No schedule can have fewer segments: segment count is the longest chain of
"collective then compute" on any path, and ASAP meets it. Collectives keep their
ASAP batch (communication is not delayed), except a ZeRO-3 parameter's all-gathers
(tagged ``ZERO_GATHER_KEY``): each runs after the segment of the compute nodes before
it in graph order (the compiler places it just before its first reader), so that a
gathered parameter lives from just before its reads to its last reader, not from the
step's start, at the price of a segment boundary per gather; the readers of a gather
stay in the segment right after it. Compute nodes are then
moved as late as their consumers allow (the smallest level of any consumer; nodes
that only feed graph outputs stay put), which keeps the segment count: a node that
does not feed a
collective runs in the segment of its first consumer, not at the start. Reason,
measured: with ASAP, the backward's ``Transpose(W)`` of a sharded MatMul ran in
segment 0 while its MatMul ran after a collective, so the transposed weight was
materialised across segments (427 us for a 2 MiB shard on this machine) and held as
live memory, where onnxruntime fuses the pair into one transposed GEMM when both sit
in the same segment. Within a segment and a batch, nodes keep graph order. Since
every rank's graph has the same structure, every rank issues its collectives in
the same order (checked by :func:`tensoropt.runtime.program.check_collective_order`).

Names in ``fed`` (data, labels, parameters, optimizer state) become segment inputs
fed every step. Other initializers are constants: a small one (at most 1 KiB:
shapes, axes, scalars) is copied into each segment that reads it, where onnxruntime
and shape inference see its value; a larger one (or one in external data) is a
*shared* constant: the rank holds one array of it (``SplitPlan.weights``) and every
segment that reads it gets it as a segment input, fed from that array (onnxruntime
reads a fed numpy array in place). No segment proto embeds weight bytes. Handing
the array to each session as an initializer instead
(``SessionOptions.add_external_initializers``) made onnxruntime 1.32 copy it into
every session (measured in benchmarks/RESULTS.md, "Runtime at scale").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TypeProto, helper, numpy_helper

from tensoropt.errors import TensorOptError
from tensoropt.ir.vocab import ZERO_GATHER_KEY
from tensoropt.runtime.collectives import (
    DOMAIN,
    CollectiveCall,
    is_collective,
    output_dims,
    parse_collective,
)
from tensoropt.runtime.external import is_shared, read_initializer
from tensoropt.runtime.lowering import lower_row_sums


@dataclass(frozen=True, slots=True, eq=False)
class Segment:
    """One compute segment: an ONNX model with the names it reads and writes."""

    index: int
    model: ModelProto
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shared: tuple[str, ...] = ()  # inputs that are shared constants (SplitPlan.weights)
    # (output, input) pairs whose output is written over its input's buffer
    # (runtime.inplace: a step phase's optimizer update)
    in_place: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class Stage:
    """A segment (or none) then the collectives that follow it, in issue order."""

    segment: Segment | None
    collectives: tuple[CollectiveCall, ...]
    release: tuple[str, ...] = ()  # values no later stage reads (freed after this stage)
    # per collective: inputs that nothing after it reads (freed as soon as it returns, so
    # a batch of all-reduces does not hold every gradient twice)
    release_after: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class SplitPlan:
    """Everything needed to run one rank's graph, without any session."""

    rank: int
    stages: tuple[Stage, ...]
    feeds: tuple[str, ...]  # graph inputs that must be fed each step
    outputs: tuple[str, ...]  # graph outputs, in graph order
    constants: dict[str, np.ndarray] = field(default_factory=dict)  # initializers read
    # by collectives or returned as outputs directly
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # the rank's one copy of
    # every shared constant (fed to the segments that read it)

    @property
    def collectives(self) -> tuple[CollectiveCall, ...]:
        """Every collective, in the order this rank issues them."""
        return tuple(c for s in self.stages for c in s.collectives)

    @property
    def num_segments(self) -> int:
        return sum(1 for s in self.stages if s.segment is not None)


def subgraph_reads(node: NodeProto) -> set[str]:
    """Outer-scope names read by the subgraphs (If/Loop/Scan bodies) of ``node``."""
    names: set[str] = set()
    for attr in node.attribute:
        if attr.type and attr.type not in _GRAPH_TYPES:  # typed, and not a graph: skip
            continue
        graphs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for g in graphs:
            names |= _graph_free_names(g)
    return names


_GRAPH_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _graph_free_names(g: GraphProto) -> set[str]:
    defined = {i.name for i in g.input} | {t.name for t in g.initializer}
    free: set[str] = set()
    for node in g.node:
        reads = set(node.input) | subgraph_reads(node)
        free |= {n for n in reads if n and n not in defined}
        defined |= set(node.output)
    return free


def _reads(node: NodeProto) -> list[str]:
    seen = [n for n in node.input if n]
    extra = sorted(subgraph_reads(node) - set(seen))
    return seen + extra


@dataclass(slots=True)
class _Schedule:
    level: list[int]  # per node: segment index (compute) or batch index (collective)
    ready_seg: dict[str, int]
    ready_coll: dict[str, int]
    num_stages: int


def _schedule(graph: GraphProto, rank: int) -> _Schedule:
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    ready_seg: dict[str, int] = {}
    ready_coll: dict[str, int] = {}
    level: list[int] = []
    frontier = 0  # the highest segment of the compute nodes so far, in graph order
    nodes = list(graph.node)
    all_reads = [_reads(node) for node in nodes]
    for node, reads in zip(nodes, all_reads, strict=True):
        for name in reads:
            if name not in known and name not in ready_seg:
                raise TensorOptError(
                    f"rank {rank}: node {node.name!r} reads {name!r} before it is produced; "
                    "the graph is not topologically sorted; recompile the model"
                )
        if is_collective(node):
            lvl = max((ready_coll.get(n, 0) for n in reads), default=0)
            if zero_gather(node):
                lvl = max(lvl, frontier)
            for out in node.output:
                ready_seg[out], ready_coll[out] = lvl + 1, lvl
        else:
            lvl = max((ready_seg.get(n, 0) for n in reads), default=0)
            frontier = max(frontier, lvl)
            for out in node.output:
                ready_seg[out], ready_coll[out] = lvl, lvl
        level.append(lvl)
    num_stages = max(level, default=0) + 1
    _as_late_as_possible(nodes, all_reads, level)
    return _Schedule(level, ready_seg, ready_coll, num_stages)


def zero_gather(node: NodeProto) -> bool:
    """Is ``node`` the all-gather of a ZeRO-3 parameter (``ZERO_GATHER_KEY``)?"""
    return any(p.key == ZERO_GATHER_KEY for p in node.metadata_props)


def _as_late_as_possible(
    nodes: Sequence[NodeProto], reads: Sequence[list[str]], level: list[int]
) -> None:
    """Move compute nodes to the smallest level of their consumers (in place), except the
    readers of a ZeRO-3 parameter's gather.

    A compute consumer at segment L needs its input made in a segment <= L; a
    collective of batch L needs it made in a segment <= L. Visiting nodes in reverse
    graph order sees every consumer's final level first."""
    first_use: dict[str, int] = {}
    # a reader of a gathered ZeRO-3 parameter stays right after its gather
    gathered = {o for node in nodes if zero_gather(node) for o in node.output}
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if not is_collective(node) and not gathered.intersection(node.input):
            uses = [first_use[o] for o in node.output if o in first_use]
            if uses:
                level[i] = max(level[i], min(uses))
        for name in reads[i]:
            first_use[name] = min(first_use.get(name, level[i]), level[i])


def collective_order(model: ModelProto, rank: int, world_size: int) -> tuple[CollectiveCall, ...]:
    """The collectives of one rank's graph in the order :func:`split_graph` issues them.

    Cheap (no segment models, no shape inference): the launcher's pre-check uses it.
    """
    sched = _schedule(model.graph, rank)
    calls = [
        (lvl, i, parse_collective(node, rank, world_size))
        for i, (node, lvl) in enumerate(zip(model.graph.node, sched.level, strict=True))
        if is_collective(node)
    ]
    return tuple(call for _, _, call in sorted(calls, key=lambda t: (t[0], t[1])))


def shared_weights(model: ModelProto, fed: Iterable[str], base=None) -> dict[str, np.ndarray]:
    """The values of ``model``'s shared constants (not fed, external or over 1 KiB).

    External data is read from the directory ``base`` (one copy per tensor)."""
    fed_set = set(fed)
    out: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if t.name in fed_set or not is_shared(t):
            continue
        if base is None and t.data_location == onnx.TensorProto.EXTERNAL:
            raise TensorOptError(
                f"initializer {t.name!r} is external data: pass the directory of its file"
            )
        out[t.name] = read_initializer(t, base)
    return out


def split_graph(
    model: ModelProto,
    rank: int,
    world_size: int,
    fed: Iterable[str],
    weights: Mapping[str, np.ndarray] | None = None,
) -> SplitPlan:
    """Split one rank's device graph; ``fed`` names the inputs fed every step.

    ``weights``: the rank's shared constants (:func:`shared_weights`; read from the
    graph when omitted, which needs the weight bytes inline)."""
    graph = model.graph
    fed_set = set(fed)
    if weights is None:
        weights = shared_weights(model, fed_set)
    sched = _schedule(graph, rank)
    n = sched.num_stages
    seg_nodes: list[list[NodeProto]] = [[] for _ in range(n)]
    batches: list[list[CollectiveCall]] = [[] for _ in range(n)]
    for node, lvl in zip(graph.node, sched.level, strict=True):
        if is_collective(node):
            batches[lvl].append(parse_collective(node, rank, world_size))
        else:
            seg_nodes[lvl].append(node)

    ctx = _Context(
        model=model,
        fed=fed_set,
        inits={t.name: t for t in graph.initializer},
        graph_outputs=tuple(o.name for o in graph.output),
        last_use=_last_use(seg_nodes, batches),
        coll_reads={c.input for calls in batches for c in calls},
        types=_initial_types(graph),
        weights=dict(weights),
    )
    stages: list[Stage] = []
    for i in range(n):
        live = any(ctx.exported(o, i) for node in seg_nodes[i] for o in node.output if o)
        segment = _make_segment(ctx, i, seg_nodes[i]) if live else None  # dead: skipped
        for call in batches[i]:
            _type_collective_output(call, ctx.types, rank)
        release = tuple(
            sorted(v for v, s in ctx.last_use.items() if s == i and v not in ctx.graph_outputs)
        )
        stages.append(
            Stage(segment, tuple(batches[i]), release, _release_after(batches[i], release))
        )
    feeds = tuple(i.name for i in graph.input if i.name in fed_set or i.name not in ctx.inits)
    return SplitPlan(rank, tuple(stages), feeds, ctx.graph_outputs, ctx.constants(), ctx.weights)


@dataclass(frozen=True, slots=True, eq=False)
class _Context:
    """What building the segments of one graph needs to know about the whole graph."""

    model: ModelProto
    fed: set[str]
    inits: dict[str, onnx.TensorProto]
    graph_outputs: tuple[str, ...]
    last_use: dict[str, int]  # value -> last stage whose segment or batch reads it
    coll_reads: set[str]  # values some collective reads
    types: dict[str, TypeProto]  # grows as segments are inferred
    weights: dict[str, np.ndarray]  # shared constants (one copy per rank)

    def exported(self, name: str, index: int) -> bool:
        """Must segment ``index``, which produces ``name``, hand it out?"""
        return (
            name in self.graph_outputs
            or name in self.coll_reads
            or self.last_use.get(name, -1) > index
        )

    def constants(self) -> dict[str, np.ndarray]:
        """Initializers that something other than a segment reads (kept as numpy)."""
        wanted = self.coll_reads | set(self.graph_outputs)
        return {
            name: self.weights[name]
            if name in self.weights
            else numpy_helper.to_array(self.inits[name])
            for name in sorted(wanted)
            if name in self.inits and name not in self.fed
        }


def _release_after(
    calls: list[CollectiveCall], release: tuple[str, ...]
) -> tuple[tuple[str, ...], ...]:
    """For each collective of a batch: its input, if no later stage or collective reads it."""
    free = set(release)
    out = []
    for j, call in enumerate(calls):
        later = {c.input for c in calls[j + 1 :]}
        out.append((call.input,) if call.input in free and call.input not in later else ())
    return tuple(out)


def _last_use(seg_nodes: list[list[NodeProto]], batches: list[list[CollectiveCall]]) -> dict:
    last: dict[str, int] = {}
    for i, nodes in enumerate(seg_nodes):
        for node in nodes:
            for name in _reads(node):
                last[name] = max(last.get(name, 0), i)
    for i, calls in enumerate(batches):
        for call in calls:
            last[call.input] = max(last.get(call.input, 0), i)
    return last


def _initial_types(graph: GraphProto) -> dict[str, TypeProto]:
    types: dict[str, TypeProto] = {}
    for vi in [*graph.value_info, *graph.output, *graph.input]:
        if vi.type.HasField("tensor_type") or vi.type.WhichOneof("value"):
            types[vi.name] = vi.type
    for t in graph.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return types


def _make_segment(ctx: _Context, index: int, nodes: list[NodeProto]) -> Segment:
    """Segment ``index``: its nodes, fed or earlier values as inputs, own constants."""
    produced = [o for node in nodes for o in node.output if o]
    produced_set = set(produced)
    external = list(
        dict.fromkeys(n for node in nodes for n in _reads(node) if n not in produced_set)
    )
    consts = [n for n in external if n not in ctx.fed and n in ctx.inits]
    for n in consts:
        if n not in ctx.weights and is_shared(ctx.inits[n]):
            raise TensorOptError(
                f"segment {index}: constant {n!r} has no shared value; load the rank's "
                "weights with shared_weights"
            )
    shared = [n for n in consts if n in ctx.weights]
    inputs = [n for n in external if n in ctx.fed or n not in ctx.inits or n in ctx.weights]
    seg_inits = [ctx.inits[n] for n in consts if n not in ctx.weights]
    outputs = [o for o in produced if ctx.exported(o, index)]
    types, model = ctx.types, ctx.model
    where = f"segment {index}"
    in_vis = [_value_info(n, types, where) for n in inputs]
    graph = helper.make_graph(nodes, f"segment_{index}", in_vis, [], initializer=seg_inits)
    opsets = [o for o in model.opset_import if o.domain != DOMAIN]
    seg = helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)
    seg.functions.extend(model.functions)
    inferred = onnx.shape_inference.infer_shapes(seg)
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        if vi.type.WhichOneof("value"):
            types.setdefault(vi.name, vi.type)
    seg.graph.output.extend(_value_info(o, types, where) for o in outputs)
    seg = lower_row_sums(seg, types)  # onnxruntime's fast form (runtime.lowering)
    return Segment(index, seg, tuple(inputs), tuple(outputs), tuple(shared))


def _value_info(name: str, types: dict[str, TypeProto], where: str) -> onnx.ValueInfoProto:
    t = types.get(name)
    if t is None:
        raise TensorOptError(
            f"{where}: cannot infer the type of value {name!r}; give the device graph "
            "value_info for it (recompile the model)"
        )
    vi = onnx.ValueInfoProto()
    vi.name = name
    vi.type.CopyFrom(t)
    return vi


def _type_collective_output(call: CollectiveCall, types: dict[str, TypeProto], rank: int) -> None:
    src = types.get(call.input)
    if src is None or not src.HasField("tensor_type"):
        raise TensorOptError(
            f"rank {rank}: cannot infer the type of {call.input!r}, the input of "
            f"{call.describe()}; recompile the model"
        )
    tt = src.tensor_type
    dims: list[int | None] | None = None
    if tt.HasField("shape"):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        dims = output_dims(call, dims)
    types.setdefault(call.output, helper.make_tensor_type_proto(tt.elem_type, dims))
