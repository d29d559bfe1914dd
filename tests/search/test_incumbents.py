"""Incumbents from other meshes: the search leaves out exactly the points they strictly
dominate, and the per-device frontiers do not change."""

from __future__ import annotations

import numpy as np
import pytest

from tensoropt.search.bounds import beyond
from tensoropt.search.solver import Pruning, solve, strictly_dominated, surely_dominated
from tensoropt.search.synthetic import transformer_problem


def _values(points):
    return [(p.time_s, p.memory_bytes) for p in points]


@pytest.mark.parametrize("pruning", [Pruning.AUTO, Pruning.ALWAYS])
@pytest.mark.parametrize(("mesh", "other"), [((4,), (2, 2)), ((2, 4), (4, 2)), ((8,), (2, 4))])
def test_leaves_out_exactly_the_strictly_dominated_points(mesh, other, pruning):
    problem = transformer_problem(3, mesh, seed=1)
    whole = solve(problem).points
    incumbents = _values(solve(transformer_problem(3, other, seed=2)).points)
    inc_t = np.array([t for t, _ in incumbents])
    inc_m = np.array([m for _, m in incumbents])
    # and points of this problem: some exactly (ties: kept), some a little faster
    # (strictly dominating) and some a little larger (dominating nothing)
    ties, faster, larger = whole[::4], whole[1::4], whole[2::4]
    inc_t = np.concatenate(
        [inc_t, [p.time_s for p in ties], [p.time_s * 0.999 for p in faster],
         [p.time_s for p in larger]]
    )  # fmt: skip
    inc_m = np.concatenate(
        [inc_m, [p.memory_bytes for p in ties], [p.memory_bytes for p in faster],
         [p.memory_bytes * 1.0000001 for p in larger]]
    )  # fmt: skip
    got = solve(problem, incumbents=(inc_t, inc_m), pruning=pruning)
    t = np.array([p.time_s for p in whole])
    m = np.array([p.memory_bytes for p in whole])
    gone = strictly_dominated(t, m, inc_t, inc_m)
    expected = [p for p, out in zip(whole, gone, strict=True) if not out]
    assert 0 < len(expected) < len(whole)  # the case prunes something and keeps something
    assert _values(got.points) == _values(expected)
    for p in got.points:  # each returned choice is a plan of that value
        assert problem.evaluate(p.choice) == (p.time_s, p.memory_bytes)
    assert "strictly dominates" in got.guarantee


@pytest.mark.parametrize("mesh", [(4,), (2, 2), (2, 4)])
def test_surely_dominated_is_only_said_of_problems_with_nothing_left(mesh):
    """The relaxed proof: whenever it says every plan is strictly dominated, the exact
    search with those incumbents returns nothing (the solver then skips the search); it
    says so for incumbents well below the frontier, and not for the frontier itself
    (ties are kept) nor for incumbents that leave a little of it."""
    problem = transformer_problem(2, mesh, seed=3)
    whole = solve(problem).points
    t = np.array([p.time_s for p in whole])
    m = np.array([p.memory_bytes for p in whole])
    said = []
    for scale_t, scale_m in [(0.5, 0.5), (0.9, 0.9), (0.99, 0.99), (1.0, 1.0), (0.5, 1.001),
                             (1.001, 0.5), (0.97, 1.0), (1.0, 0.97), (2.0, 2.0)]:  # fmt: skip
        for keep in (slice(None), slice(1, None, 3)):
            inc_t, inc_m = t[keep] * scale_t, m[keep] * scale_m
            sure = surely_dominated(problem, inc_t, inc_m)
            said.append(sure)
            exact = solve(problem, incumbents=(inc_t, inc_m), pruning=Pruning.OFF)
            if sure:
                assert exact.points == (), (scale_t, scale_m, keep)
            got = solve(problem, incumbents=(inc_t, inc_m))  # with the proof
            assert _values(got.points) == _values(exact.points)
    assert any(said) and not all(said)
    assert not surely_dominated(problem, t, m)  # the frontier itself: ties stay


