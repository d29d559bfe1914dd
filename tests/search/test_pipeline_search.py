"""Pipelined points of the search (``--axes ...,stages``; search.pipeline).

- For each intra-op plan, the dynamic program over cuts returns exactly the Pareto set
  of pricing every cut of that plan (``PipelineTerms.price``) by enumeration.
- A picked pipelined point compiles to a plan whose estimate is the point's (the plan
  is the program), and that plan trains like one device.
- Pipelined points are labelled ``pp=P x (...)`` and appear only at the device counts
  asked for.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing

import numpy as np
import pytest

from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import ProblemFamily, micro_choices
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.runtime.run import run_steps
from tensoropt.search.pipeline import SCHEDULE, pipelined, segments_of
from tensoropt.search.solver import solve
from tests.cli.cli_run import cli
from tests.helpers.program import graph_of


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


def _pareto(rows):
    rows = sorted((float(t), float(m)) for t, m in rows)
    out = []
    for t, m in rows:
        if not out or m < out[-1][1]:
            out.append((t, m))
    return out


def _entry_sums(tables, choice):
    """Prefix sums of a, b, base and act by a plain loop over the unit and edge entries,
    each split on its own (``split_entries``) from the tables' three problems."""
    import numpy as np

    from tensoropt.cost.pipeline import split_entries

    problems = (tables.plain.problem, tables.more.problem, tables.bare.problem)
    sums = [np.zeros(tables.segments) for _ in range(4)]
    for k, (up, um, ub) in enumerate(zip(*(p.units for p in problems), strict=True)):
        s, t, u = up.strategies[choice[k]], um.strategies[choice[k]], ub.strategies[choice[k]]
        parts = split_entries(s.time_s, t.time_s, s.memory_bytes, u.memory_bytes, tables.m)
        for out, entry in zip(sums, parts, strict=True):
            out[tables.segment_of[k]] += entry
    for ep, em, eb in zip(*(p.edges for p in problems), strict=True):
        i, j = choice[ep.src], choice[ep.dst]
        parts = split_entries(
            ep.time_s[i][j], em.time_s[i][j], ep.memory_bytes[i][j], eb.memory_bytes[i][j],
            tables.m,
        )  # fmt: skip
        seg = max(tables.segment_of[ep.src], tables.segment_of[ep.dst])
        for out, entry in zip(sums, parts, strict=True):
            out[seg] += entry
    sums[2][tables.segment_of[0]] -= tables.gathered
    return [np.concatenate([[0.0], np.cumsum(x)]) for x in sums]


def _cut_traffic(tables, choice):
    """Per cut position j, by a plain loop over the step's crossings: the bytes and count
    of the forward values made before j and read at or after it (once per value, in the
    layout of its first crossing's source), and of those whose gradient comes back."""
    import numpy as np

    from tensoropt.ir.builder import static_shape
    from tensoropt.ir.layout import local_shape
    from tensoropt.passes.units import itemsize

    mp, sg, seg = tables.plain, tables.sg, tables.segment_of
    first, last = {}, {}
    for c in sg.units.crossings:
        if c.forward and seg[c.target] > seg[c.source]:
            first.setdefault(c.value.name, c)
            last[c.value.name] = max(last.get(c.value.name, 0), seg[c.target])
    out = [np.zeros(tables.segments + 1) for _ in range(4)]
    for name, c in first.items():
        layout = mp.programs[c.source][choice[c.source]].layout(c.source_ref)
        nbytes = float(np.prod(local_shape(static_shape(c.value), layout, mp.mesh)))
        nbytes *= itemsize(c.value)
        grad = c.value.dtype.is_floating_point() and name not in sg.data_inputs
        for j in range(seg[c.source] + 1, last[name] + 1):
            out[0][j] += nbytes
            out[1][j] += 1
            if grad:
                out[2][j] += nbytes
                out[3][j] += 1
    return out


