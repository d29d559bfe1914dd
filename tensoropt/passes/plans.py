"""Built-in plans: data parallelism and Megatron-LM style tensor parallelism.

Both produce a :class:`Plan` that goes through the same annotate/insert/partition
mechanism as searched and hand-written plans.

Megatron blocks are found by structure, not by names (``passes.blocks``): MLP blocks
(column-parallel first MatMul and gate siblings, row-parallel second) and attention
blocks (column-parallel Q/K/V projections, row-parallel output projection). Before the
training step is built, :func:`prepare_model` stacks each block's column-parallel
projections into one MatMul and views a fused QKV weight as ``[C, 3, D]``, so that
each block needs one all-reduce forward and one backward, as in Megatron-LM, and a
fused QKV splits head-wise.

Where no block applies (CNNs, say), the tp axis falls back to data parallelism
and the plan notes say so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.errors import PlanError, ShardingError
from tensoropt.ir.builder import static_shape
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard, local_shape
from tensoropt.ir.mesh import Mesh, default_axis_names
from tensoropt.ir.plan import DefaultStrategy, Plan, UnitStrategy, ZeroStage
from tensoropt.ir.vocab import MegatronSplit, Role, role_of
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.blocks import (
    ELEMENTWISE,
    Blocks,
    Rewrite,
    batch_dims,
    find_blocks,
    is_forward,
    is_stacked,
    stack_projections,
    stacked_sources,
    stored_transposed,
    transposed_source,
)
from tensoropt.passes.training_step import StepSignature
from tensoropt.rules.sharding.shape import reshape_groups


@dataclass(frozen=True, slots=True)
class BuiltPlan:
    plan: Plan
    data_axes: tuple[int, ...]
    notes: tuple[str, ...]


def data_parallel(mesh: Mesh) -> BuiltPlan:
    """Every mesh axis shards the batch; parameters are replicated."""
    plan = Plan(mesh, {}, source="data-parallel", default=DefaultStrategy.DATA_PARALLEL)
    return BuiltPlan(plan, tuple(range(mesh.ndim)), ())


def _layouts(
    x_rank: int,
    w_rank: int,
    mesh: Mesh,
    tp: int,
    dp_axes,
    batch_ok: bool,
    kind: MegatronSplit,
    dims: tuple[int, int] = (0, 0),
):
    """(x, W, out) layouts of a column- or row-parallel MatMul (W 2-D, or stacked 3-D);
    ``dims``: the batch dimension of x and of out (:func:`batch_dims`)."""
    x = [Replicate()] * mesh.ndim
    w = [Replicate()] * mesh.ndim
    out = [Replicate()] * mesh.ndim
    for a in dp_axes:
        if batch_ok:
            x[a] = Shard(dims[0])
            out[a] = Shard(dims[1])
    if kind is MegatronSplit.COLUMN:
        w[tp] = Shard(w_rank - 1)
        out[tp] = Shard(x_rank - 1)
    else:
        x[tp] = Shard(x_rank - 1)
        w[tp] = Shard(0)
        out[tp] = Partial()
    return Layout(tuple(x)), Layout(tuple(w)), Layout(tuple(out))


def megatron(
    graph: ir.Graph, sig: StepSignature, mesh: Mesh, blocks: Blocks | None = None
) -> BuiltPlan:
    """Tensor parallelism on the last mesh axis for every block found; dp on the others.

    ``blocks``: ``find_blocks`` of this graph, when the caller builds plans for several
    meshes (the blocks do not depend on the mesh)."""
    tp = mesh.ndim - 1
    dp_axes = tuple(range(mesh.ndim - 1))
    params = set(sig.params)
    if blocks is None:
        blocks = find_blocks(graph, params)
    batch = batch_dims(graph, (*sig.data_inputs, *([sig.labels] if sig.labels else [])))
    attention = []
    split_heads: list[str] = []
    for column, row in blocks.attention:
        problem = _heads_problem(column, mesh, tp, params)
        if problem is None:
            attention.append((column, row))
        else:
            split_heads.append(problem)
    roles: dict[ir.Node, MegatronSplit] = {}
    for column, row in (*blocks.mlp, *attention):
        for node in column:
            roles[node] = MegatronSplit.COLUMN
        roles[row] = MegatronSplit.ROW
    units: dict[str, UnitStrategy] = {}
    skipped = []
    for node, kind in roles.items():
        unit = _unit(node, kind, mesh, tp, dp_axes, params, batch)
        if unit is None:
            skipped.append(node.name)
            continue
        units[node.name] = unit
        if kind is MegatronSplit.COLUMN and is_stacked(node):
            units.update(_stacked_weight_units(node, mesh, tp, params))
        if transposed_source(node.inputs[1], params) is not None:
            units.update(_transposed_weight_unit(node, kind, mesh, tp))
        if kind is MegatronSplit.ROW:
            units.update(_reduce_after(node, mesh, dp_axes, params, batch))
    counts = f"{len(blocks.mlp)} MLP and {len(attention)} attention blocks"
    notes = [f"megatron: {counts} on mesh axis {tp} (tp)"]
    # a block left whole is replicated over tp: data parallel only where dp axes exist
    whole = f"whole, replicated over the tp axis's {mesh.shape[tp]} devices" + (
        " (data parallel over the others)" if dp_axes else ""
    )
    if split_heads:
        notes.append(
            f"megatron: {len(split_heads)} attention blocks left {whole}, because a tp "
            f"split would cut heads apart: {split_heads[0]}"
        )
    viewed = _viewed_fused(attention, params)
    if viewed:
        views = " or ".join(sorted({view for _, view in viewed}))
        notes.append(
            f"megatron: {len(viewed)} fused QKV weights trained as their {views} view and "
            "split head-wise (each rank holds the same heads of q, k and v): "
            + ", ".join(name for name, _ in viewed[:5])
        )
    if blocks.fused:
        fused = [f"{m.name} -> {o.name}" for m, o in blocks.fused]
        notes.append(
            f"megatron: {len(fused)} attention blocks with a fused QKV projection left "
            f"{whole} (a column split would mix Q, K and V, and the weight is not "
            "viewed head-wise: the model was not prepared for megatron (prepare_model), or "
            "the weight or its bias is shared with another layer): " + ", ".join(fused[:5])
        )
    if not roles:
        notes.append(
            "megatron: no attention or MLP block found; the tp axis falls back to data parallelism"
        )
        built = data_parallel(mesh)
        return BuiltPlan(
            Plan(mesh, {}, source="megatron (fallback: data-parallel)", default=built.plan.default),
            built.data_axes,
            tuple(notes),
        )
    if skipped:
        notes.append(
            f"megatron: {len(skipped)} MatMuls left unsharded (a split does not divide): "
            + ", ".join(skipped[:5])
        )
    plan = Plan(mesh, units, source="megatron", default=DefaultStrategy.DATA_PARALLEL)
    return BuiltPlan(plan, dp_axes, tuple(notes))


def prepare_model(name: str, model: ir.Model) -> Rewrite | None:
    """Rewrite the imported forward ``model`` for built-in plan ``name`` before its
    training step is built: for megatron, stack each block's column-parallel projections
    and view fused QKV weights head-wise (``passes.blocks``). Other plans change nothing.
    """
    if name != "megatron":
        return None
    return stack_projections(model)


def _viewed_fused(attention, params: set[str]) -> list[tuple[str, str]]:
    """(name, view) of the fused QKV weights that the rewrite viewed per head: ``[C, 3,
    D]``, or ``[3, D, C]`` for one stored as torch keeps it (an unoptimized export)."""
    found = []
    for column, _row in attention:
        for node in column:
            sources = stacked_sources(node.inputs[1], params) if is_stacked(node) else None
            if sources and len(sources) == 1:
                view = "[3, D, C]" if stored_transposed(node.inputs[1]) else "[C, 3, D]"
                found.append((sources[0].name, view))
    # a packed cross-attention weight feeds two projections (q, and k with v): once
    return list(dict.fromkeys(found))


def _unit(
    node: ir.Node,
    kind: MegatronSplit,
    mesh: Mesh,
    tp: int,
    dp_axes,
    params: set[str],
    batch: dict[ir.Value, int],
) -> UnitStrategy | None:
    _check_weight_split(node, kind, mesh, tp, params)
    x = node.inputs[0]
    xshape = static_shape(x)
    wrank = len(static_shape(node.inputs[1]))
    dims = (batch.get(x, 0), batch.get(node.outputs[0], 0))
    batch_ok = all(xshape[dims[0]] % mesh.shape[a] == 0 for a in dp_axes) if xshape else False
    xl, wl, ol = _layouts(len(xshape), wrank, mesh, tp, dp_axes, batch_ok, kind, dims)
    for cand in sa.candidates(node, mesh):
        if sa.matches(cand, (xl, wl), (ol,)):
            return UnitStrategy(inputs=(xl, wl), outputs=(ol,))
    return None


def _tp_layout(mesh: Mesh, tp: int, dim: int) -> Layout:
    placements = [Replicate()] * mesh.ndim
    placements[tp] = Shard(dim)
    return Layout(tuple(placements))


def _first_inputs_match(cand, inputs, outputs) -> bool:
    """``cand`` takes ``inputs`` at its first inputs (the rest: constants, replicated)."""
    if tuple(cand.outputs) != tuple(outputs) or len(cand.inputs) < len(inputs):
        return False
    if tuple(cand.inputs[: len(inputs)]) != tuple(inputs):
        return False
    return all(x is None or not _split(x) for x in cand.inputs[len(inputs) :])


def _split(layout: Layout) -> bool:
    return any(isinstance(p, (Shard, Partial)) for p in layout.placements)


def _pinned(node: ir.Node, mesh: Mesh, inputs, outputs) -> dict[str, UnitStrategy]:
    for cand in sa.candidates(node, mesh):
        if _first_inputs_match(cand, inputs, outputs):
            return {node.name: UnitStrategy(inputs=tuple(cand.inputs), outputs=tuple(cand.outputs))}
    return {}


def _stacked_weight_units(node: ir.Node, mesh: Mesh, tp: int, params) -> dict[str, UnitStrategy]:
    """The nodes that build a stacked weight keep it split on its feature dim: the
    weights themselves are column-split, never gathered (``passes.blocks``)."""
    w = node.inputs[1]
    build = w.producer()
    s0, s1, s2 = (_tp_layout(mesh, tp, d) for d in range(3))
    units: dict[str, UnitStrategy] = {}
    if stored_transposed(w):  # Transpose(W[k, D, C] or Concat(Unsqueeze(W_i [D, C])), [0, 2, 1])
        concat = build.inputs[0].producer()
        if concat is not None and concat.op_type == "Slice":  # a packed weight's piece
            units.update(_pinned(concat, mesh, (s1,), (s1,)))  # the Transpose follows
            for use in node.outputs[0].uses():  # its bias's piece, [k, 1, D]: split alike
                bias = use.node.inputs[1 - use.idx] if use.node.op_type == "Add" else None
                sliced = bias.producer() if bias is not None else None
                if sliced is not None and sliced.op_type == "Slice":
                    units.update(_pinned(sliced, mesh, (s2,), (s2,)))
            return units
        if concat is None or concat.op_type != "Concat":
            return _pinned(build, mesh, (s1,), (s2,))
        for v in concat.inputs:  # the Transpose follows the Concat's unit
            units.update(_pinned(v.producer(), mesh, (s0,), (s1,)))
        units.update(_pinned(concat, mesh, (s1,) * len(concat.inputs), (s1,)))
        return units
    if build.op_type == "Transpose":  # Transpose(W[C, k, D], [1, 0, 2])
        units.update(_pinned(build, mesh, (s2,), (s2,)))
        return units
    for v in build.inputs:  # Concat(Unsqueeze(W_i [C, D], [0]), ...)
        units.update(_pinned(v.producer(), mesh, (s1,), (s2,)))
    units.update(_pinned(build, mesh, (s2,) * len(build.inputs), (s2,)))
    return units


def _transposed_weight_unit(
    node: ir.Node, kind: MegatronSplit, mesh: Mesh, tp: int
) -> dict[str, UnitStrategy]:
    """The Transpose of a weight stored ``[D, C]`` keeps it split as the MatMul reads its
    transpose (column-parallel: the MatMul's dim 1 is the weight's dim 0; row-parallel:
    the other way round), so the weight itself is split, never gathered."""
    build = node.inputs[1].producer()
    read = 1 if kind is MegatronSplit.COLUMN else 0
    return _pinned(build, mesh, (_tp_layout(mesh, tp, 1 - read),), (_tp_layout(mesh, tp, read),))


def _act_layout(value: ir.Value, mesh: Mesh, dp_axes, params, batch) -> Layout:
    """A block's activations: batch-split over the data axes (as far as they divide),
    whole on tp; parameters and constants replicated."""
    placements = [Replicate()] * mesh.ndim
    if value.name in params or value.const_value is not None:
        return Layout(tuple(placements))
    shape = static_shape(value)
    d = batch.get(value, 0)
    for a in dp_axes:
        if shape and shape[d] % mesh.shape[a] == 0:
            placements[a] = Shard(d)
    return Layout(tuple(placements))


def _reduce_after(
    node: ir.Node, mesh: Mesh, dp_axes, params, batch: dict[ir.Value, int]
) -> dict[str, UnitStrategy]:
    """Megatron all-reduces a row-parallel output where the block ends: the Add that
    takes it (its bias, or the residual) reads and makes whole values on tp.

    Without it the cheapest-conversion choice would reduce-scatter instead (sequence
    parallelism), which moves the same bytes in two collectives and leaves the
    normalisation after the block split by sequence, with more conversions around it.
    """
    uses = node.outputs[0].uses()
    if len(uses) != 1 or uses[0].node.op_type != "Add":
        return {}
    add = uses[0].node
    ins = tuple(_act_layout(v, mesh, dp_axes, params, batch) for v in add.inputs)
    out = (_act_layout(add.outputs[0], mesh, dp_axes, params, batch),)
    for cand in sa.candidates(add, mesh):
        if sa.matches(cand, ins, out):
            return {add.name: UnitStrategy(inputs=ins, outputs=out)}
    return {}


def _heads_problem(column, mesh: Mesh, tp: int, params: set[str]) -> str | None:
    """Why the tp axis cannot split an attention block's heads, or None if it can.

    Walks from each projection output to the Reshape that splits its feature (last) dim
    into heads; the heads dim must divide (a split inside a head would need the scores
    of a head summed across ranks).
    """
    stack = [m.outputs[0] for m in column]
    seen: set[ir.Node] = set()
    while stack:
        value = stack.pop()
        for use in value.uses():
            node = use.node
            if node in seen or not is_forward(node) or use.idx != 0:
                continue
            seen.add(node)
            if node.op_type == "Reshape":
                problem = _reshape_heads_problem(node, column, mesh.shape[tp], params)
                if problem is not None:
                    return problem
            elif node.op_type in ELEMENTWISE or node.op_type in ("Split", "Squeeze"):
                stack.extend(node.outputs)
            elif node.op_type == "Transpose":
                perm = node.attributes.get("perm")
                rank = len(static_shape(value))
                if perm is not None and list(perm.value)[-1] == rank - 1:
                    stack.extend(node.outputs)
    return None


def _reshape_heads_problem(node: ir.Node, column, n: int, params) -> str | None:
    src, dst = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    try:
        groups = reshape_groups(src, dst)
    except ShardingError:
        return None
    last = len(src) - 1
    for gin, gout in groups:
        if last in gin and gin[0] == last and len(gout) > 1:
            heads = dst[gout[0]]
            if heads % n:
                weights = ", ".join(repr(_weight_name(m, params)) for m in column)
                return (
                    f"the projection of weight {weights} feeds Reshape {node.name!r}, which "
                    f"splits dim {last} (size {src[last]}) of tensor {node.inputs[0].name!r} "
                    f"into {heads} heads of {src[last] // heads}, and {n} does not divide "
                    f"{heads}; use a tp size that divides {heads} to split them"
                )
    return None


def _weight_name(node: ir.Node, params: set[str]) -> str:
    """The trained weight(s) behind a projection MatMul (a stacked one's sources)."""
    w = node.inputs[1]
    sources = stacked_sources(w, params) if is_stacked(node) else None
    if sources:
        return " + ".join(v.name for v in sources)
    stored = transposed_source(w, params)
    return stored.name if stored is not None else w.name


def _check_weight_split(
    node: ir.Node, kind: MegatronSplit, mesh: Mesh, tp: int, params: set[str]
) -> None:
    """Refuse a block whose weight the tp axis cannot split as Megatron promises.

    Column-parallel splits the weight's output (last) dim, row-parallel its input dim (0).
    A stacked weight is named by the trained weights it is built from, with their dim.
    """
    weight = node.inputs[1]
    assert weight is not None  # a weight MatMul (see blocks.weight_matmuls)
    wshape = static_shape(weight)
    dim = len(wshape) - 1 if kind is MegatronSplit.COLUMN else 0
    size, n = wshape[dim], mesh.shape[tp]
    if size % n:
        sources = stacked_sources(weight, params) if is_stacked(node) else None
        stored = transposed_source(weight, params)
        if sources:  # the output dim: last as stored [C, D], first as stored [D, C]
            names = ", ".join(repr(v.name) for v in sources)
            dim = len(static_shape(sources[0])) - (2 if stored_transposed(weight) else 1)
        elif stored is not None:  # the weight as stored, [D, C]: the other dim
            names, dim = repr(stored.name), 1 - dim
        else:
            names = repr(weight.name)
        raise ShardingError(
            f"megatron over {n} devices on mesh axis {tp} ({mesh.axis_names[tp]}): weight "
            f"{names} of MatMul {node.name!r} ({kind.value}-parallel) dim {dim} has "
            f"size {size}, which {n} does not divide; use a tp size that divides {size}"
        )


def _check_batch(graph: ir.Graph, sig: StepSignature, mesh: Mesh, axes, plan: str) -> None:
    """Refuse data parallelism over ``axes`` that cannot split every data input's batch.

    Without this, annotate keeps an undividable batch replicated: every rank computes
    the whole step, which is correct but no faster than one device.
    """
    count = math.prod(mesh.shape[a] for a in axes)
    if count == 1:
        return
    names = (*sig.data_inputs, *((sig.labels,) if sig.labels else ()))
    by_name = {v.name: v for v in graph.inputs}
    for name in names:
        value = by_name.get(name)
        shape = static_shape(value) if value is not None else ()
        if shape and shape[0] % count:
            over = f"{count} devices" if len(axes) == mesh.ndim else _axes_text(mesh, axes)
            raise ShardingError(
                f"{plan} over {over}: input {name!r} dim 0 has size {shape[0]}, which "
                f"{count} does not divide; use a device count that divides {shape[0]}"
            )


def _axes_text(mesh: Mesh, axes) -> str:
    names = ", ".join(f"{mesh.axis_names[a]}={mesh.shape[a]}" for a in axes)
    return f"mesh axes {names} ({math.prod(mesh.shape[a] for a in axes)} devices)"


def builtin_axis_names(name: str, ndim: int) -> tuple[str, ...]:
    """The axis names of a built-in plan's mesh of ``ndim`` axes: a 1-D Megatron mesh
    splits the model ("tp"); every other 1-D mesh splits the batch ("dp"); 2-D meshes
    are ("dp", "tp")."""
    if ndim == 1:
        return ("tp",) if name == "megatron" else ("dp",)
    return default_axis_names(ndim)


def builtin_plan(
    name: str, graph: ir.Graph, sig: StepSignature, mesh: Mesh, blocks: Blocks | None = None
) -> BuiltPlan:
    """A built-in plan by name; refuses a mesh on which it cannot split what it promises.
    ``blocks``: the graph's ``find_blocks``, if already known (megatron). ``fsdp`` is data
    parallelism on every mesh axis with ZeRO-3 on every unit that places parameters
    (:func:`fsdp`)."""
    if name == "data-parallel":
        built = data_parallel(mesh)
    elif name == "megatron":
        built = megatron(graph, sig, mesh, blocks)
    elif name == "fsdp":
        _check_batch(graph, sig, mesh, tuple(range(mesh.ndim)), name)
        return fsdp(graph, sig, mesh)
    else:
        raise PlanError(
            f"unknown built-in plan {name!r}; use data-parallel, megatron, fsdp or a PLAN.json"
        )
    _check_batch(graph, sig, mesh, built.data_axes, name)
    return built


def fsdp(graph: ir.Graph, sig: StepSignature, mesh: Mesh) -> BuiltPlan:
    """Fully sharded data parallelism: data-parallel on every mesh axis, ZeRO-3 on every
    unit that places parameters, and every block (``passes.recompute.find_blocks``)
    recomputed in the backward (``compile --recompute`` replaces the blocks)."""
    from tensoropt.passes.recompute import find_blocks

    built = data_parallel(mesh)
    zeroed = with_zero(built.plan, graph, sig, built.data_axes, ZeroStage.PARAMETERS, "fsdp")
    blocks = tuple(b.name for b in find_blocks(graph, sig.data_inputs))
    plan = dataclasses.replace(zeroed.plan, source="fsdp", recompute=blocks)
    recomputed = (
        f"fsdp: all {len(blocks)} blocks recomputed" if blocks else "fsdp: no block to recompute"
    )
    return BuiltPlan(plan, built.data_axes, (*zeroed.notes, recomputed))


@dataclass(frozen=True, slots=True)
class ZeroApplied:
    """A plan with a ZeRO stage on every unit that has a ZeRO axis, and notes on what
    was left at stage 0."""

    plan: Plan
    units: int  # units that use ZeRO
    notes: tuple[str, ...]


def with_zero(
    plan: Plan,
    graph: ir.Graph,
    sig: StepSignature,
    data_axes,
    stage: ZeroStage,
    what: str,
) -> ZeroApplied:
    """``plan`` with ZeRO ``stage`` on every unit that has a ZeRO axis (see
    ``passes.units.zero_axes``): those units are listed with the strategy completion
    gives them, so the rest of the plan completes as before. A unit one of whose
    parameters no dimension of which the ZeRO axes divide stays at stage 0 (a note says
    so). Refuses (PlanError naming ``what``) when no unit has a ZeRO axis. Stage 0
    removes ZeRO from every unit (a note says from how many, if any had it)."""
    from tensoropt.passes.annotate import complete_plan, step_units
    from tensoropt.passes.units import zero_params, zero_shards

    units = {name: dataclasses.replace(u, zero=ZeroStage.NONE) for name, u in plan.units.items()}
    if stage is ZeroStage.NONE:
        had = sum(u.zero is not ZeroStage.NONE for u in plan.units.values())
        notes = (f"{what}: ZeRO off on the {had} units that had it",) if had else ()
        return ZeroApplied(dataclasses.replace(plan, units=units), 0, notes)
    su = step_units(graph, sig)
    roots = complete_plan(graph, sig, plan, data_axes, su)
    count = 0
    undivided: list[str] = []
    for k, unit in enumerate(su.units):
        name = unit.root.name
        if not zero_params(su, k):
            continue
        strategy = roots[name]
        try:
            shards = zero_shards(su, k, strategy, plan.mesh)
        except PlanError:
            undivided.append(name)
            continue
        if not shards:
            continue
        listed = units.get(name)
        if listed is None or not listed.explicit:
            listed = UnitStrategy(tuple(strategy.inputs), tuple(strategy.outputs), None)
        units[name] = dataclasses.replace(listed, zero=stage)
        count += 1
    if not count:
        raise PlanError(
            f"{what}: no unit of the plan on mesh {plan.mesh} has a data-parallel axis (a "
            "parameter read replicated while its op splits the batch); use a mesh axis "
            "that splits the batch, or leave ZeRO off"
        )
    notes = [f"{what}: ZeRO stage {int(stage)} on {count} units"]
    if undivided:
        notes.append(
            f"{what}: {len(undivided)} units keep ZeRO 0, a parameter of theirs has no "
            f"dimension the data-parallel axes divide (first: {undivided[0]})"
        )
    return ZeroApplied(dataclasses.replace(plan, units=units), count, tuple(notes))


def check_plan(graph: ir.Graph, plan: Plan) -> None:
    """Refuse a plan that names no node of the graph or whose explicit split does not divide.

    Runs before annotate so the message names the plan unit, the tensor, the
    dimension and the sizes (annotate only knows that no legal strategy matched).
    """
    nodes = {node.name: node for node in graph}
    for name, unit in plan.units.items():
        node = nodes.get(name)
        if node is None:
            raise PlanError(
                f"plan unit {name!r}: the model has no node of that name; the plan was made "
                "for another model (units are named by forward ONNX node names)"
            )
        if not unit.explicit or role_of(node) is not Role.FORWARD:
            continue
        # a layout count that does not match the node is annotate's error to report
        ins = zip(node.inputs, unit.inputs, strict=False)
        outs = zip(node.outputs, unit.outputs, strict=False)
        slots = [
            *(("input", i, v, lay) for i, (v, lay) in enumerate(ins)),
            *(("output", j, v, lay) for j, (v, lay) in enumerate(outs)),
        ]
        for kind, index, value, layout in slots:
            if value is None or layout is None:
                continue
            where = f"plan unit {name!r} ({node.op_type}) {kind} {index}, tensor {value.name!r}"
            try:
                local_shape(static_shape(value), layout, plan.mesh, where)
            except ShardingError as exc:
                raise ShardingError(f"{exc}; fix the plan file") from None
