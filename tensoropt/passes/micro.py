"""Micro-batching with gradient accumulation (``Plan.micro_batches``).

A step's batch runs as ``k`` micro-batches, one after the other; their gradients are
summed, synchronised once and applied once. This is a batch split that runs in time
instead of on other devices, so it is compiled as one: the plan's mesh gets one more
axis, the *micro axis* of size ``k``, placed first (outermost: micro-batch m is the m-th
contiguous chunk of the batch, split over the data-parallel axes inside it), on which
every decision unit takes the data-parallel strategy (the batch split, parameters
replicated, gradients partial). The micro axis is the mesh's sequential axis
(``Mesh.sequential_axis``): the strategies' scoring never moves data along it.
Annotation, conversions and localization then run unchanged on that *micro mesh*; the
local shapes and constants they produce are those of one micro-batch on one rank.

A micro-mesh device is (micro-batch index, real rank). Ranks run the device graph of
micro index 0 for every micro-batch; what depends on the index besides the data fed
(a slice or a zeroing along the micro axis, an initializer or constant split with the
batch) reads it from the input :data:`MICRO_INDEX_INPUT`, fed per micro-step. The only
collectives over the micro axis are the all-reduces that turn partial values (parameter
gradients, the loss) into replicated ones; a sum over micro-batches is the runtime's
accumulation, so each is rewritten to an all-reduce over its other axes (or an Identity
when none remain). Any other collective over the micro axis needs every micro-batch at
once and is refused, naming the unit; parameters split with the batch are refused too.

The graph is then cut into two phases (node metadata :data:`PHASE_KEY`):

- ``micro``: everything before the accumulation (forward, loss, backward, and
  collectives of other axes inside them), run once per micro-batch;
- ``step``: the rewritten all-reduces and everything after them (gradient
  synchronisation, optimizer), run once per step, on the accumulated values.

Values crossing the cut are listed in :class:`MicroCut` (the model's metadata
:data:`MICRO_KEY`, and the manifest's ``micro``): ``accumulate`` (summed over the
micro-batches; each is a partial sum, so the sum is exact) and ``keep`` (values that do
not depend on the batch; the step phase reads them as the micro phase left them).
A step value that depends on one micro-batch alone would be wrong: such steps (an op
that couples the samples of a batch) are refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir

from tensoropt.errors import PlanError
from tensoropt.ir.builder import UNIT_KEY, static_shape
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard, local_shape
from tensoropt.ir.mesh import SEQUENTIAL_AXIS, Mesh
from tensoropt.ir.plan import DefaultStrategy, Plan
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.annotate import (
    Annotation,
    annotate,
    annotate_roots,
    complete_plan,
    plan_zero,
)
from tensoropt.passes.insert_redistribution import DOMAIN, TEMPLATE_LOCAL, planned_conversions
from tensoropt.passes.partition import LocalTemplate
from tensoropt.passes.training_step import StepSignature
from tensoropt.passes.units import ProgramCache, StepUnits, combine_axes
from tensoropt.rules.sharding import SHARDING_RULES, MeshSharding

MICRO_AXIS = SEQUENTIAL_AXIS
"""The name of the micro axis in the micro mesh: conversions never move data along it."""
PHASE_KEY = "tensoropt.phase"
"""Node metadata: the node's :class:`Phase`."""
MICRO_KEY = "tensoropt.micro"
"""Model metadata: the :class:`MicroCut` as JSON."""
MICRO_INDEX = 0
"""The index of the micro axis in the micro mesh."""


class MicroError(PlanError):
    """A plan's ``micro_batches`` cannot be compiled for this step."""


class Phase(Enum):
    """When a node of a micro-batched device graph runs."""

    MICRO = "micro"  # once per micro-batch
    STEP = "step"  # once per step, after the micro-batches


@dataclass(frozen=True, slots=True)
class MicroCut:
    """The contract between the phases (see the module doc)."""

    batches: int
    accumulate: tuple[str, ...]  # micro values summed over the micro-batches
    keep: tuple[str, ...]  # batch-independent micro values the step phase reads
    index: str | None = None  # the graph input fed the micro-batch index, if any

    def to_json(self) -> dict:
        out: dict = {
            "batches": self.batches,
            "accumulate": list(self.accumulate),
            "keep": list(self.keep),
        }
        if self.index is not None:
            out["index"] = self.index
        return out

    @staticmethod
    def from_json(data: Mapping) -> MicroCut:
        return MicroCut(
            int(data["batches"]),
            tuple(str(n) for n in data["accumulate"]),
            tuple(str(n) for n in data.get("keep", ())),
            None if data.get("index") is None else str(data["index"]),
        )