def _micro_tables(gpt, mesh, k, optimizer="sgd", zero=ZeroStage.NONE):
    """The tiny GPT's micro-batched family on ``mesh`` with ``k`` micro-batches, its
    offered strategies, segments and segment tables (priced independently of the
    search's own, with fresh unit programs), every unit at ZeRO stage ``zero``."""
    from tensoropt.cost.pipeline import SegmentTables

    sg = graph_of(str(gpt), optimizer)
    profile = builtin("a100")
    plan_mesh = Mesh(mesh, ("dp",))
    offered = micro_choices(sg, plan_mesh, k)
    choices = {name: [c for c, _ in pairs] for name, pairs in offered.items()}
    family = ProblemFamily(sg, plan_mesh, profile, micro_batches=k, choices=choices, chosen={})
    segments = segments_of(sg)

    def problem(slots, scale):
        f = ProblemFamily(
            sg, plan_mesh, profile, micro_batches=k, choices=choices, chosen={},
            slots=slots, saved_scale=scale,
        )  # fmt: skip
        return f.problem(zero_all=zero)

    tables = SegmentTables(
        sg, family.problem(zero_all=zero), problem(k + 1, 1.0), problem(k, 0.0),
        [segments.segment_of(u.root.name) for u in sg.units.units], segments.count,
        profile, plan_mesh,
    )  # fmt: skip
    return sg, profile, family, choices, segments, tables


@pytest.mark.parametrize(("mesh", "k"), [((1,), 2), ((2,), 4)])
def test_each_plans_pipelined_points_are_the_pareto_set_of_every_cut(gpt, mesh, k):
    sg, profile, family, choices, segments, tables = _micro_tables(gpt, mesh, k)
    frontier = solve(family.problem().problem).points[:3]
    counts = [2, 3, 4]
    found = pipelined(
        sg, family, choices, {}, ZeroStage.NONE, False, profile, frontier, counts, None
    )
    n = segments.count
    for point in frontier:  # the gathered sums are the per-entry sums, float for float
        terms = tables.terms(point.choice)
        for got, want in zip(
            (terms.a, terms.b, terms.base, terms.act),
            _entry_sums(tables, point.choice),
            strict=True,
        ):
            assert got.tolist() == want.tolist()
        traffic = (terms.fwd_bytes, terms.fwd_count, terms.bwd_bytes, terms.bwd_count)
        for got, want in zip(traffic, _cut_traffic(tables, point.choice), strict=True):
            assert got.tolist() == want.tolist()
    for p in counts:
        rows = []
        for point in frontier:
            terms = tables.terms(point.choice)
            for inner in itertools.combinations(range(1, n), p - 1):
                estimate, _ = terms.price([0, *inner, n], SCHEDULE)
                rows.append((estimate.time_s, estimate.memory_bytes))
        points, picks = found[p]
        # the same stage prices, combined by max: equal, not just close
        assert [(float(q.time_s), float(q.memory_bytes)) for q in points] == _pareto(rows)
        for q, choice in zip(points, picks, strict=True):  # each point is its cuts' price
            estimate, _ = tables.terms(choice).price(list(q.cuts), SCHEDULE)
            assert (estimate.time_s, estimate.memory_bytes) == (q.time_s, q.memory_bytes)


