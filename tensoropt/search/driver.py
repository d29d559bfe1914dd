"""Search over device counts and mesh shapes, merge, and turn points into plans.

For every device count the meshes are the 1-D mesh and, with ``--mesh auto``, every
2-D factorisation a x b (a, b >= 2). Each (devices, mesh) problem is solved by
Frontier Tracking; the frontiers merge into one over (devices, time, memory).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.cost.model import MeshProblem, SearchGraph, build_problem
from tensoropt.errors import InfeasibleError, TensorOptError
from tensoropt.ir.costs import FrontierPoint
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import DefaultStrategy, Plan, UnitStrategy
from tensoropt.search.merge import MergedPoint, merge_frontiers
from tensoropt.search.solver import SearchResult, solve

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MeshSearch:
    """One (devices, mesh) problem and its frontier."""

    mp: MeshProblem
    result: SearchResult
    references: dict[str, tuple[float, float, tuple[int, ...]]]

    @property
    def mesh(self) -> Mesh:
        return self.mp.mesh


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


def plan_from_choice(mp: MeshProblem, choice: Sequence[int], source: str) -> Plan:
    """The plan of one frontier point: explicit layouts for every unit."""
    units = {}
    for info, k in zip(mp.units, choice, strict=True):
        s = info.strategies[k]
        units[info.node.name] = UnitStrategy(inputs=tuple(s.inputs), outputs=tuple(s.outputs))
    return Plan(mp.mesh, units, source=source, default=DefaultStrategy.DATA_PARALLEL)


def reference_choices(sg: SearchGraph, mp: MeshProblem) -> dict[str, tuple[int, ...]]:
    """The data-parallel and Megatron plans as choices of this problem (when expressible)."""
    from tensoropt.passes.annotate import annotate
    from tensoropt.passes.plans import builtin_plan
    from tensoropt.passes.training_step import StepSignature

    sig = StepSignature(
        loss="",
        data_inputs=sg.data_inputs,
        labels=None,
        labels_high=None,
        params=tuple(sorted(sg.params)),
        states=(),
        carry=(),
        optimizer={},
    )
    out = {}
    for name in ("data-parallel", "megatron"):
        if name == "data-parallel" and mp.mesh.ndim > 1:
            continue  # the same plan as on the 1-D mesh of this device count
        try:
            built = builtin_plan(name, sg.graph, sig, mp.mesh)
            if name == "megatron" and not built.plan.units:
                continue
            ann = annotate(sg.graph, sig, built.plan, built.data_axes)
        except TensorOptError as exc:
            log.info("reference %s not expressible on %s: %s", name, mp.mesh, exc)
            continue
        choice = []
        for info in mp.units:
            chosen = ann.strategies[info.node]
            if chosen not in info.strategies:
                break
            choice.append(info.strategies.index(chosen))
        else:
            out[name] = tuple(choice)
    return out


def explore(
    sg: SearchGraph,
    devices: Sequence[int],
    mesh_spec: str,
    profile: ClusterProfile,
    *,
    memory_budget: float | None = None,
    epsilon: float | None = None,
    on_problem: Callable[[Mesh], None] | None = None,
) -> Exploration:
    """Solve every (devices, mesh) problem and merge the frontiers."""
    searches = []
    for d in devices:
        for mesh in mesh_shapes(d, mesh_spec):
            if on_problem:
                on_problem(mesh)
            mp = build_problem(sg, mesh, profile)
            result = solve(mp.problem, memory_budget=memory_budget, epsilon=epsilon)
            refs = {}
            for name, choice in reference_choices(sg, mp).items():
                t, m = mp.problem.evaluate(choice)
                refs[name] = (t, m, choice)
            searches.append(MeshSearch(mp, result, refs))
    merged = merge_frontiers({(s.mesh.size, tuple(s.mesh.shape)): s.result for s in searches})
    if memory_budget is not None and not merged:
        raise InfeasibleError(_infeasible_message(sg, searches, memory_budget, profile))
    return Exploration(tuple(searches), merged, epsilon, memory_budget)


def _infeasible_message(sg, searches, budget, profile) -> str:
    """Smallest reachable memory per device count (memory is exact even with epsilon)."""
    best: dict[int, float] = {}
    for s in searches:
        free = solve(s.mp.problem, epsilon=0.25)
        if free.points:
            low = free.points[-1].memory_bytes
            best[s.mesh.size] = min(best.get(s.mesh.size, low), low)
    parts = ", ".join(f"{d} devices: {_gib(m)}" for d, m in sorted(best.items()))
    return (
        f"no plan fits the memory budget of {_gib(budget)} per device; the smallest "
        f"memory per device reachable is {parts}; add devices (memory falls roughly "
        "with tensor parallelism) or raise --memory-budget"
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def point_of(exp: Exploration, merged: MergedPoint) -> tuple[MeshSearch, FrontierPoint]:
    search = exp.search_of(merged.devices, merged.mesh)
    return search, search.result.points[merged.index]


def graph_batch(graph: ir.Graph, data_inputs: Sequence[str]) -> int:
    for value in graph.inputs:
        if value.name in data_inputs and value.shape is not None and len(value.shape):
            return int(value.shape[0])
    return 1