# -- the micro mesh ------------------------------------------------------------------


def micro_mesh(mesh: Mesh, k: int) -> Mesh:
    """``mesh`` with the micro axis of size ``k`` in front."""
    if MICRO_AXIS in mesh.axis_names:
        raise MicroError(f"mesh {mesh}: the axis name {MICRO_AXIS!r} is reserved; rename it")
    return Mesh((k, *mesh.shape), (MICRO_AXIS, *mesh.axis_names))


def micro_axes(axes: Sequence[int], mesh: Mesh) -> tuple[tuple[int, ...], bool]:
    """An all-reduce over ``axes`` of the micro mesh ``mesh``, as a rank issues it:
    the axes it still reduces over, and whether it sums over the micro-batches (then
    its input is accumulated and the rest runs once per step). Axes are the micro
    mesh's; the plan's axis ``a`` is the micro mesh's ``a + 1``."""
    return tuple(a for a in axes if a != MICRO_INDEX), MICRO_INDEX in axes


# -- annotation ----------------------------------------------------------------------


def check_batch_divides(
    graph: ir.Graph,
    sig: StepSignature,
    ann: Annotation,
    k: int,
    whole: Collection[str] = (),
) -> None:
    """Refuse a ``k`` that does not divide each data input's batch on one rank, but for
    the inputs fed ``whole`` to every micro-step (:func:`micro_along`)."""
    data = set(sig.data_inputs) | ({sig.labels} if sig.labels else set())
    mesh = ann.mesh
    for value in graph.inputs:
        if value.name not in data or value.name in whole:
            continue
        shape = static_shape(value)
        if not shape:
            continue
        local = local_shape(shape, ann.layouts[value], mesh, value.name)[0]
        if local % k:
            raise MicroError(
                f"--micro-batches {k} does not divide the batch: input {value.name!r} has "
                f"batch {shape[0]} over data-parallel size {shape[0] // local} "
                f"({local} per rank); give a micro-batch count that divides {local}"
            )


def check_no_coupling(graph: ir.Graph, k: int) -> None:
    """Refuse ops whose result depends on the whole batch (training-mode statistics)."""
    for node in graph:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        mode = node.attributes.get("training_mode")
        if mode is not None and mode.value:
            raise MicroError(
                f"--micro-batches {k}: node {node.name!r} (BatchNormalization in training "
                "mode) normalises with statistics of the whole batch, which micro-batches "
                "do not see; compile with --micro-batches 1"
            )


def check_micro_cut(graph: ir.Graph, sig: StepSignature, k: int) -> None:
    """Raise MicroError where compile would cut any plan of ``k`` micro-batches: every
    such plan takes the data-parallel strategy on the micro axis, so the data-parallel
    plan of one device, annotated, converted and cut (:func:`cut_phases`) on a copy of
    the step, meets the same couplings (a loss divided by the count of labels kept,
    which each micro-batch knows only of itself) and values needed whole. The search
    asks this once per step and ``k``: it offers no micro-batched point compile would
    refuse."""
    from tensoropt.passes.insert_redistribution import insert_redistribution

    copy = graph.clone()  # nodes, values and their metadata; tensors shared
    plan = Plan(Mesh((1,), ("dp",)), {}, "micro check", micro_batches=k)
    ann = annotate_micro(copy, sig, plan, (0,))
    layouts = insert_redistribution(copy, ann)
    cut_phases(copy, sig, ann.mesh, dict(layouts), k)