def test_a_picked_pipelined_point_compiles_to_its_estimate_and_trains(gpt, tmp_path, capsys):
    found = cli(
        capsys, "search", gpt, "--devices", "2", "--axes", "split,stages",
        "--json-out", tmp_path / "s.json",
    )  # fmt: skip
    assert found.code == 0, found.err
    doc = json.loads((tmp_path / "s.json").read_text())
    rows = [r for r in doc["per_device"]["2"] if "pipeline" in r]
    assert rows, "no pipelined point at 2 devices"
    assert all(r["summary"].startswith("pp=2 x (") for r in rows)
    assert set(doc["per_device"]) == {"2"}  # the stages' 1-device meshes are not shown
    row = rows[0]
    out = tmp_path / "out"
    compiled = cli(
        capsys, "compile", gpt, "--devices", "2", "--pick", row["index"], "--search",
        tmp_path / "s.json", "-o", out, "--json",
    )  # fmt: skip
    assert compiled.code == 0, compiled.err
    body = json.loads(compiled.out)
    assert body["estimate"]["time_s"] == row["time_s"]
    assert body["estimate"]["memory_bytes"] == row["memory_bytes"]
    assert body["pipeline"]["starts"] == row["pipeline"]["starts"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["pipeline"]["starts"] == row["pipeline"]["starts"]
    result = run_steps(out, 3, verify=True)
    assert result.verify is not None and result.verify.ok, result.verify.to_json()


def test_every_megatron_pp_reference_is_matched_by_the_frontier(tmp_path, capsys):
    """The Megatron plan's cuts join the pipelined frontier, so no megatron+pp reference
    lies outside it. On this model at 16 devices (h100) the Megatron plan is not on the
    8-device stage mesh's own frontier, and its pipelined point was faster than every
    searched one."""
    path = tmp_path / "gpt.onnx"
    model = build_model("gpt", "paper", layers=4, hidden=256, heads=8, seq=64, batch=16)
    save_model(model, str(path))
    found = cli(
        capsys, "search", path, "--devices", 16, "--axes", "split,stages", "--cluster",
        "h100", "--optimizer", "adam", "--micro-batches", "1,2", "--stages", "2,8",
        "--json-out", tmp_path / "s.json",
    )  # fmt: skip
    assert found.code == 0, found.err
    doc = json.loads((tmp_path / "s.json").read_text())
    refs = [r for r in doc["references"] if r["plan"] == "megatron+pp"]
    assert refs
    rows = doc["per_device"]["16"]
    for ref in refs:
        assert any(
            r["time_s"] <= ref["time_s"] and r["memory_bytes"] <= ref["memory_bytes"] for r in rows
        ), ref


def test_megatron_pp_reference_on_a_two_d_stage_mesh(tmp_path, capsys):
    """Megatron-LM's layout at scale is data x tensor parallelism within each stage
    (dp=8 x tp=8 x pp=16 at 1024 devices). At 8 devices in 2 stages the 2x2 stage mesh
    gives a megatron+pp reference (dp=2 x tp=2) beside the 1-D one, and the frontier
    matches both."""
    path = tmp_path / "gpt.onnx"
    model = build_model("gpt", "paper", layers=2, hidden=192, heads=6, seq=32, batch=8)
    save_model(model, str(path))
    found = cli(
        capsys, "search", path, "--devices", 8, "--axes", "split,stages", "--cluster",
        "h100", "--optimizer", "adam", "--micro-batches", "2", "--stages", "2",
        "--json-out", tmp_path / "s.json",
    )  # fmt: skip
    assert found.code == 0, found.err
    doc = json.loads((tmp_path / "s.json").read_text())
    refs = {tuple(r["mesh"]): r for r in doc["references"] if r["plan"] == "megatron+pp"}
    assert set(refs) == {(4,), (2, 2)}, refs
    assert "dp=2 x tp=2" in refs[(2, 2)]["summary"], refs[(2, 2)]
    for ref in refs.values():
        assert any(
            r["time_s"] <= ref["time_s"] and r["memory_bytes"] <= ref["memory_bytes"]
            for r in doc["per_device"]["8"]
        ), ref


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("mesh", "k"), [((1,), 2), ((2,), 4)])
def test_stage_grids_are_the_floats_of_stage_entry_by_entry(gpt, mesh, k, schedule):
    """Every (stage, start, end) entry of the compiled grids that a cut can use equals
    PipelineTerms.stage bit for bit, on several intra-op plans and stage counts (a
    fused multiply-add or another order of the additions would change some): the first
    stage starts at position 0, the last ends at the last, and each stage holds a
    segment at least. The other entries are unset, and the frontier over the cuts is the
    same whatever they hold (inf or 0, the cheapest stage of all): plan_frontier reads
    none of them."""
    import math

    from tensoropt.search.pipeline import positions, stage_grids
    from tensoropt.search.stages import plan_frontier

    _, _, family, _, segments, tables = _micro_tables(gpt, mesh, k)
    allowed = positions(segments.count)
    n = len(allowed)
    checked = 0
    plans = solve(family.problem().problem).points[:4]
    for point in plans:
        terms = tables.terms(point.choice, working_set=123.0)
        for p in (1, 2, 3, 4):
            taus, mems = stage_grids(terms, allowed, p, schedule)
            outside = np.zeros(taus.shape, dtype=bool)
            for s in range(p):
                for x, i in enumerate(allowed):
                    for y, j in enumerate(allowed):
                        usable = s <= x < y <= n - p + s
                        usable &= (s > 0 or x == 0) and (s < p - 1 or y == n - 1)
                        if not usable:
                            outside[s, x, y] = True
                            continue
                        want = terms.stage(i, j, s, p, schedule)
                        assert (taus[s, x, y], mems[s, x, y]) == (want.time_s, want.memory_bytes)
                        checked += 1
            # what no cut can use does not change the frontier (a free stage would win
            # wherever it were read)
            frontiers = []
            for fill in (np.inf, 0.0):
                t, m = taus.copy(), mems.copy()
                t[outside], m[outside] = fill, fill
                found = plan_frontier(allowed, t, m, "plan")
                frontiers.append([(q.time_s, q.memory_bytes, q.cuts) for q in found])
            assert frontiers[0] == frontiers[1] and frontiers[0]
    # cuts of n positions into p stages: the first and the last stage have n - p
    # (start, end) pairs each, a middle one every pair of its n - p + 1 positions
    per_count = [1] + [2 * (n - p) + (p - 2) * math.comb(n - p + 1, 2) for p in (2, 3, 4)]
    assert checked == len(plans) * sum(per_count) >= 30