@pytest.mark.parametrize("mesh", [(4,), (2, 2), (2, 4)])
@pytest.mark.parametrize("eps", [None, 0.05])
def test_exact_lower_bounds_prove_what_the_relaxation_cannot(mesh, eps):
    """Incumbents 10% below the frontier in both coordinates: the per-unit relaxation
    cannot prove the problem empty, the scalar DPs over the elimination can (the search
    stops before the sweep), and the answer is the one of the search without bounds."""
    problem = transformer_problem(2, mesh, seed=3)
    whole = solve(problem).points
    inc_t = np.array([p.time_s * 0.9 for p in whole])
    inc_m = np.array([p.memory_bytes * 0.9 for p in whole])
    assert not surely_dominated(problem, inc_t, inc_m)
    got = solve(problem, epsilon=eps, incumbents=(inc_t, inc_m))
    assert got.points == ()
    assert got.stats.blocks[-1].endswith("(exact lower bounds)")
    assert solve(problem, incumbents=(inc_t, inc_m), pruning=Pruning.OFF).points == ()
    assert got.epsilon == eps and "given plans" in got.guarantee
    # the fastest frontier point left undominated (the others lose only memory): no
    # proof, and that point comes back (with epsilon: it is covered by a returned point
    # or an incumbent)
    inc_t, inc_m = inc_t / 0.9, inc_m.copy()
    inc_t[0], inc_m[0] = whole[0].time_s * 1.01, whole[0].memory_bytes * 1.01
    again = solve(problem, epsilon=eps, incumbents=(inc_t, inc_m))
    assert "exact lower bounds" not in "".join(again.stats.blocks)
    fastest = [(whole[0].time_s, whole[0].memory_bytes)]
    if eps is None:
        assert _values(again.points) == fastest
    else:
        given = list(zip(inc_t.tolist(), inc_m.tolist(), strict=True))
        assert _covered(fastest, _values(again.points) + given, eps)


def test_beyond_claims_only_regions_that_incumbents_strictly_dominate():
    """Random staircases and lower bounds: whenever ``beyond`` says every point of the
    region {x >= ideal, w.x >= low_w} is strictly dominated, no point of a fine grid in
    that region escapes (ties with an incumbent included); it says so sometimes, and
    not always."""
    rng = np.random.default_rng(7)
    said = []
    axis = np.linspace(0.0, 12.0, 97)
    gt, gm = np.meshgrid(axis, axis)
    gt, gm = gt.ravel(), gm.ravel()
    for _ in range(300):
        k = int(rng.integers(1, 6))
        inc_t = np.sort(rng.choice(np.arange(1, 11), k, replace=False)).astype(float)
        inc_m = np.sort(rng.choice(np.arange(1, 11), k, replace=False))[::-1].astype(float)
        t_low, m_low = (float(x) for x in rng.integers(0, 12, 2))
        weights = rng.uniform(0.05, 1.0, (int(rng.integers(0, 4)), 2))
        w_low = np.array([w @ (t_low, m_low) for w in weights]) + rng.uniform(0, 6, len(weights))
        sure = beyond(t_low, m_low, weights, w_low, inc_t, inc_m)
        said.append(sure)
        if not sure:
            continue
        inside = (gt >= t_low) & (gm >= m_low)
        for w, b in zip(weights, w_low, strict=True):
            inside &= w[0] * gt + w[1] * gm >= b
        assert strictly_dominated(gt[inside], gm[inside], inc_t, inc_m).all()
    assert any(said) and not all(said)


def test_strictly_dominated_keeps_equal_points():
    inc_t, inc_m = np.array([1.0, 2.0]), np.array([5.0, 3.0])
    t = np.array([1.0, 1.5, 2.0, 0.5, 3.0])
    m = np.array([5.0, 5.0, 3.0, 9.0, 2.0])
    assert strictly_dominated(t, m, inc_t, inc_m).tolist() == [False, True, False, False, False]


def _tiny_gpt_graph(tmp_path):
    """The search graph of the zoo's tiny gpt (plain SGD step)."""
    from tensoropt.cli import build_parser
    from tensoropt.cli.common import search_graph
    from tensoropt.models import build_model, save_model

    path = tmp_path / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return search_graph(build_parser().parse_args(["search", str(path), "--devices", "4,8"]))


def test_explore_chained_meshes_give_the_same_frontiers(tmp_path):
    """The tiny gpt over 4 and 8 devices: solving each count's meshes in a chain with
    incumbents leaves points out of some meshes, but no per-device frontier changes."""
    from tensoropt.cost.cluster import builtin
    from tensoropt.display import fmt_memory
    from tensoropt.search.driver import explore, guarantee_of
    from tensoropt.search.merge import merge_frontiers

    sg = _tiny_gpt_graph(tmp_path)

    def per_device(exp):
        out = {}
        for d in (4, 8):
            group = {(s.mesh.size, tuple(s.mesh.shape)): s.result for s in exp.searches
                     if s.mesh.size == d}  # fmt: skip
            out[d] = [(p.mesh, p.time_s, p.memory_bytes) for p in merge_frontiers(group)]
        return out

    chained = explore(sg, [4, 8], "auto", builtin("h100"), jobs=1)
    whole = explore(sg, [4, 8], "auto", builtin("h100"), jobs=1, whole_frontiers=True)
    assert per_device(chained) == per_device(whole)

    def merged(exp):  # a point's index into its mesh's result differs: the values do not
        return [(p.devices, p.mesh, p.time_s, p.memory_bytes) for p in exp.merged]

    assert merged(chained) == merged(whole)
    kept = sum(len(s.result.points) for s in chained.searches)
    assert kept < sum(len(s.result.points) for s in whole.searches)
    # so the exploration states the whole frontier's guarantee, not a problem's own
    # (which leaves out what its incumbents, points of the same exploration, dominate)
    assert any("given plans" in s.result.guarantee for s in chained.searches)
    exact = "exact: the points are the Pareto frontier of every plan"
    assert guarantee_of(chained) == guarantee_of(whole) == exact
    budget = max(p.memory_bytes for p in chained.merged)
    capped = explore(sg, [4, 8], "auto", builtin("h100"), jobs=1, memory_budget=budget)
    assert guarantee_of(capped) == f"{exact} with memory <= {fmt_memory(budget)} per device"