def annotate_micro(
    graph: ir.Graph,
    sig: StepSignature,
    plan: Plan,
    data_axes: Sequence[int] | None,
) -> Annotation:
    """Annotate the step on the micro mesh: the data-parallel strategy on the micro
    axis, the plan's strategies on the plan's axes."""
    roots, su = micro_roots(graph, sig, plan, data_axes)
    mesh = micro_mesh(plan.mesh, plan.micro_batches)
    ann = annotate_roots(graph, su, roots, mesh, zero=plan_zero(plan, su))
    stored = set(sig.params) | set(sig.states)
    for value in graph.inputs:
        first = ann.layouts[value].placements[MICRO_INDEX]
        if value.name in stored and not isinstance(first, Replicate):
            raise MicroError(
                f"--micro-batches {plan.micro_batches}: parameter {value.name!r} (shape "
                f"{list(static_shape(value))}) is split with the batch ({first} over the "
                "micro-batches), but each micro-batch updates the whole parameter; "
                "compile with --micro-batches 1"
            )
    return ann


def micro_roots(
    graph: ir.Graph,
    sig: StepSignature,
    plan: Plan,
    data_axes: Sequence[int] | None,
) -> tuple[dict[str, MeshSharding], StepUnits]:
    """Every unit's root strategy on the micro mesh, and the step's units.

    The plan completes on its own mesh (``annotate``); on a one-axis mesh of the micro
    axis alone every unit completes data-parallel; each root takes the second on the
    micro axis and the first on the plan's axes."""
    k = plan.micro_batches
    check_no_coupling(graph, k)
    real = annotate(graph, sig, plan, data_axes)
    su = real.units
    along, whole = micro_along(graph, sig, su, k)
    check_batch_divides(graph, sig, real, k, whole)
    roots = {}
    for unit in su.units:
        name = unit.root.name
        roots[name] = _combine(unit.root, real.roots[name], along[name], plan.mesh, k)
    params = set(sig.params)
    _split_where_gathered(
        graph, su, roots, micro_mesh(plan.mesh, k),
        lambda root, current: _batch_split(root, current, params, plan.mesh, k),
    )  # fmt: skip
    return roots, su


def micro_along(
    graph: ir.Graph, sig: StepSignature, su: StepUnits, k: int
) -> tuple[dict[str, MeshSharding], frozenset[str]]:
    """Each unit's root strategy on the micro axis alone: the data-parallel completion
    (the batch split into the ``k`` micro-batches), but whole where a sum over the batch
    is made of the data alone (:func:`_whole_where_counted`); and the data inputs that
    makes whole (fed whole to every micro-step, so ``k`` need not divide their batch).
    A unit that would gather a value over the micro axis splits its batch instead
    (:func:`_split_where_gathered`, on the micro axis alone).
    The compiler (:func:`micro_roots`) and the search (``cost.model.micro_choices``) both
    take it from here, so a searched point compiles to what it priced."""
    seq = Mesh((k,), (MICRO_AXIS,))
    split = Plan(seq, {}, "micro", DefaultStrategy.DATA_PARALLEL, (0,))
    along = complete_plan(graph, sig, split, (0,), su)
    whole = _whole_where_counted(graph, sig, su, along, seq)
    params = set(sig.params)
    _split_where_gathered(
        graph, su, along, seq, lambda root, current: _batch_split(root, current, params, None, k)
    )
    fed = frozenset(name for name in su.data if su.owner.get(name) in whole)
    return along, fed