def test_dumped_costs_recompute_with_stages_searched(gpt, tmp_path, capsys):
    """--dump-costs with stages: every frontier in the file is the Pareto set of its own
    problem's sums (an external solver recomputes each from the file alone); the
    pipelined problems, whose step is a max over stages, are left out and said so."""
    from tensoropt.ir.costs import record_from_json

    path = tmp_path / "costs.json"
    argv = ["search", gpt, "--devices", "2", "--axes", "split,micro,stages"]
    out = cli(capsys, *argv, "--micro-batches", "1,2", "--dump-costs", path)
    assert out.code == 0, out.err
    assert "pipelined problems left out" in out.err
    problems = json.loads(path.read_text())["problems"]
    assert problems
    for i, entry in enumerate(problems):
        record = record_from_json(entry, f"problems[{i}]")
        again = solve(record.problem).points
        assert _pareto((p.time_s, p.memory_bytes) for p in again) == _pareto(
            (p.time_s, p.memory_bytes) for p in record.frontier
        ), i


@pytest.mark.parametrize("budgeted", [False, True])
def test_pipelined_points_come_from_the_stage_problems_whole_frontier(gpt, budgeted):
    """Every pipelined point made of the stages' problem's whole frontier is matched or
    dominated by the merged frontier: neither the incumbents of the stages' own device
    count nor the budget on their whole step may prune the plans the stages are cut
    from (a plan dominated at 2 devices, or over the budget there, can make a pipelined
    point at 4 that nothing beats). The oracle prices the pipelines with fresh unit
    programs from the problem's whole frontier, solved alone. (With Adam, two of its
    points were missing when the stages' problem was solved with the incumbents.)"""
    from tensoropt.search.driver import Axis, SearchSpace, Variant, explore

    sg, profile, family, choices, segments, tables = _micro_tables(gpt, (2,), 2, "adam")
    frontier = solve(family.problem().problem).points
    budget = None
    if budgeted:  # below every plan's whole step: only their stages can fit
        budget = min(p.memory_bytes for p in frontier) * (1 - 1e-9)
    want, _ = pipelined(
        sg, family, choices, {}, ZeroStage.NONE, False, profile, frontier, [2], budget
    )[2]
    assert want  # the oracle has points to look for
    space = SearchSpace(
        frozenset({Axis.SPLIT, Axis.MICRO, Axis.STAGES}), micro_batches=(1, 2), stage_counts=(2,)
    )
    exp = explore(sg, [2, 4], "auto", profile, jobs=1, space=space, memory_budget=budget)
    stage_problem = exp.search_of(2, (2,), Variant(micro_batches=2)).problem
    assert [[s.label for s in u.strategies] for u in stage_problem.units] == [
        [s.label for s in u.strategies] for u in family.problem().problem.units
    ]  # the oracle's problem is the search's
    merged = [(p.time_s, p.memory_bytes) for p in exp.merged if p.devices == 4]
    missing = [
        (q.time_s, q.memory_bytes)
        for q in want
        if not any(t <= q.time_s and m <= q.memory_bytes for t, m in merged)
    ]
    assert not missing, f"{len(missing)} of {len(want)} pipelined points missing"
    # the stages' problem shows at 2 devices what it shows without stages searched
    plain = explore(
        sg, [2, 4], "auto", profile, jobs=1, memory_budget=budget,
        space=dataclasses.replace(space, axes=frozenset({Axis.SPLIT, Axis.MICRO})),
    )  # fmt: skip
    for devices, mesh in ((2, (2,)), (4, (4,)), (4, (2, 2))):
        got = exp.search_of(devices, mesh, Variant(micro_batches=2))
        alone = plain.search_of(devices, mesh, Variant(micro_batches=2))
        assert got.result.points == alone.result.points
        assert got.summaries == alone.summaries


