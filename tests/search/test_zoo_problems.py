"""Frontier Tracking on the cost problems of real (zoo) models.

The frontier is checked against solvers that share no code with it: brute force
where the plan space is small, and an Alpa-style integer program (HiGHS) at memory
budgets, which must find exactly the time of the fastest frontier point within
each budget. The built-in plans (data parallel, Megatron) evaluated on the same
problem must be equalled or dominated by some frontier point.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest

from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import build_problem
from tensoropt.models import build_model, save_model
from tensoropt.search.driver import mesh_shapes, reference_choices
from tensoropt.search.solver import solve
from tests.helpers.exhaustive import exhaustive_frontier

pytest.importorskip("highspy")
from tensoropt.search.ilp import ilp_min_time  # noqa: E402
from tests.helpers.program import graph_of


def _search_graph(name: str, **knobs):
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, f"{name}.onnx")
    save_model(build_model(name, "tiny", **knobs), path)
    return graph_of(path)


@pytest.fixture(scope="module")
def graphs():
    return {name: _search_graph(name) for name in ("mlp", "gpt", "resnet50", "rnnlm")}


def _problem(sg, mesh_spec: str, profile: str = "h100"):
    devices = math.prod(int(x) for x in mesh_spec.split("x"))
    (mesh,) = [m for m in mesh_shapes(devices, "auto") if "x".join(map(str, m.shape)) == mesh_spec]
    return build_problem(sg, mesh, builtin(profile))


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


CASES = [
    ("mlp", "2"),
    ("mlp", "2x2"),
    ("gpt", "2"),
    ("gpt", "2x2"),
    ("rnnlm", "2"),
    ("resnet50", "2"),
]


@pytest.mark.parametrize(("name", "mesh"), CASES)
def test_points_reevaluate_and_match_the_integer_program(graphs, name, mesh):
    mp = _problem(graphs[name], mesh)
    points = solve(mp.problem).points
    assert points
    for p in points:
        assert mp.problem.evaluate(p.choice) == (p.time_s, p.memory_bytes)
    # Budgets at a few frontier points' memory (and just below the next): the ILP's
    # optimum is exactly the fastest frontier point within the budget.
    picks = sorted({0, len(points) // 3, (2 * len(points)) // 3, len(points) - 1})
    for k in picks:
        budget = points[k].memory_bytes
        _, ilp_time = ilp_min_time(mp.problem, budget)
        best = min(p.time_s for p in points if p.memory_bytes <= budget)
        assert _same(ilp_time, best), (name, mesh, k, ilp_time, best)


def test_small_zoo_problem_equals_brute_force():
    """A 1-layer MLP on 2 devices: few enough plans to enumerate every one."""
    sg = _search_graph("mlp", layers=1)
    mp = _problem(sg, "2")
    size = math.prod(len(u.strategies) for u in mp.problem.units)
    assert size <= 200_000, size
    exact = [(p.time_s, p.memory_bytes) for p in solve(mp.problem).points]
    assert exact == exhaustive_frontier(mp.problem)


@pytest.mark.parametrize(
    ("name", "mesh"), [("gpt", "2"), ("gpt", "4"), ("gpt", "2x2"), ("mlp", "4"), ("rnnlm", "2")]
)
def test_frontier_dominates_the_built_in_plans(graphs, name, mesh):
    sg = graphs[name]
    mp = _problem(sg, mesh)
    points = solve(mp.problem).points
    refs = reference_choices(sg, mp)
    assert "data-parallel" in refs or mp.mesh.ndim > 1
    for plan, choice in refs.items():
        t, m = mp.problem.evaluate(choice)
        assert any(p.time_s <= t and p.memory_bytes <= m for p in points), (plan, t, m)
