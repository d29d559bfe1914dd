"""The estimate of a pipelined plan (``Plan.stages``): 1F1B pricing over unit entries.

A pipelined plan is a micro-batched plan on one stage's mesh whose units are cut into
stages (``passes.stages.unit_stages``). Its problem is built as for the micro-batched
plan, with two changes that make each unit's entries the stage formula's summands
(docs/design/pipeline.md):

- per-micro-batch work (compute, collectives issued per micro-batch) counts
  ``m + P - 1`` times, the slots of a 1F1B or GPipe step, not m (``slots``); per-step
  work (gradient synchronisation, update, accumulation) counts once;
- activations (the saved outputs, the forward conversion buffers) are priced apart
  (``saved_scale`` 0), so that each stage holds ``min(P - s, m)`` micro-batches' worth
  (1F1B) or m (GPipe) of them and one copy of its parameters and state.

Then, for stage s (units U_s, edges whose later unit is in U_s):

    tau_s = sum of time entries + x_s
    mem_s = sum of resident entries + in_flight(s) * (activation entries + received)
            + per-stage constants (ZeRO-3's gathered bound, the recompute working set)

x_s is the point-to-point time of the values stage s sends per slot: each forward value
read by a later stage (and, for a floating-point value, its gradient sent back by the
reader's stage), at the link between the two stages' devices (``intra`` when they share
a node). The step is ``max tau_s``, the memory per device ``max mem_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.cost.model import (
    RECOMPUTE_KEY,
    Estimate,
    ProblemFamily,
    SearchGraph,
    gathered_bound,
    itemsize,
    micro_choices,
    priced_collectives,
)
from tensoropt.ir.builder import static_shape
from tensoropt.ir.layout import local_shape
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.rules.sharding import MeshSharding


def stage_time(per_micro: float, per_step: float, micro_batches: int, stages: int) -> float:
    """tau_s of a stage: ``per_micro`` (f + b + x) per micro-batch slot, over m + P - 1
    slots, plus its once-per-step work."""
    return (micro_batches + stages - 1) * per_micro + per_step


def in_flight(stage: int, micro_batches: int, stages: int) -> int:
    """Micro-batches stage ``stage`` (0 = first) holds activations of under 1F1B."""
    return min(stages - stage, micro_batches)


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage's share of a pipelined step."""

    time_s: float
    memory_bytes: float
    p2p_s: float  # of time_s: its sends per step
    p2p_bytes: float  # sent per micro-batch


def stage_link(profile: ClusterProfile, stage: int, ranks_per_stage: int):
    """The link between stage ``stage``'s devices and the next stage's: rank r of a stage
    talks to rank r of the next, ``ranks_per_stage`` devices apart."""
    per_node = profile.devices_per_node
    first = stage * ranks_per_stage
    same = all(
        (first + r) // per_node == (first + ranks_per_stage + r) // per_node
        for r in range(ranks_per_stage)
    )
    return profile.intra if same else profile.inter


def estimate_pipeline(
    sg: SearchGraph,
    roots: Mapping[str, MeshSharding],
    mesh: Mesh,
    profile: ClusterProfile,
    *,
    micro_batches: int,
    stages: int,
    stage_of: Callable[[str], int],
    schedule: str = "1f1b",
    zero: Mapping[str, ZeroStage] | None = None,
) -> tuple[Estimate, list[StageCost]]:
    """Price one pipelined plan (see the module doc): its estimate and each stage's."""
    m, p = micro_batches, stages
    slots = m + p - 1
    choices = {name: (s,) for name, s in roots.items()}
    families = [
        ProblemFamily(
            sg, mesh, profile, micro_batches=m, choices=choices, slots=slots, saved_scale=scale
        )
        for scale in (1.0, 0.0)
    ]
    full, bare = (f.problem(zero=zero) for f in families)
    units = sg.units.units
    where = [stage_of(u.root.name) for u in units]
    time = [0.0] * p
    resident = [0.0] * p
    active = [0.0] * p
    for k in range(len(units)):
        s = where[k]
        entry = full.problem.units[k].strategies[0]
        t, mem = entry.time_s, entry.memory_bytes
        base = bare.problem.units[k].strategies[0].memory_bytes
        time[s] += t
        resident[s] += base
        active[s] += mem - base
    for e in full.problem.edges:
        s = max(where[e.src], where[e.dst])
        time[s] += e.time_s[0][0]
        active[s] += e.memory_bytes[0][0]
    constant = 0.0
    if any(pr.zero is ZeroStage.PARAMETERS for ps in full.programs for pr in ps):
        constant += gathered_bound(sg)
        resident[where[0]] -= gathered_bound(sg)  # the problem's copy, on unit 0
    if any(RECOMPUTE_KEY in node.metadata_props for node in sg.graph):
        offered = micro_choices(sg, mesh, m)
        family = ProblemFamily(
            sg, mesh, profile, micro_batches=m,
            choices={name: [c for c, _ in pairs] for name, pairs in offered.items()},
        )  # fmt: skip
        constant += family.working_set().of(full, (0,) * len(units))
    sent = [0.0] * p
    received = [0.0] * p
    sent_time = [0.0] * p
    seen: set[tuple[str, int]] = set()
    for c in sg.units.crossings:
        a, b = where[c.source], where[c.target]
        if a == b or not c.forward or (c.value.name, b) in seen:
            continue
        seen.add((c.value.name, b))
        layout = full.programs[c.source][0].layout(c.source_ref)
        shape = local_shape(static_shape(c.value), layout, full.mesh)
        nbytes = float(np.prod(shape, dtype=np.float64)) * itemsize(c.value)
        directions = [(a, b)]
        if c.value.dtype.is_floating_point() and c.value.name not in sg.data_inputs:
            directions.append((b, a))  # its gradient, back
        for src, dst in directions:
            link = stage_link(profile, min(src, dst), mesh.size)
            sent[src] += nbytes
            sent_time[src] += slots * (link.alpha_s + nbytes / link.bandwidth)
            received[dst] += nbytes
    costs = []
    for s in range(p):
        flight = in_flight(s, m, p) if schedule == "1f1b" else m
        costs.append(
            StageCost(
                time[s] + sent_time[s],
                resident[s] + flight * (active[s] + received[s]) + constant,
                sent_time[s],
                sent[s],
            )
        )
    count = sum(c.times for c in priced_collectives(full, (0,) * len(units)))
    estimate = Estimate(
        max(c.time_s for c in costs),
        max(c.memory_bytes for c in costs),
        count,
        profile.name,
    )
    return estimate, costs