def _covered(points, by, eps: float) -> bool:
    """Whether every (t, m) of ``points`` has a (t', m') in ``by`` with m' <= m and
    t' <= (1 + eps) t (a relative 1e-12 of rounding on top)."""
    for t, m in points:
        if not any(bm <= m and bt <= t * (1.0 + eps) * (1.0 + 1e-12) for bt, bm in by):
            return False
    return True


@pytest.mark.parametrize("pruning", [Pruning.AUTO, Pruning.ALWAYS])
@pytest.mark.parametrize("eps", [0.01, 0.1])
@pytest.mark.parametrize(("mesh", "other"), [((4,), (2, 2)), ((2, 4), (4, 2)), ((8,), (2, 4))])
def test_epsilon_with_incumbents_covers_the_frontier(mesh, other, eps, pruning):
    """Epsilon mode with incumbents: every exact frontier point is covered within
    (1 + eps) in time, with no more memory, by a returned point or an incumbent; no
    returned point is strictly dominated by an incumbent; and the incumbents prune (fewer
    points than the same epsilon search without them)."""
    problem = transformer_problem(3, mesh, seed=1)
    whole = _values(solve(problem).points)
    alone = solve(problem, epsilon=eps)
    incumbents = _values(solve(transformer_problem(3, other, seed=2)).points)
    incumbents += [(t * 0.999, m) for t, m in whole[1::3]]  # strictly dominating some
    inc_t = np.array([t for t, _ in incumbents])
    inc_m = np.array([m for _, m in incumbents])
    got = solve(problem, epsilon=eps, incumbents=(inc_t, inc_m), pruning=pruning)
    values = _values(got.points)
    assert _covered(whole, values + incumbents, eps)
    assert not _covered(whole, incumbents, eps)  # the returned points are needed
    t = np.array([v[0] for v in values])
    m = np.array([v[1] for v in values])
    assert not strictly_dominated(t, m, inc_t, inc_m).any()
    assert len(values) < len(alone.points)
    for p in got.points:
        assert problem.evaluate(p.choice) == (p.time_s, p.memory_bytes)
    assert "given plans" in got.guarantee and f"epsilon={eps!r}" in got.guarantee


def test_explore_chained_epsilon_covers_each_device_count(tmp_path):
    """Chained meshes in epsilon mode: each device count's merged frontier covers that
    count's exact frontier within (1 + eps) in time, with no more memory."""
    from tensoropt.cost.cluster import builtin
    from tensoropt.search.driver import device_frontier, explore

    sg = _tiny_gpt_graph(tmp_path)
    exact = explore(sg, [4, 8], "auto", builtin("h100"), jobs=1)
    eps = 0.05
    approx = explore(sg, [4, 8], "auto", builtin("h100"), jobs=1, epsilon=eps)
    for d in (4, 8):
        want = [(p.time_s, p.memory_bytes) for _, p in device_frontier(exact, d)]
        have = [(p.time_s, p.memory_bytes) for _, p in device_frontier(approx, d)]
        assert _covered(want, have, eps), d
        assert len(have) <= len(want)
    # the meshes were chained: later problems got the earlier points as incumbents
    assert any("given plans" in s.result.guarantee for s in approx.searches)


def test_epsilon_search_proved_empty_keeps_its_epsilon():
    """A problem that the incumbents surely dominate returns nothing, and still says it
    is an epsilon result with the epsilon guarantee."""
    problem = transformer_problem(2, (2, 2), seed=3)
    whole = solve(problem).points
    inc_t = np.array([p.time_s * 0.5 for p in whole])
    inc_m = np.array([p.memory_bytes * 0.5 for p in whole])
    assert surely_dominated(problem, inc_t, inc_m)
    got = solve(problem, epsilon=0.05, incumbents=(inc_t, inc_m))
    assert got.points == () and got.epsilon == 0.05
    assert got.guarantee.startswith("epsilon=0.05") and "given plans" in got.guarantee