@pytest.mark.slow
def test_the_default_search_pipelines_across_nodes_only(gpt, tmp_path, capsys):
    """Without --axes, stages are searched at the device counts above one node of the
    cluster (h100: 8), and each pipelined problem there has the points the explicit
    --axes split,stages search gives it; micro-batched plans show only inside pipelines;
    --stages 1 leaves the stages out, and so does a search with no count above a node."""
    argv = ["search", gpt, "--cluster", "h100", "--optimizer", "adam", "--micro-batches", "1,2"]
    argv += ["--stages", "2,4"]
    found = cli(capsys, *argv, "--devices", "8,16", "--json-out", tmp_path / "d.json")
    assert found.code == 0, found.err
    assert "searched split,stages (stages above 8 devices" in found.out
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["axes_searched"] == ["split", "stages"] and doc["stages_above_devices"] == 8
    rows = {d: doc["per_device"][d] for d in ("8", "16")}
    assert not [r for r in rows["8"] if r["axes"]["stages"] > 1 or r["axes"]["micro_batches"] > 1]
    piped = [r for r in rows["16"] if r["axes"]["stages"] > 1]
    assert piped, "no pipelined point at 16 devices"
    assert all(r["axes"]["micro_batches"] == 2 for r in piped)
    assert not [
        r for r in rows["16"] if r["axes"]["stages"] == 1 and r["axes"]["micro_batches"] > 1
    ]

    from tensoropt.cli import build_parser
    from tensoropt.cli.cmd_search import search_space
    from tensoropt.search.driver import explore

    def pipelined_searches(*extra):
        args = build_parser().parse_args([str(a) for a in (*argv, *extra)])
        sg = graph_of(str(gpt), "adam")
        profile = builtin("h100")
        exp = explore(sg, [16], "auto", profile, jobs=1, space=search_space(args, sg, profile))
        return {s.key: s.result.points for s in exp.searches if s.variant.stages > 1}

    default = pipelined_searches()
    assert default and default == pipelined_searches("--axes", "split,stages")

    off = cli(
        capsys, *argv[:-2], "--stages", "1", "--devices", "16", "--json-out", tmp_path / "o.json"
    )
    assert off.code == 0, off.err
    none = json.loads((tmp_path / "o.json").read_text())
    assert none["axes_searched"] == ["split"]
    assert all(r["axes"]["stages"] == 1 for r in none["per_device"]["16"])
    # a budget nothing meets: the figures it names are without stages, and it says so
    short = cli(capsys, *argv, "--devices", "16", "--memory-budget", "1KiB")
    assert short.code == 2
    assert "16 devices: " in short.err
    assert "without pipeline stages; with stages (at 16 devices) none fits either" in short.err
    within = cli(capsys, *argv[:-2], "--devices", "8", "--json-out", tmp_path / "w.json")
    assert json.loads((tmp_path / "w.json").read_text())["axes_searched"] == ["split"], within.err


@pytest.mark.parametrize(
    ("mesh", "k", "optimizer", "zero"),
    [
        ((1,), 2, "sgd", ZeroStage.NONE),
        ((2,), 4, "adam", ZeroStage.NONE),
        ((2,), 2, "adam", ZeroStage.PARAMETERS),
    ],
)
def test_every_cut_of_a_plan_is_at_least_its_stage_bound(gpt, mesh, k, optimizer, zero):
    """The bounds behind the stage problems' incumbents (``CutBound``): for every plan X
    of the tiny GPT's micro-batched frontier and every stage count P, the fastest cut
    takes no less than a time T whose threshold is at most t_X, and the smallest holds
    no less than a memory M whose threshold is at most m_X; the thresholds at the
    fastest cut's time and the smallest cut's memory are at least t_X and m_X. The
    per-stage levels of the memory bound are in use and beat the bound of the sums on
    some plan with SGD or ZeRO-3."""
    from tensoropt.search.pipeline import cut_bound, slot_problem

    sg, profile, family, choices, segments, tables = _micro_tables(gpt, mesh, k, optimizer, zero)
    plain = family.problem(zero_all=zero)
    bare = slot_problem(sg, family, choices, {}, zero, profile, k, 0.0)
    more = slot_problem(sg, family, choices, {}, zero, profile, k + 1, 1.0)
    bound = cut_bound(plain, bare, more, sg)
    assert bound is not None and bound.act_floor > 0 and bound.levels
    # read from the pipelines' tables (the search's path), the same bound float for float
    assert cut_bound(plain, bare, more, sg, tables=tables) == bound
    assert (bound.gathered > 0) == (zero is ZeroStage.PARAMETERS)
    assert bound.per_micro_floor > 0 and np.isfinite(bound.per_step_ceiling)
    n = segments.count
    tighter = 0
    for point in solve(plain.problem).points:
        terms = tables.terms(point.choice)
        t_x, m_x = plain.problem.evaluate(point.choice)
        assert sum(terms.act[1:] - terms.act[:-1]) >= bound.act_floor * (1 - 1e-12)
        for p in range(2, n + 1):
            cuts = [
                terms.price([0, *inner, n], SCHEDULE)[0]
                for inner in itertools.combinations(range(1, n), p - 1)
            ]
            fastest = min(e.time_s for e in cuts)
            smallest = min(e.memory_bytes for e in cuts)
            assert bound.time_threshold(p, fastest) >= t_x * (1 - 1e-12)
            assert bound.memory_threshold(p, smallest) >= m_x * (1 - 1e-12)
            # the bounds of the sums alone hold too
            assert fastest >= t_x / p * (1 - 1e-12)
            assert smallest >= (m_x + bound.act_floor) / p * (1 - 1e-12)
            sums = dataclasses.replace(bound, levels=False)
            tighter += bound.memory_threshold(p, smallest) < sums.memory_threshold(p, smallest)
    if optimizer == "sgd" or zero is ZeroStage.PARAMETERS:
        # with Adam's state and no ZeRO the tiny model's activations fill no stage at the
        # levels its cuts reach, and the two bounds agree
        assert tighter


