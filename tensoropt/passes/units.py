"""Decision units of a training step and their programs: one decision procedure.

A *decision unit* is a forward (or loss) node, its *root*, with the nodes that belong to
it: its *followers* (forward nodes with one activation input, made by the unit, and
otherwise constants), and every backward and optimizer node that autodiff and the
optimizer tagged with the unit (``tensoropt.unit``). Nodes of no unit (forward
``Constant`` nodes, Adam's shared step counter) are *fixed*: everything they make is
replicated.

A :class:`Program` is what the root's strategy decides: the strategy of every node of
the unit, the layout in which the unit reads each value it does not make (its *entry*
layouts), and the conversions between its own nodes. It depends on the root's strategy
and nothing else, so a training step decomposes exactly into

- unit terms: the unit's compute and its internal conversions (a function of its own
  strategy), and
- edge terms: for each value that unit P makes (or owns: a parameter or data input it
  reads first) and unit U reads, one conversion from P's layout of it to U's entry layout
  (a function of both strategies).

The cost model prices these conversions (``cost.model``) and the partitioner emits them
(``passes.insert_redistribution``), from the same :class:`Program` objects: the plan is
the program. Gradients are converted where they enter the unit that needs them, before
they are summed, so the sum never depends on another unit's strategy.

How a program chooses (the propagation, run once per unit and strategy): the root takes
the strategy; every other node takes its legal strategy with the cheapest conversion of
its inputs, scored (bytes sent, partial outputs, conversions, spread of outputs). A
follower's constants and fixed values are replicated. Backward nodes mirror the forward:
a gradient takes, per mesh axis, ``S(d)`` for a primal ``S(d)``, ``R`` or ``P`` for a
primal ``R``, ``R`` for a primal ``P``. Optimizer nodes neither take nor make partial
values and keep their parameter's layout. A gradient made by another unit enters as its
primal's layout with partial axes replicated. A value the root does not read enters in
the layout its first reader in the unit needs.

ZeRO (a unit's :class:`~tensoropt.ir.plan.ZeroStage`) is a layout choice of the same
program. The ZeRO axes of a parameter the unit places are the mesh axes (of size > 1)
where the root reads it replicated while an output of the root is split (the unit's op
splits the batch: its gradient is partial there). Its *shard* layout is its root layout
with one dimension split over all ZeRO axes (:func:`zero_shards`). From stage 1 the
optimizer nodes and states take the shard layout, so the gradient is reduce-scattered
(P -> S) where the update reads it and the new parameter is all-gathered (S -> R) where it
leaves as a graph output. At stage 3 the parameter itself is stored as the shard: the
unit's nodes see it, for their choices, in its root layout, and it is gathered once for
the forward reads and once more for the backward reads (two conversions, so the first
gathered buffer dies after the last forward read). Stage 2 is stage 1 within one
micro-batch; on a micro mesh the stages differ in the order of the gradient's two sums
(``conversion_steps``' ``scatter_first``): stage 1 sums over the micro-batches first
(the full gradient is accumulated, reduce-scattered once per step), stages 2 and 3
reduce-scatter each micro-batch's gradient and accumulate the shard. A gradient the
unit makes whole on every rank (an embedding's backward that gathers its incoming
gradient) is likewise sliced to its shard in each micro-batch at stages 2 and 3.

Micro meshes (``passes.micro``: the micro axis of k micro-batches in front of the plan's
mesh M): a unit's program runs M's program per micro-batch. Each node takes its strategy
in the unit's program on M on M's axes, after its strategy in the unit's program on the
micro axis alone, where the op can run that pair (checked axis by axis, as the micro
mesh's strategies compose); a node that cannot (a batch too small to split over both)
chooses by the propagation on the micro mesh, as do all nodes of a unit with no program
on M. So M's programs are made once for every micro-batch count, and a micro-batched
plan splits each op as the plan does (:class:`_MicroParts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import onnx_ir as ir

from tensoropt.errors import PlanError, ShardingError
from tensoropt.ir.builder import ROLE_KEY, UNIT_KEY, static_shape
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard, local_shape
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.ir.redistribute import CollectiveKind, Step, plan_redistribution, step_output_shape
from tensoropt.ir.vocab import PARAM_KEY
from tensoropt.passes import sharding_adapter as sa
from tensoropt.passes.autodiff import GRAD_OF_KEY, grad_of
from tensoropt.passes.recompute import RECOMPUTE_KEY, RECOMPUTE_OF_KEY
from tensoropt.rules.sharding import MeshSharding
from tensoropt.rules.sharding.memo import Memo
from tensoropt.rules.sharding.registry import axis_step


class Entry(Enum):
    """How a unit comes by a value it does not make."""

    FIXED = "fixed"  # a constant, frozen initializer or fixed node's output: replicated
    PARAM = "param"  # a trained parameter
    STATE = "state"  # an optimizer state (takes its parameter's layout)
    DATA = "data"  # a data input or labels
    GRAD = "grad"  # a gradient made by another unit
    VALUE = "value"  # a forward value made by another unit


# -- conversions ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConversionStep:
    """One emitted redistribution step: all-reduces over several axes are one step."""

    step: Step
    axes: tuple[int, ...]
    in_shape: tuple[int, ...]  # local shape before the step
    out_shape: tuple[int, ...]  # local shape after it

    @property
    def communicates(self) -> bool:
        return self.step.kind.communicates


def conversion_steps(
    have: Layout,
    need: Layout,
    shape: Sequence[int],
    mesh: Mesh,
    tensor: str = "tensor",
    scatter_first: bool = False,
) -> tuple[ConversionStep, ...]:
    """The steps that turn ``have`` into ``need``, as the partitioner emits them.

    Consecutive all-reduces on different mesh axes become one over all of them; steps on
    mesh axes of size 1 are the identity and are not emitted.

    ``scatter_first`` (:func:`scatters_first`: a unit at ZeRO stage 2 or 3): a sum over
    the mesh's sequential (micro-batch) axis comes after the other axes' steps, so a
    gradient is reduce-scattered (or, held whole, sliced) per micro-batch and only its
    shard is accumulated.
    Without it the sum over the micro-batches comes first (the full gradient is
    accumulated and reduce-scattered once per step: stage 1).
    """
    if have == need:
        return ()
    via = _scatter_via(have, need, mesh) if scatter_first else None
    if via is not None:
        first = conversion_steps(have, via, shape, mesh, tensor)
        return (*first, *conversion_steps(via, need, shape, mesh, tensor))
    steps = plan_redistribution(have, need, shape, mesh, tensor)
    merged: list[tuple[Step, tuple[int, ...]]] = []
    for step in steps:
        if merged and step.kind is CollectiveKind.ALL_REDUCE:
            last, axes = merged[-1]
            if last.kind is CollectiveKind.ALL_REDUCE:
                merged[-1] = (last, (*axes, step.mesh_axis))
                continue
        merged.append((step, (step.mesh_axis,)))
    out = []
    current = tuple(local_shape(shape, have, mesh, tensor))
    for step, axes in merged:
        after = current
        for axis in axes:
            after = _after(step, after, mesh.shape[axis])
        if any(mesh.shape[a] > 1 for a in axes):
            out.append(ConversionStep(step, axes, current, after))
        current = after
    return tuple(out)


def scatters_first(zero: ZeroStage) -> bool:
    """Whether a unit at ``zero`` reduce-scatters its gradients before summing them over
    the micro-batches (``conversion_steps``' ``scatter_first``): stages 2 and 3."""
    return zero >= ZeroStage.GRADIENTS


def _scatter_via(have: Layout, need: Layout, mesh: Mesh) -> Layout | None:
    """``need`` still partial over the sequential axis, when ``have`` is partial there
    and another axis reduce-scatters or slices (partial or replicated to split); else
    None."""
    seq = mesh.sequential_axis
    if seq is None or mesh.shape[seq] == 1:
        return None
    if not isinstance(have.placements[seq], Partial) or not isinstance(
        need.placements[seq], Replicate
    ):
        return None
    # a reduce-scatter (partial to split), or a slice (replicated to split: a gradient
    # made whole on every rank, as an embedding's gathered backward)
    scatters = any(
        isinstance(h, (Partial, Replicate)) and isinstance(n, Shard)
        for h, n in zip(have.placements, need.placements, strict=True)
    )
    if not scatters:
        return None
    placements = list(need.placements)
    placements[seq] = Partial()
    return Layout(tuple(placements))


def _after(step: Step, shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(step_output_shape(step, shape, n))


# -- grouping ------------------------------------------------------------------------

Ref = tuple  # ("n", node index, output index) or ("x", external index)


@dataclass(eq=False, slots=True)
class UnitNodes:
    """The nodes of one decision unit (root first, graph order) and what it reads."""

    root: ir.Node
    nodes: list[ir.Node]
    externals: list[ir.Value] = field(default_factory=list)
    kinds: list[Entry] = field(default_factory=list)
    outputs: list[tuple[Ref, str | None]] = field(default_factory=list)  # graph outputs made
    key: int = -1  # structure number: units with equal keys have equal programs


@dataclass(eq=False, slots=True)
class StepUnits:
    """A training step grouped into decision units."""

    graph: ir.Graph
    units: list[UnitNodes]
    unit_of: dict[ir.Node, int]  # node -> unit index (absent: fixed)
    fixed: list[ir.Node]
    params: frozenset[str]
    data: frozenset[str]
    state_param: dict[str, str]  # optimizer state -> its parameter
    owner: dict[str, int]  # parameter / data input -> unit that places it
    required: dict[ir.Value, str | None]  # graph output -> carried input (None: replicated)
    # every value one unit holds and another reads (``crossings``): the same on every mesh
    crossings: tuple[Crossing, ...] = ()
    # what every mesh's programs and strategies of this step share: the micro axis's
    # program cache, by (shape, names); each micro mesh's :class:`_MicroParts`, by
    # ("micro", shape, names); the micro axis's root
    # strategies per micro-batch count, by ("along", k) (``cost.model.micro_choices``)
    shared: dict = field(default_factory=dict, repr=False)

    def once(self, key: tuple, make: Callable[[], object]):
        """``shared[key]``, made by ``make`` the first time it is asked for."""
        found = self.shared.get(key)
        if found is None:
            found = self.shared[key] = make()
        return found

    def index(self, name: str) -> int:
        for k, u in enumerate(self.units):
            if u.root.name == name:
                return k
        raise KeyError(name)


def state_params(sig) -> dict[str, str]:
    """Optimizer state -> its parameter, from a step signature (Adam's shared step
    counter belongs to no parameter)."""
    from tensoropt.passes.optimizer import OptimizerKind, state_names

    kind = OptimizerKind(sig.optimizer.get("kind", "sgd"))
    momentum = sig.optimizer.get("momentum", 0.0)
    states = set(sig.states)
    return {
        name: p for p in sig.params for name in state_names(p, kind, momentum) if name in states
    }


def _role(node: ir.Node) -> str:
    return node.metadata_props.get(ROLE_KEY, "forward")


def group_units(
    graph: ir.Graph,
    params: Iterable[str],
    data: Iterable[str],
    states: Mapping[str, str],
    carry: Mapping[str, str],
) -> StepUnits:
    """Group the nodes of a training step (or of a forward graph with its loss).

    ``params``: trained parameters; ``data``: data inputs and labels; ``states``: optimizer
    state -> parameter; ``carry``: graph output -> the input it replaces next step.
    """
    params = frozenset(params)
    data = frozenset(data)
    fixed_inputs = params | data
    units: list[UnitNodes] = []
    unit_of: dict[ir.Node, int] = {}
    fixed: list[ir.Node] = []
    made: dict[ir.Value, int] = {}  # forward value -> unit that makes it
    by_name: dict[str, int] = {}
    for node in graph:
        role = _role(node)
        if role in ("forward", "loss"):
            if node.op_type == "Constant":
                fixed.append(node)
                continue
            k = _follows(node, made, fixed_inputs)
            if k is None:
                k = len(units)
                units.append(UnitNodes(node, [node]))
            else:
                units[k].nodes.append(node)
            unit_of[node] = k
            by_name[node.name] = k
            for v in node.outputs:
                made[v] = k
            continue
        k = by_name.get(node.metadata_props.get(UNIT_KEY, ""))
        if k is None:
            fixed.append(node)
            continue
        units[k].nodes.append(node)
        unit_of[node] = k
    # A parameter is placed by the unit that updates it (the optimizer tags its update
    # with its first reader's unit); a data input by its first reader.
    owner: dict[str, int] = {}
    for node, k in unit_of.items():
        param = node.metadata_props.get(PARAM_KEY)
        if param and _role(node) == "optimizer" and _reads_at_root(units[k], param):
            owner.setdefault(param, k)
    for k, unit in enumerate(units):
        for v in unit.root.inputs:
            if v is not None and v.name in fixed_inputs:
                owner.setdefault(v.name, k)
    required = {v: carry.get(v.name) for v in graph.outputs}
    su = StepUnits(graph, units, unit_of, fixed, params, data, dict(states), owner, required)
    for unit in units:
        # a unit's structure, numbered: programs and prices are memoised by it many times
        unit.key = _structure_number(_describe(su, unit))
    su.crossings = tuple(crossings(su))
    return su


def _structure_number(structure: tuple) -> int:
    """The number of a unit structure (:func:`_describe`), the same in every step built in
    this process: equal structures have equal programs wherever they occur, so a step
    with recomputed blocks shares the programs of its unchanged units with the plain
    step's (ProgramCache). Numbers are never reused: one that falls out of the bounded
    memo comes back as a new number (a cache miss, never a wrong hit)."""
    found = _STRUCTURES.get(structure)
    if found is None:
        global _NEXT_STRUCTURE
        found = _STRUCTURES.put(structure, _NEXT_STRUCTURE)
        _NEXT_STRUCTURE += 1
    return found


_STRUCTURES = Memo(100_000)  # unit structure -> its number
_NEXT_STRUCTURE = 0


def _reads_at_root(unit: UnitNodes, name: str) -> bool:
    return any(v is not None and v.name == name for v in unit.root.inputs)


def _follows(node: ir.Node, made: Mapping[ir.Value, int], fixed_inputs) -> int | None:
    """The unit whose single activation input ``node`` follows, or None (a root)."""
    acts = [v for v in node.inputs if v is not None and v in made]
    if len({id(v) for v in acts}) != 1 or sum(v is acts[0] for v in node.inputs) != 1:
        return None
    for v in node.inputs:
        if v is None or v is acts[0]:
            continue
        producer = v.producer()
        if producer is None and v.name not in fixed_inputs:
            continue  # an initializer constant
        if producer is not None and producer.op_type == "Constant":
            continue
        return None
    return made[acts[0]]


def _original(unit: UnitNodes, i: int) -> int | None:
    """For a recompute clone (``recompute.RECOMPUTE_OF_KEY``): the position in the unit of
    the forward node it reruns, whose strategy it takes; else None."""
    name = unit.nodes[i].metadata_props.get(RECOMPUTE_OF_KEY)
    if name is None:
        return None
    for j, node in enumerate(unit.nodes[:i]):
        if node.name == name:
            return j
    raise AssertionError(f"recompute clone {unit.nodes[i].name!r} is not in its original's unit")


def _entry_kind(su: StepUnits, value: ir.Value) -> Entry:
    producer = value.producer()
    if producer is None:
        if value.name in su.params:
            return Entry.PARAM
        if value.name in su.state_param:
            return Entry.STATE
        if value.name in su.data:
            return Entry.DATA
        return Entry.FIXED
    if producer not in su.unit_of:
        return Entry.FIXED
    if value.metadata_props.get(GRAD_OF_KEY) and _role(producer) == "backward":
        return Entry.GRAD
    return Entry.VALUE


def _describe(su: StepUnits, unit: UnitNodes) -> tuple:
    """Record the unit's externals; return its structure (equal structures: equal
    programs)."""
    local: dict[ir.Value, tuple] = {}
    ext: dict[ir.Value, int] = {}
    parts: list[tuple] = []
    names = {}
    for i, node in enumerate(unit.nodes):
        for j, v in enumerate(node.outputs):
            local[v] = ("n", i, j)
            if v.name:
                names[v.name] = ("n", i, j)
    for i, node in enumerate(unit.nodes):
        refs = []
        for v in node.inputs:
            if v is None:
                refs.append(None)
            elif v in local:
                refs.append(local[v])
            else:
                if v not in ext:
                    ext[v] = len(unit.externals)
                    unit.externals.append(v)
                    unit.kinds.append(_entry_kind(su, v))
                refs.append(("x", ext[v]))
        for v in node.inputs:
            if v is not None and v.name:
                names.setdefault(v.name, local.get(v) or ("x", ext[v]))
        parts.append((sa.view_key(node), _role(node), tuple(refs), _original(unit, i)))
    # what the unit's choices depend on besides its ops: primal refs, parameters, outputs
    primal = []
    for i, node in enumerate(unit.nodes):
        for j, v in enumerate(node.outputs):
            for name in grad_of(v):
                primal.append(((i, j), names.get(name)))
            if v in su.required:
                carried = su.required[v]
                unit.outputs.append((("n", i, j), carried))
                primal.append(((i, j), "out", names.get(carried) if carried else None))
        param = node.metadata_props.get(PARAM_KEY)
        if param:
            primal.append((i, "param", names.get(param)))
    kinds = []
    for k, v in enumerate(unit.externals):
        kind = unit.kinds[k]
        extra = None
        if kind is Entry.STATE:
            extra = names.get(su.state_param[v.name])
        elif kind is Entry.GRAD:
            extra = tuple(names.get(n) for n in grad_of(v))
        elif RECOMPUTE_OF_KEY in v.metadata_props:
            extra = names.get(v.metadata_props[RECOMPUTE_OF_KEY])
        kinds.append((kind, extra))
    return (tuple(parts), tuple(primal), tuple(kinds))


# -- programs ------------------------------------------------------------------------


class Phase(Enum):
    """Which reads of a value a conversion serves. Only a ZeRO-3 parameter is converted
    per phase (gathered for the forward, and again for the backward); every other
    conversion serves all reads (``ANY``)."""

    ANY = "any"
    FORWARD = "forward"
    BACKWARD = "backward"


def read_phase(node: ir.Node) -> Phase:
    """The phase of a read of a ZeRO-3 parameter by ``node``."""
    return Phase.BACKWARD if _role(node) == "backward" else Phase.FORWARD


@dataclass(frozen=True, slots=True)
class Conversion:
    """A conversion inside a unit: the value at ``ref`` from ``have`` to ``need``.

    ``update``: the value does not depend on the batch (a parameter, a state, or what
    the update makes) and only the update reads the conversion's result: under
    micro-batching it runs once per step, after the micro-batches."""

    ref: Ref
    have: Layout
    need: Layout
    phase: Phase = Phase.ANY
    update: bool = False


@dataclass(frozen=True, slots=True)
class Program:
    """What a unit strategy decides, by position in the unit (see the module doc)."""

    strategies: tuple[MeshSharding, ...]  # per node of the unit
    entries: tuple[Layout, ...]  # per external
    conversions: tuple[Conversion, ...]  # inside the unit, in emission order
    zero: ZeroStage = ZeroStage.NONE
    shards: tuple[ZeroShard, ...] = ()  # the parameters ZeRO shards (empty at stage 0)

    def layout(self, ref: Ref) -> Layout:
        if ref[0] == "x":
            return self.entries[ref[1]]
        return self.strategies[ref[1]].outputs[ref[2]]


@dataclass(frozen=True, slots=True)
class ZeroShard:
    """A parameter that ZeRO shards in a unit: external ``index``, the layout its root
    reads (``use``), its ``shard`` layout, and the ZeRO mesh ``axes``."""

    param: str
    index: int
    use: Layout
    shard: Layout
    axes: tuple[int, ...]


class ProgramCache:
    """Programs per (unit structure, root strategy, ZeRO stage), shared by repeated
    layers.

    ``chosen``: a memo of the nodes' choices (:meth:`_Chooser.choose_key`) and of the
    programs that several caches may share, e.g. the problems of one mesh with and
    without recomputed blocks and ZeRO stages: a node chooses alike wherever it sees the
    same inputs, and a unit's program is its structure's (``UnitNodes.key`` numbers
    structures across steps), so the units that recomputation leaves as they were take
    the plain step's programs. Programs are keyed by the mesh there as well."""

    def __init__(self, su: StepUnits, mesh: Mesh, chosen: dict | None = None) -> None:
        self.su = su
        self.mesh = mesh
        self._chosen = {} if chosen is None else chosen
        # the programs, in the shared memo under keys of their own (mesh, unit structure,
        # strategy, ZeRO stage)
        self._cache: dict[tuple, Program] = self._chosen
        self._where = (_PROGRAM, tuple(mesh.shape), tuple(mesh.axis_names))
        self._out_terms: dict = {}  # candidate -> its scoring tie-breakers on this mesh
        self._parts = _MicroParts.of(su, mesh)
        # a micro mesh's programs combine the plan mesh's, taken from the same memo (the
        # plan mesh's family made most of them already), with the micro axis's
        self._plan: ProgramCache | None = None
        if self._parts is not None:
            self._plan = ProgramCache(su, self._parts.plan_mesh, self._chosen)

    def program(self, k: int, strategy: MeshSharding, zero: ZeroStage = ZeroStage.NONE) -> Program:
        unit = self.su.units[k]
        key: tuple = (*self._where, unit.key, strategy)
        if zero is not ZeroStage.NONE:  # which parameters it places matters then
            placed = tuple(self.su.owner.get(v.name) == k for v in unit.externals)
            key = (*key, zero, placed)
        found = self._cache.get(key)
        if found is None:
            shards = zero_shards(self.su, k, strategy, self.mesh) if zero else ()
            if zero and not shards:
                raise PlanError(
                    f"plan unit {unit.root.name!r}: ZeRO stage {int(zero)} needs a "
                    "data-parallel mesh axis (a parameter it places read replicated while "
                    f"its op splits the batch) and strategy {strategy} has none; drop "
                    "'zero' for this unit"
                )
            forced = None
            if self._parts is not None:
                assert self._plan is not None
                forced = self._parts.combined(k, strategy, zero, self._plan)
            chooser = _Chooser(
                self.su, unit, self.mesh, self._out_terms, zero, shards, self._chosen
            )
            found = self._cache[key] = chooser.run(strategy, forced)
        return found


class _MicroParts:
    """A micro mesh's programs as combinations (see the module doc, "Micro meshes"):
    the plan mesh's programs (from the asking cache's memo), the micro axis's (the same
    for every plan mesh: one cache per step and micro-batch count), and which of their
    node strategies combine legally on the micro mesh."""

    def __init__(self, su: StepUnits, mesh: Mesh) -> None:
        self.su = su
        self.mesh = mesh
        self.plan_mesh = Mesh(tuple(mesh.shape[1:]), tuple(mesh.axis_names[1:]))
        axis = Mesh(tuple(mesh.shape[:1]), tuple(mesh.axis_names[:1]))
        key = (tuple(axis.shape), tuple(axis.axis_names))
        self.along = su.once(key, lambda: ProgramCache(su, axis))
        self._split: dict[MeshSharding, tuple[MeshSharding, MeshSharding]] = {}
        # (unit structure, node position, plan-mesh strategy, micro-axis strategy) ->
        # the combined strategy, or None where the op cannot run it on the micro mesh
        self._node: dict[tuple, MeshSharding | None] = {}

    @staticmethod
    def of(su: StepUnits, mesh: Mesh) -> _MicroParts | None:
        """The parts of ``mesh`` when it is a micro mesh with more than one micro-batch
        (the micro axis first, ``passes.micro.micro_mesh``); else None."""
        if mesh.sequential_axis != 0 or mesh.ndim == 1 or mesh.shape[0] == 1:
            return None
        key = ("micro", tuple(mesh.shape), tuple(mesh.axis_names))
        return su.once(key, lambda: _MicroParts(su, mesh))

    def combined(
        self,
        k: int,
        strategy: MeshSharding,
        zero: ZeroStage,
        plan: ProgramCache,
    ) -> list[MeshSharding | None] | None:
        """Unit ``k``'s node strategies under root ``strategy``: each node's strategy in
        the plan mesh's program (of ``plan``), after its strategy in the micro axis's
        program; None for a node that cannot run the pair, and in place of the list where
        a part has no program."""
        parts = self._split.get(strategy)
        if parts is None:
            parts = (MeshSharding(strategy.axes[1:]), MeshSharding(strategy.axes[:1]))
            self._split[strategy] = parts
        try:
            on_plan = plan.program(k, parts[0], zero)
            on_axis = self.along.program(k, parts[1])
        except (PlanError, ShardingError):
            return None
        unit = self.su.units[k]
        out = []
        for i, (s, m) in enumerate(zip(on_plan.strategies, on_axis.strategies, strict=True)):
            key = (unit.key, i, s, m)
            if key in self._node:
                found = self._node[key]
            else:
                found = self._node[key] = combine_axes(unit.nodes[i], m, s, self.mesh)
            out.append(found)
        return out


_PROGRAM = object()  # names the program entries of a shared memo (ProgramCache)


def combine_axes(
    node: ir.Node, micro: MeshSharding, plain: MeshSharding, mesh: Mesh
) -> MeshSharding | None:
    """``micro``'s placements on the micro axis, then ``plain``'s on the plan axes, each
    legal on the op as the axes before it localized it; None where one is not (memoised
    per distinct op view: repeated layers and unit structures share their nodes' ops)."""
    key = (sa.view_key(node), micro, plain, mesh.shape)
    found = _COMBINED.get(key)
    if found is None:
        axes = (*micro.axes, *plain.axes)
        found = _COMBINED.put(key, _combine_axes(sa.op_view(node), axes, mesh))
    return found or None


def _combine_axes(view, axes: tuple, mesh: Mesh) -> MeshSharding | bool:
    for s, n in zip(axes, mesh.shape, strict=True):
        legal, views = axis_step(view, n)
        if s not in legal:
            return False
        view = views[legal.index(s)]
    return MeshSharding(axes)


_COMBINED = Memo(200_000)  # (view key, micro, plain, micro mesh shape) -> strategy or False


def zero_params(su: StepUnits, k: int) -> list[tuple[int, int, ir.Value]]:
    """(external index, root input index, value) of each parameter unit ``k`` places
    and updates (read by its root, updated by its optimizer nodes)."""
    unit = su.units[k]
    updated = {
        node.metadata_props.get(PARAM_KEY)
        for node in unit.nodes
        if _role(node) == "optimizer" and node.metadata_props.get(PARAM_KEY)
    }
    out = []
    seen = set()
    for i, v in enumerate(unit.root.inputs):
        if v is None or v.name in seen or v.name not in updated or su.owner.get(v.name) != k:
            continue
        seen.add(v.name)
        out.append((unit.externals.index(v), i, v))
    return out


def zero_axes(strategy: MeshSharding, use: Layout, mesh: Mesh) -> tuple[int, ...]:
    """Mesh axes (size > 1) where ``use`` is replicated while an output of the root is
    split: the parameter's gradient is a partial sum over them. The sequential micro-batch
    axis is never one: its micro-batches run on the same device, one after the other."""
    return tuple(
        a
        for a, p in enumerate(use.placements)
        if isinstance(p, Replicate)
        and mesh.shape[a] > 1
        and a != mesh.sequential_axis
        and any(isinstance(o.placements[a], Shard) for o in strategy.outputs)
    )


def zero_shards(su: StepUnits, k: int, strategy: MeshSharding, mesh: Mesh) -> tuple[ZeroShard, ...]:
    """The parameters of unit ``k`` that ZeRO shards under ``strategy``, with their shard
    layouts; empty when the unit has no ZeRO axis. A parameter with no dimension that the
    ZeRO axes divide is refused (PlanError naming it)."""
    unit = su.units[k]
    out = []
    for x, i, value in zero_params(su, k):
        use = strategy.inputs[i]
        if use is None:
            continue
        axes = zero_axes(strategy, use, mesh)
        if not axes:
            continue
        shard = shard_layout(use, axes, static_shape(value), mesh)
        if shard is None:
            n = math.prod(mesh.shape[a] for a in axes)
            raise PlanError(
                f"plan unit {unit.root.name!r}: ZeRO cannot shard parameter {value.name!r} "
                f"(shape {list(static_shape(value))}, layout {use}) over mesh axes "
                f"{list(axes)} ({n} devices): no dimension divides; drop 'zero' for this unit"
            )
        out.append(ZeroShard(value.name, x, use, shard, axes))
    return tuple(out)


def shard_layout(
    use: Layout, axes: Sequence[int], shape: Sequence[int], mesh: Mesh
) -> Layout | None:
    """``use`` with one dimension also split over ``axes``: the largest local dimension
    that their size divides, preferring one that ``use`` does not split already (then the
    conversions from ``use`` need no gather); None when none divides."""
    local = local_shape(shape, use, mesh)
    n = math.prod(mesh.shape[a] for a in axes)
    split = {p.dim for p in use.placements if isinstance(p, Shard)}
    dims = [d for d in range(len(local)) if local[d] % n == 0 and local[d] >= n]
    if not dims:
        return None
    d = min(dims, key=lambda d: (d in split, -local[d], d))
    placements = list(use.placements)
    for a in axes:
        placements[a] = Shard(d)
    return Layout(tuple(placements))


def replicated(mesh: Mesh) -> Layout:
    return Layout((Replicate(),) * mesh.ndim)


class _Chooser:
    """Runs the propagation over one unit for one root strategy."""

    def __init__(
        self,
        su: StepUnits,
        unit: UnitNodes,
        mesh: Mesh,
        out_terms: dict | None = None,
        zero: ZeroStage = ZeroStage.NONE,
        shards: Sequence[ZeroShard] = (),
        chosen: dict | None = None,
    ) -> None:
        self.su = su
        self.unit = unit
        self.mesh = mesh
        self.chosen = {} if chosen is None else chosen
        self.zero = zero
        self.shards = tuple(shards)
        self.sharded = {z.param: z for z in shards}  # parameter -> its ZeRO shard
        # ZeRO-3: the parameter is stored as its shard; the unit's nodes choose as if
        # they held it in its root layout (``use``)
        self.stored_shard = {("x", z.index): z for z in shards if zero is ZeroStage.PARAMETERS}
        self.refs: dict[ir.Value, Ref] = {}
        self.by_name: dict[str, Ref] = {}
        for i, node in enumerate(unit.nodes):
            for j, v in enumerate(node.outputs):
                self.refs[v] = ("n", i, j)
        for k, v in enumerate(unit.externals):
            self.refs[v] = ("x", k)
        for v, ref in self.refs.items():
            if v.name:
                self.by_name.setdefault(v.name, ref)
        self.layouts: dict[Ref, Layout] = {}
        self.conversions: dict[tuple[Ref, Layout], Conversion] = {}
        self.out_terms: dict = {} if out_terms is None else out_terms

    def run(
        self, root: MeshSharding, forced: Sequence[MeshSharding | None] | None = None
    ) -> Program:
        """The program under ``root``; ``forced``: the nodes' strategies, given (None: the
        node chooses); a given strategy is only placed, its conversions recorded."""
        strategies: list[MeshSharding] = []
        unread: set[int] = set()  # chosen nodes whose outputs no node has read yet
        for i, node in enumerate(self.unit.nodes):
            original = _original(self.unit, i)
            if i == 0:
                strategy = root
            elif forced is not None and forced[i] is not None:
                strategy = forced[i]
            elif original is not None:  # a recomputed forward node reruns as the original
                strategy = strategies[original]
            else:
                strategy = self._choose(node)
                unread.add(i)
            self._relay(node, strategy, strategies, unread)
            self._apply(node, strategy)
            strategies.append(strategy)
        self._graph_outputs(strategies)
        entries = []
        for k in range(len(self.unit.kinds)):
            layout = self.layouts.get(("x", k))
            if layout is None:  # read only by nodes that take any layout
                layout = replicated(self.mesh)
            entries.append(layout)
        return Program(
            tuple(strategies),
            tuple(entries),
            tuple(self.conversions.values()),
            self.zero,
            self.shards,
        )

    def _relay(self, node: ir.Node, strategy: MeshSharding, strategies, unread: set[int]):
        """Make an unread value in the layout ``node`` reads it in, where its producer can
        make that layout from the same inputs: a generated tensor (ConstantOfShape, whose
        rule may shard any output dim) is then made as its local piece, not made whole on
        every device and sliced. Producers choose before their readers, and with nothing
        to convert their candidates tie; the least spread one (replicated) wins."""
        for i, value in enumerate(node.inputs):
            ref = self.refs.get(value) if value is not None else None
            if ref is None or ref[0] != "n":
                continue
            p = ref[1]
            if p not in unread:
                continue
            unread.discard(p)
            need = strategy.inputs[i] if i < len(strategy.inputs) else None
            made = strategies[p]
            if need is None or made.outputs[ref[2]] == need:
                continue
            for cand in sa.candidates(self.unit.nodes[p], self.mesh):
                outs = list(cand.outputs)
                outs[ref[2]] = made.outputs[ref[2]]
                if (
                    cand.inputs == made.inputs
                    and cand.outputs[ref[2]] == need
                    and tuple(outs) == tuple(made.outputs)
                ):
                    strategies[p] = cand
                    self.layouts[ref] = need
                    break

    # -- entries -------------------------------------------------------------------
    def _have(self, value: ir.Value) -> Layout | None:
        """The layout the unit holds ``value`` in; None for an entry not yet placed."""
        ref = self.refs[value]
        found = self.layouts.get(ref)
        if found is not None or ref[0] == "n":
            return found
        k = ref[1]
        kind = self.unit.kinds[k]
        layout = None
        if kind is Entry.FIXED:
            layout = replicated(self.mesh)
        elif kind is Entry.PARAM and ref in self.stored_shard:
            layout = self.stored_shard[ref].shard
        elif kind is Entry.STATE:
            param = self.su.state_param[value.name]
            z = self.sharded.get(param)
            layout = z.shard if z is not None else self._layout_of_name(param)
        elif kind is Entry.GRAD:
            primal = self._primal_layout(value)
            if primal is not None:
                layout = _no_partial(primal)
        elif kind is Entry.VALUE and RECOMPUTE_OF_KEY in value.metadata_props:
            # a recomputed value enters as the unit holds or reads its original
            layout = self._layout_of_name(value.metadata_props[RECOMPUTE_OF_KEY])
        if layout is not None:
            self.layouts[ref] = layout
        return layout

    def _primal_layout(self, grad: ir.Value) -> Layout | None:
        """The layout of the first primal of ``grad`` that this unit holds or reads (a
        ZeRO-3 parameter: the layout its nodes read it in)."""
        for name in grad_of(grad):
            z = self.sharded.get(name)
            if z is not None and self.zero is ZeroStage.PARAMETERS:
                return z.use
            found = self._layout_of_name(name)
            if found is not None:
                return found
        return None

    def _seen(self, value: ir.Value) -> Layout | None:
        """The layout the unit's choices see ``value`` in (a ZeRO-3 parameter: ``use``)."""
        z = self.stored_shard.get(self.refs[value])
        return z.use if z is not None else self._have(value)

    def _layout_of_name(self, name: str) -> Layout | None:
        ref = self.by_name.get(name)
        if ref is None:
            return None
        if ref[0] == "x":
            return self._have(self.unit.externals[ref[1]])
        return self.layouts.get(ref)

    # -- choice --------------------------------------------------------------------
    def _choose(self, node: ir.Node) -> MeshSharding:
        role = _role(node)
        haves = [None if v is None else self._seen(v) for v in node.inputs]
        key = self.choose_key(node, role, haves)
        found = self.chosen.get(key)
        if found is not None:
            return found
        cands = sa.candidates(node, self.mesh)
        if not cands:
            raise ShardingError(f"node {node.name!r} ({node.op_type}) has no legal strategy")
        if role == "optimizer":
            cands = self._optimizer_candidates(node, cands)
        elif role == "backward":
            cands = self._mirror_candidates(node, cands)
        found = cheapest(node, cands, haves, self.mesh, self.out_terms, self._stored)
        self.chosen[key] = found
        return found

    def choose_key(self, node: ir.Node, role: str | None, haves) -> tuple:
        """Everything :meth:`_choose` reads: the op's plain-data view, the mesh, the
        layouts its inputs are held in (and which unplaced inputs are stored), and what
        filters its candidates (an update's parameter layout, a gradient's primals)."""
        if role == "optimizer":
            param = node.metadata_props.get(PARAM_KEY)
            want = self._layout_of_name(param) if param else None
            if param in self.sharded:
                want = self.sharded[param].shard
            pshape = None
            if param and want is not None:
                pshape = tuple(static_shape(self.unit.externals[self.by_name[param][1]]))
            context: tuple = (want, pshape)
        elif role == "backward":
            context = tuple(self._primal_layout(v) for v in node.outputs)
        else:
            context = ()
        placed = tuple(
            v is not None and h is None and self._stored(v)
            for v, h in zip(node.inputs, haves, strict=True)
        )
        mesh = (self.mesh.shape, self.mesh.sequential_axis)
        return (sa.view_key(node), mesh, role, context, tuple(haves), placed)

    def _optimizer_candidates(self, node: ir.Node, cands):
        no_partial = [c for c in cands if not sa.has_partial(c)]
        param = node.metadata_props.get(PARAM_KEY)
        want = self._layout_of_name(param) if param else None
        if param in self.sharded:  # ZeRO: the update runs on the shard
            want = self.sharded[param].shard
        if want is None:
            return no_partial or cands
        pshape = tuple(static_shape(self.unit.externals[self.by_name[param][1]]))
        keep = [
            c
            for c in no_partial
            if all(
                tuple(static_shape(v)) != pshape or c.outputs[j] == want
                for j, v in enumerate(node.outputs)
            )
        ]
        return keep or no_partial or cands

    def _mirror_candidates(self, node: ir.Node, cands):
        primals = [self._primal_layout(v) for v in node.outputs]
        if all(p is None for p in primals):
            return cands
        keep = [
            c
            for c in cands
            if all(p is None or _mirrors(c.outputs[j], p) for j, p in enumerate(primals))
        ]
        return keep or cands

    # -- bookkeeping ---------------------------------------------------------------
    def _apply(self, node: ir.Node, strategy: MeshSharding) -> None:
        for i, value in enumerate(node.inputs):
            need = strategy.inputs[i] if i < len(strategy.inputs) else None
            if value is None or need is None:
                continue
            ref = self.refs[value]
            have = self._have(value)
            if have is None:
                if need.has_partial and self._stored(value):
                    raise ShardingError(
                        f"node {node.name!r} ({node.op_type}) would read {value.name!r} as a "
                        "partial sum; no legal strategy"
                    )
                self.layouts[ref] = need
                continue
            if have != need:
                phase = read_phase(node) if ref in self.stored_shard else Phase.ANY
                update = _role(node) == "optimizer" and self._unbatched(ref)
                key = (ref, need, phase)
                found = self.conversions.get(key)
                if found is None:
                    self.conversions[key] = Conversion(ref, have, need, phase, update)
                elif found.update and not update:  # read outside the update too
                    self.conversions[key] = Conversion(ref, have, need, phase)
        for j in range(len(node.outputs)):
            self.layouts[("n", self._index(node), j)] = strategy.outputs[j]

    def _unbatched(self, ref: Ref) -> bool:
        """A parameter or state entry, or a value the unit's update makes."""
        if ref[0] == "x":
            return self.unit.kinds[ref[1]] in (Entry.PARAM, Entry.STATE)
        return _role(self.unit.nodes[ref[1]]) == "optimizer"

    def _stored(self, value: ir.Value) -> bool:
        """Parameters, states and data inputs are stored whole, never as partial sums."""
        ref = self.refs[value]
        return ref[0] == "x" and self.unit.kinds[ref[1]] in (Entry.PARAM, Entry.STATE, Entry.DATA)

    def _index(self, node: ir.Node) -> int:
        return self.refs[node.outputs[0]][1]

    def _graph_outputs(self, strategies) -> None:
        for ref, carried in self.unit.outputs:
            have = self.layouts[ref]
            need = replicated(self.mesh)
            if carried is not None:
                found = self._layout_of_name(carried)
                if found is not None:
                    need = found
            if have != need:
                update = self._unbatched(ref)  # a new parameter or state leaving the step
                conv = Conversion(ref, have, need, Phase.ANY, update)
                self.conversions.setdefault((ref, need, Phase.ANY), conv)


def cheapest(
    node: ir.Node,
    cands: Sequence[MeshSharding],
    haves: Sequence[Layout | None],
    mesh: Mesh,
    out_terms: dict,
    stored: Callable[[ir.Value], bool],
) -> MeshSharding:
    """The candidate with the cheapest conversion of its inputs, scored (bytes sent,
    partial outputs, spread of outputs); lower wins, the first of equals.

    ``haves``: the layout each input is held in, None for a value this reader places (a
    stored value, ``stored(value)``, may then not be read as a partial sum)."""
    # Per held input: (index, held layout, shape, dtype); an input this reader places is
    # checked only for partial sums of stored values.
    held = []
    placed = []
    for i, value in enumerate(node.inputs):
        if value is None:
            continue
        if haves[i] is None:
            if stored(value):
                placed.append(i)
        else:
            held.append((i, haves[i], static_shape(value), value.dtype))
    memo: dict = {}
    volume = sa.conversion_volume  # (the memoised function itself: called per candidate)
    mesh_shape = mesh.shape
    sequential = mesh.sequential_axis

    def score(cand: MeshSharding) -> tuple:
        ins = cand.inputs
        for i in placed:
            need = ins[i] if i < len(ins) else None
            if need is not None and need.has_partial:
                return (math.inf,)
        cost = 0.0
        for i, have, shape, dtype in held:
            need = ins[i] if i < len(ins) else None
            if need is None or have is need or have == need:
                continue
            found = memo.get((i, need))
            if found is None:
                found = memo[(i, need)] = volume(have, need, shape, dtype, mesh_shape, sequential)
            cost += found
        return (cost, *output_terms(cand, mesh, out_terms))

    return min(cands, key=score)


def output_terms(cand: MeshSharding, mesh: Mesh, memo: dict) -> tuple[int, float]:
    """(partial outputs, spread of outputs) of a candidate: the scoring's tie-breakers.

    ``memo`` is keyed by the candidate's identity (and holds the candidate, so the id
    stays its own): equal strategies of different ops are distinct objects, and comparing
    them by value costs more than the terms."""
    hit = memo.get(id(cand))
    if hit is not None and hit[0] is cand:
        return hit[1]
    partial = 0
    spread = 0.0
    for layout in cand.outputs:
        partial += sum(isinstance(p, Partial) for p in layout.placements)
        sharded = [mesh.shape[a] for a, p in enumerate(layout.placements) if isinstance(p, Shard)]
        spread += float(math.prod(sharded))
    found = (partial, spread)
    memo[id(cand)] = (cand, found)
    return found


def _no_partial(layout: Layout) -> Layout:
    return Layout(tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements))


def _mirrors(grad: Layout, primal: Layout) -> bool:
    for g, p in zip(grad.placements, primal.placements, strict=True):
        if isinstance(p, Shard):
            if g != p:
                return False
        elif isinstance(p, Partial):
            if not isinstance(g, Replicate):
                return False
        elif isinstance(g, Shard):
            return False
    return True


# -- crossings -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Crossing:
    """Value ``value`` held by unit ``source`` (its ``ref`` there) read by unit ``target``
    (its external ``index`` there). ``forward``: a forward value, parameter or data input
    (its converted buffer is held); else a gradient."""

    value: ir.Value
    source: int
    source_ref: Ref
    target: int
    index: int
    forward: bool


def crossings(su: StepUnits) -> list[Crossing]:
    """Every value that one unit holds and another reads, in a deterministic order."""
    out = []
    refs: dict[ir.Value, tuple[int, Ref]] = {}
    for k, unit in enumerate(su.units):
        for i, node in enumerate(unit.nodes):
            for j, v in enumerate(node.outputs):
                refs[v] = (k, ("n", i, j))
    for k, unit in enumerate(su.units):
        for x, v in enumerate(unit.externals):
            kind = unit.kinds[x]
            if kind is Entry.FIXED:
                continue
            if kind in (Entry.PARAM, Entry.DATA, Entry.STATE):
                name = su.state_param[v.name] if kind is Entry.STATE else v.name
                source = su.owner.get(name)
                if source is None or source == k:
                    continue
                # a state is held in its parameter's layout: the parameter's entry there
                src_ref = ("x", su.units[source].externals.index(_value(su, source, name)))
                out.append(Crossing(v, source, src_ref, k, x, kind is not Entry.STATE))
                continue
            source, src_ref = refs[v]
            # a recomputed value's converted buffer lives only during the recompute
            held = kind is Entry.VALUE and not _recomputed(v)
            out.append(Crossing(v, source, src_ref, k, x, held))
    return out


def _recomputed(value: ir.Value) -> bool:
    producer = value.producer()
    return producer is not None and RECOMPUTE_KEY in producer.metadata_props


def _value(su: StepUnits, k: int, name: str) -> ir.Value:
    for v in su.units[k].externals:
        if v.name == name:
            return v
    raise KeyError(name)


def itemsize(value: ir.Value) -> int:
    return max(1, int(np.ceil(value.dtype.itemsize))) if value.dtype is not None else 4