def _whole_where_counted(
    graph: ir.Graph,
    sig: StepSignature,
    su: StepUnits,
    along: dict[str, MeshSharding],
    seq: Mesh,
) -> set[int]:
    """Units made of the data alone that sum over the batch run on every micro-batch's
    data at once (``along`` in place: replicated on the micro axis), with the units of
    the data they read and the units that place the data inputs they read (which are
    then fed whole); where one of those reads a parameter, none of them. Returns the
    units made whole.

    A loss divided by the count of the labels it keeps (HuggingFace's ``labels`` with
    ``ignore_index``) needs the count over the whole batch before any micro-batch's
    backward; split with the batch, the count is partial over the micro-batches and
    each micro-batch's loss would divide by its own. Such a count depends on the data
    alone, which a rank holds for every micro-batch before the first: its data inputs
    are fed whole (no ``micro_dim``), the count is computed whole in every micro-step,
    and the readers that split the batch take their micro-batch's piece of it (a local
    slice by the micro-batch index). The cost is that unit's work on the rank's whole
    batch once per micro-batch: integer compares and sums of labels."""
    data = set(sig.data_inputs) | ({sig.labels} if sig.labels else set())
    stored = set(sig.params) | set(sig.states)
    inputs = {v for v in graph.inputs if v.name in data}
    known = set(inputs)
    known.update(v for v in graph.initializers.values() if v.name not in stored)
    for node in graph:  # values made of data inputs and constants alone
        if all(v is None or v in known for v in node.inputs):
            known.update(node.outputs)
    made = {v: u for u, unit in enumerate(su.units) for n in unit.nodes for v in n.outputs}
    cache = su.once(
        (tuple(seq.shape), tuple(seq.axis_names)), lambda: ProgramCache(su, seq)
    )  # the micro axis's programs, shared with the micro meshes' (units._MicroParts)
    pure = {
        u
        for u, unit in enumerate(su.units)
        if all(v is None or v in known for n in unit.nodes for v in n.inputs)
    }
    whole: set[int] = set()
    for u in sorted(pure):
        program = cache.program(u, along[su.units[u].root.name])
        if u in whole or not any(
            isinstance(lay.placements[0], Partial) for s in program.strategies for lay in s.outputs
        ):
            continue
        group, todo = set(), [u]
        while todo:  # the sum's unit, the units of the data it reads, and the units that
            w = todo.pop()  # place the data inputs it reads (they are fed whole)
            if w not in group:
                group.add(w)
                for node in su.units[w].nodes:
                    todo.extend(made[v] for v in node.inputs if v in made and made[v] != w)
                    todo.extend(
                        su.owner[v.name] for v in node.inputs if v in inputs and v.name in su.owner
                    )
        if group <= pure:  # else a unit would repeat work on parameters: refused
            whole |= group
    for u in whole:
        root = su.units[u].root
        along[root.name] = next(
            c
            for c in sa.candidates(root, seq)
            if all(isinstance(lay.placements[0], Replicate) for lay in (*c.inputs, *c.outputs)
                   if lay is not None)
        )  # fmt: skip
    return whole


def _split_where_gathered(
    graph: ir.Graph,
    su: StepUnits,
    roots: dict[str, MeshSharding],
    mesh: Mesh,
    split: Callable[[ir.Node, MeshSharding], MeshSharding | None],
) -> None:
    """Units that would gather a value over the micro axis split their batch instead
    (``roots`` in place, strategies on ``mesh``, whose first axis is the micro axis),
    while another strategy can (``split``: a root and its strategy -> the strategy that
    splits its batch there, or None).

    Completing the data-parallel plan unit by unit leaves a unit whose inputs are all
    replicated (an LSTM's first step reads a constant initial state) replicated over the
    micro axis, which is free there; its backward then needs the gradient of every
    micro-batch at once. The conversions the inserter would make (a dry run) show where.
    :func:`micro_along` repairs the micro axis alone, which every micro-batched plan takes
    (so the search offers the repaired strategies); :func:`micro_roots` repairs what a
    plan's own axes still gather."""
    by_name = {n.name: n for n in graph}
    first = dict(roots)
    for _ in range(len(su.units)):
        ann = annotate_roots(graph, su, roots, mesh)
        gathering = _gathering_units(graph, ann, su, by_name)
        if not gathering:
            return
        changed = False
        for root in gathering:
            alt = split(root, roots[root.name])
            if alt is not None:
                roots[root.name] = alt
                changed = True
        if not changed:
            break
    roots.update(first)  # no repair: the cut names the unit that needs the whole batch


def _gathering_units(graph: ir.Graph, ann: Annotation, su: StepUnits, by_name) -> list[ir.Node]:
    """Roots of the units whose conversions move data along the micro axis."""
    found: dict[ir.Node, None] = {}
    for planned in planned_conversions(graph, ann):
        have = planned.have.placements[MICRO_INDEX]
        need = planned.need.placements[MICRO_INDEX]
        moves = (isinstance(have, Shard) and have != need) or (
            isinstance(have, Partial) and isinstance(need, Shard)
        )
        node = by_name.get(planned.unit)
        if moves and node is not None and node in su.unit_of:
            found[su.units[su.unit_of[node]].root] = None
    return list(found)


