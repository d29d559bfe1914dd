"""Built-in plans: data parallelism and Megatron-LM style tensor parallelism.

Both produce a :class:`Plan` that goes through the same annotate/insert/partition
mechanism as searched and hand-written plans.

Megatron blocks are found by structure, not by names:

- an MLP block is a MatMul by a trained 2-D weight (A), a region of element-wise
  ops (bias Add, activation, dropout, ...), and a second weight MatMul (B) that is
  the region's only exit. A is column-parallel, B row-parallel.
- an attention block is a weight MatMul (O) whose activation input comes, through
  attention ops only (Reshape, Transpose, activation MatMuls, Softmax, scale,
  mask, ...), from weight MatMuls (Q, K, V, or one fused QKV). The projections are
  column-parallel, O is row-parallel, so heads split across the tp axis.

Where no block applies (CNNs, say), the tp axis falls back to data parallelism
and the plan notes say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.errors import PlanError, ShardingError
from tensoropt.ir.builder import static_shape
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard, local_shape
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import DefaultStrategy, Plan, UnitStrategy
from tensoropt.ir.vocab import MegatronSplit, Role, role_of
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.training_step import StepSignature

_ELEMENTWISE = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Sqrt",
        "Neg",
        "Gelu",
        "Relu",
        "Tanh",
        "Sigmoid",
        "Erf",
        "Cast",
        "Dropout",
        "Identity",
        "LeakyRelu",
        "Exp",
    }
)
_NONLINEAR = frozenset(
    {
        "Gelu",
        "Relu",
        "Tanh",
        "Sigmoid",
        "Erf",
        "LeakyRelu",
        "Exp",
        "Pow",
        "Sqrt",
        "Softplus",
        "Elu",
        "HardSigmoid",
        "HardSwish",
        "Mul",
        "Div",
    }
)
_ATTENTION = _ELEMENTWISE | frozenset(
    {
        "Reshape",
        "Transpose",
        "MatMul",
        "Softmax",
        "Where",
        "Split",
        "Slice",
        "Squeeze",
        "Unsqueeze",
        "Concat",
        "Expand",
        "Constant",
        "Einsum",
    }
)


@dataclass(frozen=True, slots=True)
class BuiltPlan:
    plan: Plan
    data_axes: tuple[int, ...]
    notes: tuple[str, ...]


def data_parallel(mesh: Mesh) -> BuiltPlan:
    """Every mesh axis shards the batch; parameters are replicated."""
    plan = Plan(mesh, {}, source="data-parallel", default=DefaultStrategy.DATA_PARALLEL)
    return BuiltPlan(plan, tuple(range(mesh.ndim)), ())


def _forward(node: ir.Node) -> bool:
    return role_of(node) is Role.FORWARD


def _weight_matmuls(graph: ir.Graph, params: set[str]) -> list[ir.Node]:
    out = []
    for node in graph:
        if not _forward(node) or node.op_type != "MatMul":
            continue
        w = node.inputs[1]
        if w is not None and w.name in params and len(static_shape(w)) == 2:
            out.append(node)
    return out


def _is_const(value: ir.Value, params: set[str]) -> bool:
    if value.const_value is not None or value.name in params:
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"


def _mlp_partner(
    a: ir.Node, weights: set[ir.Node], params: set[str]
) -> tuple[ir.Node, list[ir.Node]] | None:
    """The row-parallel MatMul that closes an MLP block opened by ``a``, if any.

    Also returns the gate siblings: weight MatMuls on ``a``'s own input whose outputs
    join the region (a SiLU/GELU-gated MLP, ``down(act(gate(x)) * up(x))``); they are
    column-parallel like ``a``.
    """
    region: set[ir.Node] = set()
    frontier = [a.outputs[0]]
    exit_node = None
    while frontier:
        value = frontier.pop()
        for use in value.uses():
            node = use.node
            if not _forward(node):
                continue
            if node in weights and use.idx == 0:
                if exit_node not in (None, node):
                    return None
                exit_node = node
                continue
            if node.op_type not in _ELEMENTWISE:
                return None
            if node not in region:
                region.add(node)
                frontier.extend(node.outputs)
    if exit_node is None or not any(n.op_type in _NONLINEAR for n in region):
        # Two weight MatMuls joined by nothing (or only a bias) are not an MLP block:
        # pairing them would take a MatMul away from the block that follows.
        return None
    siblings: list[ir.Node] = []
    for node in region:
        for v in node.inputs:
            if v is None or v is a.outputs[0] or v.producer() in region:
                continue
            sibling = v.producer()
            if sibling in weights and sibling.inputs[0] is a.inputs[0] and sibling is not a:
                if sibling not in siblings:
                    siblings.append(sibling)
                continue
            if not _is_const(v, params):
                return None
    return exit_node, siblings


def _param_dependent(graph: ir.Graph, params: set[str]) -> set[ir.Value]:
    """Values computed from some parameter; the others come from data inputs and
    constants only (attention masks built from an ``attention_mask`` input)."""
    dependent = {v for v in graph.initializers.values() if v.name in params}
    dependent |= {v for v in graph.inputs if v.name in params}
    for node in graph:  # topological order
        if any(v is not None and v in dependent for v in node.inputs):
            dependent.update(node.outputs)
    return dependent


def _attention_sources(
    o: ir.Node, weights: set[ir.Node], params: set[str], dependent: set[ir.Value]
) -> list[ir.Node] | None:
    """The projection MatMuls feeding ``o`` through attention ops only, if that holds."""
    sources: list[ir.Node] = []
    seen: set[ir.Node] = set()
    stack = [o.inputs[0]]
    saw_softmax = False
    while stack:
        value = stack.pop()
        if value is None or _is_const(value, params) or value not in dependent:
            continue
        node = value.producer()
        if node is None or not _forward(node):
            return None
        if node in weights:
            if node not in sources:
                sources.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        if node.op_type not in _ATTENTION:
            return None
        saw_softmax |= node.op_type == "Softmax"
        stack.extend(node.inputs)
    return sources if saw_softmax and sources else None


def _layouts(x_rank: int, mesh: Mesh, tp: int, dp_axes, batch_ok: bool, kind: MegatronSplit):
    """(x, W, out) layouts of a column- or row-parallel MatMul."""
    x = [Replicate()] * mesh.ndim
    w = [Replicate()] * mesh.ndim
    out = [Replicate()] * mesh.ndim
    for a in dp_axes:
        if batch_ok:
            x[a] = Shard(0)
            out[a] = Shard(0)
    if kind is MegatronSplit.COLUMN:
        w[tp] = Shard(1)
        out[tp] = Shard(x_rank - 1)
    else:
        x[tp] = Shard(x_rank - 1)
        w[tp] = Shard(0)
        out[tp] = Partial()
    return Layout(tuple(x)), Layout(tuple(w)), Layout(tuple(out))


def megatron(graph: ir.Graph, sig: StepSignature, mesh: Mesh) -> BuiltPlan:
    """Tensor parallelism on the last mesh axis for every block found; dp on the others."""
    tp = mesh.ndim - 1
    dp_axes = tuple(range(mesh.ndim - 1))
    params = set(sig.params)
    weights = _weight_matmuls(graph, params)
    weight_set = set(weights)
    roles: dict[ir.Node, MegatronSplit] = {}
    for a in weights:
        found = _mlp_partner(a, weight_set, params)
        if found is None:
            continue
        b, siblings = found
        if not any(n in roles for n in (a, b, *siblings)):
            for n in (a, *siblings):
                roles[n] = MegatronSplit.COLUMN
            roles[b] = MegatronSplit.ROW
    attention = 0
    fused: list[str] = []
    dependent = _param_dependent(graph, params)
    for o in weights:
        if o in roles:
            continue
        sources = _attention_sources(o, weight_set, params, dependent)
        if not sources or any(s in roles for s in sources):
            continue
        if len(sources) == 1:
            # One projection makes Q, K and V: a column split would give each rank a
            # slice of [Q | K | V], not whole heads (see docs/design/exports.md).
            fused.append(f"{sources[0].name} -> {o.name}")
            continue
        for s in sources:
            roles[s] = MegatronSplit.COLUMN
        roles[o] = MegatronSplit.ROW
        attention += 1
    mlps = sum(1 for r in roles.values() if r is MegatronSplit.ROW) - attention
    units: dict[str, UnitStrategy] = {}
    skipped = []
    for node, kind in roles.items():
        unit = _unit(node, kind, mesh, tp, dp_axes)
        if unit is None:
            skipped.append(node.name)
            continue
        units[node.name] = unit
        if kind is MegatronSplit.ROW:
            units.update(_reduce_before_bias(node, mesh, tp, dp_axes, params))
    notes = [f"megatron: {mlps} MLP and {attention} attention blocks on mesh axis {tp} (tp)"]
    if fused:
        notes.append(
            f"megatron: {len(fused)} attention blocks with a fused QKV projection left to "
            "data parallelism (a column split would mix Q, K and V): " + ", ".join(fused[:5])
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


def _unit(node: ir.Node, kind: MegatronSplit, mesh: Mesh, tp: int, dp_axes) -> UnitStrategy | None:
    _check_weight_split(node, kind, mesh, tp)
    x = node.inputs[0]
    xshape = static_shape(x)
    batch_ok = all(xshape[0] % mesh.shape[a] == 0 for a in dp_axes) if xshape else False
    xl, wl, ol = _layouts(len(xshape), mesh, tp, dp_axes, batch_ok, kind)
    for cand in sa.candidates(node, mesh):
        if sa.matches(cand, (xl, wl), (ol,)):
            return UnitStrategy(inputs=(xl, wl), outputs=(ol,))
    return None


def _reduce_before_bias(node: ir.Node, mesh: Mesh, tp: int, dp_axes, params) -> dict:
    """Megatron all-reduces a row-parallel output before its bias Add: list that Add.

    Without it the cheapest-conversion choice would reduce-scatter instead (sequence
    parallelism), which moves the same bytes in two collectives instead of one.
    """
    uses = node.outputs[0].uses()
    if len(uses) != 1 or uses[0].node.op_type != "Add":
        return {}
    add = uses[0].node
    other = add.inputs[1 - uses[0].idx]
    if other is None or other.name not in params:
        return {}
    act = [Replicate()] * mesh.ndim
    xshape = static_shape(node.outputs[0])
    for a in dp_axes:
        if xshape and xshape[0] % mesh.shape[a] == 0:
            act[a] = Shard(0)
    act_layout = Layout(tuple(act))
    bias_layout = Layout((Replicate(),) * mesh.ndim)
    ins = [act_layout, act_layout]
    ins[1 - uses[0].idx] = bias_layout
    for cand in sa.candidates(add, mesh):
        if sa.matches(cand, tuple(ins), (act_layout,)):
            return {add.name: UnitStrategy(inputs=tuple(ins), outputs=(act_layout,))}
    return {}


def _check_weight_split(node: ir.Node, kind: MegatronSplit, mesh: Mesh, tp: int) -> None:
    """Refuse a block whose weight the tp axis cannot split as Megatron promises.

    Column-parallel splits the weight's output dim (1), row-parallel its input dim (0).
    """
    weight = node.inputs[1]
    assert weight is not None  # a weight MatMul (see _weight_matmuls)
    dim = 1 if kind is MegatronSplit.COLUMN else 0
    size, n = static_shape(weight)[dim], mesh.shape[tp]
    if size % n:
        raise ShardingError(
            f"megatron over {n} devices on mesh axis {tp} ({mesh.axis_names[tp]}): weight "
            f"{weight.name!r} of MatMul {node.name!r} ({kind.value}-parallel) dim {dim} has "
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


def builtin_plan(name: str, graph: ir.Graph, sig: StepSignature, mesh: Mesh) -> BuiltPlan:
    """A built-in plan by name; refuses a mesh on which it cannot split what it promises."""
    if name == "data-parallel":
        built = data_parallel(mesh)
    elif name == "megatron":
        built = megatron(graph, sig, mesh)
    else:
        raise PlanError(
            f"unknown built-in plan {name!r}; use data-parallel, megatron or a PLAN.json"
        )
    _check_batch(graph, sig, mesh, built.data_axes, name)
    return built


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
