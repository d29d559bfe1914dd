"""The stage DP (search/stages.py) against exhaustive enumeration of every cut and every
per-stage plan, on random synthetic per-stage frontiers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tensoropt.search.stages import (
    PipelinePoint,
    Staircase,
    _bottleneck,
    in_flight,
    pareto,
    plan_frontier,
    stage_frontier,
    stage_time,
)


def _pareto_values(values):
    out = []
    for t, m in sorted(values):
        if not out or m < out[-1][1]:
            out.append((t, m))
    return out


def _instance(seed: int, layers: int):
    rng = np.random.default_rng(seed)
    table = {}
    for i in range(layers + 1):
        for j in range(i + 1, layers + 1):
            for s in range(layers):
                if rng.random() < 0.1:
                    table[(i, j, s)] = []  # this stage cannot hold the range
                    continue
                k = int(rng.integers(1, 4))
                # integer-valued: ties between different cuts are common and exact
                table[(i, j, s)] = [
                    (float(rng.integers(1, 20)), float(rng.integers(1, 20)), (i, j, s, q))
                    for q in range(k)
                ]
    return table


@pytest.mark.parametrize("seed", range(40))
def test_the_dp_is_the_pareto_set_of_every_cut_and_plan(seed):
    layers = 2 + seed % 5
    positions = list(range(layers + 1))
    if seed % 3 == 0:  # only some cut positions allowed (block boundaries)
        positions = [0, *[c for c in range(1, layers) if (c + seed) % 2 == 0], layers]
    table = _instance(seed, layers)
    for stages in range(1, len(positions)):
        got = stage_frontier(positions, stages, lambda i, j, s: table[(i, j, s)])
        values = []
        for inner in itertools.combinations(positions[1:-1], stages - 1):
            cuts = (0, *inner, layers)
            ranges = [table[(cuts[s], cuts[s + 1], s)] for s in range(stages)]
            for pick in itertools.product(*ranges):
                values.append((max(p[0] for p in pick), max(p[1] for p in pick)))
        assert [(p.time_s, p.memory_bytes) for p in got] == _pareto_values(values), stages
        for p in got:  # each point is the plan it says
            assert p.cuts[0] == 0 and p.cuts[-1] == layers and len(p.cuts) == stages + 1
            assert all(c in positions for c in p.cuts)
            picked = [
                next(q for q in table[(p.cuts[s], p.cuts[s + 1], s)] if q[2] == p.plans[s])
                for s in range(stages)
            ]
            assert max(q[0] for q in picked) == p.time_s
            assert max(q[1] for q in picked) == p.memory_bytes


@pytest.mark.parametrize("seed", range(60))
def test_one_plan_frontier_equals_the_dp_and_every_cut(seed):
    """plan_frontier (one point per stage, epsilon-constraint over arrays) gives the
    points of stage_frontier and of the enumeration of every cut, with and without a
    memory budget; each point's cuts price to its figures."""
    rng = np.random.default_rng(1000 + seed)
    layers = 2 + seed % 7
    positions = list(range(layers + 1))
    if seed % 3 == 0:
        positions = [0, *[c for c in range(1, layers) if (c + seed) % 2 == 0], layers]
    n = len(positions)
    at = {positions[k]: k for k in range(n)}
    for stages in range(1, n):
        # integer-valued (ties common) or continuous; some ranges infeasible (inf)
        draw = (
            (lambda: rng.integers(1, 12, (n, n)).astype(float))
            if seed % 2
            else (lambda: rng.random((n, n)) * 10)
        )
        taus, mems = [], []
        for _ in range(stages):
            t, m = draw(), draw()
            t[rng.random((n, n)) < 0.1] = np.inf
            taus.append(t)
            mems.append(m)

        def one(i, j, s, taus=taus, mems=mems):
            t, m = taus[s][at[i], at[j]], mems[s][at[i], at[j]]
            return [] if not np.isfinite(t) else [(float(t), float(m), "plan")]

        budget = None if seed % 4 else 6.0
        want = [
            (q.time_s, q.memory_bytes)
            for q in stage_frontier(positions, stages, one)
            if budget is None or q.memory_bytes <= budget
        ]
        got = plan_frontier(positions, taus, mems, "plan", budget)
        assert [(q.time_s, q.memory_bytes) for q in got] == want, stages
        values = []
        for inner in itertools.combinations(positions[1:-1], stages - 1):
            cuts = (0, *inner, layers)
            picks = [one(cuts[s], cuts[s + 1], s) for s in range(stages)]
            if all(picks):
                values.append((max(p[0][0] for p in picks), max(p[0][1] for p in picks)))
        full = _pareto_values(values)
        assert want == [v for v in full if budget is None or v[1] <= budget]
        for q in got:
            ranges = [(at[q.cuts[s]], at[q.cuts[s + 1]]) for s in range(stages)]
            assert q.cuts[0] == 0 and q.cuts[-1] == layers and q.plans == ("plan",) * stages
            assert max(taus[s][i, k] for s, (i, k) in enumerate(ranges)) == q.time_s
            assert max(mems[s][i, k] for s, (i, k) in enumerate(ranges)) == q.memory_bytes


