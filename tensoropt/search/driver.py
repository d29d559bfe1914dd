"""Search over device counts and mesh shapes, merge, and turn points into plans.

For every device count the meshes are the 1-D mesh and, with ``--mesh auto``, every
2-D factorisation a x b (a, b >= 2). Each (devices, mesh) problem is solved by
Frontier Tracking; the frontiers merge into one over (devices, time, memory).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.cost.model import MeshProblem, SearchGraph, build_problem
from tensoropt.errors import InfeasibleError, TensorOptError
from tensoropt.ir.costs import CostProblem, FrontierPoint
from tensoropt.ir.layout import Layout
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import DefaultStrategy, Plan, UnitStrategy
from tensoropt.passes.blocks import Blocks, find_blocks
from tensoropt.search.merge import MergedPoint, merge_frontiers
from tensoropt.search.solver import SearchResult, solve

log = logging.getLogger(__name__)


UnitLayouts = tuple[tuple[tuple["Layout | None", ...], tuple["Layout", ...]], ...]


@dataclass(frozen=True, slots=True)
class MeshSearch:
    """One (devices, mesh) problem, its frontier, and what is needed to use its points.

    Plain data (no graph objects), so that it crosses process boundaries.
    """

    mesh: Mesh
    problem: CostProblem
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


@dataclass(frozen=True, slots=True)
class Exploration:
    searches: tuple[MeshSearch, ...]
    merged: tuple[MergedPoint, ...]
    epsilon: float | None
    memory_budget: float | None

    def search_of(self, devices: int, mesh: tuple[int, ...]) -> MeshSearch:
        for s in self.searches:
            if s.mesh.size == devices and tuple(s.mesh.shape) == tuple(mesh):
                return s
        raise KeyError((devices, mesh))


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
    dims = tuple(int(x) for x in spec.lower().split("x"))
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


def plan_from_choice(search: MeshSearch, choice: Sequence[int], source: str) -> Plan:
    """The plan of one frontier point: explicit layouts for every unit."""
    units = {}
    for name, layouts, k in zip(search.unit_names, search.unit_layouts, choice, strict=True):
        inputs, outputs = layouts[k]
        units[name] = UnitStrategy(inputs=inputs, outputs=outputs)
    return Plan(search.mesh, units, source=source, default=DefaultStrategy.DATA_PARALLEL)


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
    from tensoropt.passes.annotate import complete_plan
    from tensoropt.passes.plans import builtin_plan

    out = {}
    for name in ("data-parallel", "megatron"):
        if name == "data-parallel" and mp.mesh.ndim > 1:
            continue  # the same plan as on the 1-D mesh of this device count
        try:
            built = builtin_plan(name, sg.graph, sg.signature, mp.mesh, blocks)
            if name == "megatron" and not built.plan.units:
                continue
            roots = complete_plan(sg.graph, sg.signature, built.plan, built.data_axes, sg.units)
        except TensorOptError as exc:
            log.info("reference %s not expressible on %s: %s", name, mp.mesh, exc)
            continue
        choice = []
        for info in mp.units:
            chosen = roots[info.node.name]
            if chosen not in info.strategies:
                break
            choice.append(info.strategies.index(chosen))
        else:
            out[name] = tuple(choice)
    return out


def _solve_mesh(
    sg: SearchGraph,
    job: tuple[Mesh, ClusterProfile, float | None, float | None],
    incumbents: tuple[list[float], list[float]] | None = None,
    blocks: Blocks | None = None,
) -> MeshSearch:
    from tensoropt.cost.summary import Summarizer, kind_table

    mesh, profile, budget, epsilon = job
    mp = build_problem(sg, mesh, profile)
    result = solve(mp.problem, memory_budget=budget, epsilon=epsilon, incumbents=incumbents)
    kinds = kind_table(mp, sg)
    summarize = Summarizer(mp, sg, kinds)
    refs, ref_summaries = {}, {}
    for name, choice in reference_choices(sg, mp, blocks).items():
        t, m = mp.problem.evaluate(choice)
        refs[name] = (t, m, choice)
        ref_summaries[name] = summarize(choice)
    return MeshSearch(
        mesh=mesh,
        problem=mp.problem,
        result=result,
        references=refs,
        unit_names=tuple(u.node.name for u in mp.units),
        unit_layouts=tuple(
            tuple((tuple(s.inputs), tuple(s.outputs)) for s in u.strategies) for u in mp.units
        ),
        summaries=tuple(summarize(p.choice) for p in result.points),
        reference_summaries=ref_summaries,
        strategy_kinds=kinds,
        unit_ops=tuple(u.node.op_type for u in mp.units),
        unit_weighted=tuple(
            any(v is not None and v.name in sg.params for v in u.node.inputs) for u in mp.units
        ),
    )


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
) -> Exploration:
    """Solve every (devices, mesh) problem (in parallel processes) and merge the frontiers.

    The meshes of one device count are solved one after the other in one job, the most
    balanced 2-D mesh first: each exact search gets the points already found for its
    device count as incumbents, and leaves out what they strictly dominate (points that
    no per-device table, merged frontier or ``--pick`` can show), which spares most of the
    work on meshes whose plans are all slower and larger than another mesh's.
    ``whole_frontiers``: every mesh's complete frontier instead (``--dump-costs`` records
    them for an external solver). Jobs are spread over ``jobs`` worker processes (fork;
    default: one per core, at most one per job; 1 = in this process).
    """
    meshes = search_meshes(sg, devices, mesh_spec)
    groups: dict[int, list[Mesh]] = {}
    for m in meshes:
        groups.setdefault(m.size, []).append(m)
    chained = epsilon is None and not whole_frontiers
    work = []
    for d in sorted(groups, reverse=True):  # the largest counts first: the longest jobs
        ordered = sorted(groups[d], key=_solve_order) if chained else groups[d]
        batches = [ordered] if chained else [[m] for m in ordered]
        work += [(tuple(b), profile, memory_budget, epsilon) for b in batches]
    workers = max(1, min(len(work), jobs or os.cpu_count() or 1))
    found: dict[tuple[int, tuple[int, ...]], MeshSearch] = {}
    blocks = megatron_blocks(sg)
    if workers == 1 or multiprocessing.get_start_method(allow_none=True) not in (None, "fork"):
        for job in work:
            for search in _solve_meshes(sg, job, blocks):
                found[(search.mesh.size, tuple(search.mesh.shape))] = search
                if on_problem:
                    on_problem(search.mesh)
    else:
        # A forked worker inherits the search graph from this process (initargs are not
        # pickled under fork); only the plain-data results come back.
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(workers, initializer=_pool_worker_init, initargs=(sg, blocks)) as pool:
            for batch in pool.imap_unordered(_solve_in_worker, work):
                for search in batch:
                    found[(search.mesh.size, tuple(search.mesh.shape))] = search
                    if on_problem:
                        on_problem(search.mesh)
    searches = [found[(m.size, tuple(m.shape))] for m in meshes]
    merged = merge_frontiers({(s.mesh.size, tuple(s.mesh.shape)): s.result for s in searches})
    if memory_budget is not None and not merged:
        raise InfeasibleError(_infeasible_message(sg, searches, memory_budget, profile))
    return Exploration(tuple(searches), merged, epsilon, memory_budget)


def _solve_order(mesh: Mesh) -> tuple[int, tuple[int, ...]]:
    """Most balanced mesh first, the 1-D mesh last: balanced 2-D meshes have the fastest
    plans at moderate memory and small frontiers, so they make strong incumbents
    (measured on GPT-2-medium at 32 and 64 devices: see docs/design/search.md)."""
    return (-min(mesh.shape) if mesh.ndim > 1 else 0, tuple(mesh.shape))


_WORKER_GRAPH: list = []  # a pool worker's search graph and its Megatron blocks


def _solve_in_worker(job) -> list[MeshSearch]:
    return _solve_meshes(_WORKER_GRAPH[0], job, _WORKER_GRAPH[1])


def _pool_worker_init(sg: SearchGraph, blocks: Blocks | None) -> None:
    """Keep the worker's search graph; die on SIGTERM, whatever handler the parent has:
    the pool stops its workers with SIGTERM when it closes, and a handler that raises
    (as `tensoropt calibrate`'s did in a test process) can interrupt a worker holding
    the pool's task-queue lock and hang the pool for good (seen in CI)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER_GRAPH[:] = [sg, blocks]


def _solve_meshes(sg: SearchGraph, job, blocks: Blocks | None = None) -> list[MeshSearch]:
    """The meshes of one job in order, each exact search with the points found before it
    in the job as incumbents."""
    meshes, profile, budget, epsilon = job
    out: list[MeshSearch] = []
    for mesh in meshes:
        incumbents = None
        if out and epsilon is None:
            incumbents = (
                [p.time_s for s in out for p in s.result.points],
                [p.memory_bytes for s in out for p in s.result.points],
            )
        out.append(_solve_mesh(sg, (mesh, profile, budget, epsilon), incumbents, blocks))
    return out


def _infeasible_message(sg, searches, budget, profile) -> str:
    """Smallest reachable memory per device count (memory is exact even with epsilon)."""
    best: dict[int, float] = {}
    for s in searches:
        free = solve(s.problem, epsilon=0.25)
        if free.points:
            low = free.points[-1].memory_bytes
            best[s.mesh.size] = min(best.get(s.mesh.size, low), low)
    parts = ", ".join(f"{d} devices: {_gib(m)}" for d, m in sorted(best.items()))
    fits = [d for d, m in sorted(best.items()) if m <= budget]
    advice = (
        f"the fewest devices that fit is {fits[0]}"
        if fits
        else "no searched device count fits; search more devices"
    )
    return (
        f"no plan fits the memory budget of {_gib(budget)} per device; the smallest "
        f"memory per device reachable is {parts}; {advice}, or raise --memory-budget"
    )


def _gib(n: float) -> str:
    """A human-readable size (the name is historical)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def point_of(exp: Exploration, merged: MergedPoint) -> tuple[MeshSearch, FrontierPoint]:
    search = exp.search_of(merged.devices, merged.mesh)
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
    group = {
        (s.mesh.size, tuple(s.mesh.shape)): s.result for s in exp.searches if s.mesh.size == devices
    }
    return [
        (exp.search_of(p.devices, p.mesh), exp.search_of(p.devices, p.mesh).result.points[p.index])
        for p in merge_frontiers(group)
    ]


def pick_index(
    policy: str, memories: Sequence[float], devices: int, parse_bytes, where: str = ""
) -> int:
    """The index that a per-count policy (fastest | min-memory | fastest-under:MEM | INDEX)
    names in one device count's frontier, given its memories (fastest point first).
    ``where``: what holds the frontier, for the messages (e.g. a search file)."""
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
                f"--pick {policy}: the smallest memory {at} is {_gib(memories[-1])} "
                "per device; raise the budget or add devices"
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
    INDEX (into the frontier of ``devices``, fastest first)."""
    name, _, arg = policy.partition(":")
    if name == "fewest-devices-under":
        budget = parse_bytes(arg, "--pick fewest-devices-under")
        counts = sorted({s.mesh.size for s in exp.searches})
        for d in counts:
            for k, (s, p) in enumerate(device_frontier(exp, d)):
                if p.memory_bytes <= budget:
                    return Pick(s, p, k, policy)
        raise InfeasibleError(
            f"--pick {policy}: no plan at {', '.join(map(str, counts))} devices fits "
            f"{_gib(budget)} per device; add devices or raise the budget"
        )
    rows = device_frontier(exp, devices)
    if not rows:
        raise InfeasibleError(f"no plan found at {devices} devices")
    k = pick_index(policy, [p.memory_bytes for _, p in rows], devices, parse_bytes)
    s, p = rows[k]
    return Pick(s, p, k, policy)
