"""The report's answers against brute force over every point the search returned."""

from __future__ import annotations

import math

import pytest

from tensoropt.cost.model import build_problem
from tensoropt.cost.summary import unit_kind
from tensoropt.report import analysis, strategies

from .conftest import DEVICES


def _all_points(exp):
    """Every frontier point of every mesh: a superset of the merged frontier."""
    return [(s.mesh.size, p.time_s, p.memory_bytes) for s in exp.searches for p in s.result.points]


def test_fastest_under_each_capacity_is_the_brute_force_optimum(explored):
    _, _, exp = explored
    everything = _all_points(exp)
    caps = analysis.capacities(exp)
    assert {c / 2**30 for c in caps} >= set(analysis.STANDARD_CAPACITIES_GIB)
    assert len(caps) > len(analysis.STANDARD_CAPACITIES_GIB)  # the model's own range too
    for row in analysis.capacity_table(exp, caps):
        fits = [(t, d) for d, t, m in everything if m <= row.capacity]
        if not fits:
            assert row.best is None and row.fewest is None
            continue
        assert row.best.time_s == min(t for t, _ in fits)
        assert row.best.memory_bytes <= row.capacity
        assert row.fewest.devices == min(d for _, d in fits)


def test_capacity_steps_are_a_decreasing_staircase_of_optima(explored):
    _, _, exp = explored
    everything = _all_points(exp)
    steps = analysis.capacity_steps(exp)
    assert steps
    for a, b in zip(steps, steps[1:], strict=False):
        assert a.memory_bytes < b.memory_bytes and a.time_s > b.time_s
    for p in steps:
        assert p.time_s == min(t for _, t, m in everything if m <= p.memory_bytes)
    least = min(m for _, _, m in everything)
    assert steps[0].memory_bytes == least


@pytest.mark.parametrize("capacity_index", [0, 1, -1])
def test_fewest_devices_per_target_is_the_brute_force_optimum(explored, capacity_index):
    _, _, exp = explored
    everything = _all_points(exp)
    caps = analysis.binding_capacities(exp, analysis.capacities(exp))
    assert caps, "the tiny gpt has a memory range with binding capacities"
    cap = [*caps, math.inf][capacity_index]
    targets = analysis.time_targets(exp)
    assert len(targets) >= 2 and targets == sorted(targets)
    rows = analysis.target_table(exp, targets, caps)
    column = [*caps, math.inf].index(cap)
    for row in rows:
        got = row.by_capacity[column]
        fits = [d for d, t, m in everything if t <= row.target_s and m <= cap]
        if not fits:
            assert got is None
            continue
        assert got.devices == min(fits)
        assert got.time_s <= row.target_s and got.memory_bytes <= cap
    # the staircase plotted agrees with the table
    steps = analysis.device_steps(exp, cap)
    for row in rows:
        reach = [p.devices for p in steps if p.time_s <= row.target_s]
        got = row.by_capacity[column]
        assert (got.devices if got else None) == (min(reach) if reach else None)


def test_baselines_compare_references_with_their_own_device_count(explored):
    _, _, exp = explored
    rows = analysis.baselines(exp)
    assert [r.devices for r in rows] == DEVICES
    for r in rows:
        names = [ref.name for ref in r.references]
        assert "data-parallel" in names
        for ref, lean in zip(r.references, r.lean_at_reference_time, strict=True):
            assert ref.devices == r.devices
            # exact search: every reference plan is dominated by a frontier point
            assert r.fastest.time_s <= ref.time_s
            assert lean.time_s <= ref.time_s and lean.memory_bytes <= ref.memory_bytes
            assert lean.devices == r.devices


def test_search_records_unit_kinds_that_match_the_cost_model(explored):
    sg, profile, exp = explored
    for s in exp.searches:
        if s.variant.micro_batches > 1 or s.variant.recompute:
            continue  # other strategy tables (micro mesh) or another step (recomputed)
        mp = build_problem(sg, s.mesh, profile)
        assert len(s.strategy_kinds) == len(mp.units) == len(s.unit_ops)
        assert s.unit_ops == tuple(u.node.op_type for u in mp.units)
        assert sum(s.unit_weighted) > 0
        for p in s.result.points[:3]:
            for k, choice in enumerate(p.choice):
                assert s.strategy_kinds[k][choice] == unit_kind(mp, sg, k, choice)


def test_track_of_the_largest_device_count(explored):
    _, _, exp = explored
    rows = analysis.device_frontiers(exp)[4]
    tr = strategies.track(exp, 4, rows)
    assert len(tr.kinds) == len(tr.units) > 0
    assert all(len(series) == len(rows) for series in tr.kinds)
    assert {u.op for u in tr.units} >= {"MatMul", "Gather"}
    # the least-memory plan shards more weight units than the fastest
    tp_fast = sum("tp=" in series[0] for series in tr.kinds)
    tp_lean = sum("tp=" in series[-1] for series in tr.kinds)
    assert tp_lean > tp_fast


def test_binding_capacities_prefer_the_clusters_memory_when_it_binds(explored):
    _, _, exp = explored
    mems = [p.memory_bytes for p in analysis.merged_points(exp)]
    inside, outside = (min(mems) + max(mems)) / 2, 2 * max(mems)
    caps = analysis.capacities(exp)
    chosen = analysis.binding_capacities(exp, caps, limit=3, prefer=(inside, outside))
    assert inside in chosen and outside not in chosen
    assert len(chosen) == 3 and chosen == sorted(chosen)
    assert all(min(mems) <= c < max(mems) for c in chosen)