def test_stage_incumbents_are_the_corners_of_every_stage_counts_region():
    """A plan (t, m) is at or beyond a corner exactly when, for every stage count P, a
    point Q made at its device count has time and memory thresholds (``CutBound``) at
    most t and m (with the slack): the intersection of the P regions, against
    enumeration on random points and bounds."""
    import random

    from tensoropt.search.pipeline import _BOUND_SLACK, CutBound, stage_incumbents

    rng = random.Random(7)
    for _ in range(60):
        made = {
            p: [(rng.uniform(1, 10), rng.uniform(1, 10)) for _ in range(rng.randint(1, 6))]
            for p in rng.sample([2, 4, 8], rng.randint(1, 3))
        }
        bound = CutBound(
            rng.choice([2, 4, 8]), rng.uniform(0, 8), rng.uniform(0, 1), rng.uniform(0, 1),
            rng.choice([rng.uniform(0, 5), float("inf")]), rng.random() < 0.5,
        )  # fmt: skip
        times, mems = stage_incumbents(made, bound)
        s = 1 + _BOUND_SLACK

        def beyond(p, qt, qm, t, m):
            need_t = max(0.0, float(bound.time_threshold(p, qt))) * s  # noqa: B023
            need_m = max(0.0, float(bound.memory_threshold(p, qm))) * s  # noqa: B023
            return need_t <= t and need_m <= m

        for _ in range(200):
            t, m = rng.uniform(0, 90), rng.uniform(0, 90)
            want = all(any(beyond(p, qt, qm, t, m) for qt, qm in pts) for p, pts in made.items())
            got = any(ct <= t and cm <= m for ct, cm in zip(times, mems, strict=True))
            assert got == want
    assert stage_incumbents({2: [(1.0, 1.0)], 4: []}, CutBound(2, 0.0)) is None


def test_cut_bound_memory_levels_against_a_linear_program():
    """``CutBound.memory_threshold`` with levels against the linear program it solves
    greedily, solved by HiGHS: the least L with base_s + h_s act_s <= L over nonnegative
    per-stage parts summing to BASE and ACT. At the threshold the program's level (plus
    g) reaches M0; where the levels beat the bound of the sums, a plan well below the
    threshold can be split under M0."""
    import random

    highspy = pytest.importorskip("highspy")

    from tensoropt.cost.pipeline import held_micro_batches
    from tensoropt.search.pipeline import CutBound

    def least_level(base, act, held):
        # columns: base_0..base_{P-1}, act_0..act_{P-1}, L; minimise L
        p = len(held)
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        n = 2 * p + 1
        cost = np.zeros(n)
        cost[-1] = 1.0
        h.addCols(n, cost, np.zeros(n), np.full(n, highspy.kHighsInf), 0,
                  np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))  # fmt: skip
        rows = [(list(range(p)), [1.0] * p, base, base),
                (list(range(p, 2 * p)), [1.0] * p, act, act)]  # fmt: skip
        rows += [([s, p + s, 2 * p], [1.0, float(held[s]), -1.0], -np.inf, 0.0) for s in range(p)]
        starts = np.cumsum([0] + [len(r[0]) for r in rows[:-1]]).astype(np.int32)
        h.addRows(
            len(rows), np.array([r[2] for r in rows]), np.array([r[3] for r in rows]),
            sum(len(r[0]) for r in rows), starts,
            np.array([i for r in rows for i in r[0]], dtype=np.int32),
            np.array([v for r in rows for v in r[1]]),
        )  # fmt: skip
        h.run()
        return float(h.getSolution().col_value[-1])

    rng = random.Random(3)
    beaten = 0
    for _ in range(150):
        p, m = rng.choice([2, 3, 4, 8]), rng.choice([1, 2, 4, 8])
        g, a = rng.uniform(0, 2), rng.uniform(0.1, 10)
        bound = CutBound(m, a, g, levels=True)
        held = [held_micro_batches(s, m, p, "1f1b") for s in range(p)]
        m0 = g + rng.uniform(0.1, 10)
        need = float(bound.memory_threshold(p, m0))
        if need <= 0:  # no split reaches M0 with the activations alone
            assert least_level(0.0, a, held) + g >= m0 * (1 - 1e-7)
            continue
        assert least_level(need - g - a, a, held) + g >= m0 * (1 - 1e-7)
        sums = float(dataclasses.replace(bound, levels=False).memory_threshold(p, m0))
        below = need * (1 - 1e-3) - g - a
        if need < sums and below >= 0:
            beaten += 1
            assert least_level(below, a, held) + g < m0
    assert beaten > 10


