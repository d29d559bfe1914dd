"""The search over the memory axes (ZeRO, recomputation, micro-batches): its merged
frontier is the exact Pareto set of every plan of every variant problem, and each point
is a plan that compile prices and emits as the search priced it, and that trains like
one device."""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import pytest

from tensoropt.cli.cmd_search import search_space
from tensoropt.cli.common import search_graph
from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import ProblemFamily, micro_choices
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.search.driver import (
    PLAIN,
    Axis,
    Variant,
    device_frontier,
    explore,
    plan_from_choice,
)
from tensoropt.search.frontier import prune_groups

ALL = "split,zero,recompute,micro"


def _args(path, axes: str = ALL) -> argparse.Namespace:
    return argparse.Namespace(
        model=str(path),
        input_shape=None,
        trainable=None,
        freeze=None,
        optimizer="sgd",
        momentum=0.9,
        lr=0.01,
        loss="auto",
        axes=axes,
        micro_batch_counts="1,2,4,8",
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("axes_search")
    out = {}
    for name in ("mlp", "gpt", "rnnlm"):
        out[name] = root / f"{name}.onnx"
        save_model(build_model(name, "tiny"), str(out[name]))
    return out


def _explore(path, devices, axes: str = ALL):
    args = _args(path, axes)
    sg = search_graph(args)
    space = search_space(args, sg)
    return args, sg, space, explore(sg, devices, "auto", builtin("h100"), jobs=1, space=space)


def _all_values(problem) -> tuple[np.ndarray, np.ndarray]:
    """(time, memory) of every choice vector of ``problem``, by enumeration."""
    sizes = [len(u.strategies) for u in problem.units]
    choices = np.array(list(itertools.product(*map(range, sizes))), dtype=np.int64)
    t = np.zeros(len(choices))
    m = np.zeros(len(choices))
    for k, unit in enumerate(problem.units):
        t += np.array([s.time_s for s in unit.strategies])[choices[:, k]]
        m += np.array([s.memory_bytes for s in unit.strategies])[choices[:, k]]
    for e in problem.edges:
        t += np.array(e.time_s)[choices[:, e.src], choices[:, e.dst]]
        m += np.array(e.memory_bytes)[choices[:, e.src], choices[:, e.dst]]
    return t, m


def test_the_merged_frontier_is_the_pareto_set_of_every_plan_of_every_variant(models):
    """mlp tiny on 2 devices, every axis: enumerate every plan of every variant problem
    (built here from the cost model, none left out as covered or dominated) and compare
    its Pareto set with the search's frontier at 2 devices."""
    _, sg, space, exp = _explore(models["mlp"], [2])
    profile = builtin("h100")
    (mesh,) = {s.mesh for s in exp.searches}
    variants = space.variants(sg, mesh)
    assert {v.micro_batches for v in variants} == {1, 2, 4, 8}
    assert {v.zero for v in variants} == {0, 1, 2, 3} and {v.recompute for v in variants} == {
        False,
        True,
    }
    ts, ms = [], []
    for v in variants:
        graph = space.recomputed if v.recompute else sg
        choices = None
        if v.micro_batches > 1:
            offered = micro_choices(graph, mesh, v.micro_batches)
            choices = {n: [m for m, _ in pairs] for n, pairs in offered.items()}
        family = ProblemFamily(graph, mesh, profile, micro_batches=v.micro_batches, choices=choices)
        mp = family.problem(zero_all=ZeroStage(v.zero), working_set=v.recompute)
        t, m = _all_values(mp.problem)
        ts.append(t)
        ms.append(m)
    t, m = np.concatenate(ts), np.concatenate(ms)
    keep = prune_groups(np.zeros(len(t), dtype=np.int64), t, m)
    want = sorted(zip(t[keep].tolist(), m[keep].tolist(), strict=True))
    got = sorted((p.time_s, p.memory_bytes) for _, p in device_frontier(exp, 2))
    assert len(got) == len(want)
    for (gt, gm), (wt, wm) in zip(got, want, strict=True):
        assert gt == pytest.approx(wt, rel=1e-9) and gm == pytest.approx(wm, rel=1e-9)
    used = {s.variant for s, _ in device_frontier(exp, 2)}
    assert len(used) > 1 and any(not v.plain for v in used), used


def test_axes_restrict_the_space(models):
    """--axes split searches the plain problems alone; split,zero adds ZeRO stages and
    nothing else; every variant searched uses only the axes asked for."""
    for axes, allowed in (
        ("split", {Axis.SPLIT}),
        ("split,zero", {Axis.SPLIT, Axis.ZERO}),
        ("micro", {Axis.SPLIT, Axis.MICRO}),
    ):
        _, _, _, exp = _explore(models["gpt"], [2], axes)
        variants = {s.variant for s in exp.searches}
        assert PLAIN in variants
        for v in variants:
            assert (v.zero == 0 or Axis.ZERO in allowed) and (
                v.micro_batches == 1 or Axis.MICRO in allowed
            )
            assert not v.recompute
        if axes != "split":
            assert len(variants) > 1, axes


def _searched_points(exp, devices, ndim=None):
    """The fastest and least-memory point of every problem at ``devices`` (on meshes of
    ``ndim`` dimensions only, when given)."""
    for s in exp.searches:
        if s.mesh.size != devices or not s.result.points:
            continue
        if ndim is not None and s.mesh.ndim != ndim:
            continue
        for k in sorted({0, len(s.result.points) - 1}):
            yield s, s.result.points[k]


def _estimate(args, plan):
    from tensoropt.cli.cmd_compile import estimate_of
    from tensoropt.cli.common import build_step

    return estimate_of(build_step(args, load_weights=False), plan, None, "h100")


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_searched_point_is_priced_by_compile_as_the_search_priced_it(models, devices):
    """The plan of a point (its split, ZeRO stages, micro-batches and recomputed blocks)
    priced the way `compile` prices it gives the point's own figures. At 4 devices the
    2-D mesh only: every variant on a 1-D mesh is checked at 2."""
    args, _, _, exp = _explore(models["gpt"], [devices])
    seen = set()
    for s, point in _searched_points(exp, devices, ndim=None if devices == 2 else 2):
        plan = plan_from_choice(s, point.choice, "test")
        got = _estimate(args, plan)
        assert got.time_s == pytest.approx(point.time_s, rel=1e-9), s.key
        assert got.memory_bytes == pytest.approx(point.memory_bytes, rel=1e-9), s.key
        seen.add(s.variant)
    assert any(v.zero for v in seen) and any(v.recompute for v in seen)
    assert any(v.micro_batches > 1 for v in seen)


@pytest.mark.parametrize(
    "devices, mesh", [(2, (2,)), pytest.param(4, (2, 2), marks=pytest.mark.slow)]
)
def test_every_point_of_an_lstm_is_priced_by_compile_as_the_search_priced_it(models, devices, mesh):
    """Points of every problem, not the frontier's ends alone, of rnnlm on ``mesh``: every
    point on 2 devices; on 2x2 each problem's ends and points evenly spaced between, at
    most 8 (pricing each point the way compile does takes most of the test's time).
    Its first time step reads a constant initial state, so the data-parallel completion
    leaves that unit replicated over the micro axis, which compile repairs into a batch
    split (``passes.micro._split_where_gathered``): the search offers the repaired
    strategy. On 2x2 a unit's strategies differ in the ZeRO stage their programs take,
    and each entry of an edge converts as its own target program emits the conversion
    (reduce-scatter before the micro-batch sum under stages 2 and 3)."""
    from tensoropt.cli.cmd_compile import estimate_of
    from tensoropt.cli.common import build_step

    args, _, _, exp = _explore(models["rnnlm"], [devices])
    step = build_step(args, load_weights=False)  # pricing changes a step only to recompute
    checked = set()
    for s in exp.searches:
        if tuple(s.mesh.shape) != mesh:
            continue
        points = s.result.points
        if len(mesh) > 1 and len(points) > 8:
            points = [points[round(i * (len(points) - 1) / 7)] for i in range(8)]
        for point in points:
            plan = plan_from_choice(s, point.choice, "test")
            got = estimate_of(
                build_step(args, load_weights=False) if plan.recompute else step,
                plan, None, "h100",
            )  # fmt: skip
            assert got.time_s == pytest.approx(point.time_s, rel=1e-9), (s.key, point)
            assert got.memory_bytes == pytest.approx(point.memory_bytes, rel=1e-9), s.key
        checked.add(s.variant)
    assert any(v.micro_batches > 1 and v.zero for v in checked), checked


def _variant_points(exp, devices):
    """One point per variant at ``devices``: its least-memory point on the 1-D mesh."""
    picked: dict[Variant, tuple] = {}
    for s, point in _searched_points(exp, devices):
        if s.mesh.ndim == 1:
            picked[s.variant] = (s, point)
    return list(picked.values())


@pytest.mark.slow
def test_searched_points_emit_what_was_priced_and_train_like_one_device(models, tmp_path):
    """Compile the least-memory point of every variant problem at 2 devices: each device
    graph holds the collectives priced for it, per step, and 3 steps match one device."""
    import onnx

    from tensoropt.cli.common import build_step
    from tensoropt.cost.model import build_problem, search_graph_of
    from tensoropt.passes.annotate import complete_plan, plan_zero
    from tensoropt.passes.compile import compile_step
    from tensoropt.passes.micro import micro_roots
    from tensoropt.passes.recompute import apply_recompute
    from tensoropt.runtime.run import run_steps
    from tests.helpers.program import emitted_per_step, priced_per_step

    args, _, _, exp = _explore(models["gpt"], [2])
    points = _variant_points(exp, 2)
    assert len(points) >= 4
    for n, (s, point) in enumerate(points):
        plan = plan_from_choice(s, point.choice, "test")
        step = build_step(args, load_weights=False)
        apply_recompute(step.model, step.signature.data_inputs, plan.recompute)
        sg = search_graph_of(step)
        k = plan.micro_batches
        if k > 1:
            roots, _ = micro_roots(sg.graph, sg.signature, plan, None)
        else:
            roots = complete_plan(sg.graph, sg.signature, plan, None, sg.units)
        mp = build_problem(
            sg,
            plan.mesh,
            builtin("h100"),
            only=roots,
            micro_batches=k,
            zero=plan_zero(plan, sg.units),
        )
        choice = (0,) * len(mp.units)
        out = tmp_path / f"p{n}"
        compile_step(build_step(args), plan, None, str(out))
        for rank in (0, 1):
            device = onnx.load(str(out / f"device_{rank}.onnx"), load_external_data=False)
            assert emitted_per_step(device, k) == priced_per_step(mp, choice, rank), s.key
        report = run_steps(out, 3, "local", verify=True, threads=1).verify
        assert report is not None and len(report.per_step) == 3
        assert report.max_rel_error_params <= 1e-4, (s.key, report.to_json())


def test_the_references_with_memory_axes_are_the_hand_plans(models):
    """The search's fsdp and megatron+recompute references at 2 devices cost what
    `compile --plan fsdp` and `--plan megatron --recompute all` are priced at."""
    import dataclasses

    from tensoropt.cli.common import build_step
    from tensoropt.passes.plans import builtin_plan
    from tensoropt.passes.recompute import find_blocks

    args, _, _, exp = _explore(models["gpt"], [2])
    refs = {name: s.references[name] for s in exp.searches for name in s.references}
    assert {"data-parallel", "megatron", "fsdp", "megatron+recompute"} <= set(refs)
    mesh = next(s.mesh for s in exp.searches if "fsdp" in s.references)
    for name, base in (("fsdp", "fsdp"), ("megatron+recompute", "megatron")):
        step = build_step(args, load_weights=False)
        graph, sig = step.model.graph, step.signature
        built = builtin_plan(base, graph, sig, mesh)
        plan = built.plan
        if base == "megatron":
            blocks = tuple(b.name for b in find_blocks(graph, sig.data_inputs))
            plan = dataclasses.replace(plan, recompute=blocks)
        from tensoropt.cli.cmd_compile import estimate_of

        got = estimate_of(step, plan, built.data_axes, "h100")
        t, m, _ = refs[name]
        assert got.time_s == pytest.approx(t, rel=1e-9), name
        assert got.memory_bytes == pytest.approx(m, rel=1e-9), name


class _NoMemo(dict):
    """A memo that never remembers: every node chooses afresh."""

    def get(self, key, default=None):
        return None

    def __setitem__(self, key, value):
        pass


@pytest.mark.slow
def test_the_shared_choice_memo_changes_no_program(models):
    """The families of one mesh share the nodes' choices and the programs (with and
    without recomputed blocks, every ZeRO stage, on the plan's and the micro mesh): every
    program and every entry equals those of families that choose every node afresh, and
    the recomputed step takes some of its programs from the plain one."""
    args = _args(models["gpt"])
    sg = search_graph(args)
    space = search_space(args, sg)
    profile = builtin("h100")
    checked = 0
    for mesh in (Mesh((2,), ("dp",)), Mesh((2, 2), ("dp", "tp"))):
        shared: dict = {}
        made: dict[int, set[int]] = {id(sg): set(), id(space.recomputed): set()}
        for graph in (sg, space.recomputed):
            for k in (1, 2):
                choices = None
                if k > 1:
                    offered = micro_choices(graph, mesh, k)
                    choices = {name: [m for m, _ in p] for name, p in offered.items()}
                kw = {"micro_batches": k, "choices": choices}
                memo = ProblemFamily(graph, mesh, profile, chosen=shared, **kw)
                fresh = ProblemFamily(graph, mesh, profile, chosen=_NoMemo(), **kw)
                for stage in ZeroStage:
                    a = memo.problem(zero_all=stage, working_set=graph is not sg)
                    b = fresh.problem(zero_all=stage, working_set=graph is not sg)
                    assert a.programs == b.programs, (mesh, k, stage)
                    assert a.problem == b.problem, (mesh, k, stage)
                    made[id(graph)].update(id(p) for ps in a.programs for p in ps)
                    checked += 1
        assert shared  # the memo was used
        # the units that recomputation leaves as they were take the plain step's programs
        assert made[id(sg)] & made[id(space.recomputed)], mesh
    assert checked == 2 * 2 * 2 * len(ZeroStage)


def test_search_of_finds_the_searches_of_its_own_exploration(models):
    """search_of keeps an index made on its first lookup; a copy with other searches
    (dataclasses.replace) finds only those, not the ones the original indexed."""
    import dataclasses

    _, _, _, exp = _explore(models["mlp"], [2], "split,micro")
    first = exp.searches[0]
    assert exp.search_of(*first.key) is first
    rest = tuple(s for s in exp.searches if s.key != first.key)
    assert rest
    fewer = dataclasses.replace(exp, searches=rest)
    with pytest.raises(KeyError):
        fewer.search_of(*first.key)
    assert fewer.search_of(*rest[0].key) is rest[0]
