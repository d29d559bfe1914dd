"""Search over device counts and mesh shapes, merge, and turn points into plans.

For every device count the meshes are the 1-D mesh and, with ``--mesh auto``, every
2-D factorisation a x b (a, b >= 2). Each (devices, mesh) problem is solved by
Frontier Tracking; the frontiers merge into one over (devices, time, memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import onnx_ir as ir

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.cost.model import (
    MeshProblem,
    ProblemFamily,
    SearchGraph,
    UnitInfo,
    micro_choices,
    micro_refusal,
    split_offer,
)
from tensoropt.display import fmt_memory
from tensoropt.errors import InfeasibleError, TensorOptError, WorkerFault
from tensoropt.ir.costs import CostProblem, FrontierPoint
from tensoropt.ir.layout import Layout
from tensoropt.ir.mesh import Mesh, mesh_dims
from tensoropt.ir.plan import DefaultStrategy, Plan, UnitStrategy, ZeroStage
from tensoropt.passes.blocks import Blocks, find_blocks
from tensoropt.search import memory
from tensoropt.search.merge import MergedPoint, merge_frontiers
from tensoropt.search.solver import SearchResult, restricted, solve

log = logging.getLogger(__name__)


UnitLayouts = tuple[tuple[tuple["Layout | None", ...], tuple["Layout", ...]], ...]


class Axis(enum.Enum):
    """The axes of the search space (``search --axes``). SPLIT, how each op's tensors are
    split over the mesh, is always searched; the others trade memory for time."""

    SPLIT = "split"
    ZERO = "zero"
    RECOMPUTE = "recompute"
    MICRO = "micro"
    STAGES = "stages"  # pipeline stages over the micro-batched problems (search.pipeline)


@dataclass(frozen=True, slots=True, order=True)
class Variant:
    """The memory-for-time choices one problem of a mesh makes for the whole step:
    micro-batches per step, the ZeRO stage of every unit that can shard its parameters
    (``passes.plans.with_zero``), and whether every block is recomputed."""

    micro_batches: int = 1
    zero: int = 0  # a ZeroStage value
    recompute: bool = False
    stages: int = 1  # pipeline stages (search.pipeline), each on its own copy of the mesh

    @property
    def plain(self) -> bool:
        return self == PLAIN

    def tag(self) -> str:
        """A short key: "" for the plain problem, e.g. "zero-3+recompute+micro-4"."""
        parts = [f"zero-{self.zero}"] if self.zero else []
        parts += ["recompute"] if self.recompute else []
        parts += [f"micro-{self.micro_batches}"] if self.micro_batches > 1 else []
        parts += [f"pp-{self.stages}"] if self.stages > 1 else []
        return "+".join(parts)

    def label(self, blocks: int) -> str:
        """What a point of this problem does besides its split, for tables:
        e.g. "zero-3, recompute 24/24 blocks, 4 micro-batches" ("" when plain)."""
        parts = [f"zero-{self.zero}"] if self.zero else []
        parts += [f"recompute {blocks}/{blocks} blocks"] if self.recompute else []
        parts += [f"{self.micro_batches} micro-batches"] if self.micro_batches > 1 else []
        return ", ".join(parts)

    def to_json(self, blocks: int) -> dict:
        return {
            "micro_batches": self.micro_batches,
            "zero": self.zero,
            "recompute_blocks": blocks if self.recompute else 0,
            "stages": self.stages,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> tuple[Variant, int]:
        """The variant and its block count that :meth:`to_json` wrote."""
        blocks = int(data.get("recompute_blocks", 0))
        variant = cls(
            int(data.get("micro_batches", 1)),
            int(data.get("zero", 0)),
            blocks > 0,
            int(data.get("stages", 1)),
        )
        return variant, blocks


PLAIN = Variant()


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What the search explores besides the split of every op (``search --axes``).

    ``recomputed``: the search graph of the same step with every block of ``blocks``
    recomputed (``passes.recompute``), when RECOMPUTE is searched and the model has
    blocks. ``micro_batches``: the counts tried (those that divide the batch)."""

    axes: frozenset[Axis] = frozenset({Axis.SPLIT})  # the split alone, as `search`
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    recomputed: SearchGraph | None = field(default=None, compare=False)
    blocks: tuple[str, ...] = ()
    # pipeline stage counts tried (with Axis.STAGES), and the device counts whose
    # frontiers get pipelined points (a stage count P is tried on mesh M when
    # P * M.size is one of them)
    stage_counts: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    pipeline_devices: tuple[int, ...] = ()
    # with STAGES: pipelined points only at the device counts above this (the default
    # search's stages, across nodes: the cluster's devices per node); 0: at every count
    stages_above: int = 0
    # filled in by explore: the device counts searched only for the stages' meshes, none
    # of whose points is shown (searched_counts), and the pipeline segments of the
    # search graph and of the recomputed one (None without it), found once for every mesh
    stage_only: tuple[int, ...] = ()
    segments: tuple = field(default=(), compare=False, repr=False)
    # filled in by explore: why the micro-batch counts it left out cannot compile (an
    # op or a loss that couples the samples of a batch: cost.model.micro_refusal)
    micro_refused: str = ""

    @property
    def shows_micro(self) -> bool:
        """Whether micro-batched points are searched for their own sake; without MICRO
        (the default search's stages) the micro-batched problems only feed pipelines."""
        return Axis.MICRO in self.axes

    def variants(self, sg: SearchGraph, mesh: Mesh) -> list[Variant]:
        """The problems of one mesh, plain first. ZeRO needs more than one device;
        micro-batch counts must divide the batch."""
        counts = [1]
        if self.axes & {Axis.MICRO, Axis.STAGES}:
            counts += [k for k in self.micro_batches if k > 1 and sg.batch % k == 0]
        stages = [0]
        if Axis.ZERO in self.axes and mesh.size > 1:
            stages += [int(z) for z in ZeroStage if z is not ZeroStage.NONE]
        recompute = [False]
        if Axis.RECOMPUTE in self.axes and self.recomputed is not None and self.blocks:
            recompute.append(True)
        return [
            Variant(k, z, r)
            for k in counts
            for r in recompute
            for z in stages
            # ZeRO-2 differs from ZeRO-1 only across micro-batches (it prices the same)
            if not (k == 1 and z == int(ZeroStage.GRADIENTS))
        ]


PLAIN_SPACE = SearchSpace()


@dataclass(frozen=True, slots=True)
class MeshSearch:
    """One (devices, mesh) problem, its frontier, and what is needed to use its points.

    Plain data (no graph objects), so that it crosses process boundaries.
    """

    mesh: Mesh
    # the problem its points are sums of; None for a pipelined search (variant.stages >
    # 1), whose step is its slowest stage's: the stages' micro-batched problem is not
    # sent back from the workers with it
    problem: CostProblem | None
    result: SearchResult
    references: dict[str, tuple[float, float, tuple[int, ...]]]
    unit_names: tuple[str, ...]
    unit_layouts: tuple[UnitLayouts, ...]  # per unit, per strategy: (inputs, outputs)
    summaries: tuple[str, ...]  # per frontier point
    reference_summaries: dict[str, str]
    # Per-unit detail for reports (``tensoropt report``); empty when not computed.
    # strategy_kinds[k][s]: what strategy s does with unit k, as ``cost.summary.unit_kind``
    # says ("dp=8", "tp=4 x dp=2", "replicated"); a point's kinds are
    # ``strategy_kinds[k][point.choice[k]]``. Stored per strategy, not per point: exact
    # frontiers reach thousands of points, strategies stay a few per unit.
    strategy_kinds: tuple[tuple[str, ...], ...] = ()
    unit_ops: tuple[str, ...] = ()  # op type of each unit's root node
    unit_weighted: tuple[bool, ...] = ()  # whether the unit reads a trained parameter
    variant: Variant = PLAIN
    # per unit, per strategy: whether the variant's ZeRO stage applies to it
    unit_zero: tuple[tuple[bool, ...], ...] = ()
    blocks: tuple[str, ...] = ()  # the recomputed blocks when variant.recompute
    # pipelined searches (variant.stages > 1): per point, the blocks where stages 1..P-1
    # start (search.pipeline)
    stage_starts: tuple[tuple[str, ...], ...] = ()
    # the plain problem's: why each reference plan is not expressible on this mesh
    reference_misses: dict[str, str] = field(default_factory=dict)

    @property
    def devices(self) -> int:
        """Devices a point of this search runs on: the mesh, once per pipeline stage."""
        return self.mesh.size * self.variant.stages

    @property
    def key(self) -> tuple[int, tuple[int, ...], Variant]:
        return (self.devices, tuple(self.mesh.shape), self.variant)


