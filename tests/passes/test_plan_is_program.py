"""The plan is the program: what the cost model priced is what compile emits.

For the frontiers of four models (zoo gpt, bert and resnet50 tiny, and a real torch.onnx
export of GPT-2) on meshes 2, 4 and 2x2:

- for points that take every unit's every choice on the frontier and every edge's every
  pair of choices (``tests.helpers.program.covering``), the conversions the partitioner
  inserts for the point's plan
  (``insert_redistribution.planned_conversions``, the inserter's own decisions) give, as a
  multiset of (kind, mesh axes, local input bytes), exactly the collectives the cost model
  priced (``cost.model.priced_collectives``);
- for the fastest, a middle and the least-memory point, the plan is compiled for real
  and the collectives found in the device files of the first and the last rank
  (kind, group of ranks, input bytes) equal the priced ones for that rank;
- the estimate that ``tensoropt compile --pick`` reports equals the search point's;
- micro-batched (k = 2, zoo models): for the same points compiled with
  ``micro_batches`` 2, the collectives priced per step (k x those of the micro phase,
  once those of the step phase) equal those the device files issue per step.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

from tensoropt.cli.common import build_step
from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import build_problem, priced_collectives, search_graph_of
from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.passes.annotate import annotate_roots
from tensoropt.passes.compile import compile_step
from tensoropt.passes.units import ProgramCache
from tensoropt.search.driver import mesh_shapes, plan_from_choice
from tensoropt.search.solver import solve
from tests.cli.cli_run import cli
from tests.helpers.program import (
    covering,
    emitted,
    graph_of,
    inserted,
    priced,
    priced_axes,
    search_args,
    search_of,
)

MESHES = ("2", "4", "2x2")


@pytest.fixture(scope="module")
def models(tmp_path_factory, exported):
    folder = tmp_path_factory.mktemp("program")
    paths = {}
    for name in ("gpt", "bert", "resnet50"):
        path = folder / f"{name}.onnx"
        save_model(build_model(name, "tiny"), str(path))
        paths[name] = path
    paths["gpt2-export"] = exported("gpt2")
    return paths


def _mesh(spec: str):
    devices = int(np.prod([int(x) for x in spec.split("x")]))
    (mesh,) = [m for m in mesh_shapes(devices, "auto") if "x".join(map(str, m.shape)) == spec]
    return mesh


def _problem(path, spec):
    sg = graph_of(path)
    mp = build_problem(sg, _mesh(spec), builtin("h100"))
    return sg, mp, solve(mp.problem).points


@pytest.mark.slow
@pytest.mark.parametrize("spec", MESHES)
@pytest.mark.parametrize("name", ["gpt", "bert", "resnet50", "gpt2-export"])
def test_every_frontier_point_emits_what_was_priced(models, name, spec):
    sg, mp, points = _problem(models[name], spec)
    assert len(points) > 1
    collectives = 0
    cache = ProgramCache(sg.units, mp.mesh)
    for point in covering(mp.problem, points):
        roots = {u.node.name: u.strategies[k] for u, k in zip(mp.units, point.choice, strict=True)}
        found = inserted(sg, annotate_roots(sg.graph, sg.units, roots, mp.mesh, cache))
        assert found == priced_axes(mp, point.choice), (name, spec, point)
        collectives += sum(found.values())
    assert collectives > 0  # the frontier holds plans that communicate


@pytest.mark.slow
@pytest.mark.parametrize("spec", MESHES)
@pytest.mark.parametrize("name", ["gpt", "bert", "resnet50", "gpt2-export"])
def test_compiled_device_graphs_hold_the_priced_collectives(models, name, spec, tmp_path):
    sg, mp, points = _problem(models[name], spec)
    last = mp.mesh.size - 1
    for k in sorted({0, len(points) // 2, len(points) - 1}):
        search = search_of(mp)
        plan = plan_from_choice(search, points[k].choice, "test")
        out = tmp_path / f"p{k}"
        compile_step(build_step(search_args(models[name])), plan, None, str(out))
        for rank in (0, last):
            device = onnx.load(str(out / f"device_{rank}.onnx"))
            assert emitted(device) == priced(mp, points[k].choice, rank), (name, spec, k, rank)


@pytest.mark.parametrize("spec", ["2", "2x2"])
def test_compile_reports_the_estimate_of_the_picked_point(models, spec, tmp_path, capsys):
    path = models["gpt"]
    sg, mp, points = _problem(path, spec)
    devices = mp.mesh.size
    rows = sorted(points, key=lambda p: (p.time_s, p.memory_bytes))
    for index in sorted({0, len(rows) // 2, len(rows) - 1}):
        out = tmp_path / f"o{index}"
        result = cli(
            capsys, "compile", path, "--devices", devices, "--mesh", spec,
            "--pick", index, "--json", "-o", out,
        )  # fmt: skip
        assert result.code == 0, result.err
        estimate = json.loads(result.out)["estimate"]
        point = rows[index]
        assert estimate["time_s"] == pytest.approx(point.time_s, rel=1e-12)
        assert estimate["memory_bytes"] == round(point.memory_bytes)
        assert estimate["collectives_per_device"] == len(priced_collectives(mp, point.choice))
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["estimate"] == estimate
        assert os.path.exists(out / "plan.json")


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["2", "2x2"])
@pytest.mark.parametrize("name", ["gpt", "bert"])  # the export's batch of 2 splits once
def test_micro_batched_points_issue_what_was_priced_per_step(models, name, spec, tmp_path):
    import dataclasses

    from tensoropt.passes.micro import micro_roots
    from tests.helpers.program import emitted_per_step, priced_per_step

    sg, mp, points = _problem(models[name], spec)
    last = mp.mesh.size - 1
    for k in sorted({0, len(points) // 2, len(points) - 1}):
        plan = plan_from_choice(search_of(mp), points[k].choice, "test")
        plan = dataclasses.replace(plan, micro_batches=2)
        step = build_step(search_args(models[name]))
        micro_sg = search_graph_of(step)
        roots, _ = micro_roots(micro_sg.graph, micro_sg.signature, plan, None)
        micro = build_problem(micro_sg, mp.mesh, builtin("h100"), roots, micro_batches=2)
        choice = (0,) * len(micro.units)
        want = {r: priced_per_step(micro, choice, r) for r in (0, last)}
        out = tmp_path / f"p{k}"
        compile_step(step, plan, None, str(out))
        for rank in (0, last):
            device = onnx.load(str(out / f"device_{rank}.onnx"), load_external_data=False)
            assert emitted_per_step(device, 2) == want[rank], (name, spec, k, rank)
