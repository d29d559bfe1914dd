"""Build the Frontier Tracking problem of a model on one mesh (DESIGN §4).

Units are the forward nodes (Constant nodes excluded): a unit's strategy is the
node's mesh strategy; its backward and its parameter update follow it (the
partitioner mirrors the forward layouts into the backward).

- Unit cost of strategy s: compute of the local shard, forward + backward
  (``cost.compute``); for each parameter the unit owns (it is the parameter's
  first consumer): the gradient all-reduce over the mesh axes where the parameter
  is replicated but the op's work is split, and the optimizer update. Memory:
  owned parameter shards x (parameter + gradient + optimizer states) plus the
  local outputs saved for backward.
- Edge cost of (s_u, s_w) for a value made by unit u and read by unit w: the
  redistribution from u's output layout to w's input layout, forward, plus the
  redistribution of the gradient back (w's gradient layout to the layout u's
  backward needs); memory: the converted buffer. A parameter or data input read
  by several units is placed by its first reader; the others get an edge from it.

Every total is a plain sum of unit and edge entries, as the frontier DP needs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.cost.compute import (
    GRID_UPDATE_STATES,
    grid_update_slots,
    op_time,
    update_time,
)
from tensoropt.errors import ShardingError
from tensoropt.ir.builder import static_shape
from tensoropt.ir.costs import CostProblem, Edge, Strategy, Unit
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard, local_shape
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.redistribute import (
    CollectiveKind,
    comm_bytes,
    latency_terms,
    plan_redistribution,
    step_output_shape,
)
from tensoropt.passes import sharding_adapter as sa
from tensoropt.rules.sharding import MeshSharding

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SearchGraph:
    """What the cost model reads of a model: the forward graph and its parameters."""

    graph: ir.Graph
    params: frozenset[str]
    data_inputs: tuple[str, ...]
    optimizer_states: int  # state tensors per parameter (SGD momentum 1, Adam 2)
    batch: int  # global samples per step (dim 0 of the first data input)
    # forward values the training step's backward reads (saved for backward); None =
    # unknown, every op output counts as saved
    saved: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class UnitInfo:
    """A root node, its strategies, and the follower nodes folded into it."""

    node: ir.Node
    strategies: tuple[MeshSharding, ...]
    followers: tuple[ir.Node, ...] = ()


@dataclass(frozen=True, slots=True)
class MeshProblem:
    """A cost problem with the nodes and strategies behind its indices."""

    problem: CostProblem
    mesh: Mesh
    units: tuple[UnitInfo, ...]


# the runtime op type of each communicating redistribution step (profile.link_for keys)
_OP_TYPE = {
    CollectiveKind.ALL_REDUCE: "AllReduce",
    CollectiveKind.ALL_GATHER: "AllGather",
    CollectiveKind.REDUCE_SCATTER: "ReduceScatter",
    CollectiveKind.ALL_TO_ALL: "AllToAll",
}


def axis_link(mesh: Mesh, axes: Sequence[int], profile: ClusterProfile):
    """The link a collective over ``axes`` uses: inter-node when its group spans nodes."""
    span = 1
    for a in axes:
        stride = int(np.prod(mesh.shape[a + 1 :], dtype=np.int64))
        span = max(span, stride * mesh.shape[a])
    return profile.intra if span <= profile.devices_per_node else profile.inter


class _Costs:
    def __init__(self, sg: SearchGraph, mesh: Mesh, profile: ClusterProfile):
        self.sg = sg
        self.mesh = mesh
        self.profile = profile
        self.conv_cache: dict = {}
        self.unit_cache: dict = {}
        self.edge_cache: dict = {}

    # -- redistribution ---------------------------------------------------------------
    def convert(self, have: Layout, need: Layout, shape, itemsize: int) -> tuple[float, float]:
        """(seconds, buffer bytes) to turn ``have`` into ``need`` for a value of ``shape``."""
        if have == need:
            return 0.0, 0.0
        key = (have, need, tuple(shape), itemsize)
        cached = self.conv_cache.get(key)
        if cached is not None:
            return cached
        try:
            steps = plan_redistribution(have, need, shape, self.mesh)
        except ShardingError:
            steps = ()
        seconds = 0.0
        current = local_shape(shape, have, self.mesh)
        dtype = np.dtype(f"V{itemsize}")
        for step in steps:
            n = self.mesh.shape[step.mesh_axis]
            link = self.profile.link_for(
                _OP_TYPE.get(step.kind, ""), axis_link(self.mesh, [step.mesh_axis], self.profile)
            )
            volume = comm_bytes(step, current, dtype, n)
            seconds += latency_terms(step.kind) * link.alpha_s + volume / link.bandwidth
            current = step_output_shape(step, current, n)
        buffer = float(np.prod(current, dtype=np.float64)) * itemsize if steps else 0.0
        self.conv_cache[key] = (seconds, buffer)
        return seconds, buffer

    # -- units ------------------------------------------------------------------------
    def unit_cost(self, node: ir.Node, strategy: MeshSharding, owned: Sequence[int]):
        owned_params = tuple(i for i in owned if node.inputs[i].name in self.sg.params)
        key = (sa.view_key(node), strategy, owned_params)
        cached = self.unit_cache.get(key)
        if cached is None:
            cached = self.unit_cache[key] = self._unit_cost(node, strategy, owned_params)
        return cached

    def _unit_cost(self, node: ir.Node, strategy: MeshSharding, owned: Sequence[int]):
        local = sa.localize(node, strategy, self.mesh)
        itemsize = _itemsize(node.outputs[0])
        seconds = op_time(
            node.op_type,
            sa.op_view(node).attributes,
            local.input_shapes,
            local.output_shapes,
            itemsize,
            self.profile,
        )
        memory = 0.0
        saved = self.sg.saved
        for j, shape in enumerate(local.output_shapes):
            if node.op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"):
                continue  # a view of its input
            if saved is not None and node.outputs[j].name not in saved:
                continue  # freed during the forward: no backward node reads it
            memory += _numel(shape) * _itemsize(node.outputs[j])
        split_axes = _split_axes(strategy, self.mesh)
        in_grid = grid_update_slots(node.op_type, self.profile)
        for i in owned:
            value = node.inputs[i]
            layout = strategy.inputs[i]
            if value.name not in self.sg.params or layout is None:
                continue
            shard = local.input_shapes[i]
            elements = _numel(shard)
            isz = _itemsize(value)
            # The step holds the parameter and its gradient, the new parameter it returns,
            # and each optimizer state twice (in and out): the emitted graph has no
            # in-place update (measured: docs/design/measured.md).
            memory += elements * isz * (3 + 2 * self.sg.optimizer_states)
            update = update_time(elements, self.sg.optimizer_states, isz, self.profile)
            if i in in_grid:  # op_time's grid entry holds a momentum-SGD update of it
                held = update_time(elements, GRID_UPDATE_STATES, isz, self.profile)
                update = max(update - held, 0.0)
            seconds += update
            sync = [a for a in split_axes if isinstance(layout.placements[a], Replicate)]
            if sync:
                n = int(np.prod([self.mesh.shape[a] for a in sync]))
                link = self.profile.link_for("AllReduce", axis_link(self.mesh, sync, self.profile))
                seconds += 2 * link.alpha_s + 2 * (n - 1) / n * elements * isz / link.bandwidth
        return seconds, memory

    def edge_tables(self, haves: Sequence[Layout], w: UnitInfo, i: int, value: ir.Value):
        """Tables over (strategy of the producing unit, strategy of the consumer)."""
        shape = static_shape(value)
        isz = _itemsize(value)
        key = (tuple(haves), sa.view_key(w.node), i, shape, isz)
        cached = self.edge_cache.get(key)
        if cached is None:
            cached = self.edge_cache[key] = self._edge_tables(haves, w, i, shape, isz)
        return cached

    def _edge_tables(self, haves, w: UnitInfo, i: int, shape, isz: int):
        times = np.zeros((len(haves), len(w.strategies)))
        mems = np.zeros_like(times)
        for a, have in enumerate(haves):
            for b, sw in enumerate(w.strategies):
                need = sw.inputs[i]
                if need is None:
                    continue
                fwd_t, buf = self.convert(have, need, shape, isz)
                # The backward runs even when the forward needs no conversion: a consumer
                # that splits an axis on which it reads the value replicated (a
                # column-parallel MatMul) returns a partial gradient, which must be
                # summed (Megatron's backward AllReduce).
                grad_have = _grad_at_consumer(need, sw, self.mesh)
                bwd_t, _ = self.convert(grad_have, _grad_needed(have), shape, isz)
                times[a, b] = fwd_t + bwd_t
                mems[a, b] = buf
        return times, mems


def _numel(shape) -> float:
    return float(np.prod(shape, dtype=np.float64)) if shape is not None else 0.0


def _itemsize(value: ir.Value) -> int:
    return max(1, int(np.ceil(value.dtype.itemsize))) if value.dtype is not None else 4


def _split_axes(strategy: MeshSharding, mesh: Mesh) -> list[int]:
    """Mesh axes on which the op's work is divided (some input/output S or P there)."""
    layouts = [*(x for x in strategy.inputs if x is not None), *strategy.outputs]
    return [
        a
        for a in range(mesh.ndim)
        if any(isinstance(lay.placements[a], (Shard, Partial)) for lay in layouts)
    ]