def _batch_split(
    root: ir.Node, current: MeshSharding, params: set[str], mesh: Mesh | None, k: int
) -> MeshSharding | None:
    """The first other strategy of ``root`` that splits an output over the micro axis,
    keeps its parameters whole there and keeps its strategy on the plan's axes (those
    of ``mesh``; None: ``current`` is on the micro axis alone)."""
    for s in SHARDING_RULES.strategies(sa.op_view(root), k):
        if s == current.axes[0] or not any(isinstance(o, Shard) for o in s.outputs):
            continue
        whole = all(
            value is None or value.name not in params or isinstance(p, Replicate)
            for value, p in zip(root.inputs, s.inputs, strict=False)
        )
        if not whole:
            continue
        if mesh is None:
            return MeshSharding((s,))
        try:
            return _combine(root, MeshSharding(current.axes[1:]), MeshSharding((s,)), mesh, k)
        except MicroError:
            continue
    return None


def _combine(
    node: ir.Node, real: MeshSharding, along: MeshSharding, mesh: Mesh, k: int
) -> MeshSharding:
    """``along``'s placements on the micro axis, then ``real`` on the plan's axes, each
    legal on the op as the axes before it localized it (``units.combine_axes``)."""
    found = combine_axes(node, along, real, micro_mesh(mesh, k))
    if found is None:
        raise MicroError(
            f"--micro-batches {k}: unit {node.name!r} ({node.op_type}) cannot run its "
            f"strategy {real} within a micro-batch (input shapes "
            f"{list(sa.op_view(node).input_shapes)}); give a micro-batch count that divides "
            "its local batch, or --micro-batches 1"
        )
    return found


# -- the phase cut -------------------------------------------------------------------


def _mesh_axes(node: ir.Node) -> tuple[int, ...]:
    attr = node.attributes["mesh_axis"]
    value = attr.value
    return tuple(value) if isinstance(value, Sequence) else (int(value),)


def _describe(graph_nodes: Mapping[str, ir.Node], node: ir.Node) -> str:
    """``'unit' (OpType)`` of the forward node whose unit ``node`` belongs to."""
    unit = node.metadata_props.get(UNIT_KEY, "") or node.name
    owner = graph_nodes.get(unit)
    return f"{unit!r} ({owner.op_type if owner is not None else node.op_type})"


def _batch_values(graph: ir.Graph, sig: StepSignature) -> set[ir.Value]:
    """Values that depend on the data inputs (the micro-batch)."""
    data = set(sig.data_inputs) | ({sig.labels} if sig.labels else set())
    batch = {v for v in graph.inputs if v.name in data}
    for node in graph:
        if any(v in batch for v in node.inputs if v is not None):
            batch.update(node.outputs)
    return batch


def cut_phases(
    graph: ir.Graph,
    sig: StepSignature,
    mesh: Mesh,
    layouts: dict[ir.Value, Layout],
    k: int,
) -> MicroCut:
    """Tag every node with its phase, rewrite the micro-axis all-reduces, return the cut.

    ``mesh`` is the micro mesh; ``layouts`` (the conversions' layouts) gets the values
    of the Identity nodes that replace all-reduces over the micro axis alone."""
    micro = MICRO_INDEX
    by_name = {n.name: n for n in graph}
    syncs: list[ir.Node] = []
    for node in graph:
        if node.domain != DOMAIN:
            continue
        axes = _mesh_axes(node)
        if micro not in axes:
            continue
        if node.op_type in TEMPLATE_LOCAL:
            continue  # local: by the micro-batch index (``to_plan_mesh``)
        reader = next((u.node for u in node.outputs[0].uses()), node)
        if node.op_type != "AllReduce":
            raise MicroError(
                f"--micro-batches {k}: unit {_describe(by_name, reader)} needs the whole batch "
                f"(a {node.op_type} over the micro-batches, node {node.name!r}); compile with "
                "--micro-batches 1 or a plan that keeps the batch split there"
            )
        syncs.append(node)
    batch = _batch_values(graph, sig)
    phase = _phases(graph, set(syncs), batch)
    accumulate: dict[str, None] = {}
    keep: dict[str, None] = {}
    for node in graph:
        if phase[node] is not Phase.STEP:
            continue
        for value in node.inputs:
            producer = None if value is None else value.producer()
            if producer is None or phase[producer] is not Phase.MICRO:
                continue
            if node in syncs:
                accumulate[value.name] = None  # type: ignore[union-attr]
            elif value in batch:
                raise MicroError(
                    f"--micro-batches {k}: unit {_describe(by_name, node)} couples the "
                    f"samples of a batch (it reads {value.name!r} of one micro-batch after "
                    "the micro-batches are summed); compile with --micro-batches 1"
                )
            else:
                keep[value.name] = None  # type: ignore[union-attr]
    for value in graph.outputs:  # a graph output the micro phase makes passes the cut
        producer = value.producer()
        if producer is not None and phase[producer] is Phase.MICRO:
            if value in batch:
                raise MicroError(
                    f"--micro-batches {k}: output {value.name!r} is made per micro-batch "
                    "but returned once per step; compile with --micro-batches 1"
                )
            keep[value.name] = None
    for node in syncs:
        producer = node.inputs[0].producer() if node.inputs[0] is not None else None
        if producer is None or phase[producer] is not Phase.MICRO:
            raise MicroError(
                f"--micro-batches {k}: all-reduce {node.name!r} over the micro-batches reads "
                "a value made once per step; compile with --micro-batches 1"
            )
    for node, p in phase.items():
        node.metadata_props[PHASE_KEY] = p.value
    for node in syncs:
        _rewrite_sync(graph, node, mesh, layouts)
    cut = MicroCut(k, tuple(accumulate), tuple(keep))
    return cut