@pytest.mark.slow
def test_stage_problems_pruned_by_pipelines_leave_the_default_frontier_as_it_was(gpt, monkeypatch):
    """The default search (stages above one node; the stage problems feed pipelines
    only): the stage problems' solves take the pipelined points already made as
    incumbents, the largest micro-batch count first, and their plans are cut into P
    stages only where no pipelined point made at that device count beats every cut
    (``search.pipeline.beaten``). Both drop plans and cuts but no merged point; each
    mesh's searches still come in the order of its problems."""
    from tensoropt.cli import build_parser
    from tensoropt.cli.cmd_search import search_space
    from tensoropt.cli.common import search_graph
    from tensoropt.search import driver, pipeline

    cut = []  # the stage counts each plan is cut into
    frontiers = pipeline.cut_frontiers

    def counted(terms, counts, *args, **kwargs):
        cut.append(len(counts))
        return frontiers(terms, counts, *args, **kwargs)

    monkeypatch.setattr(pipeline, "cut_frontiers", counted)

    argv = ["search", str(gpt), "--optimizer", "adam", "--micro-batches", "1,2,4"]
    args = build_parser().parse_args([*argv, "--stages", "2,4"])
    sg = search_graph(args)
    profile = builtin("a100")
    space = search_space(args, sg, profile)

    ticks = []
    counter = multiprocessing.Value("q", 0)

    def run():
        ticks.clear()
        counter.value = 0
        exp = driver.explore(
            sg, [16, 32], "auto", profile, jobs=1, space=space, on_problem=ticks.append,
            counter=counter,
        )  # fmt: skip
        merged = [(p.devices, p.time_s, p.memory_bytes) for p in exp.merged]
        return merged, sum(len(s.result.points) for s in exp.searches), exp.searches

    pruned, kept, searches = run()
    cuts = sum(cut)
    # two passes (driver._two_phases): the callback runs once per mesh and pass, and
    # each pass goes through every problem of every mesh (the progress counts them)
    assert len(ticks) == 2 * len(set(ticks))
    problems = sum(len(space.variants(sg, mesh)) for mesh in set(ticks))
    assert counter.value == driver.problem_count(sg, [16, 32], "auto", space) == 2 * problems
    for mesh in {s.mesh for s in searches}:
        counts = [s.variant.micro_batches for s in searches if s.mesh == mesh]
        assert counts == sorted(counts)
    assert {s.variant.micro_batches for s in searches if s.variant.stages > 1} == {2, 4}
    monkeypatch.setattr(pipeline, "_inside", lambda *args: False)  # every plan is cut
    cut.clear()
    uncut, _, _ = run()
    assert pruned == uncut
    assert cuts < sum(cut)  # the bound did leave cuts out
    monkeypatch.setattr(driver, "_staged_incumbents", lambda *args: None)
    whole, all_kept, _ = run()
    assert pruned == whole
    assert kept < all_kept  # the incumbents did drop plans