def _grad_at_consumer(need: Layout, strategy: MeshSharding, mesh: Mesh) -> Layout:
    """Layout of the gradient a consumer produces for an input it read as ``need``."""
    split = set(_split_axes(strategy, mesh))
    out = []
    for a, p in enumerate(need.placements):
        if isinstance(p, Replicate):
            out.append(Partial() if a in split else Replicate())
        elif isinstance(p, Partial):
            out.append(Replicate())
        else:
            out.append(p)
    return Layout(tuple(out))


def _grad_needed(have: Layout) -> Layout:
    """Layout the producer's backward needs for the gradient of its output."""
    return Layout(tuple(Replicate() if isinstance(p, Partial) else p for p in have.placements))


def _allowed(node: ir.Node, s: MeshSharding, fixed_inputs: set[str], params) -> bool:
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


def _activation_inputs(node: ir.Node, produced: dict) -> list[int]:
    return [i for i, v in enumerate(node.inputs) if v is not None and v in produced]


def _is_follower(node: ir.Node, produced: dict, fixed: set[str]) -> bool:
    """One activation input, everything else constant: its layout follows its producer."""
    if node.op_type == "Constant":
        return False
    acts = _activation_inputs(node, produced)
    if len(acts) != 1:
        return False
    others = [v for i, v in enumerate(node.inputs) if v is not None and i != acts[0]]
    return all(v.name not in fixed and v.producer() is None or _constant(v) for v in others)


