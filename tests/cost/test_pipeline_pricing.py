"""Pricing of pipelined plans (cost.pipeline) against the micro-batched problem it splits.

One stage over every segment is the micro-batched plan itself: its time and memory must
equal ``estimate_of`` of that plan, for plain, ZeRO-3 and recomputing plans. With P
stages, the stages' per-step work adds up to the plan's, their per-micro-batch work to
the plan's over m + P - 1 slots, and the first stage holds min(P, m) micro-batches of
activations under 1F1B (m under GPipe).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tensoropt.cli.cmd_compile import estimate_of, pipeline_terms_of
from tensoropt.cost.cluster import builtin
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.models import build_model
from tensoropt.passes.plans import builtin_plan, prepare_model, with_zero
from tensoropt.passes.recompute import find_blocks
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tests.helpers.steps import import_proto

PROFILE = builtin("a100")


def _step(name="gpt", plan="data-parallel"):
    model = import_proto(build_model(name, "tiny"))
    prepare_model(plan, model)
    return build_training_step(model, TrainingOptions())


def _plan(step, mesh, k, plan="data-parallel", zero=ZeroStage.NONE, recompute=()):
    built = builtin_plan(plan, step.model.graph, step.signature, mesh)
    out = dataclasses.replace(built.plan, micro_batches=k, recompute=recompute)
    if zero is not ZeroStage.NONE:
        out = with_zero(out, step.model.graph, step.signature, built.data_axes, zero, "t").plan
    return out, built.data_axes


@pytest.mark.parametrize(
    ("mesh", "k", "zero", "recompute"),
    [
        ((1,), 2, ZeroStage.NONE, False),
        ((2,), 4, ZeroStage.NONE, False),
        ((2,), 2, ZeroStage.PARAMETERS, False),
        ((2,), 2, ZeroStage.NONE, True),
    ],
)
def test_one_stage_prices_as_the_micro_batched_plan(mesh, k, zero, recompute):
    step = _step()
    blocks = tuple(b.name for b in find_blocks(step.model.graph, step.signature.data_inputs))
    plan, axes = _plan(
        step, Mesh(mesh, ("dp",)), k, zero=zero, recompute=blocks if recompute else ()
    )
    terms, segments = pipeline_terms_of(step, plan, axes, PROFILE)
    one, costs = terms.price([0, segments.count], "1f1b")
    plain = estimate_of(_step(), plan, axes, PROFILE)
    assert math.isclose(one.time_s, plain.time_s, rel_tol=1e-9)
    assert math.isclose(one.memory_bytes, plain.memory_bytes, rel_tol=1e-9)
    assert costs[0].p2p_bytes == 0


@pytest.mark.parametrize(("stages", "k"), [(2, 2), (2, 4), (4, 4), (4, 2)])
def test_stages_split_the_work_and_hold_micro_batches_in_flight(stages, k):
    step = _step()
    plan, axes = _plan(step, Mesh((1,), ("dp",)), k)
    terms, segments = pipeline_terms_of(step, plan, axes, PROFILE)
    n = segments.count
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    _, costs = terms.price(cuts, "1f1b")
    slots = k + stages - 1
    per_step = terms.b[n]
    total = sum(c.time_s - c.p2p_s for c in costs)
    assert math.isclose(total, slots * terms.a[n] + per_step, rel_tol=1e-9)
    first = costs[0]
    i, j = first.segments
    activations = terms.act[j] - terms.act[i]
    resident = terms.base[j] - terms.base[i] + terms.constant
    # the micro-batches in flight, and one more for the backward part's working set
    held = min(stages, k) + 1
    assert math.isclose(first.memory_bytes, resident + held * activations, rel_tol=1e-9)
    _, gpipe = terms.price(cuts, "gpipe")
    assert math.isclose(gpipe[0].memory_bytes, resident + (k + 1) * activations, rel_tol=1e-9)
    assert all(c.p2p_bytes > 0 for c in costs)  # each sends its boundary every slot


def test_the_bubble_grows_with_the_stages_for_the_same_micro_batches():
    step = _step()
    plan, axes = _plan(step, Mesh((1,), ("dp",)), 4)
    terms, segments = pipeline_terms_of(step, plan, axes, PROFILE)
    n = segments.count
    two, _ = terms.price([0, n // 2, n], "1f1b")
    one, _ = terms.price([0, n], "1f1b")
    assert two.time_s < one.time_s  # half the work per stage, 5 slots for 4 micro-batches
    assert two.time_s > one.time_s / 2  # but not half: the bubble and the sends


@pytest.mark.parametrize("per_node", [1, 2, 3, 8])
def test_stage_link_is_intra_node_exactly_when_every_rank_pair_shares_a_node(per_node):
    """stage_link's closed form against its definition: rank r of stage s talks to rank
    r of stage s + 1, and the link is the node's own only if every such pair shares a
    node (uneven node sizes included)."""
    from tensoropt.cost.pipeline import stage_link

    profile = dataclasses.replace(builtin("h100"), devices_per_node=per_node)
    assert profile.intra != profile.inter
    seen = set()
    for n in range(1, 20):
        for s in range(12):
            first = s * n
            same = all((first + r) // per_node == (first + n + r) // per_node for r in range(n))
            seen.add(same)
            assert stage_link(profile, s, n) == (profile.intra if same else profile.inter)
    assert seen == {True, False} or per_node == 1