@dataclass(frozen=True, slots=True)
class Exploration:
    searches: tuple[MeshSearch, ...]
    merged: tuple[MergedPoint, ...]
    epsilon: float | None
    memory_budget: float | None
    space: SearchSpace = PLAIN_SPACE  # what was searched (pipeline_devices filled in)
    # key -> the first search with it, made on the first lookup (a table of every merged
    # point looks up its source: a scan per point took 4% of an every-axis search); not
    # an init field, so dataclasses.replace starts a copy with other searches afresh
    _by_key: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    # (id(search), id(point)) -> the point's index in that search's frontier, made on the
    # first lookup (a list.index per point is quadratic: frontiers reach 10,000 points)
    _at: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def search_of(
        self, devices: int, mesh: tuple[int, ...], variant: Variant = PLAIN
    ) -> MeshSearch:
        if not self._by_key:
            for s in self.searches:
                self._by_key.setdefault(s.key, s)
        found = self._by_key.get((devices, tuple(mesh), variant))
        if found is None:
            raise KeyError((devices, mesh, variant))
        return found

    def index_of(self, search: MeshSearch, point: FrontierPoint) -> int:
        """The index of ``point`` (an object of ``search.result.points``) in that
        frontier, as :func:`device_frontier` pairs them."""
        if not self._at:
            for s in self.searches:
                for k, p in enumerate(s.result.points):
                    self._at[id(s), id(p)] = k
        return self._at[id(search), id(point)]

    def source_of(self, point: MergedPoint) -> MeshSearch:
        """The search a merged point comes from."""
        return self.search_of(point.devices, point.mesh, point.variant or PLAIN)


PIPELINED_GUARANTEE = (
    "pipelined points (mesh ppP:M, P stages of mesh M): for each plan of a micro-batched "
    "frontier, the exact Pareto set over its stage cuts, less the cuts that points "
    "already made at the same device count dominate (docs/design/pipeline.md)"
)


def idle_axes(exp) -> dict:
    """{axis: why it has no problem in this search}, for the asked axes ZeRO,
    recomputation and micro-batching that gave no problem (ZeRO at one device, a model
    without blocks, no micro-batch count dividing the batch): the axes line must not
    claim that plans using them were searched."""
    axes, searches = exp.space.axes, exp.searches
    idle = {}
    if Axis.ZERO in axes and not any(s.variant.zero for s in searches):
        if all(s.devices < 2 for s in searches):
            idle[Axis.ZERO] = "it needs 2 devices or more"
        else:
            idle[Axis.ZERO] = "no unit can shard its parameters on these meshes"
    if Axis.RECOMPUTE in axes and not any(s.variant.recompute for s in searches):
        idle[Axis.RECOMPUTE] = "the model has no block to recompute"
    if Axis.MICRO in axes and not any(s.variant.micro_batches > 1 for s in searches):
        counts = ",".join(str(k) for k in exp.space.micro_batches if k > 1)
        if exp.space.micro_refused:
            idle[Axis.MICRO] = f"no plan compiles micro-batched: {exp.space.micro_refused}"
        elif counts:
            idle[Axis.MICRO] = f"no micro-batch count of {counts} divides the batch"
        else:
            idle[Axis.MICRO] = "--micro-batches gives no count above 1"
    return idle


def guarantee_of(exp: Exploration) -> str:
    """What an exploration's frontier guarantees: exact or epsilon over every plan of its
    unpipelined problems (within the memory budget), and what its pipelined points are
    when it has any.

    Not a problem's own guarantee: the plans a problem was given as incumbents are
    points of this exploration, so what they dominate is not missing from the merged
    frontier ("less the points that one of N given plans dominates" holds per problem,
    not for the whole)."""
    plain = [s for s in exp.searches if s.variant.stages == 1]
    parts = []
    within = ""
    if exp.memory_budget is not None:
        within = f" with memory <= {fmt_memory(exp.memory_budget)} per device"
    if plain and exp.epsilon is None:
        parts = ["exact: the points are the Pareto frontier of every plan" + within]
    if plain and exp.epsilon is not None:  # the meshes of a count cover each other
        parts = [
            f"epsilon={exp.epsilon!r}: for every plan P on N devices{within} there is a "
            f"point Q of the N-device frontier with Q.memory <= P.memory and Q.time <= "
            f"(1 + {exp.epsilon!r}) * P.time"
        ]
    if len(plain) < len(exp.searches):
        parts.append(PIPELINED_GUARANTEE)
    return "; ".join(parts)


def mesh_label(shape: Sequence[int], stages: int = 1) -> str:
    """A mesh for tables: "2x4"; a pipeline's "pp4:2x4" (4 stages of a 2x4 mesh each)."""
    text = "x".join(map(str, shape))
    return f"pp{stages}:{text}" if stages > 1 else text