def _phases(graph: ir.Graph, syncs: set[ir.Node], batch: set[ir.Value]) -> dict[ir.Node, Phase]:
    """Step: the syncs and what reads their results; then every node that does not
    depend on the batch and whose readers all run in the step phase moves there too
    (it is needed once per step)."""
    phase: dict[ir.Node, Phase] = {}
    step_values: set[ir.Value] = set()
    for node in graph:
        if node in syncs or any(v in step_values for v in node.inputs if v is not None):
            phase[node] = Phase.STEP
            step_values.update(node.outputs)
        else:
            phase[node] = Phase.MICRO
    outputs = set(graph.outputs)
    for node in reversed(list(graph)):
        if phase[node] is Phase.STEP or any(v in batch for v in node.outputs):
            continue
        readers = [u.node for v in node.outputs for u in v.uses()]
        returned = any(v in outputs for v in node.outputs)  # read after the step
        if (readers or returned) and all(phase[r] is Phase.STEP for r in readers):
            phase[node] = Phase.STEP
    return phase


def _rewrite_sync(graph: ir.Graph, node: ir.Node, mesh: Mesh, layouts: dict) -> None:
    """An all-reduce over the micro axis, as a rank runs it on the accumulated input."""
    rest, _ = micro_axes(_mesh_axes(node), mesh)
    if rest:
        node.attributes["mesh_axis"] = ir.AttrInt64s("mesh_axis", list(rest))
        return
    ident = ir.Node(
        "",
        "Identity",
        [node.inputs[0]],
        name=node.name,
        metadata_props=dict(node.metadata_props),
        num_outputs=1,
    )
    out, new = node.outputs[0], ident.outputs[0]
    new.dtype, new.shape = out.dtype, out.shape
    layouts[new] = layouts[out]
    graph.insert_after(node, ident)
    for use in list(out.uses()):
        use.node.replace_input_with(use.idx, new)
    if out.is_graph_output():
        index = list(graph.outputs).index(out)
        graph.outputs[index] = new
    name = out.name
    graph.remove(node, safe=True)
    new.name = name
    layouts.pop(out, None)


# -- back to the plan's mesh ---------------------------------------------------------


def _split(layout: Layout, what: str, k: int) -> tuple[int | None, Layout]:
    """(the dim ``layout`` splits over the micro axis or None, the plan-mesh layout)."""
    first, *rest = layout.placements
    if isinstance(first, Partial):
        raise MicroError(
            f"--micro-batches {k}: {what} is partial over the micro-batches, which no "
            "micro-batch can hold alone; compile with --micro-batches 1"
        )
    return (first.dim if isinstance(first, Shard) else None), Layout(tuple(rest))


