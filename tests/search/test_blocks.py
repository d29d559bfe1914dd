"""Repeated blocks: detection, hints, and exactness on problems too big to enumerate."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from search_strategies import block_chains, problems, values

from tensoropt.errors import PlanError
from tensoropt.ir.costs import BlockHint, CostProblem
from tensoropt.search import BlockMode, solve
from tensoropt.search.synthetic import transformer_problem


@settings(max_examples=30, deadline=None)
@given(block_chains(max_units=40))
def test_long_chains_blocks_equal_plain_elimination(case) -> None:
    problem, _ = case
    plain = solve(problem, blocks=BlockMode.OFF)
    composed = solve(problem, blocks=BlockMode.ALWAYS)
    assert values(composed) == values(plain)
    for p in composed.points:
        assert problem.evaluate(p.choice) == (p.time_s, p.memory_bytes)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_transformer_blocks_detected_and_exact(mesh: tuple[int, ...]) -> None:
    problem = transformer_problem(6, mesh)
    auto = solve(problem)
    assert auto.stats.blocks and "size=12" in auto.stats.blocks[0]
    plain = solve(problem, blocks=BlockMode.OFF)
    assert values(auto) == values(plain)
    hinted = solve(transformer_problem(6, mesh, hint=True), blocks=BlockMode.ALWAYS)
    assert values(hinted) == values(plain)
    for p in auto.points:
        assert problem.evaluate(p.choice) == (p.time_s, p.memory_bytes)


def test_epsilon_mode_composes_blocks_exactly_and_guarantee_holds() -> None:
    """Epsilon mode composes the repeated blocks as the exact mode does (adaptive
    squaring, no thinning inside them): the same pieces, thinned once with part of the
    slack, the rest spread over the filtering steps around them (fewer than the exact
    run's products)."""
    problem = transformer_problem(9, (2,))
    exact = solve(problem, blocks=BlockMode.OFF)
    composed = solve(problem)
    approx = solve(problem, epsilon=0.05)
    assert approx.stats.blocks == composed.stats.blocks and "composed=8" in approx.stats.blocks[0]
    assert 0 < approx.stats.filter_depth < composed.stats.filter_depth
    got = values(approx)
    for t, m in values(exact):
        assert any(qm <= m and qt <= 1.05 * t * (1 + 1e-12) for qt, qm in got)


@settings(max_examples=60, deadline=None)
@given(block_chains(max_units=12), st.sampled_from([0.05, 0.5, 2.0]))
def test_epsilon_with_thinned_pieces_covers_every_plan(case, eps) -> None:
    """The composed blocks thinned with part of the slack and the steps around them with
    the rest: every plan (by enumeration) has a returned point with no more memory and
    at most (1 + eps) times its time, and the least memory is exact."""
    problem, (first, size, count) = case
    hinted = CostProblem(
        problem.units, problem.edges, problem.devices, problem.mesh,
        (BlockHint(first, size, count),),
    )  # fmt: skip
    result = solve(hinted, epsilon=eps, blocks=BlockMode.ALWAYS)
    assert result.stats.blocks  # the pieces were composed (and thinned)
    got = values(result)
    plans = [hinted.evaluate(choice) for choice in itertools.product(*map(range, dims(hinted)))]
    for t, m in plans:
        assert any(qm <= m and qt <= (1 + eps) * t * (1 + 1e-12) for qt, qm in got), (t, m)
    assert min(qm for _, qm in got) == min(m for _, m in plans)


def dims(problem: CostProblem) -> list[int]:
    return [len(u.strategies) for u in problem.units]


def test_wrong_hint_is_a_plan_error() -> None:
    problem = transformer_problem(4, (2,))
    bad = CostProblem(problem.units, problem.edges, 2, (2,), (BlockHint(1, 11, 4),))
    with pytest.raises(PlanError, match=r"blocks\[0\]"):
        solve(bad)


@settings(max_examples=80, deadline=None)
@given(problems(max_units=12, max_strategies=5))
def test_work_floor_bounds_the_greedy_work(problem) -> None:
    """Every greedy order's table work is at least the floor: the bound that lets
    `worthwhile` skip the whole-graph order when a region already beats it."""
    from tensoropt.search.blocks import table_work, work_floor
    from tensoropt.search.prepared import prepare

    prep = prepare(problem)
    assert work_floor(prep) <= table_work(prep, [])


@settings(max_examples=40, deadline=None)
@given(block_chains(max_units=40))
def test_worthwhile_decides_as_with_the_whole_graph_work(case) -> None:
    """The regions chosen with the floor are those chosen by comparing every region
    with the exact work of the graph without regions."""
    from tensoropt.search import blocks
    from tensoropt.search.prepared import prepare

    problem, _ = case
    prep = prepare(problem)
    found = blocks.detect_regions(prep)
    chosen, best = [], blocks.table_work(prep, [])
    for r in found:
        if blocks.port_dim(prep, r) > blocks.MAX_PORT_DIM:
            continue
        work = blocks.table_work(prep, chosen + [r])
        if work < best:
            chosen.append(r)
            best = work
    assert blocks.worthwhile(prep, found) == chosen


def test_detected_regions_are_shared_only_by_problems_of_one_structure() -> None:
    """detect_regions and auto_regions keep what they found per structure (which tables
    are equal, the edges, the strategy counts): a problem with other prices and the same
    structure gets the regions a fresh detection finds, and one whose structure differs
    is detected again (a memo entry served there would cover a block that is not a
    repeat)."""
    import dataclasses

    from tensoropt.search import blocks
    from tensoropt.search.prepared import prepare

    def fresh(problem):
        prep = prepare(problem)
        return blocks._detect(prep, blocks._Signatures(prep))

    blocks._DETECTED.clear()
    first = transformer_problem(6, (2, 2), seed=0)
    repriced = transformer_problem(6, (2, 2), seed=1)
    assert first.units != repriced.units  # other prices
    found = blocks.detect_regions(prepare(first))
    assert found and found == fresh(first)
    assert len(blocks._DETECTED) == 1
    assert blocks.detect_regions(prepare(repriced)) == fresh(repriced) == found
    assert len(blocks._DETECTED) == 1  # served from the first
    # layer 3's first unit priced apart from the others: the repeat breaks there
    k = 1 + 3 * 12
    unit = first.units[k]
    odd = dataclasses.replace(
        unit,
        strategies=tuple(dataclasses.replace(s, time_s=s.time_s * 1.5) for s in unit.strategies),
    )
    broken = dataclasses.replace(first, units=(*first.units[:k], odd, *first.units[k + 1 :]))
    again = blocks.detect_regions(prepare(broken))
    assert again == fresh(broken) != found
    assert len(blocks._DETECTED) == 2
    # the regions worth composing, kept with them: what worthwhile chooses afresh
    for problem in (first, repriced, broken, first):
        prep = prepare(problem)
        assert blocks.auto_regions(prep) == blocks.worthwhile(prep, fresh(problem))
    assert blocks.auto_regions(prepare(first)) != blocks.auto_regions(prepare(broken))