def _constant(value: ir.Value) -> bool:
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"


class _Builder:
    """Units (root nodes) with their followers folded in, then edges between units."""

    def __init__(self, sg: SearchGraph, mesh: Mesh, profile: ClusterProfile):
        self.sg = sg
        self.mesh = mesh
        self.costs = _Costs(sg, mesh, profile)
        self.fixed = set(sg.params) | set(sg.data_inputs)
        self.infos: list[UnitInfo] = []
        self.index: dict[ir.Node, int] = {}
        # value -> (unit, layout of the value under each of the unit's strategies)
        self.produced: dict[ir.Value, tuple[int, list[Layout]]] = {}
        self.extra_t: dict[int, np.ndarray] = {}
        self.extra_m: dict[int, np.ndarray] = {}
        self.follow_cache: dict = {}

    def add_nodes(self) -> None:
        for node in self.sg.graph:
            if node.op_type == "Constant":
                continue
            if _is_follower(node, self.produced, self.fixed):
                self._fold(node)
                continue
            strategies = tuple(
                s
                for s in sa.candidates(node, self.mesh)
                if _allowed(node, s, self.fixed, self.sg.params)
            )
            if not strategies:
                raise ShardingError(f"node {node.name!r} ({node.op_type}) has no legal strategy")
            k = len(self.infos)
            self.index[node] = k
            self.infos.append(UnitInfo(node, strategies, ()))
            for j, value in enumerate(node.outputs):
                self.produced[value] = (k, [s.outputs[j] for s in strategies])

    def _fold(self, node: ir.Node) -> None:
        (i,) = _activation_inputs(node, self.produced)
        u, haves = self.produced[node.inputs[i]]
        n = len(haves)
        times = self.extra_t.setdefault(u, np.zeros(n))
        mems = self.extra_m.setdefault(u, np.zeros(n))
        outs: list[list[Layout]] = [[] for _ in node.outputs]
        for a, have in enumerate(haves):
            chosen, t, m = self._follow(node, i, have)
            times[a] += t
            mems[a] += m
            for j in range(len(node.outputs)):
                outs[j].append(chosen.outputs[j])
        info = self.infos[u]
        self.infos[u] = UnitInfo(info.node, info.strategies, (*info.followers, node))
        for j, value in enumerate(node.outputs):
            self.produced[value] = (u, outs[j])

    def _follow(self, node: ir.Node, i: int, have: Layout):
        """The follower's strategy for an input layout: the propagation's choice."""
        key = (sa.view_key(node), i, have)
        cached = self.follow_cache.get(key)
        if cached is not None:
            return cached
        value = node.inputs[i]
        best = None
        for cand in sa.candidates(node, self.mesh):
            need = cand.inputs[i]
            nbytes = sa.conversion_bytes(have, need, value, self.mesh) if need != have else 0.0
            partial = sum(isinstance(p, Partial) for lay in cand.outputs for p in lay.placements)
            score = (nbytes, partial, int(need != have), _spread(cand, self.mesh))
            if best is None or score < best[0]:
                best = (score, cand)
        cand = best[1]
        conv_t, buf = self.costs.convert(
            have, cand.inputs[i], static_shape(value), _itemsize(value)
        )
        compute_t, mem = self.costs.unit_cost(node, cand, ())
        result = (cand, conv_t + compute_t, mem + buf)
        self.follow_cache[key] = result
        return result

    def edges(self) -> tuple[list[Edge], dict[int, list[int]]]:
        owner: dict[str, tuple[int, int]] = {}
        owned: dict[int, list[int]] = {}
        edges: list[Edge] = []
        for k, info in enumerate(self.infos):
            node = info.node
            for i, value in enumerate(node.inputs):
                if value is None:
                    continue
                if value in self.produced:
                    u, haves = self.produced[value]
                    if u != k:
                        t, m = self.costs.edge_tables(haves, info, i, value)
                        edges.append(Edge(u, k, _table(t), _table(m)))
                elif value.name in self.fixed:
                    if value.name not in owner:
                        owner[value.name] = (k, i)
                        owned.setdefault(k, []).append(i)
                        continue
                    u, slot = owner[value.name]
                    if u != k:
                        haves = [s.inputs[slot] for s in self.infos[u].strategies]
                        t, m = self.costs.edge_tables(haves, info, i, value)
                        edges.append(Edge(u, k, _table(t), _table(m)))
        return edges, owned

    def units(self, owned: dict[int, list[int]]) -> list[Unit]:
        units = []
        for k, info in enumerate(self.infos):
            extra_t = self.extra_t.get(k)
            extra_m = self.extra_m.get(k)
            strategies = []
            for a, s in enumerate(info.strategies):
                t, m = self.costs.unit_cost(info.node, s, owned.get(k, []))
                if extra_t is not None:
                    t += float(extra_t[a])
                    m += float(extra_m[a])
                strategies.append(Strategy(str(s), t, m))
            units.append(Unit(info.node.name, tuple(strategies)))
        return units


def _spread(cand: MeshSharding, mesh: Mesh) -> float:
    total = 0.0
    for lay in cand.outputs:
        total += float(
            np.prod([mesh.shape[a] for a, p in enumerate(lay.placements) if isinstance(p, Shard)])
        )
    return total


def build_problem(sg: SearchGraph, mesh: Mesh, profile: ClusterProfile) -> MeshProblem:
    """The cost problem of ``sg`` on ``mesh`` (see the module doc)."""
    builder = _Builder(sg, mesh, profile)
    builder.add_nodes()
    edges, owned = builder.edges()
    units = builder.units(owned)
    problem = CostProblem(tuple(units), tuple(edges), mesh.size, tuple(mesh.shape))
    return MeshProblem(problem, mesh, tuple(builder.infos))


def _table(array: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(x) for x in row) for row in array)