def to_plan_mesh(template: LocalTemplate, mesh: Mesh, k: int) -> LocalTemplate:
    """The micro-mesh template as every rank of ``mesh`` runs it.

    What depends on the micro-batch index takes it from the graph input
    :data:`MICRO_INDEX_INPUT` (int64 [1], fed per micro-step): a local conversion along
    the micro axis slices (or zeroes unless first) by it, and an initializer or constant
    split over the micro axis keeps every micro-batch's piece and is sliced by it."""
    inits: dict[str, Layout] = {}
    split_inits: dict[str, tuple[int, list[int]]] = {}  # name -> (dim, micro-batch shape)
    dims = {t.name: list(t.dims) for t in template.proto.graph.initializer}
    for name, lay in template.initializer_layouts.items():
        dim, rest = _split(lay, f"initializer {name!r}", k)
        if dim is not None:
            split_inits[name] = (dim, local_shape(dims[name], lay, template.mesh, name))
        if _sliced(rest):
            inits[name] = rest
    consts: dict[str, Layout] = {}
    split_consts: dict[str, int] = {}
    for name, lay in template.constant_layouts.items():
        dim, rest = _split(lay, f"constant {name!r}", k)
        if dim is not None:
            split_consts[name] = dim
        if _sliced(rest):
            consts[name] = rest
    lowered = _Lowering(template.proto.graph)
    lowered.run(split_inits, split_consts)
    _tag_by_readers(template.proto.graph)
    if lowered.used:
        _record_index(template.proto)
    return LocalTemplate(template.proto, mesh, inits, consts)


MICRO_INDEX_INPUT = "__micro_index__"
"""The graph input that holds the micro-batch index (int64, shape [1]), when used."""


def _record_index(model: onnx.ModelProto) -> None:
    graph = model.graph
    graph.input.append(
        onnx.helper.make_tensor_value_info(MICRO_INDEX_INPUT, onnx.TensorProto.INT64, [1])
    )
    entry = next(p for p in model.metadata_props if p.key == MICRO_KEY)
    cut = MicroCut.from_json(json.loads(entry.value))
    entry.value = json.dumps(dataclasses.replace(cut, index=MICRO_INDEX_INPUT).to_json())


def _tag_by_readers(graph: onnx.GraphProto) -> None:
    """Nodes that localize added (constants, scales) take the phase of their first
    reader, or of their producer when nothing reads them."""
    phase: dict[str, str] = {}  # value -> phase of its first reader
    tagged = {PHASE_KEY}
    for node in reversed(graph.node):
        own = next((p.value for p in node.metadata_props if p.key in tagged), None)
        if own is None:
            own = next((phase[o] for o in node.output if o in phase), None)
            if own is None:
                own = Phase.STEP.value
            entry = node.metadata_props.add()
            entry.key, entry.value = PHASE_KEY, own
        for name in node.input:
            if name:
                phase[name] = own


