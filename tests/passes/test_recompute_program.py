"""Recomputed plans are programs too: what the cost model prices is what compile emits.

For the frontier points of recomputed steps (every block recomputed) of zoo gpt and
resnet50 tiny and a real GPT-2 export, on meshes 2, 4 and 2x2, that take every unit's
every choice and every edge's every pair of choices (``tests.helpers.program.covering``),
the partitioner's
conversions equal the priced collectives as a multiset (the recomputed forward's
conversions included: they are priced and emitted again); for the fastest and the
least-memory point the compiled device graphs hold exactly the priced collectives. The
estimate of a recomputed plan drops the saved activations that ``block_terms`` says and
adds the largest block's working set.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx
import pytest

from tensoropt.cli.common import build_step
from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import (
    ProblemFamily,
    UnitWorkingSets,
    WorkingSetBound,
    _unit_working_set,
    block_terms,
    build_problem,
    estimate_plan,
    recompute_working_set,
    search_graph_of,
)
from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.passes.annotate import annotate_roots, complete_plan
from tensoropt.passes.compile import compile_step
from tensoropt.passes.plans import builtin_plan
from tensoropt.passes.recompute import RECOMPUTE_KEY, apply_recompute, find_blocks
from tensoropt.passes.units import ProgramCache
from tensoropt.search.driver import mesh_shapes, plan_from_choice
from tensoropt.search.solver import solve
from tests.helpers.program import (
    covering,
    emitted,
    inserted_collectives,
    priced,
    priced_axes,
    search_args,
    search_of,
)

MESHES = ("2", "4", "2x2")
COMPILED = (("gpt", "2"), ("gpt", "4"), ("gpt", "2x2"), ("resnet50", "2"))


class _Models:
    """Model paths by name, each written on first use (the GPT-2 export takes seconds)."""

    def __init__(self, folder, exported):
        self.folder = folder
        self.exported = exported
        self.paths = {}

    def __getitem__(self, name: str):
        if name not in self.paths:
            if name == "gpt2-export":
                self.paths[name] = self.exported("gpt2")
            else:
                path = self.folder / f"{name}.onnx"
                save_model(build_model(name, "tiny"), str(path))
                self.paths[name] = path
        return self.paths[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory, exported):
    return _Models(tmp_path_factory.mktemp("recompute_program"), exported)


def _mesh(spec: str):
    devices = int(np.prod([int(x) for x in spec.split("x")]))
    (mesh,) = [m for m in mesh_shapes(devices, "auto") if "x".join(map(str, m.shape)) == spec]
    return mesh


def _recomputed_step(path):
    step = build_step(search_args(path))
    names = tuple(b.name for b in find_blocks(step.model.graph, step.signature.data_inputs))
    assert apply_recompute(step.model, step.signature.data_inputs, names) > 0
    return step, names


def _inserted(sg, mp, choice, cache) -> tuple[Counter, int]:
    """The partitioner's collectives (kind, axes, bytes), and how many of them convert a
    value that a recompute node makes or reads."""
    roots = {info.node.name: info.strategies[k] for info, k in zip(mp.units, choice, strict=True)}
    ann = annotate_roots(sg.graph, sg.units, roots, mp.mesh, cache)
    found = Counter()
    recomputed = 0
    for value, key in inserted_collectives(sg, ann):
        found[key] += 1
        recomputed += _touches_recompute(value)
    return found, recomputed


def _touches_recompute(value) -> bool:
    producer = value.producer()
    if producer is not None and RECOMPUTE_KEY in producer.metadata_props:
        return True
    return any(RECOMPUTE_KEY in u.node.metadata_props for u in value.uses())


def _frontier(path, spec):
    step, _ = _recomputed_step(path)
    sg = search_graph_of(step)
    mp = build_problem(sg, _mesh(spec), builtin("h100"))
    points = solve(mp.problem).points
    assert len(points) > 1
    return sg, mp, points


def _check_frontier(path, spec):
    sg, mp, points = _frontier(path, spec)
    cache = ProgramCache(sg.units, mp.mesh)
    recomputed = 0
    for point in covering(mp.problem, points):
        inserted, touching = _inserted(sg, mp, point.choice, cache)
        assert inserted == priced_axes(mp, point.choice), (path, spec, point)
        recomputed += touching
    assert recomputed > 0  # conversions of recomputed values are priced and emitted
    return mp, points


@pytest.mark.parametrize("spec", ["2x2"])
def test_recomputed_gpt_frontier_emits_what_was_priced(models, spec):
    _check_frontier(models["gpt"], spec)


@pytest.mark.slow
@pytest.mark.parametrize("spec", MESHES)
@pytest.mark.parametrize("name", ["gpt", "resnet50", "gpt2-export"])
def test_recomputed_frontier_points_emit_what_was_priced(models, name, spec):
    _check_frontier(models[name], spec)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "spec"), COMPILED)
def test_compiled_recomputed_graphs_hold_the_priced_collectives(models, name, spec, tmp_path):
    _, mp, points = _frontier(models[name], spec)
    _, names = _recomputed_step(models[name])
    last = mp.mesh.size - 1
    for k in sorted({0, len(points) - 1}):
        plan = plan_from_choice(search_of(mp), points[k].choice, "test")
        plan = dataclasses.replace(plan, recompute=names)
        out = tmp_path / f"p{k}"
        compile_step(build_step(search_args(models[name])), plan, None, str(out))
        for rank in (0, last):
            device = onnx.load(str(out / f"device_{rank}.onnx"))
            assert emitted(device) == priced(mp, points[k].choice, rank), (name, spec, k, rank)


@pytest.mark.parametrize(("plan_name", "spec"), [("data-parallel", "2"), ("megatron", "2x2")])
def test_the_estimate_drops_saved_activations_and_adds_the_working_set(models, plan_name, spec):
    """estimate(plain) - estimate(recomputed) = bytes dropped - largest working set; the
    recomputed step is slower by at least the recomputed forward."""
    from tests.helpers.compile import make_mesh

    profile = builtin("h100")
    mesh = make_mesh(spec, plan_name)
    plain = build_step(search_args(models["gpt"]))
    built = builtin_plan(plan_name, plain.model.graph, plain.signature, mesh)
    sg_plain = search_graph_of(plain)
    roots = complete_plan(sg_plain.graph, sg_plain.signature, built.plan, built.data_axes)
    before = estimate_plan(sg_plain, roots, mesh, profile)
    step, _ = _recomputed_step(models["gpt"])
    sg = search_graph_of(step)
    roots_rc = complete_plan(sg.graph, sg.signature, built.plan, built.data_axes)
    assert roots_rc == roots  # recompute changes no root strategy
    after = estimate_plan(sg, roots_rc, mesh, profile)
    mp = build_problem(sg, mesh, profile, only=roots_rc)
    choice = (0,) * len(mp.units)
    terms = block_terms(mp, sg_plain.saved, profile)
    assert {t.block for t in terms} == {f"block_{i}" for i in range(len(terms))}
    dropped = sum(d[0] for t in terms for d in t.bytes_dropped)
    added = sum(a[0] for t in terms for a in t.seconds_added)
    working = max(recompute_working_set(mp, choice).values())
    bound = ProblemFamily(sg, mesh, profile).working_set_of(mp, choice)
    assert dropped > working > 0
    assert bound >= working * (1 - 1e-12)
    assert before.memory_bytes - after.memory_bytes == pytest.approx(dropped - bound, abs=1)
    assert after.time_s - before.time_s >= added * (1 - 1e-9) > 0


@pytest.mark.parametrize("spec", ["2", "2x2"])
def test_the_working_set_bound_holds_for_every_plan_and_is_a_sum(models, spec, monkeypatch):
    """For random plans of the recomputed gpt: the problem's memory with the bound minus
    without it is ProblemFamily.working_set_of (a sum of entries, the same floats as
    counted afresh), at least the largest block's working set, and equal to it when
    every unit takes its smallest strategy."""
    import random

    profile = builtin("h100")
    step, _ = _recomputed_step(models["gpt"])
    sg = search_graph_of(step)
    from tests.helpers.compile import make_mesh

    # each (unit, program)'s excess is counted once per family, however many plans ask
    # (a pipelined search prices thousands of plans of one family)
    counted: Counter = Counter()
    excess = WorkingSetBound.excess

    def counting(self, k, unit, program, mesh, sets=None):
        counted[(k, id(program))] += 1
        return excess(self, k, unit, program, mesh, sets)

    monkeypatch.setattr(WorkingSetBound, "excess", counting)
    family = ProblemFamily(sg, make_mesh(spec, "megatron"), profile)
    plain, bounded = family.problem(), family.problem(working_set=True)
    bound = family.working_set()
    assert counted and max(counted.values()) == 1
    rng = random.Random(0)
    sizes = [len(u.strategies) for u in plain.problem.units]
    floors = []
    for k, unit in enumerate(sg.units.units):  # each unit's smallest-working-set strategy
        sets = [sum(_unit_working_set(unit, p, plain.mesh).values()) for p in plain.programs[k]]
        floors.append(sets.index(min(sets)))
    for choice in [tuple(floors)] + [tuple(rng.randrange(n) for n in sizes) for _ in range(50)]:
        extra = bounded.problem.evaluate(choice)[1] - plain.problem.evaluate(choice)[1]
        working = max(recompute_working_set(plain, choice).values())
        of = family.working_set_of(plain, choice)  # memoised per (unit, program)
        assert max(counted.values()) == 1
        direct = bound.constant + sum(
            excess(bound, k, unit, plain.programs[k][choice[k]], plain.mesh)
            for k, unit in enumerate(sg.units.units)
        )
        assert of == direct
        assert extra == pytest.approx(of, rel=1e-12)
        assert extra >= working * (1 - 1e-12)
        if choice == tuple(floors):
            assert extra == pytest.approx(working, rel=1e-12)


@pytest.mark.parametrize("spec", ["2", "2x2"])
def test_working_sets_memoised_across_repeated_layers_equal_a_direct_count(models, spec):
    """UnitWorkingSets, shared by every unit of the recomputed gpt, gives for each (unit,
    program) exactly the per-block bytes of a node-by-node count, and localises each
    structure's recompute nodes once (the repeated layers share the entries)."""
    from tensoropt.cost.compute import numel_or_zero
    from tensoropt.cost.model import itemsize
    from tensoropt.passes import sharding_adapter as sa
    from tests.helpers.compile import make_mesh

    # no bytes of their own: constants and views of another node's output
    skipped = ("Constant", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
    step, _ = _recomputed_step(models["gpt"])
    sg = search_graph_of(step)
    family = ProblemFamily(sg, make_mesh(spec, "megatron"), builtin("h100"))
    mp = family.problem()
    sets = UnitWorkingSets(mp.mesh)
    pairs = 0
    for unit, programs in zip(sg.units.units, mp.programs, strict=True):
        for program in programs:
            direct: dict[str, float] = {}
            for i, node in enumerate(unit.nodes):
                block = node.metadata_props.get(RECOMPUTE_KEY)
                if block is None or node.op_type in skipped:
                    continue
                local = sa.localize(node, program.strategies[i], mp.mesh)
                direct[block] = direct.get(block, 0.0) + sum(
                    numel_or_zero(shape) * itemsize(node.outputs[j])
                    for j, shape in enumerate(local.output_shapes)
                )
            found = sets.of(unit, program)
            assert found == direct, (unit.root.name, program)
            pairs += bool(direct)
    assert pairs > 0
    assert len(sets._bytes) < pairs  # repeated layers localised once