def mesh_shapes(devices: int, spec: str) -> list[Mesh]:
    """Meshes for one device count: ``auto`` = 1-D plus every 2-D factorisation."""
    if devices < 1:
        raise TensorOptError(f"device count {devices} must be at least 1")
    if spec == "auto":
        meshes = [Mesh((devices,), ("dp",))]
        for a in range(2, devices):
            if devices % a == 0 and devices // a >= 2:
                meshes.append(Mesh((a, devices // a), ("dp", "tp")))
        return meshes
    dims = mesh_dims(spec)
    size = 1
    for d in dims:
        size *= d
    if size != devices:
        raise TensorOptError(
            f"--mesh {spec} has {size} devices, which cannot run device count {devices}; "
            "use --mesh auto or matching --devices"
        )
    return [Mesh(dims, ("dp",) if len(dims) == 1 else ("dp", "tp"))]


def search_meshes(sg: SearchGraph, devices: Sequence[int], mesh_spec: str) -> list[Mesh]:
    """The meshes searched for ``devices``.

    With ``auto``, a 2-D mesh whose data axis does not divide the batch is skipped: that
    axis could only replicate, so every plan on it is a plan of the smaller mesh on more
    devices (dominated in the merged frontier).
    """
    return [
        m
        for d in devices
        for m in mesh_shapes(d, mesh_spec)
        if mesh_spec != "auto" or m.ndim == 1 or sg.batch % m.shape[0] == 0
    ]


def plan_of_point(search: MeshSearch, point: FrontierPoint, source: str) -> Plan:
    """The plan of one of ``search``'s frontier points (with its pipeline stages)."""
    starts: tuple[str, ...] = ()
    if search.stage_starts:
        index = next(i for i, p in enumerate(search.result.points) if p is point)
        starts = search.stage_starts[index]
    return plan_from_choice(search, point.choice, source, starts)


def plan_from_choice(
    search: MeshSearch, choice: Sequence[int], source: str, starts: Sequence[str] = ()
) -> Plan:
    """The plan of one frontier point: explicit layouts for every unit, and the
    variant's ZeRO stage, micro-batches and recomputed blocks; ``starts``: the blocks
    where its pipeline stages 1, 2, ... begin."""
    units = {}
    variant = search.variant
    for u, (name, layouts, k) in enumerate(
        zip(search.unit_names, search.unit_layouts, choice, strict=True)
    ):
        inputs, outputs = layouts[k]
        zeroed = bool(search.unit_zero) and search.unit_zero[u][k]
        stage = ZeroStage(variant.zero) if zeroed else ZeroStage.NONE
        units[name] = UnitStrategy(inputs=inputs, outputs=outputs, zero=stage)
    return Plan(
        search.mesh,
        units,
        source=source,
        default=DefaultStrategy.DATA_PARALLEL,
        micro_batches=variant.micro_batches,
        recompute=search.blocks if variant.recompute else (),
        stages=tuple(starts),
    )


def megatron_blocks(sg: SearchGraph) -> Blocks | None:
    """The Megatron blocks of the search graph: the same for every mesh. None when they
    cannot be found (each mesh's reference plan then reports why, as before)."""
    try:
        return find_blocks(sg.graph, set(sg.params))
    except TensorOptError:
        return None


def reference_choices(
    sg: SearchGraph, mp: MeshProblem, blocks: Blocks | None = None
) -> dict[str, tuple[int, ...]]:
    """The data-parallel and Megatron plans as choices of this problem (when expressible).
    ``blocks``: :func:`megatron_blocks` of ``sg``, when already found."""
    return _reference_choices(sg, mp.mesh, mp.units, blocks)


def _reference_choices(
    sg: SearchGraph,
    mesh: Mesh,
    units: Sequence[UnitInfo],
    blocks: Blocks | None,
    misses: dict[str, str] | None = None,
) -> dict[str, tuple[int, ...]]:
    """:func:`reference_choices` from the units' strategies on ``mesh`` alone (no prices
    needed); ``misses`` takes why each plan that is not expressible is not."""
    misses = {} if misses is None else misses
    from tensoropt.passes.annotate import complete_plan
    from tensoropt.passes.plans import builtin_axis_names, builtin_plan

    out = {}
    for name in ("data-parallel", "megatron"):
        if name == "data-parallel" and mesh.ndim > 1:
            continue  # the same plan as on the 1-D mesh of this device count
        # named as compile names the plan's mesh, so that a refusal reads the same
        named = Mesh(mesh.shape, builtin_axis_names(name, mesh.ndim))
        try:
            built = builtin_plan(name, sg.graph, sg.signature, named, blocks)
            if name == "megatron" and not built.plan.units:
                misses[name] = "megatron: the model has no block it splits"
                continue
            roots = complete_plan(sg.graph, sg.signature, built.plan, built.data_axes, sg.units)
        except TensorOptError as exc:
            log.info("reference %s not expressible on %s: %s", name, mesh, exc)
            misses[name] = str(exc)
            continue
        found = _positions([info.strategies for info in units], [roots[i.node.name] for i in units])
        if found is not None:
            out[name] = found
        else:
            misses[name] = f"{name}: a unit's strategy is not among those searched on {mesh}"
    return out


def reference_gaps(exp: Exploration, devices: int) -> dict[str, str]:
    """The reference plans the searched axes call for that no problem of ``devices``
    holds, each with why: the built-in plan's own refusal on the device count's 1-D mesh
    (e.g. a batch that does not split that many ways), for fsdp and megatron+recompute
    their base plan's. Pipelined references (megatron+pp) are not listed."""
    if devices == 1:  # the data-parallel plan is the one plan there
        return {}
    wanted = ["data-parallel", "megatron"]
    if Axis.ZERO in exp.space.axes and Axis.RECOMPUTE in exp.space.axes:
        wanted.append("fsdp")
    if Axis.RECOMPUTE in exp.space.axes:
        wanted.append("megatron+recompute")
    here = [s for s in exp.searches if s.devices == devices]
    have = {name for s in here for name in s.references}
    why: dict[str, str] = {}
    for s in sorted(here, key=lambda s: s.mesh.ndim):  # the 1-D mesh's reasons first
        if s.variant.plain:
            for name, reason in s.reference_misses.items():
                why.setdefault(name, reason)
    base = {"fsdp": "data-parallel", "megatron+recompute": "megatron"}
    gaps = {}
    for name in wanted:
        if name in have:
            continue
        if name in why or base.get(name) in why:
            # the refusal without its advice to compile ("; use a device count ...")
            gaps[name] = (why.get(name) or why[base[name]]).split("; ")[0]
        else:
            gaps[name] = f"{name}: not among the problems searched at {devices} devices"
    return gaps


def _positions(rows: Sequence[Sequence], wanted: Sequence) -> tuple[int, ...] | None:
    """Per unit, the first position of ``wanted[k]`` in ``rows[k]``; None when a row
    lacks it. Repeated layers share their rows: each distinct row is indexed once."""
    index: dict[int, dict] = {}
    out = []
    for row, want in zip(rows, wanted, strict=True):
        where = index.get(id(row))
        if where is None:
            where = index[id(row)] = {}
            for i, x in enumerate(row):
                where.setdefault(x, i)
        i = where.get(want)
        if i is None:
            return None
        out.append(i)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _Built:
    variant: Variant
    mp: MeshProblem
    graph: SearchGraph  # the step it prices (recomputed blocks or not)
    reals: tuple[tuple[object, ...], ...] | None  # per unit, per strategy: on the plan's mesh


class _MeshProblems:
    """The variant problems of one mesh, built on demand. A problem whose every entry is
    at least another's of the same family (same units, strategies and edges) is left
    out: each of its plans is matched or beaten by the same choice of the other, so the
    merged frontier does not change (a stage no unit can take is the plain problem)."""

    def __init__(
        self,
        sg: SearchGraph,
        space: SearchSpace,
        mesh: Mesh,
        profile: ClusterProfile,
    ):
        self.sg, self.space, self.mesh, self.profile = sg, space, mesh, profile
        self.families: dict[tuple[bool, int], tuple[ProblemFamily, tuple | None] | None] = {}
        self.built: dict[tuple[bool, int], list[MeshProblem]] = {}
        self.plain_refs: dict[str, tuple[int, ...]] = {}
        self.plain_misses: dict[str, str] = {}  # why a reference is not expressible here
        # the plain problem's strategies per unit (plain data: they cross to the second
        # phase's jobs with the references, ``_Phase``)
        self.plain_strategies: tuple[tuple, ...] | None = None
        self.chosen: dict = {}  # the nodes' choices, shared by the families (ProgramCache)
        self.choices: dict[tuple[bool, int], object] = {}  # each family's strategies
        # (recompute, micro-batches, ZeRO stage) -> (the problem with one more
        # micro-batch slot and without activations, the regions of the points made, the
        # stage problem's SegmentTables or None), found for a stage problem's incumbents
        # and taken by its pipelines
        self.bare: dict[tuple[bool, int, int], object] = {}
        # (recompute, micro-batches) -> the family priced with one more micro-batch slot
        # and without activations (search.pipeline.slot_family), made once: its prices
        # serve the stage problems of every ZeRO stage (_staged_incumbents)
        self.slot_families: dict[tuple[bool, int], ProblemFamily] = {}
        # (recompute, micro-batches, ZeRO stage) -> the summaries of a problem that only
        # feeds pipelines (its points are not shown, so _solve_one leaves them to
        # _pipelined, which describes the plans its pipelines pick)
        self.describe: dict[tuple[bool, int, int], Callable[[Sequence[int]], str]] = {}

    def read_references(self, blocks: Blocks | None) -> None:
        """Keep the reference plans of the plain problem's units (those of the variant
        problems and of the pipelines are mapped from them)."""
        found = self.family(PLAIN)
        assert found is not None  # only a micro-batch count can be refused
        infos = found[0].infos
        self.plain_strategies = tuple(tuple(info.strategies) for info in infos)
        self.plain_refs = _reference_choices(self.sg, self.mesh, infos, blocks, self.plain_misses)

    def build(self, v: Variant) -> _Built | None:
        found = self.family(v)
        if found is None:
            return None
        family, reals = found
        graph = self.graph(v)
        mp = family.problem(zero_all=ZeroStage(v.zero), working_set=v.recompute)
        same = self.built.setdefault((v.recompute, v.micro_batches), [])
        if any(_covers(other, mp) for other in same):
            return None
        same.append(mp)
        return _Built(v, mp, graph, reals)

    def slot_family(self, v: Variant) -> ProblemFamily:
        """The family of ``v`` (:meth:`family`, which must exist) priced with one more
        micro-batch slot and without activations, made once."""
        from tensoropt.search.pipeline import slot_family

        key = (v.recompute, v.micro_batches)
        found = self.slot_families.get(key)
        if found is None:
            made = self.family(v)
            assert made is not None
            found = self.slot_families[key] = slot_family(
                self.graph(v), made[0], self.choices[key], self.chosen, self.profile,
                v.micro_batches + 1, 0.0,
            )  # fmt: skip
        return found

    def graph(self, v: Variant) -> SearchGraph:
        """The step ``v``'s problems price: with every block recomputed, or not."""
        graph = self.space.recomputed if v.recompute else self.sg
        assert graph is not None
        return graph

    def family(self, v: Variant) -> tuple[ProblemFamily, tuple | None] | None:
        """The problem family of ``v``'s recomputation and micro-batch count (its units
        and strategies, made once), and the strategies on the plan's mesh of a
        micro-batched one; None when the micro-batch count cannot be searched here."""
        from tensoropt.passes.micro import MicroError

        key = (v.recompute, v.micro_batches)
        graph = self.graph(v)
        if key not in self.families:
            choices, reals = None, None
            try:
                if v.micro_batches > 1:
                    choices, real = split_offer(micro_choices(graph, self.mesh, v.micro_batches))
                    reals = tuple(real[unit.root.name] for unit in graph.units.units)
                family = ProblemFamily(
                    graph,
                    self.mesh,
                    self.profile,
                    micro_batches=v.micro_batches,
                    choices=choices,
                    chosen=self.chosen,
                )
                if choices is not None and reals is not None:
                    family, choices, reals = _stored_whole(family, choices, reals)
                self.families[key] = (family, reals)
                self.choices[key] = choices
            except MicroError as exc:
                log.info("%s on %s: not searched: %s", v.tag(), self.mesh, exc)
                self.families[key] = None
        return self.families[key]


def _stored_whole(family: ProblemFamily, choices: dict, reals: tuple):
    """A micro-batched family without the strategies that would split a parameter with
    the batch (``ProblemFamily.stores_whole``: compile refuses them), and its choices and
    plan-mesh strategies to match. Raises MicroError when a unit keeps none."""
    from tensoropt.passes.micro import MicroError

    whole = family.stores_whole()
    if all(all(row) for row in whole):
        return family, choices, reals
    units = family.sg.units.units
    for unit, row in zip(units, whole, strict=True):
        if not any(row):
            raise MicroError(
                f"--micro-batches {family.micro_batches}: unit {unit.root.name!r} "
                f"({unit.root.op_type}) splits a parameter with the batch under every "
                "strategy"
            )
    # repeated layers share their rows (split_offer): each distinct one is narrowed once
    narrowed_rows: dict[tuple[int, int, tuple[bool, ...]], tuple[tuple, tuple]] = {}
    kept, kept_reals = {}, []
    for unit, rs, row in zip(units, reals, whole, strict=True):
        offered = choices[unit.root.name]
        key = (id(offered), id(rs), row)
        found = narrowed_rows.get(key)
        if found is None:
            found = narrowed_rows[key] = (
                tuple(c for c, ok in zip(offered, row, strict=True) if ok),
                tuple(r for r, ok in zip(rs, row, strict=True) if ok),
            )
        kept[unit.root.name] = found[0]
        kept_reals.append(found[1])
    reals = tuple(kept_reals)
    narrowed = ProblemFamily(
        family.sg,
        family.plan_mesh,
        family.builder.pricer.profile,
        micro_batches=family.micro_batches,
        choices=kept,
        like=family,  # the same programs and prices: nothing runs again
    )
    return narrowed, kept, reals


def axis_level(v: Variant) -> int:
    """The order in which a device count's problems are solved, across its meshes: the
    split alone, then with ZeRO, then with recomputation, then with micro-batches. Each
    level's points are incumbents of the next, so the frontier of every level is exact
    over that level and those before it (``report`` shows what each axis buys). Pipeline
    stages, made from the micro-batched problems' frontiers, come last."""
    if v.stages > 1:
        return 4
    if v.micro_batches > 1:
        return 3
    if v.recompute:
        return 2
    return 1 if v.zero else 0


def _covers(a: MeshProblem, b: MeshProblem) -> bool:
    """Whether every entry of ``a`` is at most the same entry of ``b`` (same shapes)."""
    pa, pb = a.problem, b.problem
    if len(pa.units) != len(pb.units) or pa.edges != pb.edges:
        return False
    for ua, ub in zip(pa.units, pb.units, strict=True):
        if len(ua.strategies) != len(ub.strategies):
            return False
        for sa_, sb in zip(ua.strategies, ub.strategies, strict=True):
            if sa_.time_s > sb.time_s or sa_.memory_bytes > sb.memory_bytes:
                return False
    return True


# the reference plans, in table order: the built-in plans on the plain problems, and
# two of them with memory axes on the variant problems below
REFERENCE_NAMES = ("data-parallel", "megatron", "fsdp", "megatron+recompute", "megatron+pp")
# the reference plans of a variant problem: (variant, name in the variant, plain reference)
_VARIANT_REFERENCES = (
    (Variant(1, int(ZeroStage.PARAMETERS), True), "fsdp", "data-parallel"),
    (Variant(1, 0, True), "megatron+recompute", "megatron"),
)


def _solve_one(
    b: _Built,
    at: _MeshProblems,
    job: tuple[Mesh, ClusterProfile, float | None, float | None],
    blocks: Blocks | None,
    incumbents: tuple[list[float], list[float]] | None,
) -> MeshSearch:
    """Solve one problem of a mesh and describe its points."""
    from tensoropt.cost.summary import Summarizer, kind_table

    mesh, profile, budget, epsilon = job
    mp, v = b.mp, b.variant
    result = solve(mp.problem, memory_budget=budget, epsilon=epsilon, incumbents=incumbents)
    shown = mp  # summaries name the strategies on the plan's mesh
    if b.reals is not None:
        shown = dataclasses.replace(
            mp,
            mesh=mesh,
            units=tuple(
                dataclasses.replace(u, strategies=r) for u, r in zip(mp.units, b.reals, strict=True)
            ),
        )
    space = at.space
    label = v.label(len(space.blocks))
    suffix = f", {label}" if label else ""
    refs, ref_summaries = {}, {}
    if v.plain:
        at.read_references(blocks)
        named: dict[str, tuple[int, ...] | None] = dict(at.plain_refs)
    else:
        named = {
            name: _mapped(at.plain_refs[base], at.plain_strategies, mp)
            for want, name, base in _VARIANT_REFERENCES
            if want == v and base in at.plain_refs and at.plain_strategies is not None
        }
    shows = v.micro_batches == 1 or space.shows_micro
    # A variant problem with no point and no reference plan describes nothing (most of
    # them come back empty): its strategies' kinds are left out. The plain problems keep
    # theirs (report reads the units from the first problem of a device count), and so
    # do the problems that feed pipelines (_pipelined describes the plans they pick).
    if v.plain or result.points or any(c is not None for c in named.values()) or not shows:
        kinds = kind_table(shown, b.graph)
        summarize = Summarizer(shown, b.graph, kinds)
    else:
        kinds = ()
    for name, choice in named.items():
        if choice is None:
            continue
        t, m = mp.problem.evaluate(choice)
        refs[name] = (t, m, choice)
        ref_summaries[name] = summarize(choice) + suffix
    strategies = b.reals or tuple(u.strategies for u in mp.units)
    if shows:
        summaries = tuple(summarize(p.choice) + suffix for p in result.points)
    else:  # it only feeds pipelines: _pipelined describes the plans they pick
        summaries = ()
        at.describe[(v.recompute, v.micro_batches, v.zero)] = summarize
    return MeshSearch(
        mesh=mesh,
        problem=mp.problem,
        result=result,
        references=refs,
        unit_names=tuple(u.node.name for u in mp.units),
        unit_layouts=_layouts_of(strategies),
        summaries=summaries,
        reference_summaries=ref_summaries,
        strategy_kinds=kinds,
        unit_ops=tuple(u.node.op_type for u in mp.units),
        unit_weighted=tuple(
            any(x is not None and x.name in b.graph.params for x in u.node.inputs) for u in mp.units
        ),
        variant=v,
        unit_zero=tuple(
            tuple(p.zero is not ZeroStage.NONE for p in programs) for programs in mp.programs
        )
        if v.zero
        else (),
        blocks=space.blocks if v.recompute else (),
        reference_misses=dict(at.plain_misses) if v.plain else {},
    )


def _layouts_of(strategies) -> tuple[UnitLayouts, ...]:
    """Per unit, per strategy: (input layouts, output layouts). Repeated layers offer
    equal strategy tuples: each distinct one is converted once, and shared."""
    seen: dict[tuple, UnitLayouts] = {}
    out = []
    for unit in strategies:
        key = tuple(unit)
        found = seen.get(key)
        if found is None:
            found = seen[key] = tuple((tuple(s.inputs), tuple(s.outputs)) for s in unit)
        out.append(found)
    return tuple(out)


def _mapped(choice: Sequence[int], strategies, mp: MeshProblem) -> tuple[int, ...] | None:
    """A plain problem's choice (of ``strategies``, per unit) as a choice of ``mp`` (same
    units, strategies looked up by value); None when a strategy is not offered there."""
    wanted = [offered[s] for offered, s in zip(strategies, choice, strict=True)]
    return _positions([target.strategies for target in mp.units], wanted)


def explore(
    sg: SearchGraph,
    devices: Sequence[int],
    mesh_spec: str,
    profile: ClusterProfile,
    *,
    memory_budget: float | None = None,
    epsilon: float | None = None,
    jobs: int | None = None,
    on_problem: Callable[[Mesh], None] | None = None,
    whole_frontiers: bool = False,
    space: SearchSpace = PLAIN_SPACE,
    counter=None,
) -> Exploration:
    """Solve every (devices, mesh, variant) problem (in parallel processes) and merge the
    frontiers. ``space``: the axes searched besides the split (default: none).

    The meshes of one device count are solved one after the other in one job, the most
    balanced 2-D mesh first, and each mesh's variants after its plain problem: each search
    (exact or epsilon) gets the points already found for its device count as incumbents,
    and leaves out what they strictly dominate (points that no per-device table, merged
    frontier or ``--pick`` can show), which spares most of the work on problems whose
    plans are all slower and larger than another's. ``whole_frontiers``: every problem's complete
    frontier instead (``--dump-costs`` records them for an external solver). Jobs are
    spread over ``jobs`` worker processes (fork; default: one per core, at most one per
    job; 1 = in this process). ``on_problem`` is called once per mesh. ``counter``: a
    shared integer (``multiprocessing.Value``) that counts the problems gone through,
    solved or left out, in this process or its workers (:func:`problem_count` of them in
    all), for a progress that moves while a device count's job runs.
    """
    wanted = sorted(set(devices))
    space, devices = searched_counts(space, wanted)
    space = _compilable_counts(sg, space)
    if space.pipeline_devices:
        from tensoropt.search.pipeline import segments_of

        graphs = (sg, space.recomputed)
        space = dataclasses.replace(
            space, segments=tuple(None if g is None else segments_of(g) for g in graphs)
        )
    meshes = search_meshes(sg, devices, mesh_spec)
    groups: dict[int, list[Mesh]] = {}
    for m in meshes:
        groups.setdefault(m.size, []).append(m)
    chained = not whole_frontiers
    batches: list[tuple[Mesh, ...]] = []
    for d in sorted(groups, reverse=True):  # the largest counts first: the longest jobs
        ordered = sorted(groups[d], key=_solve_order) if chained else groups[d]
        batches += [tuple(ordered)] if chained else [(m,) for m in ordered]

    def work(phase: _Phase) -> list:
        order = batches
        if phase.part == "first":  # whole solves of stage problems take longest
            order = sorted(batches, key=lambda b: not _first_pass_stages(space, sg, b))
        return [(b, profile, memory_budget, epsilon, chained, phase.of(b)) for b in order]

    workers = max(1, min(len(batches), jobs or os.cpu_count() or 1))
    found: dict[tuple[int, ...], list[tuple[tuple[int, int], MeshSearch]]] = {}
    refs: dict[tuple[int, ...], tuple] = {}
    blocks = megatron_blocks(sg)

    def collect(results) -> None:
        for mesh, keyed, plain in results:
            found.setdefault(tuple(mesh.shape), []).extend(keyed)
            refs.setdefault(tuple(mesh.shape), plain)
            if on_problem:
                on_problem(mesh)

    # forked workers inherit the thresholds
    with memory.fewer_collections(), _runner(sg, blocks, space, workers, counter) as run:
        if _two_phases(space, chained):
            collect(run(work(_Phase("first"))))
            seeds: dict[int, list[tuple[float, float]]] = {}
            for m in meshes:
                for _, s in found[tuple(m.shape)]:
                    if s.devices in space.pipeline_devices:
                        points = seeds.setdefault(s.devices, [])
                        points += [(p.time_s, p.memory_bytes) for p in s.result.points]
            collect(run(work(_Phase("second", seeds, refs))))
        else:
            collect(run(work(_Phase())))
    # each mesh's searches in the order of its problems (stable: pipelines after theirs)
    searches = [
        s
        for m in meshes
        for _, s in sorted(found[tuple(m.shape)], key=lambda r: r[0])
        if s.devices in wanted
    ]
    merged = merge_frontiers({s.key: s.result for s in searches})
    if memory_budget is not None and not merged:
        raise InfeasibleError(_infeasible_message(searches, memory_budget, space))
    return Exploration(tuple(searches), merged, epsilon, memory_budget, space)


def _compilable_counts(sg: SearchGraph, space: SearchSpace) -> SearchSpace:
    """The space without the micro-batch counts no plan of the step compiles in, and the
    first reason (found before the workers fork, so they inherit the answers)."""
    if not space.axes & {Axis.MICRO, Axis.STAGES}:
        return space
    kept, why = [], ""
    for k in space.micro_batches:
        refused = micro_refusal(sg, k) if k > 1 and sg.batch % k == 0 else ""
        if refused:
            why = why or refused
        else:
            kept.append(k)
    return dataclasses.replace(space, micro_batches=tuple(kept), micro_refused=why)


def searched_counts(space: SearchSpace, devices: Sequence[int]) -> tuple[SearchSpace, list[int]]:
    """The space with its pipelined device counts filled in, and every device count whose
    meshes are searched: ``devices``, and with stages each count's N / P for the stages'
    meshes. The default's stages (``stages_above``) with no count above it: no stages."""
    wanted = sorted(set(devices))
    if Axis.STAGES not in space.axes:
        return space, wanted
    piped = tuple(d for d in wanted if d > space.stages_above)
    space = dataclasses.replace(space, pipeline_devices=piped)
    if space.stages_above and not piped:
        space = dataclasses.replace(space, axes=space.axes - {Axis.STAGES})
    stage_meshes = {d // p for d in piped for p in space.stage_counts if d % p == 0}
    space = dataclasses.replace(space, stage_only=tuple(sorted(stage_meshes - set(wanted))))
    return space, sorted(set(wanted) | stage_meshes)


@dataclass(frozen=True, slots=True)
class _Phase:
    """Which problems of a job one pass over the jobs solves. ``all``: every one (one
    pass). With two (:func:`_two_phases`), ``first``: every problem without
    micro-batches, and the stage problems :func:`_first_pass` picks; then ``second``, with
    ``seeds`` (device count -> (time, memory) of every point the first pass made there)
    as the points already made at the counts the stage problems feed, and ``refs`` (mesh
    shape -> its plain problem's reference choices and strategies, read in the first
    pass) for the reference plans of the rest."""

    part: str = "all"
    seeds: Mapping[int, Sequence[tuple[float, float]]] = field(default_factory=dict)
    refs: Mapping[tuple[int, ...], tuple] = field(default_factory=dict)

    def of(self, meshes: Sequence[Mesh]) -> _Phase:
        """This phase as one job of ``meshes`` sees it (only their references)."""
        if not self.refs:
            return self
        refs = {tuple(m.shape): self.refs[tuple(m.shape)] for m in meshes}
        return dataclasses.replace(self, refs=refs)


def _two_phases(space: SearchSpace, chained: bool) -> bool:
    """Whether the jobs run in two passes: with pipelines whose stage problems only feed
    them (the default search's stages) and incumbents. A job holds one device count, so
    the pipelined points of a count come from the jobs of its stage meshes' counts and
    the plain points from its own: within one pass, a stage problem's incumbents are
    only the pipelines its own job made. The first pass makes the points that prune the
    most (the plain problems and the fewest stages with the most micro-batches), the
    second prunes every other stage problem and cut with them."""
    return chained and bool(space.pipeline_devices) and not space.shows_micro


def _first_pass(space: SearchSpace, sg: SearchGraph, mesh: Mesh, v: Variant) -> bool:
    """Whether the first of two passes solves ``v`` on ``mesh``: a problem without
    micro-batches, or the problem with the most micro-batches on a mesh that the fewest
    stages of some pipelined device count use. On the GPT-3 175B shape every merged
    pipelined point comes from those (2 stages, 8 micro-batches; 4 stages at 1024
    devices): the fewest micro-batches' activations per stage and the least bubble."""
    if v.micro_batches == 1:
        return True
    if v.micro_batches != max(w.micro_batches for w in space.variants(sg, mesh)):
        return False
    for n in space.pipeline_devices:
        fewest = min((p for p in space.stage_counts if n % p == 0), default=None)
        if fewest is not None and fewest * mesh.size == n:
            return True
    return False


def _first_pass_stages(space: SearchSpace, sg: SearchGraph, meshes: Sequence[Mesh]) -> bool:
    """Whether a first pass solves a stage problem on one of ``meshes``."""
    return any(
        v.micro_batches > 1 and _feeds_pipelines(space, m, v) and _first_pass(space, sg, m, v)
        for m in meshes
        for v in space.variants(sg, m)
    )


def problem_count(
    sg: SearchGraph,
    devices: Sequence[int],
    mesh_spec: str,
    space: SearchSpace,
    whole_frontiers: bool = False,
) -> int:
    """How many problems :func:`explore` counts on its ``counter``: every variant of
    every mesh, once per pass (a pass goes through them all, and leaves out those that
    another pass solves)."""
    filled, counts = searched_counts(space, devices)
    passes = 2 if _two_phases(filled, not whole_frontiers) else 1
    meshes = search_meshes(sg, counts, mesh_spec)
    return passes * sum(len(filled.variants(sg, m)) for m in meshes)


# the shared count of problems gone through (explore's ``counter``), while one is given:
# set in this process for a search run here, and in each forked worker
_COUNTER: list = []


def _counted(rows):
    """``rows``, each counted on the shared counter once the loop's body for it has
    run (solved or left out)."""
    for row in rows:
        yield row
        if _COUNTER:
            with _COUNTER[0].get_lock():
                _COUNTER[0].value += 1


@contextlib.contextmanager
def _runner(sg: SearchGraph, blocks: Blocks | None, space: SearchSpace, workers: int, counter=None):
    """A function that solves a list of jobs and gives back each mesh's results
    (:func:`_solve_meshes`) as the jobs finish: in this process (``workers`` 1, or no
    fork) or in ``workers`` forked processes, the same ones for every pass."""
    if workers == 1 or multiprocessing.get_start_method(allow_none=True) not in (None, "fork"):
        _COUNTER[:] = [counter] if counter is not None else []
        try:
            with memory.limited(memory.share(1)):
                yield lambda work: [
                    r for job in work for r in _solve_meshes(sg, job, blocks, space)
                ]
        finally:
            _COUNTER.clear()
        return
    # A forked worker inherits the search graphs from this process (initargs are not
    # pickled under fork); only the plain-data results come back.
    ctx = multiprocessing.get_context("fork")
    init = (sg, blocks, space, memory.share(workers), counter)
    others = {p.pid for p in multiprocessing.active_children()}
    # what the workers inherit goes to the collector's permanent generation: their
    # collections of the younger generations then traverse only what they make, not the
    # objects the parent left there (under fewer_collections, much of the search graph)
    gc.freeze()
    try:
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_pool_worker_init, initargs=init
        ) as pool:
            try:
                yield lambda work: _as_finished(pool, work)
            except BaseException:
                # Ctrl-C, a dead worker, a caller that stopped: the others stop now, not
                # after their current jobs (which the pool's shutdown would wait for)
                for p in multiprocessing.active_children():
                    if p.pid not in others:
                        p.terminate()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    finally:
        gc.unfreeze()


def _as_finished(pool: ProcessPoolExecutor, work: Sequence) -> Iterator:
    """Each result of ``work``'s jobs (:func:`_solve_meshes`), job by job as they finish.
    A worker that dies (killed by the kernel for memory the share does not see, or by a
    crash) breaks the pool: the search stops in one line that names the device counts
    left unsolved, where a ``multiprocessing.Pool`` would replace the worker, lose its
    job and wait for its result for good."""
    jobs = {pool.submit(_solve_in_worker, job): job for job in work}
    try:
        for done in as_completed(jobs):
            yield from done.result()
    except BrokenProcessPool:
        pending = [j for f, j in jobs.items() if not f.done() or f.exception() is not None]
        counts = sorted({m.size for job in pending for m in job[0]}, reverse=True)
        named = ", ".join(map(str, counts[:4])) + (
            f" and {len(counts) - 4} more" if len(counts) > 4 else ""
        )
        raise WorkerFault(
            f"a search worker process died with the problems of {named} devices unsolved "
            "(killed from outside, or by the kernel when the machine ran out of memory: "
            "see `dmesg`); search again with --jobs 1, fewer --devices or --epsilon"
        ) from None


def _solve_order(mesh: Mesh) -> tuple[int, tuple[int, ...]]:
    """Most balanced mesh first, the 1-D mesh last: balanced 2-D meshes have the fastest
    plans at moderate memory and small frontiers, so they make strong incumbents
    (measured on GPT-2-medium at 32 and 64 devices: see docs/design/search.md)."""
    return (-min(mesh.shape) if mesh.ndim > 1 else 0, tuple(mesh.shape))


_WORKER_GRAPH: list = []  # a pool worker's search graph, Megatron blocks and space


def _solve_in_worker(job) -> list[tuple[Mesh, list, tuple]]:
    return _solve_meshes(_WORKER_GRAPH[0], job, _WORKER_GRAPH[1], _WORKER_GRAPH[2])


def _pool_worker_init(
    sg: SearchGraph,
    blocks: Blocks | None,
    space: SearchSpace = PLAIN_SPACE,
    limit: float | None = None,
    counter=None,
) -> None:
    """Keep the worker's search graph; die on SIGTERM, whatever handler the parent has:
    the search stops its workers with SIGTERM, and a handler that raises (as
    `tensoropt calibrate`'s did in a test process) can interrupt a worker holding the
    pool's task-queue lock and hang the pool for good (seen in CI). Ctrl-C reaches the
    whole process group: the parent alone answers it (and stops the workers), so no
    worker prints a traceback of its own."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_GRAPH[:] = [sg, blocks, space]
    _COUNTER[:] = [counter] if counter is not None else []
    memory.set_limit(limit)  # its share of the machine (search.memory)


def _solve_meshes(
    sg: SearchGraph, job, blocks: Blocks | None = None, space: SearchSpace = PLAIN_SPACE
) -> list[tuple[Mesh, list[tuple[tuple[int, int], MeshSearch]], tuple]]:
    """The problems of one job's meshes that its phase (:class:`_Phase`) solves, level by
    level (:func:`axis_level`), each level's meshes in the job's order; with ``chained``,
    each search gets the points found before it in the job as incumbents. Per mesh: its
    searches keyed by their problem's place in the order of its problems, and its plain
    problem's (reference choices, strategies)."""
    meshes, profile, budget, epsilon, chained, phase = job
    at = {mesh: _MeshProblems(sg, space, mesh, profile) for mesh in meshes}
    for mesh in meshes:
        if tuple(mesh.shape) in phase.refs:
            at[mesh].plain_refs, at[mesh].plain_strategies = phase.refs[tuple(mesh.shape)]
    # Problems that only feed pipelines go the largest micro-batch count first: its
    # pipelines hold the fewest micro-batches' activations per stage and make the points
    # that prune the stage problems of the smaller counts (_staged_incumbents)
    order = sorted(
        ((axis_level(v), 0 if space.shows_micro else -v.micro_batches, i, j, mesh, v)
         for i, mesh in enumerate(meshes) for j, v in enumerate(space.variants(sg, mesh))),
        key=lambda row: row[:4],
    )  # fmt: skip
    # each mesh's searches, keyed by their problem's place in the job's order
    out: dict[Mesh, list[tuple[tuple[int, int], MeshSearch]]] = {mesh: [] for mesh in meshes}
    done: list[MeshSearch] = []
    # devices -> points made there that prune the stage problems and their cuts: the
    # pipelines made so far, and a second pass's seeds
    piped: dict[int, list[tuple[float, float]]] = {d: list(p) for d, p in phase.seeds.items()}
    for level, _, _, j, mesh, v in _counted(order):
        if phase.part != "all" and (phase.part == "first") != _first_pass(space, sg, mesh, v):
            continue
        feeds = _feeds_pipelines(space, mesh, v)
        if v.micro_batches > 1 and not space.shows_micro and not feeds:
            continue  # micro-batches only within pipelines, and none is made of it
        if mesh.size in space.stage_only and not feeds:
            # a stage mesh's count shows no point: of its other problems only the plain
            # one's reference plans are read (megatron+pp's), neither built nor solved
            if v.plain:
                at[mesh].read_references(blocks)
            continue
        memory.solving(f"the search of {mesh.size} devices, mesh {mesh_label(mesh.shape)}")
        built = at[mesh].build(v)
        if built is None:
            continue
        incumbents = None
        if chained and done:
            incumbents = (
                [p.time_s for s in done for p in s.result.points],
                [p.memory_bytes for s in done for p in s.result.points],
            )
        if feeds:
            # The stages' plans come from this problem's whole frontier: a plan that an
            # incumbent of this device count dominates, or whose whole step exceeds the
            # budget, can still make a pipelined point that nothing beats (a stage holds
            # part of the step, and no plan without micro-batches pipelines). The
            # problem's own points are that frontier restricted as a chained search
            # would return it.
            # shown at its own count, the problem's whole frontier is wanted; feeding
            # pipelines only, plans whose every cut a pipelined point already made
            # dominates are left out (search.pipeline.stage_incumbents)
            staged = None if space.shows_micro else _staged_incumbents(built, at[mesh], piped)
            whole = _solve_one(built, at[mesh], (mesh, profile, None, epsilon), blocks, staged)
            pipelined = _pipelined(built, at[mesh], whole, profile, budget)
            for s in pipelined:
                piped.setdefault(s.devices, []).extend(
                    (p.time_s, p.memory_bytes) for p in s.result.points
                )
            result, kept = restricted(whole.result, budget, incumbents)
            summaries = tuple(whole.summaries[i] for i in kept) if whole.summaries else ()
            search = dataclasses.replace(whole, result=result, summaries=summaries)
        else:
            search = _solve_one(
                built, at[mesh], (mesh, profile, budget, epsilon), blocks, incumbents
            )
            pipelined = []
        if v.micro_batches == 1 or space.shows_micro:
            out[mesh].append(((level, j), search))
            done.append(search)  # a point shown is an incumbent of what follows
        out[mesh] += [((level, j), s) for s in pipelined]
    return [(m, out[m], (at[m].plain_refs, at[m].plain_strategies)) for m in meshes]


def _staged_incumbents(b: _Built, at: _MeshProblems, piped: dict) -> tuple | None:
    """Incumbents for the whole solve of a stage problem that only feeds pipelines, from
    the points made so far at the device counts it feeds. The problems its pipelines
    price with and each stage count's region of those points under the bound
    (``search.pipeline.cut_bound``, ``beaten``) go to ``at.bare``, where ``_pipelined``
    takes them."""
    from tensoropt.search.pipeline import (
        beaten,
        cut_bound,
        segment_tables,
        stage_incumbents,
    )

    space, mesh, v = at.space, at.mesh, b.variant
    segments = space.segments[1 if v.recompute else 0]
    counts = [
        p
        for p in space.stage_counts
        if p * mesh.size in space.pipeline_devices and 2 <= p <= segments.count
    ]
    made = {p: piped.get(p * mesh.size, ()) for p in counts}
    if not counts:
        return None
    found = at.families.get((v.recompute, v.micro_batches))
    if found is None:
        return None
    key = (v.recompute, v.micro_batches)
    family, zero = found[0], ZeroStage(v.zero)
    # one more slot and no activations: the times of the one, the memories of the other
    slot = at.slot_family(v).problem(zero_all=zero)
    # the pipelines of this problem price with the tables of b.mp (the family's problem
    # with its ZeRO stage, unless it holds the recompute working set, which they do not
    # price) and prune with the regions, which the solve's incumbents intersect
    tables = None
    if not v.recompute:
        tables = segment_tables(b.graph, family, at.profile, segments, b.mp, slot)
    bound = cut_bound(b.mp, slot, slot, b.graph, v.recompute, tables)
    regions = {} if bound is None else beaten(made, bound)
    at.bare[(*key, v.zero)] = (slot, regions, tables)
    if bound is None or not all(made.values()):
        return None
    return stage_incumbents(made, bound, regions)


def _feeds_pipelines(space: SearchSpace, mesh: Mesh, v: Variant) -> bool:
    """Whether the problem of ``v`` on ``mesh`` is the stages' problem of some pipelined
    device count (:func:`_pipelined` makes points of its frontier)."""
    return (
        Axis.STAGES in space.axes
        and v.micro_batches > 1
        and any(p * mesh.size in space.pipeline_devices for p in space.stage_counts)
    )


def _pipelined(
    b: _Built,
    at: _MeshProblems,
    search: MeshSearch,
    profile: ClusterProfile,
    budget,
) -> list[MeshSearch]:
    """The pipelined searches made of one micro-batched problem's frontier
    (search.pipeline): one per stage count whose device count is searched. The stage
    problem's plans are not cut into P stages where the regions of the points made so
    far (``_staged_incumbents``) say every such cut is beaten."""
    from tensoropt.search.pipeline import pipeline_search, pipelined

    space, mesh, v = at.space, at.mesh, b.variant
    counts = [p for p in space.stage_counts if p * mesh.size in space.pipeline_devices]
    key = (v.recompute, v.micro_batches)
    found = at.families.get(key)
    summarize = at.describe.pop((*key, v.zero), None)
    if not counts or found is None:
        return []
    family, _ = found
    reference = _megatron_in(b, at)
    fastest: dict = {}
    segments = space.segments[1 if v.recompute else 0]
    slot, regions, tables = at.bare.pop((*key, v.zero), (None, None, None))
    by_count = pipelined(
        b.graph, family, at.choices[key], at.chosen, ZeroStage(v.zero), v.recompute,
        profile, search.result.points, counts, budget,
        extra=[reference] if reference else (), fastest=fastest, segments=segments,
        slot=slot, regions=regions, tables=tables,
    )  # fmt: skip
    label = v.label(len(space.blocks))
    megatron = "megatron, " + megatron_label(mesh.shape)  # the reference's own summary
    # each frontier plan's summary: shown ones are described already (with the label),
    # the others when a pipeline picks them
    frontier = [tuple(p.choice) for p in search.result.points]
    if summarize is None:
        described = dict(zip(frontier, search.summaries, strict=True))
    else:
        described = dict.fromkeys(frontier)
    out = []
    for p, (points, picks) in sorted(by_count.items()):
        staged = dataclasses.replace(v, stages=p)
        summaries = []
        for choice in picks:
            # a choice off the frontier is the reference plan's (its cuts join the points)
            core = megatron
            if choice in described:
                if described[choice] is None:
                    described[choice] = summarize(choice)
                core = described[choice]
            if label and core.endswith(f", {label}"):
                core = core[: -len(label) - 2]
            summaries.append(f"pp={p} x ({core})" + (f", {label}" if label else ""))
        made = pipeline_search(search, staged, points, picks, segments, summaries)
        if p in fastest:  # Megatron within each stage, the fastest cut into p stages
            ((q, choice),) = fastest[p]
            made = dataclasses.replace(
                made,
                references={"megatron+pp": (q.time_s, q.memory_bytes, choice)},
                reference_summaries={"megatron+pp": f"pp={p} x ({megatron}), {label}"},
            )
        out.append(made)
    return out


def megatron_label(shape: Sequence[int]) -> str:
    """How the Megatron plan uses a mesh: tensor parallelism on the last axis, data
    parallelism on the others ("tp=8", "dp=8 x tp=8")."""
    return " x ".join([f"dp={n}" for n in shape[:-1]] + [f"tp={shape[-1]}"])


def _megatron_in(b: _Built, at: _MeshProblems) -> tuple[int, ...] | None:
    """The Megatron plan (tensor parallelism on the mesh's last axis, data parallelism
    on the others) as a choice of a micro-batched problem without other axes (the
    ``megatron+pp`` reference), when the plain problem has it."""
    v = b.variant
    plain = at.plain_refs.get("megatron")
    if plain is None or at.plain_strategies is None or b.reals is None or v.zero or v.recompute:
        return None
    wanted = [offered[s] for offered, s in zip(at.plain_strategies, plain, strict=True)]
    return _positions(b.reals, wanted)


# the axes that trade step time for memory, as --axes names them
MEMORY_AXES = (Axis.ZERO, Axis.RECOMPUTE, Axis.MICRO)


def memory_axes_advice(axes: frozenset[Axis]) -> str:
    """The clause ', trade step time for memory with --axes ...' naming the memory axes
    a search left out ("" when it searched them all): what an infeasible budget can
    still try."""
    missing = [a.value for a in MEMORY_AXES if a not in axes]
    if not missing:
        return ""
    every = ",".join(a.value for a in (Axis.SPLIT, *MEMORY_AXES))
    return (
        f", trade step time for memory with --axes {every} ({', '.join(missing)} not searched here)"
    )


def _infeasible_message(searches, budget, space: SearchSpace) -> str:
    """Smallest reachable memory per device count (memory is exact even with epsilon),
    and the memory axes the search left out, which may reach below it."""
    best: dict[int, float] = {}
    for s in searches:
        if s.variant.stages > 1:
            continue  # no problem: its step is its slowest stage's, not a sum
        free = solve(s.problem, epsilon=0.25)
        if free.points:
            low = free.points[-1].memory_bytes
            best[s.devices] = min(best.get(s.devices, low), low)
    parts = ", ".join(
        f"{d} {'device' if d == 1 else 'devices'}: {fmt_memory(m)}" for d, m in sorted(best.items())
    )
    fits = [d for d, m in sorted(best.items()) if m <= budget]
    advice = (
        f"the fewest devices that fit is {fits[0]}"
        if fits
        else "no searched device count fits; search more devices"
    )
    advice += memory_axes_advice(space.axes)
    # a pipeline's least memory is not known once the budget has cut its frontier
    piped = sorted({s.devices for s in searches if s.variant.stages > 1})
    staged = ""
    if piped:
        counts = ",".join(map(str, piped))
        staged = f" without pipeline stages; with stages (at {counts} devices) none fits either"
    return (
        f"no plan fits the memory budget of {fmt_memory(budget)} per device; the smallest "
        f"memory per device reachable is {parts}{staged}; {advice}, or raise --memory-budget"
    )


def point_of(exp: Exploration, merged: MergedPoint) -> tuple[MeshSearch, FrontierPoint]:
    search = exp.source_of(merged)
    return search, search.result.points[merged.index]


def graph_batch(graph: ir.Graph, data_inputs: Sequence[str]) -> int:
    for value in graph.inputs:
        if value.name in data_inputs and value.shape is not None and len(value.shape):
            return int(value.shape[0])
    return 1


@dataclass(frozen=True, slots=True)
class Pick:
    search: MeshSearch
    point: FrontierPoint
    index: int  # index in the per-device-count frontier
    policy: str


def device_frontier(exp: Exploration, devices: int) -> list[tuple[MeshSearch, FrontierPoint]]:
    """Non-dominated (time, memory) points of one device count over all its meshes."""
    group = {s.key: s.result for s in exp.searches if s.devices == devices}
    return [
        (exp.source_of(p), exp.source_of(p).result.points[p.index]) for p in merge_frontiers(group)
    ]


def pick_index(
    policy: str,
    memories: Sequence[float],
    devices: int,
    parse_bytes,
    where: str = "",
    advice: str = "",
) -> int:
    """The index that a per-count policy (fastest | min-memory | fastest-under:MEM | INDEX)
    names in one device count's frontier, given its memories (fastest point first).
    ``where``: what holds the frontier, for the messages (e.g. a search file);
    ``advice``: :func:`memory_axes_advice` of the search, when no plan fits."""
    name, _, arg = policy.partition(":")
    at = f"at {devices} devices{where}"
    if name == "fastest":
        return 0
    if name == "min-memory":
        return len(memories) - 1
    if name == "fastest-under":
        budget = parse_bytes(arg, "--pick fastest-under")
        fits = [k for k, m in enumerate(memories) if m <= budget]
        if not fits:
            raise InfeasibleError(
                f"--pick {policy}: the smallest memory {at} is {fmt_memory(memories[-1])} "
                f"per device; add devices{advice}, or raise the budget"
            )
        return fits[0]
    if policy.isdigit():
        k = int(policy)
        if k >= len(memories):
            raise TensorOptError(
                f"--pick {policy}: the frontier {at} has {len(memories)} points "
                f"(0..{len(memories) - 1}, fastest first); see `tensoropt search`"
            )
        return k
    raise TensorOptError(
        f"--pick {policy!r}: use fastest, min-memory, fastest-under:MEM, "
        "fewest-devices-under:MEM or a point index"
    )


def pick(exp: Exploration, devices: int, policy: str, parse_bytes) -> Pick:
    """Apply a policy: fastest | min-memory | fastest-under:MEM | fewest-devices-under:MEM |
    INDEX (into the frontier of ``devices``, fastest first). When no plan fits, the advice
    names the memory axes the search (``exp.space``) left out."""
    name, _, arg = policy.partition(":")
    advice = memory_axes_advice(exp.space.axes)
    if name == "fewest-devices-under":
        budget = parse_bytes(arg, "--pick fewest-devices-under")
        counts = sorted({s.devices for s in exp.searches})
        for d in counts:
            for k, (s, p) in enumerate(device_frontier(exp, d)):
                if p.memory_bytes <= budget:
                    return Pick(s, p, k, policy)
        raise InfeasibleError(
            f"--pick {policy}: no plan at {', '.join(map(str, counts))} devices fits "
            f"{fmt_memory(budget)} per device; add devices{advice}, or raise the budget"
        )
    rows = device_frontier(exp, devices)
    if not rows:
        raise InfeasibleError(f"no plan found at {devices} devices")
    k = pick_index(policy, [p.memory_bytes for _, p in rows], devices, parse_bytes, "", advice)
    s, p = rows[k]
    return Pick(s, p, k, policy)