class _Lowering:
    """The micro axis out of a template graph, in place (see :func:`to_plan_mesh`)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.shapes = {
            vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in [*graph.input, *graph.output, *graph.value_info]
        }
        self.used = False

    def run(self, split_inits: Mapping[str, tuple], split_consts: Mapping[str, int]) -> None:
        graph = self.graph
        renamed = {name: f"{name}__micro" for name in split_inits}
        kept = [vi for vi in graph.value_info if vi.name not in renamed]
        del graph.value_info[:]
        graph.value_info.extend(kept)
        nodes: list[onnx.NodeProto] = []
        for name, (dim, shape) in split_inits.items():  # the micro-batch's piece
            self.shapes[renamed[name]] = list(shape)
            nodes += self._slice(name, renamed[name], dim, renamed[name])
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name in renamed:
                    node.input[i] = renamed[name]
            axis = next((a.i for a in node.attribute if a.name == "mesh_axis"), None)
            if node.domain == DOMAIN and node.op_type in TEMPLATE_LOCAL and axis == MICRO_INDEX:
                nodes += self._local(node)
                continue
            for attr in node.attribute if node.domain == DOMAIN else ():
                if attr.name == "mesh_axis" and attr.type == onnx.AttributeProto.INT:
                    attr.i -= 1  # the plan mesh's axes are the micro mesh's, less one
                elif attr.name == "mesh_axis":
                    attr.ints[:] = [a - 1 for a in attr.ints]
            if node.op_type == "Constant" and node.name in split_consts:
                out = node.output[0]
                node.output[0] = f"{out}__micro_all"
                nodes.append(node)
                nodes += self._slice(node.output[0], out, split_consts[node.name], node.name)
                continue
            nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)

    def _local(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        if node.op_type == "ShardSlice":
            dim = next(a.i for a in node.attribute if a.name == "axis")
            return self._slice(node.input[0], node.output[0], dim, node.name, node)
        # ZeroUnlessFirst: the value on micro-batch 0, zeros on the others
        self.used = True
        name = node.name
        made = [
            _node("Constant", [], [f"{name}__zero"], f"{name}__zero",
                  value=onnx.numpy_helper.from_array(np.zeros([1], np.int64))),
            _node("Equal", [MICRO_INDEX_INPUT, f"{name}__zero"], [f"{name}__first"],
                  f"{name}__first"),
            _node("Sub", [node.input[0], node.input[0]], [f"{name}__zeros"], f"{name}__zeros"),
            _node("Where", [f"{name}__first", node.input[0], f"{name}__zeros"],
                  [node.output[0]], name),
        ]  # fmt: skip
        return _tagged(made, node)

    def _slice(self, src: str, out: str, dim: int, name: str, like=None) -> list:
        """``out``: the micro-batch's piece of ``src`` along ``dim`` (its size: ``out``'s)."""
        self.used = True
        size = self.shapes[out][dim]
        made = [
            _node("Constant", [], [f"{name}__size"], f"{name}__size",
                  value=onnx.numpy_helper.from_array(np.asarray([size], np.int64))),
            _node("Constant", [], [f"{name}__axis"], f"{name}__axis",
                  value=onnx.numpy_helper.from_array(np.asarray([dim], np.int64))),
            _node("Mul", [MICRO_INDEX_INPUT, f"{name}__size"], [f"{name}__start"],
                  f"{name}__start"),
            _node("Add", [f"{name}__start", f"{name}__size"], [f"{name}__end"], f"{name}__end"),
            _node("Slice", [src, f"{name}__start", f"{name}__end", f"{name}__axis"], [out],
                  name),
        ]  # fmt: skip
        return _tagged(made, like)


def _node(op: str, inputs: list[str], outputs: list[str], name: str, **attrs):
    return onnx.helper.make_node(op, inputs, outputs, name=name, **attrs)


def _tagged(nodes: list[onnx.NodeProto], like: onnx.NodeProto | None) -> list[onnx.NodeProto]:
    """Every node in the micro phase, with ``like``'s role and unit."""
    for node in nodes:
        if like is not None:
            node.metadata_props.extend(p for p in like.metadata_props if p.key != PHASE_KEY)
        entry = node.metadata_props.add()
        entry.key, entry.value = PHASE_KEY, Phase.MICRO.value
    return nodes


def _sliced(layout: Layout) -> bool:
    return any(not isinstance(p, Replicate) for p in layout.placements)


def cut_of(model: onnx.ModelProto) -> MicroCut:
    """The cut a micro-batched model's metadata records."""
    raw = next((p.value for p in model.metadata_props if p.key == MICRO_KEY), None)
    if raw is None:
        raise AssertionError("the model records no micro-batch cut")
    return MicroCut.from_json(json.loads(raw))


def plan_mesh_view(ann: Annotation, mesh: Mesh) -> Annotation:
    """``ann`` on the plan's mesh, its micro placements dropped: what plan.json, the
    manifest and the annotated model's sharding specs describe."""

    def strategy(s: MeshSharding) -> MeshSharding:
        return MeshSharding(s.axes[1:])

    def layout(lay: Layout) -> Layout:
        return Layout(lay.placements[1:])

    return Annotation(
        mesh,
        {n: strategy(s) for n, s in ann.strategies.items()},
        {v: layout(lay) for v, lay in ann.layouts.items()},
        {v: layout(lay) for v, lay in ann.required_outputs.items()},
        ann.units,
        {n: strategy(s) for n, s in ann.roots.items()},
        {key: layout(lay) for key, lay in ann.entries.items()},
        ann.zero,
        ann.regather,
    )


def manifest_micro(manifest: dict, graph: ir.Graph, layouts: Mapping, cut: MicroCut) -> None:
    """Add the cut to ``manifest`` and, on each input split into micro-batches, the
    dim of its rank-local piece that the micro-batches split (``micro_dim``)."""
    for value in graph.inputs:
        first = layouts[value].placements[MICRO_INDEX]
        if isinstance(first, Shard):
            manifest["inputs"][value.name]["micro_dim"] = first.dim
    manifest["micro"] = cut.to_json()
