"""Build the Frontier Tracking problem of a training step on one mesh (DESIGN §4).

Units and their programs come from :mod:`tensoropt.passes.units`: a unit is a forward (or
loss) node with its followers, backward nodes and parameter updates, and a unit strategy
fixes the layout of every one of them. The problem prices exactly what the partitioner
emits for those programs:

- Unit cost of strategy s: compute of the local shards of the root and its followers,
  forward + backward (``cost.compute``), the optimizer update of the parameters the unit
  places (it is their first reader), and every conversion inside the unit (gradient
  all-reduces of replicated parameters among them). Memory: placed parameter shards x
  (parameter + gradient + optimizer states, as the step holds them) plus the local
  outputs of its forward nodes that the backward reads.
- Edge cost of (s_u, s_w): for every value one of the two units holds and the other
  reads (forward activations, parameters and data inputs read by a second unit,
  gradients flowing back), the conversion from the holder's layout to the reader's entry
  layout. Memory: the converted buffer of forward values that the backward reads (a
  value no backward node reads lives from its conversion to its reader, like a forward
  output that is not saved).

Every total is a plain sum of unit and edge entries, as the frontier DP needs.

Micro-batching (``micro_batches`` k > 1, ``passes.micro``): the problem is built on the
micro mesh (the plan's mesh with the sequential micro axis in front), so that local
shapes are those of one micro-batch. Compute and every conversion of the micro phase
count k times; an all-reduce over the micro axis is the runtime's accumulation: it
counts once per step, over its other axes (nothing when none remain), and so do the
conversion steps after it. Activations are held at the micro-batch size; each placed
parameter adds one accumulation buffer of its gradient and k - 1 accumulating adds; the
update runs once.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.cost.compute import (
    GRID_UPDATE_STATES,
    MASK_SCORE,
    accumulate_time,
    family,
    forward_time,
    grid_update_slots,
    numel_or_zero,
    op_time,
    update_time,
)
from tensoropt.errors import PlanError, ShardingError
from tensoropt.ir.builder import ROLE_KEY, static_shape
from tensoropt.ir.costs import CostProblem, Edge, Strategy, Unit
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard, local_shape, numel
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.ir.redistribute import CollectiveKind, comm_bytes, latency_terms
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.autodiff import ACCUMULATES_KEY, unit_of
from tensoropt.passes.micro import MICRO_INDEX, micro_axes, micro_mesh
from tensoropt.passes.recompute import RECOMPUTE_KEY, RECOMPUTE_OF_KEY
from tensoropt.passes.units import (
    Conversion,
    Crossing,
    Entry,
    Program,
    ProgramCache,
    StepUnits,
    conversion_steps,
    itemsize,
    scatters_first,
    zero_shards,
)
from tensoropt.rules.sharding import MeshSharding

log = logging.getLogger(__name__)

_VIEWS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")


@dataclass(frozen=True, slots=True)
class SearchGraph:
    """What the cost model reads of a model: its training step, grouped into units."""

    graph: ir.Graph  # the training step (forward, loss, backward, optimizer)
    params: frozenset[str]
    data_inputs: tuple[str, ...]  # data inputs and labels
    optimizer_states: int  # state tensors per parameter (SGD momentum 1, Adam 2)
    batch: int  # global samples per step (dim 0 of the first data input)
    saved: frozenset[str]  # forward values the backward reads (held from forward to backward)
    units: StepUnits
    signature: object  # the step's StepSignature


class _GraphFacts:
    """What every mesh's builder reads of a search graph's units, found once per graph:
    per unit, the parameters it places and which of its outputs the backward saves
    (``_Builder._signature``), its follower nodes, and which root inputs are stored
    (``unit_strategies``' key); per crossing, the value's shape, item size and whether
    its converted buffer is held (``_Builder._crossing``). Deep models have thousands of
    units and a search builds a hundred problems of one graph."""

    def __init__(self, sg: SearchGraph) -> None:
        su = sg.units
        fixed = sg.params | set(sg.data_inputs)
        self.signatures = []
        self.followers = []
        self.stored = []
        for k, unit in enumerate(su.units):
            owned = tuple(su.owner.get(v.name) == k for v in unit.externals)
            saved = tuple(v.name in sg.saved for node in unit.nodes for v in node.outputs)
            self.signatures.append((owned, saved))
            self.followers.append(
                tuple(
                    n
                    for n in unit.nodes[1:]
                    if n.metadata_props.get(ROLE_KEY) in ("forward", "loss")
                )
            )
            self.stored.append(
                tuple(
                    None if v is None else (v.name in fixed, v.name in sg.params)
                    for v in unit.root.inputs
                )
            )
        self.fixed = frozenset(fixed)
        self.crossings = tuple(
            None
            if c.source == c.target  # within a unit: no edge
            else (static_shape(c.value), itemsize(c.value), c.forward and c.value.name in sg.saved)
            for c in su.crossings
        )
        # per crossing between units, a small int for the part of its price key that
        # no program changes (its ends, value shape, item size, held buffer); and the
        # crossings grouped by unit pair (a < b), in pair order, each with whether it
        # runs from b to a (``_Builder.edges``)
        static: dict = {}
        self.crossing_keys = tuple(
            None
            if f is None
            else static.setdefault((c.source_ref, c.index, c.forward, *f), len(static))
            for c, f in zip(su.crossings, self.crossings, strict=True)
        )
        groups: dict[tuple[int, int], list[tuple[int, bool]]] = {}
        for i, c in enumerate(su.crossings):
            if c.source != c.target:
                a = min(c.source, c.target)
                groups.setdefault((a, max(c.source, c.target)), []).append((i, c.source != a))
        self.edge_groups = tuple(sorted(groups.items()))
        # per group, a small int for its crossings' static keys and directions: with the
        # two units' programs it names the group's summed tables (``_Builder.edges``)
        kinds: dict = {}
        self.group_keys = tuple(
            kinds.setdefault(tuple((self.crossing_keys[i], flip) for i, flip in cs), len(kinds))
            for _, cs in self.edge_groups
        )


_FACTS: list[tuple[SearchGraph, _GraphFacts]] = []  # the few graphs in use, latest last
_FACTS_KEPT = 4


def graph_facts(sg: SearchGraph) -> _GraphFacts:
    """The :class:`_GraphFacts` of ``sg`` (a graph is never changed once a search graph
    holds it)."""
    for i, (held, facts) in enumerate(_FACTS):
        if held is sg:
            if i != len(_FACTS) - 1:
                _FACTS.append(_FACTS.pop(i))
            return facts
    facts = _GraphFacts(sg)
    _FACTS.append((sg, facts))
    del _FACTS[:-_FACTS_KEPT]
    return facts


@dataclass(frozen=True, slots=True)
class UnitInfo:
    """A root node, its strategies, and the follower nodes folded into it."""

    node: ir.Node
    strategies: tuple[MeshSharding, ...]
    followers: tuple[ir.Node, ...] = ()


@dataclass(frozen=True, slots=True)
class MeshProblem:
    """A cost problem with the nodes, strategies and programs behind its indices."""

    problem: CostProblem
    mesh: Mesh
    units: tuple[UnitInfo, ...]
    programs: tuple[tuple[Program, ...], ...]  # per unit, per strategy
    crossings: tuple[Crossing, ...]
    sg: SearchGraph
    micro_batches: int = 1  # > 1: ``mesh`` is the micro mesh (see the module doc)


# the runtime op type of each communicating redistribution step (profile.link_for keys)
OP_TYPE = {
    CollectiveKind.ALL_REDUCE: "AllReduce",
    CollectiveKind.ALL_GATHER: "AllGather",
    CollectiveKind.REDUCE_SCATTER: "ReduceScatter",
    CollectiveKind.ALL_TO_ALL: "AllToAll",
}


def axis_link(mesh: Mesh, axes: Sequence[int], profile: ClusterProfile):
    """The link a collective over ``axes`` uses: inter-node when its group spans nodes."""
    span = 1
    for a in axes:
        stride = math.prod(mesh.shape[a + 1 :])
        span = max(span, stride * mesh.shape[a])
    return profile.intra if span <= profile.devices_per_node else profile.inter


@dataclass(frozen=True, slots=True)
class PricedCollective:
    """One collective a plan emits on every rank: kind, mesh axes, local input bytes."""

    kind: str  # the runtime op type (AllReduce, AllGather, ReduceScatter, AllToAll)
    axes: tuple[int, ...]  # of the problem's mesh (the micro mesh when micro-batched)
    in_bytes: int
    times: int = 1  # issued per step: the micro-batch count in the micro phase
    # the unit whose program emits it (a crossing's: the reading unit); not part of
    # what the device graph shows, so equality ignores it
    unit: int = field(default=-1, compare=False)


class _Pricer:
    """Prices conversions and unit computations (memoised per distinct input)."""

    def __init__(
        self,
        sg: SearchGraph,
        mesh: Mesh,
        profile: ClusterProfile,
        micro: int = 1,
        slots: int | None = None,
        saved_scale: float = 1.0,
        parts: tuple[dict, dict] | None = None,
    ):
        self.sg = sg
        self.mesh = mesh
        self.profile = profile
        self.micro = micro  # micro-batches per step (mesh is the micro mesh when > 1)
        # a pipeline stage's micro-batch slots per step (m + P - 1): per-micro-batch work
        # counts this many times, per-step work once (cost.pipeline); default: micro
        self.slots = micro if slots is None else slots
        self.saved_scale = saved_scale  # 0: price without the activations (cost.pipeline)
        self.conv_cache: dict = {}
        self.node_cache: dict = {}
        # What a price is made of before the slots and the scale apply (a conversion's
        # collectives, a node's time per micro-batch and saved bytes): the expensive part,
        # shared by the pricers of one graph, mesh and profile that differ in slots and
        # scale only. Each price is then the same float operations as without them.
        # (conversions, nodes): the pricer's own unless another's are given
        self.parts: tuple[dict, dict] = ({}, {}) if parts is None else parts

    def convert(
        self, have: Layout, need: Layout, shape, isz: int, order: tuple[bool, bool] = (False, False)
    ) -> tuple[float, float]:
        """(seconds, buffer bytes) to turn ``have`` into ``need`` for a value of ``shape``.
        ``order``: (scatter first, once per step), see :func:`conversion_order`."""
        if have == need:
            return 0.0, 0.0
        key = (have, need, tuple(shape), isz, order)
        found = self.conv_cache.get(key)
        if found is None:
            parts = self.parts[0].get(key)
            if parts is None:
                parts = self.parts[0][key] = self._conversion(have, need, shape, isz, order)
            collectives, buffer = parts
            seconds = 0.0
            for times, once in collectives:
                if self.micro > 1 and times == self.micro:
                    times = self.slots
                seconds += times * once
            found = self.conv_cache[key] = (seconds, buffer)
        return found

    def _conversion(self, have, need, shape, isz, order) -> tuple[tuple, float]:
        """The collectives of a conversion, each as (times issued per step, seconds
        once), and its buffer bytes."""
        scatter_first, per_step = order
        try:
            steps = conversion_steps(have, need, shape, self.mesh, scatter_first=scatter_first)
        except ShardingError:
            return (), 0.0
        dtype = np.dtype(f"V{isz}")
        collectives = []
        for cs, axes, times in issued(steps, self.mesh, self.micro, per_step):
            n = math.prod(self.mesh.shape[a] for a in axes)
            link = self.profile.link_for(
                OP_TYPE[cs.step.kind], axis_link(self.mesh, axes, self.profile)
            )
            volume = comm_bytes(cs.step, cs.in_shape, dtype, n)
            once = latency_terms(cs.step.kind) * link.alpha_s + volume / link.bandwidth
            collectives.append((times, once))
        buffer = numel(steps[-1].out_shape) * isz if steps else 0.0
        return tuple(collectives), buffer

    def node(self, node: ir.Node, strategy: MeshSharding) -> tuple[float, float]:
        """(compute seconds, saved-output bytes) of a forward node under ``strategy``."""
        saved = tuple(v.name in self.sg.saved for v in node.outputs)
        summed = accumulations(self.sg.graph)
        adds = tuple(summed.get(v.name, 0) for v in node.outputs)
        key = (sa.view_key(node), strategy, saved, masked_fraction(node), adds)
        found = self.node_cache.get(key)
        if found is None:
            parts = self.parts[1].get(key)
            if parts is None:
                parts = self.parts[1][key] = self._node_parts(node, strategy, adds)
            once, streamed, sums, held = parts
            seconds = max(once * self.slots, streamed * self.slots)
            for add in sums:  # the backward sums the output's gradients
                seconds += add * self.slots
            memory = 0.0
            for nbytes in held:
                memory += nbytes * self.saved_scale
            found = self.node_cache[key] = (seconds, memory)
        return found

    def _node_parts(self, node: ir.Node, strategy: MeshSharding, adds: tuple) -> tuple:
        """What :meth:`node` prices from: the op's seconds once, its streamed bytes'
        seconds once (0 when the floor does not apply), the Adds' seconds once per
        summed gradient (count x one Add), and the bytes of each saved output."""
        local = sa.localize(node, strategy, self.mesh)
        once = self._once(op_time, node, local)
        streamed = self._streamed(node, local, True)
        sums = []
        for j, count in enumerate(adds):
            if count:
                shape = local.output_shapes[j]
                isz = itemsize(node.outputs[j])
                add = forward_time("Add", {}, [shape, shape], [shape], isz, self.profile)
                sums.append(count * add)
        held = []
        if node.op_type not in _VIEWS:  # a view of its input holds nothing new
            for j, shape in enumerate(local.output_shapes):
                if node.outputs[j].name in self.sg.saved:
                    held.append(numel_or_zero(shape) * itemsize(node.outputs[j]))
        return once, streamed, tuple(sums), tuple(held)

    def recompute(self, node: ir.Node, strategy: MeshSharding) -> float:
        """Forward seconds per step of a recompute node (``passes.recompute``) under
        ``strategy``: it reruns in the backward of every micro-batch."""
        key = ("recompute", sa.view_key(node), strategy, masked_fraction(node))
        found = self.node_cache.get(key)
        if found is None:
            parts = self.parts[1].get(key)
            if parts is None:
                local = sa.localize(node, strategy, self.mesh)
                once = self._once(forward_time, node, local)
                parts = self.parts[1][key] = (once, self._streamed(node, local, False))
            found = self.node_cache[key] = max(parts[0] * self.slots, parts[1] * self.slots)
        return found

    def _streamed(self, node: ir.Node, local, backward: bool) -> float:
        """Seconds per micro-batch slot for ``node`` to stream its bytes from memory:
        its local inputs and outputs, and with ``backward`` the bytes its emitted
        backward nodes read and write (``backward_bytes``, scaled to the local shard). A
        floor under the measured price, for calibrated profiles only: their curves come
        from chains of one op whose operands stay in cache, while a step reads what its
        forward saved long before, after the rest of the model has passed through the
        cache.
        Measured on ResNet-50 and GPT small: element-wise, norm and activation nodes ran
        1.5-3x their chain rates, near this floor (docs/design/measured.md). Only nodes
        that read or make a saved value (``sg.saved``): inside a recomputed block the
        backward reads what was recomputed just before it. Contractions (MatMul, Gemm,
        Conv) are compute-bound and keep their grids; a built-in profile's roofline
        already prices traffic at the device's memory bandwidth."""
        saved = self.sg.saved
        if (
            "elementwise" not in self.profile.op_curves
            or family(node.op_type) in ("matmul", "conv") or node.op_type in _VIEWS
            or not any(v is not None and v.name in saved for v in (*node.inputs, *node.outputs))
        ):  # fmt: skip
            return 0.0
        isz = itemsize(node.outputs[0])
        ins = [shape for shape in local.input_shapes if shape is not None]
        moved = sum(numel_or_zero(shape) for shape in (*ins, *local.output_shapes)) * isz
        if backward:
            whole = numel_or_zero(static_shape(node.outputs[0]))
            share = numel_or_zero(local.output_shapes[0]) / whole if whole else 1.0
            moved += backward_bytes(self.sg.graph).get(unit_of(node), 0.0) * share
        return moved / self.profile.memory_bandwidth

    def _once(self, timer, node: ir.Node, local) -> float:
        """``timer`` (op_time or forward_time) of ``node``'s local op, once: a step runs
        it once per micro-batch slot."""
        attrs = sa.op_view(node).attributes
        ins, outs = local.input_shapes, local.output_shapes
        isz = itemsize(node.outputs[0])
        return timer(node.op_type, attrs, ins, outs, isz, self.profile, masked_fraction(node))


_ACCUMULATIONS_META = "tensoropt.accumulations"


def accumulations(graph: ir.Graph) -> Mapping[str, int]:
    """Per forward value, the Adds the backward spends summing its gradient
    contributions (one fewer than the uses that take a gradient; ``autodiff`` marks
    them). Each is an element-wise pass over the value's gradient, priced with the
    value's producer. Memoised on the graph."""
    found = graph.meta.get(_ACCUMULATIONS_META)
    if found is None:
        found = {}
        for n in graph:
            name = n.metadata_props.get(ACCUMULATES_KEY)
            if name:
                found[name] = found.get(name, 0) + 1
        graph.meta[_ACCUMULATIONS_META] = found
    return found


_BACKWARD_BYTES_META = "tensoropt.backward_bytes"


def backward_bytes(graph: ir.Graph) -> Mapping[str, float]:
    """Per forward node (its unit key), the bytes its backward nodes read and write on
    the step's global shapes, the gradient sums aside (``accumulations`` prices those).
    Memoised on the graph."""
    found = graph.meta.get(_BACKWARD_BYTES_META)
    if found is None:
        found = {}
        for n in graph:
            if n.metadata_props.get(ROLE_KEY) != "backward" or ACCUMULATES_KEY in n.metadata_props:
                continue
            if n.op_type in _VIEWS or n.op_type == "Constant":
                continue
            moved = 0.0
            for v in (*n.inputs, *n.outputs):
                if v is not None and v.shape is not None and v.dtype is not None:
                    try:
                        moved += numel_or_zero(static_shape(v)) * v.dtype.itemsize
                    except (TypeError, ValueError):
                        continue  # a symbolic dimension: not a tensor this model moves
            key = unit_of(n)
            found[key] = found.get(key, 0.0) + moved
        graph.meta[_BACKWARD_BYTES_META] = found
    return found


_MASKED_META = "tensoropt.masked_fraction"


def masked_fraction(node: ir.Node) -> float:
    """The fraction of a Softmax's input scores that a constant mask sets to a masking
    value (<= ``MASK_SCORE``), as attention masks do: ``Add(scores, mask)`` with a
    constant mask, or ``Where(cond, scores, fill)`` with a constant condition and a
    masking fill (either branch). Broadcasting repeats the constant evenly, so its own
    fraction is the output's. 0 for any other op or producer (a mask computed at run
    time cannot be seen here). Memoised on the node."""
    if node.op_type != "Softmax" or not node.inputs or node.inputs[0] is None:
        return 0.0
    found = node.meta.get(_MASKED_META)
    if found is None:
        found = node.meta[_MASKED_META] = _masked_fraction(node.inputs[0].producer())
    return found


def _masked_fraction(producer: ir.Node | None) -> float:
    from tensoropt.rules.grad.api import constant_value

    if producer is None or producer.domain not in ("", "ai.onnx"):
        return 0.0
    consts = [None if v is None else constant_value(v) for v in producer.inputs]
    if producer.op_type == "Add" and len(consts) == 2:
        fractions = [float(np.mean(c <= MASK_SCORE)) for c in consts if _is_float(c)]
        return max(fractions, default=0.0)
    if producer.op_type == "Where" and len(consts) == 3 and consts[0] is not None:
        cond = consts[0].astype(bool)
        if _is_float(consts[2]) and bool(np.all(consts[2] <= MASK_SCORE)):
            return float(np.mean(~cond))  # the fill where the condition is false
        if _is_float(consts[1]) and bool(np.all(consts[1] <= MASK_SCORE)):
            return float(np.mean(cond))
    return 0.0


def _is_float(value: np.ndarray | None) -> bool:
    return value is not None and value.size > 0 and np.issubdtype(value.dtype, np.floating)


def param_bytes(
    elements: float, shard: float, states: int, isz: int, zero: ZeroStage, in_place: bool = False
) -> float:
    """Resident bytes of one parameter of ``elements`` local elements (``shard`` of them
    in its ZeRO shard) with ``states`` optimizer states each.

    The step holds the parameter and its gradient, the new parameter it returns, and
    each optimizer state twice (in and out). ``in_place``: the step phase of a
    micro-batched plan writes each new state over the old one (``runtime.inplace``), so
    each state is held once, and so is the parameter, except under ZeRO 1 and 2, whose
    new parameter is an AllGather's result beside the old one. ZeRO 1 and 2 keep the
    states as shards; ZeRO 3 also the parameter. ZeRO 3's full-size transients (the
    gathered copies and the gradient before its reduce-scatter) live only around the
    unit's own forward or backward: :func:`gathered_bound` prices them once per step,
    not here."""
    copies = 1 if in_place else 2  # of each state (and of a parameter updated in place)
    if zero is ZeroStage.NONE:
        return elements * isz * (1 + copies + copies * states)
    if zero is ZeroStage.PARAMETERS:
        return shard * copies * (1 + states) * isz
    return (elements * 3 + shard * copies * states) * isz


def gathered_bound(sg: SearchGraph) -> float:
    """The bytes of ZeRO-3's full-size transients live at once, as a constant of the
    step: twice the full parameters of the unit that places the most (its gathered copy
    for the backward and its gradient before the reduce-scatter). The runtime gathers a
    ZeRO-3 parameter just before its readers and frees the copy after the last one, and
    reduce-scatters a gradient as soon as it is made, so the transients at any moment
    are about those of one unit (docs/design/memory-axes.md). A constant keeps every
    problem a sum of unit entries; it is added once to a problem where some unit runs
    stage 3, in the search and in ``compile``'s estimate alike."""
    su = sg.units
    placed: dict[int, float] = {}
    for name in sg.params:
        k = su.owner.get(name)
        value = sg.graph.initializers.get(name)
        if k is None or value is None:
            continue
        placed[k] = placed.get(k, 0.0) + numel_or_zero(static_shape(value)) * itemsize(value)
    return 2.0 * max(placed.values(), default=0.0)


def _allowed(node: ir.Node, s: MeshSharding, fixed_inputs, params) -> bool:
    """Strategies the search considers.

    No Partial on parameters or data inputs (they are stored, not summed). On a 2-D
    mesh the first axis is a data axis (dp x tp, as in Megatron-LM): every tensor is
    either replicated on it or split on dim 0 (the batch), so parameters are replicated
    there; the second axis takes every legal strategy. Pure tensor parallelism over
    all devices is the 1-D mesh's job. This keeps 2-D problems to ~3x (not ~8x) the
    strategies of 1-D ones.
    """
    for value, layout in zip(node.inputs, s.inputs, strict=False):
        if value is None or layout is None:
            continue
        if value.name in fixed_inputs and any(isinstance(p, Partial) for p in layout.placements):
            return False
        multi = len(layout.placements) > 1
        if multi and value.name in params and not isinstance(layout.placements[0], Replicate):
            return False
    if len(s.outputs) and len(s.outputs[0].placements) > 1:
        layouts = [*(x for x in s.inputs if x is not None), *s.outputs]
        if any(lay.placements[0] not in (_R, _S0) for lay in layouts):
            return False
    return True


_R = Replicate()
_S0 = Shard(0)


def unit_strategies(
    sg: SearchGraph, mesh: Mesh, k: int, memo: dict | None = None
) -> tuple[MeshSharding, ...]:
    """The strategies the search considers for unit ``k`` (see :func:`_allowed`).

    ``memo``: results on this mesh by what they depend on (the root's op and which of its
    inputs are stored), shared by repeated layers."""
    root = sg.units.units[k].root
    facts = graph_facts(sg)
    key = None
    if memo is not None:
        key = (sa.view_key(root), facts.stored[k])
        found = memo.get(key)
        if found is not None:
            return found
    found = tuple(s for s in sa.candidates(root, mesh) if _allowed(root, s, facts.fixed, sg.params))
    if not found:
        raise ShardingError(f"node {root.name!r} ({root.op_type}) has no legal strategy")
    if memo is not None:
        memo[key] = found
    return found


class _Builder:
    def __init__(
        self,
        sg: SearchGraph,
        mesh: Mesh,
        profile: ClusterProfile,
        only,
        zero: Mapping[str, ZeroStage] | None = None,
        chosen: dict | None = None,
        slots: int | None = None,
        saved_scale: float = 1.0,
        like: _Builder | None = None,
    ):
        self.zero = dict(zero or {})
        self.sg = sg
        self.su = sg.units
        self.mesh = mesh
        self.micro = mesh.shape[0] if mesh.sequential_axis == 0 else 1
        parts = None if like is None else like.pricer.parts
        self.pricer = _Pricer(sg, mesh, profile, self.micro, slots, saved_scale, parts)
        self.programs = ProgramCache(self.su, mesh, chosen) if like is None else like.programs
        self.only = only
        self.update_cache: dict = {}
        # Repeated layers price alike: a unit's (time, memory) under a strategy is keyed by
        # its structure, the strategy, which parameters it places and which outputs the
        # backward saves; a crossing's tables by its two units' programs, ends and value.
        self.unit_cache: dict = {}
        self.crossing_cache: dict = {}
        self.program_rows: dict[tuple[int, ...], int] = {}  # a unit's program ids -> int
        # summed tables of an edge by the ids of its crossings' cached tables (alive in
        # crossing_cache as long as this builder), and by its two units' programs and its
        # group's static key (_GraphFacts.group_keys), which name the same tables
        self.edge_cache: dict = {}
        self.group_cache: dict = {}
        self.signatures = graph_facts(sg).signatures

    def infos(self) -> list[UnitInfo]:
        infos = []
        memo: dict = {}
        followers = graph_facts(self.sg).followers
        for k, unit in enumerate(self.su.units):
            if self.only is not None:
                strategies: tuple[MeshSharding, ...] = tuple(self.only[unit.root.name])
            else:
                strategies = unit_strategies(self.sg, self.mesh, k, memo)
            infos.append(UnitInfo(unit.root, strategies, followers[k]))
        return infos

    def unit(self, k: int, strategy: MeshSharding, program: Program) -> tuple[float, float]:
        unit = self.su.units[k]
        key = (unit.key, strategy, self._signature(k), program.zero)
        found = self.unit_cache.get(key)
        if found is None:
            found = self.unit_cache[key] = self._unit(k, strategy, program)
        return found

    def _signature(self, k: int) -> tuple:
        """What a unit's pricing reads besides its structure: the parameters it places and
        which of its outputs the backward saves."""
        return self.signatures[k]

    def _unit(self, k: int, strategy: MeshSharding, program: Program) -> tuple[float, float]:
        unit = self.su.units[k]
        seconds = 0.0
        memory = 0.0
        for i, node in enumerate(unit.nodes):
            if RECOMPUTE_KEY in node.metadata_props:  # the forward again, in the backward
                seconds += self.pricer.recompute(node, program.strategies[i])
                continue
            if node.metadata_props.get(ROLE_KEY) not in ("forward", "loss"):
                continue
            t, m = self.pricer.node(node, program.strategies[i])
            seconds += t
            memory += m
        t, m = self._params(k, strategy, program)
        seconds += t
        memory += m
        for conv in program.conversions:
            value = _value_at(unit, conv.ref)
            order = conversion_order(program, conv)
            shape = static_shape(value)
            t, _ = self.pricer.convert(conv.have, conv.need, shape, itemsize(value), order)
            seconds += t
        return seconds, memory

    def _params(self, k: int, strategy: MeshSharding, program: Program) -> tuple[float, float]:
        """Update time and resident bytes of the parameters unit ``k`` places."""
        unit = self.su.units[k]
        seconds = 0.0
        memory = 0.0
        in_grid = grid_update_slots(unit.root.op_type, self.pricer.profile)
        grid_slots = {unit.root.inputs[i] for i in in_grid if i < len(unit.root.inputs)} - {None}
        states = self.sg.optimizer_states
        sharded = {z.index: z for z in program.shards}
        in_place = self.micro > 1  # the step phase updates in place (runtime.inplace)
        charged = 0.0  # the root's compute per micro-batch slot, which holds the grid update
        if grid_slots:
            i = next(i for i, n in enumerate(unit.nodes) if n is unit.root)
            charged = self.pricer.node(unit.root, program.strategies[i])[0] / self.pricer.slots
        for x, value in enumerate(unit.externals):
            if unit.kinds[x] is not Entry.PARAM or self.su.owner.get(value.name) != k:
                continue
            isz = itemsize(value)
            z = sharded.get(x)
            use = program.entries[x] if z is None else z.use
            elements = numel_or_zero(local_shape(static_shape(value), use, self.mesh, value.name))
            updated = elements
            if z is None:
                memory += param_bytes(elements, elements, states, isz, ZeroStage.NONE, in_place)
            else:
                updated = numel_or_zero(local_shape(static_shape(value), z.shard, self.mesh))
                memory += param_bytes(elements, updated, states, isz, program.zero, in_place)
            update = update_time(updated, states, isz, self.pricer.profile)
            if self.micro > 1:  # the gradient's accumulation buffer and its adds
                # ZeRO 2 and 3 accumulate the gradient's shard, the others the whole of it
                summed = updated if z is not None and scatters_first(program.zero) else elements
                memory += summed * isz
                seconds += accumulate_time(summed, self.micro, isz, self.pricer.profile)
            if value in grid_slots:  # op_time's grid entry holds a momentum-SGD update of it
                held = update_time(elements, GRID_UPDATE_STATES, isz, self.pricer.profile)
                # never more than the grid entry charged per slot (a calibration can
                # find the trained GEMM faster than the element-wise update priced alone)
                held = min(held, charged)
                charged -= held
                # ZeRO: the update runs on the shard, the grid entry held the whole one
                update = update - held if z is not None else max(update - held, 0.0)
                # the grid entry is charged once per micro-batch slot, the update runs once
                update -= held * (self.pricer.slots - 1)
            seconds += update
        return seconds, memory

    def _crossing(
        self, c: Crossing, programs, facts: tuple, key: tuple
    ) -> tuple[np.ndarray, np.ndarray]:
        """(time, memory) tables [source strategy][target strategy] of one crossing;
        ``facts``: its (shape, item size, held) (``_GraphFacts.crossings``); ``key``:
        its two units' programs and its static part, as small ints (``edges``).

        Each distinct (holder layout, entry layout) pair is priced once. The converted
        buffer counts as memory only when the backward reads the value (it is saved, as
        a node's output is); otherwise it lives from the conversion to its reader."""
        found = self.crossing_cache.get(key)
        if found is None:
            shape, isz, kept = facts
            found = self._crossing_tables(c, programs, shape, isz, kept)
            self.crossing_cache[key] = found
        return found

    def _crossing_tables(self, c: Crossing, programs, shape, isz, kept: bool):
        haves, rows = _distinct([p.layout(c.source_ref) for p in programs[c.source]])
        # how the conversion is emitted follows each target program's own ZeRO stage
        # (a family's strategies differ there: a strategy without a data-parallel axis
        # takes none), as ``priced_collectives`` and compile read it
        needs, cols = _distinct(
            [(p.entries[c.index], conversion_order(p)) for p in programs[c.target]]
        )
        times = np.zeros((len(haves), len(needs)))
        mems = np.zeros_like(times)
        for h, have in enumerate(haves):
            for n, (need, order) in enumerate(needs):
                t, buf = self.pricer.convert(have, need, shape, isz, order)
                times[h, n] = t
                if kept:
                    mems[h, n] = buf * self.pricer.saved_scale
        return times[rows][:, cols], mems[rows][:, cols]

    def edges(self, infos, programs) -> tuple[list[Edge], list[Crossing]]:
        found = self.su.crossings
        facts = graph_facts(self.sg)
        # each unit's programs as a small int: programs are shared objects
        # (ProgramCache), alive for the whole build, so their identities name them
        named = self.program_rows
        rows = [named.setdefault(tuple(map(id, ps)), len(named)) for ps in programs]
        at, keys = facts.crossings, facts.crossing_keys
        edges = []
        for ((a, b), cs), group in zip(facts.edge_groups, facts.group_keys, strict=True):
            # every crossing of the group runs between units a and b, so their programs
            # and the group's static key name each crossing's key, hence its tables
            named_edge = (rows[a], rows[b], group)
            tables = self.group_cache.get(named_edge)
            if tables is not None:
                edges.append(Edge(a, b, *tables))
                continue
            parts = []
            for i, flip in cs:
                c = found[i]
                key = (rows[c.source], rows[c.target], keys[i])
                parts.append((*self._crossing(c, programs, at[i], key), flip))
            # repeated layers sum the same cached crossing tables: one table object for
            # all of them (built once, and validated once by CostProblem)
            key = tuple((id(t), id(m), flip) for t, m, flip in parts)
            tables = self.edge_cache.get(key)
            if tables is None:
                times = np.zeros((len(infos[a].strategies), len(infos[b].strategies)))
                mems = np.zeros_like(times)
                for t, m, flip in parts:
                    if flip:  # tables are indexed [strategy of a][strategy of b]
                        t, m = t.T, m.T
                    times += t
                    mems += m
                tables = self.edge_cache[key] = (_table(times), _table(mems))
            self.group_cache[named_edge] = tables
            edges.append(Edge(a, b, *tables))
        return edges, found


def _distinct(layouts: Sequence[Hashable]) -> tuple[list, np.ndarray]:
    """The distinct layouts (or layouts with what else prices their conversion), and
    for each strategy the index of its own among them."""
    index: dict = {}
    where = np.array([index.setdefault(lay, len(index)) for lay in layouts], dtype=np.intp)
    return list(index), where


def _value_at(unit, ref) -> ir.Value:
    if ref[0] == "x":
        return unit.externals[ref[1]]
    return unit.nodes[ref[1]].outputs[ref[2]]


def build_problem(
    sg: SearchGraph,
    mesh: Mesh,
    profile: ClusterProfile,
    only: Mapping[str, MeshSharding] | None = None,
    *,
    micro_batches: int = 1,
    zero: Mapping[str, ZeroStage] | None = None,
) -> MeshProblem:
    """The cost problem of ``sg`` on ``mesh`` (see the module doc).

    ``only``: price just these root strategies (unit name -> strategy), one per unit: the
    problem of one plan, whose single choice is all zeros. ``micro_batches``: micro-batches
    per step; above 1 the strategies (and ``only``) are those of the micro mesh
    (``passes.micro.micro_mesh(mesh, micro_batches)``), one problem per (mesh, k).
    ``zero``: the ZeRO stage of units (unit name -> stage; absent: none), applied to each
    of their strategies.
    """
    choices = None if only is None else {name: (s,) for name, s in only.items()}
    family = ProblemFamily(sg, mesh, profile, micro_batches=micro_batches, choices=choices)
    return family.problem(zero=zero)


@dataclass(frozen=True, slots=True)
class WorkingSetBound:
    """A bound of the working set of the largest recomputed block that is a sum of unit
    terms, so that a problem with recomputed blocks stays a sum of its entries
    (``--dump-costs`` stays exact).

    w(u, b, s): the bytes unit u's recompute nodes of block b make under strategy s
    (:func:`recompute_working_set`); r(u, b): their least over the unit's strategies.
    For every plan s and block b, W_b(s) = sum_u w(u, b, s_u) <= sum_u r(u, b) +
    sum_u (w(u, b, s_u) - r(u, b)), so

        max_b W_b(s) <= max_b sum_u r(u, b) + sum_(u, b) (w(u, b, s_u) - r(u, b)):

    a constant (``constant``, added to the first unit's memory entries) plus each
    unit's excess over its floor (added to its own entries). It is exact when every unit
    takes its smallest strategy (the usual batch split), and counts the excess of every
    block instead of the largest block's otherwise."""

    constant: float
    floors: Mapping[tuple[int, str], float]  # (unit index, block) -> r(u, b)

    def excess(
        self, k: int, unit, program: Program, mesh: Mesh, sets: UnitWorkingSets | None = None
    ) -> float:
        """sum_b (w(u, b, s) - r(u, b)) of unit ``k`` under ``program`` (``sets``: a memo
        of the w terms, :class:`UnitWorkingSets`)."""
        sets = UnitWorkingSets(mesh) if sets is None else sets
        found = sets.of(unit, program)
        return sum(nbytes - self.floors[(k, block)] for block, nbytes in found.items())


class ProblemFamily:
    """The problems of one search graph on one mesh and micro-batch count that differ in
    their ZeRO stages: they share the strategy enumeration, the unit programs and every
    price (the search builds one problem per stage from one family).

    ``choices``: the strategies of each unit (unit name -> strategies; default: every
    strategy :func:`unit_strategies` allows), on the micro mesh when ``micro_batches`` > 1.
    ``chosen``: the nodes' choices shared with other families (``ProgramCache``).
    ``slots`` and ``saved_scale`` change the pricing only (``_Pricer``); ``like``: a
    family of the same graph, mesh, micro-batch count and profile, whose unit programs
    (which they do not change) and prices before slots and scale apply this one shares.
    """

    def __init__(
        self,
        sg: SearchGraph,
        mesh: Mesh,
        profile: ClusterProfile,
        *,
        micro_batches: int = 1,
        choices: Mapping[str, Sequence[MeshSharding]] | None = None,
        chosen: dict | None = None,
        slots: int | None = None,
        saved_scale: float = 1.0,
        like: ProblemFamily | None = None,
    ):
        self.sg = sg
        self.plan_mesh = mesh
        self.micro_batches = micro_batches
        self.mesh = micro_mesh(mesh, micro_batches) if micro_batches > 1 else mesh
        if like is not None and (
            like.sg is not sg or like.mesh != self.mesh or like.builder.pricer.profile != profile
        ):
            raise ValueError("like: a family of another graph, mesh or profile")
        self.builder = _Builder(
            sg, self.mesh, profile, choices, chosen=chosen, slots=slots,
            saved_scale=saved_scale, like=None if like is None else like.builder,
        )  # fmt: skip
        self.infos = self.builder.infos()
        self._bound: WorkingSetBound | None = None
        self._shardable: dict = {}  # (unit structure, placed, strategy) -> ZeRO can shard
        self._excess: dict = {}  # (unit, id(program)) -> its working-set excess
        self._excess_rows: dict = {}  # id(problem) -> per unit, per strategy: the excess
        self._sets = UnitWorkingSets(self.mesh)

    def zero_stage(self, k: int, strategy: MeshSharding, stage: ZeroStage) -> ZeroStage:
        """``stage`` where unit ``k`` under ``strategy`` has parameters ZeRO can shard
        (a data-parallel axis, a dimension it divides), else none: what ``--zero N``
        gives the unit (``passes.plans.with_zero``)."""
        if stage is ZeroStage.NONE:
            return stage
        su = self.sg.units
        unit = su.units[k]
        placed = graph_facts(self.sg).signatures[k][0]  # the parameters unit k places
        key = (unit.key, placed, strategy)  # repeated layers shard alike
        found = self._shardable.get(key)
        if found is None:
            try:
                found = bool(zero_shards(su, k, strategy, self.mesh))
            except PlanError:
                found = False
            self._shardable[key] = found
        return stage if found else ZeroStage.NONE

    def stores_whole(self) -> tuple[tuple[bool, ...], ...]:
        """Per unit, per strategy: whether every parameter the unit places is stored
        whole on the micro axis (replicated over the micro-batches). A strategy that
        splits one with the batch would have each micro-batch update a piece of it,
        which compile refuses (``passes.micro.annotate_micro``): a micro-batched search
        must not offer it. All true without micro-batches."""
        su = self.sg.units
        signatures = graph_facts(self.sg).signatures
        out = []
        rows: dict[tuple, tuple[bool, ...]] = {}  # repeated layers answer alike
        for k, info in enumerate(self.infos):
            unit = su.units[k]
            key = (unit.key, signatures[k], info.strategies)
            row = rows.get(key)
            if row is None:
                owned = signatures[k][0]
                kinds = unit.kinds
                placed = [x for x in range(len(owned)) if kinds[x] is Entry.PARAM and owned[x]]
                found = []
                for s in info.strategies:
                    ok = True
                    if self.micro_batches > 1 and placed:
                        entries = self.builder.programs.program(k, s).entries
                        ok = all(
                            isinstance(entries[x].placements[MICRO_INDEX], Replicate)
                            for x in placed
                        )
                    found.append(ok)
                row = rows[key] = tuple(found)
            out.append(row)
        return tuple(out)

    def working_set(self) -> WorkingSetBound:
        """The bound of the recompute working set over the plans of this family
        (:class:`WorkingSetBound`)."""
        if self._bound is None:
            floors: dict[tuple[int, str], float] = {}
            for k, (unit, info) in enumerate(zip(self.sg.units.units, self.infos, strict=True)):
                for s in info.strategies:
                    program = self.builder.programs.program(k, s)
                    for block, nbytes in self._sets.of(unit, program).items():
                        key = (k, block)
                        floors[key] = min(floors.get(key, nbytes), nbytes)
            per_block: dict[str, float] = {}
            for (_, block), nbytes in floors.items():
                per_block[block] = per_block.get(block, 0.0) + nbytes
            self._bound = WorkingSetBound(max(per_block.values(), default=0.0), floors)
        return self._bound

    def _excess_of(self, bound: WorkingSetBound, k: int, program: Program) -> float:
        # keyed by the program's identity, and holding it so that the id stays its own
        key = (k, id(program))
        found = self._excess.get(key)
        if found is None or found[0] is not program:
            unit = self.sg.units.units[k]
            found = self._excess[key] = (
                program,
                bound.excess(k, unit, program, self.mesh, self._sets),
            )
        return found[1]

    def working_set_of(self, mp: MeshProblem, choice: Sequence[int]) -> float:
        """The bound (:meth:`working_set`) under ``choice`` of ``mp``, a problem of the
        same step on this family's mesh: the constant plus each unit's excess under its
        chosen program, each excess computed once per (unit, program) (a pipelined
        search prices thousands of plans of one family)."""
        bound = self.working_set()
        found = self._excess_rows.get(id(mp))
        if found is None or found[0] is not mp:  # held, so that the id stays its own
            rows = [
                [self._excess_of(bound, k, program) for program in programs]
                for k, programs in enumerate(mp.programs)
            ]
            found = self._excess_rows[id(mp)] = (mp, rows)
        return bound.constant + sum(row[c] for row, c in zip(found[1], choice, strict=True))

    def problem(
        self,
        *,
        zero: Mapping[str, ZeroStage] | None = None,
        zero_all: ZeroStage = ZeroStage.NONE,
        working_set: bool = False,
    ) -> MeshProblem:
        """The problem with the ZeRO stages of ``zero`` (unit name -> stage, applied to
        each strategy of the unit) or ``zero_all`` on every (unit, strategy) that can
        take it (:meth:`zero_stage`). ``working_set``: add the recompute working set's
        bound (:meth:`working_set`, :class:`WorkingSetBound`) to the memory entries."""
        builder, infos, stage = self.builder, self.infos, dict(zero or {})
        su = self.sg.units
        programs = []
        units = []
        # A unit's programs and prices depend on its structure, what it places and saves
        # (``_signature``), its strategies and its ZeRO stage: repeated layers share one
        # row of each (the same objects builder.program and builder.unit would give).
        rows: dict[tuple, tuple[tuple[Program, ...], tuple[Strategy, ...]]] = {}
        for k, info in enumerate(infos):
            asked = stage.get(info.node.name, ZeroStage.NONE)
            key = (su.units[k].key, builder._signature(k), tuple(info.strategies), asked)
            row = rows.get(key)
            if row is None:
                ps = tuple(
                    builder.programs.program(
                        k,
                        s,
                        asked if zero_all is ZeroStage.NONE else self.zero_stage(k, s, zero_all),
                    )
                    for s in info.strategies
                )
                priced = []
                for s, program in zip(info.strategies, ps, strict=True):
                    t, m = builder.unit(k, s, program)
                    priced.append(Strategy(str(s), t, m))
                row = rows[key] = (ps, tuple(priced))
            programs.append(row[0])
            units.append(Unit(info.node.name, row[1]))
        edges, found = builder.edges(infos, programs)
        # the bounds of what is live at once, as constants on the first unit's entries and
        # per-strategy excesses: the problem stays a sum of its entries
        constant = 0.0
        bound = self.working_set() if working_set else None
        if bound is not None and bound.floors:
            constant += bound.constant
        else:
            bound = None
        if any(p.zero is ZeroStage.PARAMETERS for ps in programs for p in ps):
            constant += gathered_bound(self.sg)
        if (bound is not None or constant) and units:
            for k in range(len(units)):
                units[k] = Unit(
                    units[k].name,
                    tuple(
                        Strategy(
                            s.label,
                            s.time_s,
                            s.memory_bytes
                            + (self._excess_of(bound, k, program) if bound else 0.0)
                            + (constant if k == 0 else 0.0),
                        )
                        for s, program in zip(units[k].strategies, programs[k], strict=True)
                    ),
                )
        # made (and validated) once, with its final entries
        problem = CostProblem(
            tuple(units), tuple(edges), self.plan_mesh.size, tuple(self.plan_mesh.shape)
        )
        return MeshProblem(
            problem,
            self.mesh,
            tuple(infos),
            tuple(programs),
            tuple(found),
            self.sg,
            self.micro_batches,
        )


def conversion_order(program: Program, conv: Conversion | None = None) -> tuple[bool, bool]:
    """How a conversion made for a unit running ``program`` (``conv``, or an entry
    conversion when None) is emitted and issued on a micro mesh: (reduce-scatter before
    the sum over the micro-batches: ZeRO stages 2 and 3, ``units.scatters_first``; once
    per step: a conversion only the update reads, ``Conversion.update``, such as ZeRO's
    new parameter gathered where it leaves the step)."""
    return scatters_first(program.zero), conv is not None and conv.update


def issued(steps, mesh: Mesh, micro: int, per_step: bool = False):
    """The communicating steps of one conversion as ranks issue them per step:
    (step, mesh axes, times per step). On a micro mesh (``micro`` > 1) an all-reduce over
    the micro axis is issued once per step over its other axes (not at all when none
    remain), the steps after it once per step, the steps before it once per micro-batch.
    ``per_step``: the conversion runs after the micro-batches (its value is made once
    per step), so every step of it is issued once.
    """
    once = per_step
    for cs in steps:
        axes = cs.axes
        if micro > 1 and cs.step.kind is CollectiveKind.ALL_REDUCE:
            axes, summed = micro_axes(axes, mesh)
            once = once or summed
        if cs.communicates and axes:
            yield cs, axes, 1 if once else micro


def priced_collectives(mp: MeshProblem, choice: Sequence[int]) -> list[PricedCollective]:
    """The collectives a choice's programs emit on each rank, as the cost model priced them
    (one entry per collective of the device graph; ``times``: issued per step)."""
    su = mp.sg.units
    out: list[PricedCollective] = []

    def add(
        value: ir.Value, have: Layout, need: Layout, order: tuple[bool, bool], unit: int
    ) -> None:
        isz = itemsize(value)
        first, per_step = order
        steps = conversion_steps(have, need, static_shape(value), mp.mesh, scatter_first=first)
        for cs, axes, times in issued(steps, mp.mesh, mp.micro_batches, per_step):
            nbytes = int(numel_or_zero(cs.in_shape)) * isz
            out.append(PricedCollective(OP_TYPE[cs.step.kind], axes, nbytes, times, unit))

    for k, unit in enumerate(su.units):
        program = mp.programs[k][choice[k]]
        for conv in program.conversions:
            order = conversion_order(program, conv)
            add(_value_at(unit, conv.ref), conv.have, conv.need, order, k)
    for c in mp.crossings:
        if c.source == c.target:
            continue
        have = mp.programs[c.source][choice[c.source]].layout(c.source_ref)
        target = mp.programs[c.target][choice[c.target]]
        add(c.value, have, target.entries[c.index], conversion_order(target), c.target)
    return out


def _table(array: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(map(tuple, np.asarray(array, dtype=np.float64).tolist()))


@dataclass(frozen=True, slots=True)
class Estimate:
    """The cost model's estimate of one plan, as every command reports it."""

    time_s: float
    memory_bytes: float
    collectives: int  # per device and step
    profile: str

    def to_json(self) -> dict:
        return {
            "time_s": self.time_s,
            "memory_bytes": int(round(self.memory_bytes)),
            "collectives_per_device": self.collectives,
            "cluster": self.profile,
        }


def estimate_plan(
    sg: SearchGraph,
    roots: Mapping[str, MeshSharding],
    mesh: Mesh,
    profile: ClusterProfile,
    *,
    micro_batches: int = 1,
    zero: Mapping[str, ZeroStage] | None = None,
) -> Estimate:
    """Price one plan (a root strategy per unit) exactly as the search prices its points,
    plus the search's bound of the working set of its largest recomputed block
    (:class:`WorkingSetBound`).

    ``micro_batches`` > 1: ``roots`` are strategies of the micro mesh
    (``passes.micro.micro_roots``). ``zero``: the ZeRO stage of the units that use it."""
    mp = build_problem(sg, mesh, profile, only=roots, micro_batches=micro_batches, zero=zero)
    choice = (0,) * len(mp.units)
    time_s, memory = mp.problem.evaluate(choice)
    if any(RECOMPUTE_KEY in node.metadata_props for node in sg.graph):
        # the search's bound, over the strategies the search offers on this mesh
        choices = None
        if micro_batches > 1:
            choices, _ = split_offer(micro_choices(sg, mesh, micro_batches))
        family = ProblemFamily(sg, mesh, profile, micro_batches=micro_batches, choices=choices)
        memory += family.working_set_of(mp, choice)
    count = sum(c.times for c in priced_collectives(mp, choice))
    return Estimate(time_s, memory, count, profile.name)


def micro_choices(
    sg: SearchGraph, mesh: Mesh, k: int
) -> dict[str, tuple[tuple[MeshSharding, MeshSharding], ...]]:
    """The strategies a search offers each unit with ``k`` micro-batches on ``mesh``:
    (micro-mesh strategy, its strategy on ``mesh``) for every strategy
    :func:`unit_strategies` allows on ``mesh`` that runs within a micro-batch. On the
    micro axis each unit takes the data-parallel strategy, as ``passes.micro.micro_roots``
    gives a plan with ``micro_batches`` k, so a searched point compiles to what it priced.
    Raises MicroError when the step cannot run in k micro-batches (a unit with no such
    strategy, or an op that couples the samples of the batch).

    What does not depend on ``mesh`` (the units' strategies on the micro axis alone,
    :func:`_micro_along`) is made once per step and k (``StepUnits.shared``)."""
    from tensoropt.passes.micro import MicroError, _combine

    along = sg.units.once(("along", k), lambda: _micro_along(sg, k))  # raises MicroError
    strategies: dict = {}
    facts = graph_facts(sg)
    # repeated layers offer alike: a unit's pairs depend on its root's op, which of the
    # root's inputs are stored (unit_strategies' key) and its micro-axis strategy
    rows: dict = {}
    out = {}
    for u, unit in enumerate(sg.units.units):
        name = unit.root.name
        key = (sa.view_key(unit.root), facts.stored[u], along[name])
        found = rows.get(key)
        if found is None:
            pairs = []
            for s in unit_strategies(sg, mesh, u, strategies):
                with contextlib.suppress(MicroError):
                    pairs.append((_combine(unit.root, s, along[name], mesh, k), s))
            found = rows[key] = tuple(pairs)
        if not found:
            raise MicroError(
                f"--micro-batches {k}: unit {name!r} ({unit.root.op_type}) has no strategy "
                f"that runs within a micro-batch on mesh {mesh}"
            )
        out[name] = found
    return out


def split_offer(
    offered: Mapping[str, tuple[tuple[MeshSharding, MeshSharding], ...]],
) -> tuple[dict[str, tuple[MeshSharding, ...]], dict[str, tuple[MeshSharding, ...]]]:
    """:func:`micro_choices`' pairs as two maps, unit name -> micro-mesh strategies and
    unit name -> plan-mesh strategies; units that share a row of pairs (repeated layers)
    share each tuple, which the builders' memos then key alike."""
    micro: dict[str, tuple[MeshSharding, ...]] = {}
    real: dict[str, tuple[MeshSharding, ...]] = {}
    rows: dict[int, tuple[tuple, tuple]] = {}
    for name, pairs in offered.items():
        found = rows.get(id(pairs))
        if found is None:
            found = rows[id(pairs)] = (tuple(m for m, _ in pairs), tuple(r for _, r in pairs))
        micro[name], real[name] = found
    return micro, real


def micro_refusal(sg: SearchGraph, k: int) -> str:
    """Why compile refuses every plan of ``sg`` in ``k`` micro-batches (an op or a loss
    that couples the samples of a batch: ``passes.micro.check_micro_cut``), or "";
    found once per step and ``k``."""
    from tensoropt.passes.micro import MicroError, check_micro_cut, check_no_coupling

    def find() -> str:
        try:
            check_no_coupling(sg.graph, k)
            check_micro_cut(sg.graph, sg.signature, k)
        except MicroError as exc:
            return str(exc)
        return ""

    return sg.units.once(("micro refusal", k), find)


def _micro_along(sg: SearchGraph, k: int) -> dict:
    """Each unit's strategy on the micro axis alone (``k`` micro-batches, data-parallel);
    raises MicroError when an op couples the samples of the batch."""
    from tensoropt.passes.micro import MicroError, micro_along

    refused = micro_refusal(sg, k)
    if refused:
        raise MicroError(refused)
    return micro_along(sg.graph, sg.signature, sg.units, k)[0]


def recompute_working_set(mp: MeshProblem, choice: Sequence[int]) -> dict[str, float]:
    """Per recomputed block: local bytes of everything its recompute makes (the clones'
    outputs, views aside, and the block input's dependency copy) under ``choice``.

    A block's recompute runs inside the backward and its values are freed by the
    block's own backward, so one block's working set is live at a time: the step's
    extra memory is the largest of these, which :func:`estimate_plan` adds once. It is
    an upper bound of the block's peak: it assumes nothing the recompute makes is freed
    before the recompute ends."""
    out: dict[str, float] = {}
    for k, unit in enumerate(mp.sg.units.units):
        for block, nbytes in _unit_working_set(unit, mp.programs[k][choice[k]], mp.mesh).items():
            out[block] = out.get(block, 0.0) + nbytes
    return out


class UnitWorkingSets:
    """:func:`_unit_working_set` of (unit, program) pairs on one mesh, memoised so that
    repeated layers localise their recompute nodes once: units of one structure
    (``UnitNodes.key``, the same ops and shapes) whose recompute nodes sit at the same
    positions make the same bytes per node under the same program; only the block each
    node serves differs. The sums per block add the same floats in the same node order
    as :func:`_unit_working_set`, so the results are equal, not just close."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self._nodes: dict[int, tuple[object, tuple[int, ...], tuple[str, ...]]] = {}
        self._bytes: dict[tuple, tuple[Program, tuple[float, ...]]] = {}

    def of(self, unit, program: Program) -> dict[str, float]:
        found = self._nodes.get(id(unit))
        if found is None:  # the unit is kept with its entry, so its id is not reused
            at, blocks = [], []
            for i, node in enumerate(unit.nodes):
                block = node.metadata_props.get(RECOMPUTE_KEY)
                if block is None or node.op_type == "Constant" or node.op_type in _VIEWS:
                    continue
                at.append(i)
                blocks.append(block)
            found = self._nodes[id(unit)] = (unit, tuple(at), tuple(blocks))
        _, at, blocks = found
        out: dict[str, float] = {}
        if not at:
            return out
        key = (unit.key, at, id(program))
        sized = self._bytes.get(key)
        if sized is None:  # the program is kept with its entry, so its id is not reused
            sized = self._bytes[key] = (program, _node_bytes(unit, program, self.mesh, at))
        for block, nbytes in zip(blocks, sized[1], strict=True):
            out[block] = out.get(block, 0.0) + nbytes
        return out


def _node_bytes(unit, program: Program, mesh: Mesh, at: Sequence[int]) -> tuple[float, ...]:
    """Local bytes of the outputs of the unit's nodes at positions ``at``."""
    out = []
    for i in at:
        node = unit.nodes[i]
        local = sa.localize(node, program.strategies[i], mesh)
        shapes = enumerate(local.output_shapes)
        out.append(sum(numel_or_zero(shape) * itemsize(node.outputs[j]) for j, shape in shapes))
    return tuple(out)


def _unit_working_set(unit, program: Program, mesh: Mesh) -> dict[str, float]:
    """Per recomputed block: local bytes of the recompute nodes of one unit's program."""
    return UnitWorkingSets(mesh).of(unit, program)


@dataclass(frozen=True, slots=True)
class BlockTerms:
    """What recomputing one block adds to the unit terms of the units it touches, per
    strategy of each (indices as in the problem): forward seconds and conversion
    seconds of its recompute, and bytes of saved activations it drops. The working set
    is :func:`recompute_working_set`'s."""

    block: str
    units: tuple[int, ...]
    seconds_added: tuple[tuple[float, ...], ...]  # per unit in ``units``, per strategy
    bytes_dropped: tuple[tuple[float, ...], ...]


def block_terms(
    recomputed: MeshProblem, plain_saved: frozenset[str], profile: ClusterProfile
) -> tuple[BlockTerms, ...]:
    """The terms of each recomputed block of ``recomputed`` (the problem of a step with
    blocks recomputed, priced on ``profile``; ``plain_saved``: the saved values of the
    same step without recompute), attributed node by node: a unit touched by two blocks
    (the unit that makes the gradient at a block's output holds that block's dependency
    nodes) splits its terms between them."""
    su = recomputed.sg.units
    pricer = _Pricer(recomputed.sg, recomputed.mesh, profile)
    per_block: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
    for k, unit in enumerate(su.units):
        for s, program in enumerate(recomputed.programs[k]):
            for i, node in enumerate(unit.nodes):
                block = node.metadata_props.get(RECOMPUTE_KEY)
                if block is None:
                    continue
                n = len(recomputed.programs[k])
                t_add, m_drop = per_block.setdefault(block, {}).setdefault(
                    k, ([0.0] * n, [0.0] * n)
                )
                t_add[s] += pricer.recompute(node, program.strategies[i])
                original = _original_index(unit, node)
                if original is not None:
                    m_drop[s] += _dropped(unit, original, program, recomputed, plain_saved)
            for conv in program.conversions:
                block = _block_of_ref(unit, conv.ref)
                if block is None or k not in per_block.get(block, {}):
                    continue
                value = _value_at(unit, conv.ref)
                t, _ = pricer.convert(conv.have, conv.need, static_shape(value), itemsize(value))
                per_block[block][k][0][s] += t
    return tuple(
        BlockTerms(
            block,
            tuple(units),
            tuple(tuple(units[k][0]) for k in units),
            tuple(tuple(units[k][1]) for k in units),
        )
        for block, units in per_block.items()
    )


def _original_index(unit, node: ir.Node) -> int | None:
    name = node.metadata_props.get(RECOMPUTE_OF_KEY)
    if name is None:
        return None
    return next(i for i, n in enumerate(unit.nodes) if n.name == name)


def _dropped(unit, i: int, program: Program, mp: MeshProblem, plain_saved) -> float:
    """Local bytes of node ``i``'s outputs that the backward read before the recompute
    and no longer reads."""
    node = unit.nodes[i]
    if node.op_type in _VIEWS:
        return 0.0
    local = sa.localize(node, program.strategies[i], mp.mesh)
    return sum(
        numel_or_zero(shape) * itemsize(node.outputs[j])
        for j, shape in enumerate(local.output_shapes)
        if node.outputs[j].name in plain_saved and node.outputs[j].name not in mp.sg.saved
    )


def _block_of_ref(unit, ref) -> str | None:
    value = _value_at(unit, ref)
    producer = value.producer()
    return None if producer is None else producer.metadata_props.get(RECOMPUTE_KEY)


def search_graph_of(step) -> SearchGraph:
    """The search graph of a training step (``passes.training_step.TrainingStep``).

    The step is the one `compile` partitions, so the search prices the program that
    compile emits; weights are not needed (import without them)."""
    from tensoropt.passes.units import group_units, state_params

    graph = step.model.graph
    sig = step.signature
    data = tuple(sig.data_inputs) + ((sig.labels,) if sig.labels else ())
    states = state_params(sig)
    units = group_units(graph, sig.params, data, states, dict(sig.carry))
    forward: set[str] = set()
    read: set[str] = set()
    for node in graph:
        role = node.metadata_props.get(ROLE_KEY)
        if role in ("forward", "loss"):
            forward.update(v.name for v in node.outputs if v is not None)
        elif role == "backward":
            read.update(v.name for v in node.inputs if v is not None)
    per_param = max((len(v) for v in _states_by_param(states).values()), default=0)
    batch = 1
    for value in graph.inputs:
        if value.name in sig.data_inputs and value.shape is not None and len(value.shape):
            batch = int(value.shape[0])
            break
    return SearchGraph(
        graph,
        frozenset(sig.params),
        data,
        per_param,
        batch,
        frozenset(forward & read),
        units,
        sig,
    )


def _states_by_param(states: Mapping[str, str]) -> dict[str, list[str]]:
    by: dict[str, list[str]] = {}
    for state, param in states.items():
        by.setdefault(param, []).append(state)
    return by