@pytest.mark.parametrize("seed", range(40))
def test_plans_cut_against_incumbents_give_the_same_pareto_set(seed):
    """Cutting plan after plan with the frontier of the plans before as incumbents
    (``pipeline.pipelined``) leaves out only points that one already found equals or
    dominates: the Pareto set over all plans (first of equal points kept, so the same
    payload wins) is the one found without incumbents, and every point a plan keeps is
    one of its own frontier."""
    rng = np.random.default_rng(5000 + seed)
    layers = 3 + seed % 6
    positions = list(range(layers + 1))
    stages = 1 + seed % min(4, layers)
    ints = seed % 2 == 1  # integer-valued: equal points across plans are common
    budget = None if seed % 3 else 7.0
    plain, pruned = [], []
    held = Staircase()
    for plan in range(6):
        shape = (stages, layers + 1, layers + 1)
        taus = rng.integers(1, 9, shape).astype(float) if ints else rng.random(shape) * 10
        mems = rng.integers(1, 9, shape).astype(float) if ints else rng.random(shape) * 10
        taus[rng.random(shape) < 0.1] = np.inf
        own = plan_frontier(positions, taus, mems, plan, budget)
        kept = plan_frontier(positions, taus, mems, plan, budget, held)
        assert set(kept) <= set(own)
        for q in own:  # what is left out is matched or beaten by a point found before
            if q not in kept:
                assert any(
                    t <= q.time_s and m <= q.memory_bytes
                    for t, m in zip(held.times, held.memories, strict=True)
                )
        held.add(kept)
        plain += own
        pruned += kept
    want = pareto(list(plain))
    assert pareto(list(pruned)) == want
    got = list(zip(held.times, held.memories, strict=True))
    assert got == [(q.time_s, q.memory_bytes) for q in want]


def test_a_staircase_keeps_the_pareto_set_of_what_it_is_given():
    held = Staircase()
    held.add([PipelinePoint(t, m, (0, 1), ()) for t, m in [(3, 3), (1, 5), (2, 5), (4, 1)]])
    assert list(zip(held.times, held.memories, strict=True)) == [(1, 5), (3, 3), (4, 1)]
    held.add([PipelinePoint(2.0, 4.0, (0, 1), ())])
    assert list(zip(held.times, held.memories, strict=True)) == [(1, 5), (2, 4), (3, 3), (4, 1)]


def test_more_stages_than_cuts_gives_nothing():
    assert stage_frontier([0, 1, 2], 3, lambda i, j, s: [(1.0, 1.0, None)]) == []
    with pytest.raises(ValueError):
        stage_frontier([0, 1], 0, lambda i, j, s: [])


def test_1f1b_pricing():
    # m slots of work and p - 1 of bubble, then the step's own work
    assert stage_time(2.0, 5.0, micro_batches=8, stages=4) == (8 + 3) * 2.0 + 5.0
    # the first stage holds p micro-batches in flight, the last one; never more than m
    assert [in_flight(s, 8, 4) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, 2, 4) for s in range(4)] == [2, 2, 2, 1]


def _bottleneck_by_sweeps(cost, mem, tau, cap, t_limit):
    """The bottleneck program as whole-array numpy steps (np.argmin: first minimum)."""
    stages, n = cost.shape[0], cost.shape[1]
    upper = np.triu(np.ones((n, n), dtype=bool), k=1)
    best = np.full(n, np.inf)
    best[0] = 0.0
    back = []
    for s in range(stages):
        ok = upper & (mem[s] <= cap) & (tau[s] <= t_limit)
        cand = np.where(ok, np.maximum(best[:, None], cost[s]), np.inf)
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(n)]
        back.append(arg)
    if not np.isfinite(best[-1]):
        return np.inf, []
    cuts = [n - 1]
    for arg in reversed(back):
        cuts.append(int(arg[cuts[-1]]))
    return float(best[-1]), cuts[::-1]


@pytest.mark.parametrize("seed", range(40))
def test_the_compiled_bottleneck_picks_the_cuts_numpy_argmin_picks(seed):
    """Small integer prices make many cuts tie; the compiled program must return the
    same least value and the same cuts (the first start of the least value)."""
    rng = np.random.default_rng(seed)
    stages, n = int(rng.integers(1, 5)), int(rng.integers(2, 9))
    tau = rng.integers(0, 4, (stages, n, n)).astype(np.float64)
    mem = rng.integers(0, 4, (stages, n, n)).astype(np.float64)
    tau[rng.random(tau.shape) < 0.1] = np.inf
    for cap, t_limit in ((np.inf, np.inf), (2.0, np.inf), (3.0, 2.0)):
        for cost in (tau, mem):
            value, cuts = _bottleneck(cost, mem, tau, cap, t_limit)
            want_value, want_cuts = _bottleneck_by_sweeps(cost, mem, tau, cap, t_limit)
            assert value == want_value
            assert [int(c) for c in cuts] == want_cuts