@pytest.mark.slow
def test_the_second_pass_prunes_stage_problems_with_every_point_the_first_made(
    tmp_path, monkeypatch
):
    """The default search runs its jobs in two passes (``driver._two_phases``): a job
    holds one device count, so within one pass a stage problem's incumbents are only
    the pipelines its own job made. The first pass solves the problems without
    micro-batches and the stage problems with the most micro-batches of the fewest
    stages; the second prunes the other stage problems and their cuts with every point
    the first made at the counts they feed. On gpt small at 16 and 32 devices that
    leaves plans out of the stage problems' solves, and pipelined searches whose every
    cut is beaten, and the merged frontier as one pass makes it."""
    from tensoropt.cli import build_parser
    from tensoropt.cli.cmd_search import search_space
    from tensoropt.cli.common import search_graph
    from tensoropt.search import driver

    path = tmp_path / "gpt_small.onnx"
    save_model(build_model("gpt", "small"), str(path))
    argv = ["search", str(path), "--optimizer", "adam", "--micro-batches", "1,2,4"]
    args = build_parser().parse_args([*argv, "--stages", "2,4"])
    sg = search_graph(args)
    profile = builtin("a100")
    space = search_space(args, sg, profile)
    planned = []  # the points of every problem's solve, stage problems included
    solve_one = driver._solve_one

    def solved(b, *args):
        found = solve_one(b, *args)
        planned.append(len(found.result.points))
        return found

    monkeypatch.setattr(driver, "_solve_one", solved)

    def run():
        planned.clear()
        exp = driver.explore(sg, [16, 32], "auto", profile, jobs=1, space=space)
        merged = [(p.devices, p.time_s, p.memory_bytes) for p in exp.merged]
        shown = [
            (s.key, [(p.time_s, p.memory_bytes) for p in s.result.points]) for s in exp.searches
        ]
        return merged, shown, sum(planned)

    assert driver._two_phases(driver.searched_counts(space, [16, 32])[0], True)
    merged, shown, two = run()
    monkeypatch.setattr(driver, "_two_phases", lambda *args: False)
    one_merged, one_shown, one = run()
    assert merged == one_merged
    keys = [key for key, _ in shown]
    assert keys == [key for key, _ in one_shown if key in keys]  # pipelines pruned whole
    assert two < one


def test_one_slot_problem_prices_both(gpt):
    """The pipelines split each entry with the problem of one more micro-batch slot
    (its times) and the problem without activations (its memories). No time reads the
    activation scale and no memory reads the slots, so one problem with one more slot
    and no activations (what the search builds) gives both, float for float: for every
    micro-batched problem of the tiny gpt on 2x2 with ZeRO stages and recomputation."""
    from tensoropt.cli import build_parser
    from tensoropt.cli.cmd_search import search_space
    from tensoropt.cli.common import search_graph
    from tensoropt.search import driver
    from tensoropt.search.pipeline import slot_problem

    args = build_parser().parse_args(
        ["search", str(gpt), "--optimizer", "adam", "--axes", "split,zero,recompute,micro"]
    )
    sg = search_graph(args)
    profile = builtin("a100")
    space = search_space(args, sg, profile)
    mesh = Mesh((2, 2), ("x", "y"))
    at = driver._MeshProblems(sg, space, mesh, profile)
    checked = set()
    for v in space.variants(sg, mesh):
        built = at.build(v) if v.micro_batches > 1 else None
        if built is None:
            continue
        family = at.families[(v.recompute, v.micro_batches)][0]
        choices = at.choices[(v.recompute, v.micro_batches)]
        of = (built.graph, family, choices, at.chosen, ZeroStage(v.zero), profile)
        m = v.micro_batches
        more = slot_problem(*of, m + 1, 1.0).problem
        bare = slot_problem(*of, m, 0.0).problem
        both = slot_problem(*of, m + 1, 0.0).problem
        for um, ub, uc in zip(more.units, bare.units, both.units, strict=True):
            assert [s.time_s for s in um.strategies] == [s.time_s for s in uc.strategies]
            assert [s.memory_bytes for s in ub.strategies] == [
                s.memory_bytes for s in uc.strategies
            ]
        for em, eb, ec in zip(more.edges, bare.edges, both.edges, strict=True):
            assert np.array_equal(em.time_s, ec.time_s)
            assert np.array_equal(eb.memory_bytes, ec.memory_bytes)
        # the two differ from it where the pipelines read them (a check that can fail)
        assert any(
            s.memory_bytes != c.memory_bytes
            for u, w in zip(more.units, both.units, strict=True)
            for s, c in zip(u.strategies, w.strategies, strict=True)
        )
        checked.add((v.zero, v.recompute))
    assert {z for z, _ in checked} == {0, 1, 2, 3} and {r for _, r in checked} == {False, True}
