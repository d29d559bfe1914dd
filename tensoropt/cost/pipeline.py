"""Pricing of pipelined plans (``Plan.stages``): 1F1B or GPipe over unit entries.

A pipelined plan is a micro-batched plan (m micro-batches) on one stage's mesh whose
forward is cut into P stages at block starts (``passes.stages``). The model is cut at
*every* block start into segments (segment i: the units from block i's first node up to
block i + 1's); a stage is a run of consecutive segments, so every quantity below is a
sum over segments, and a stage's price is a difference of prefix sums.

Per unit (and per edge, on the segment of its later unit), under the plan's strategy:

- ``a``: per-micro-batch time (compute, collectives issued per micro-batch), and ``b``:
  per-step time (gradient synchronisation, update, accumulation). The micro-batched
  problem prices ``m * a + b``; the problem with one more micro-batch slot prices
  ``(m + 1) * a + b`` (``ProblemFamily(slots=...)``), which gives both exactly.
- ``act``: activation bytes of one micro-batch (saved outputs, forward conversion
  buffers), and ``base``: everything else (parameters, gradients, state, accumulation
  buffers): the problem priced without activations (``saved_scale`` 0) gives ``base``.

A cut before segment j sends, per micro-batch, every forward value made before j and
read at or after j (``fwd_bytes[j]``, ``fwd_count[j]`` messages), and receives back the
gradients of its floating-point ones (``bwd_bytes[j]``). For stage s over segments
[i, j) with ``slots = m + P - 1``:

    tau_s = slots * (A + send(fwd, j) + send(bwd, i)) + B
    mem_s = BASE + (in_flight(s) + 1) * (ACT + fwd_bytes[i]) + constants

``send`` is ``count * alpha + bytes / bandwidth`` on the link between the two stages'
devices (``stage_link``), in_flight(s) is ``min(P - s, m)`` under 1F1B and m under GPipe,
the one more is the backward part's working set (``held_micro_batches``; none for P = 1),
and the constants are the bounds every stage holds (ZeRO-3's gathered parameters, the
recompute working set). The step is ``max tau_s``, the memory per device ``max mem_s``
(docs/design/pipeline.md). A value read by several later stages is priced once per cut it
crosses, on the stage before the cut; compile sends it straight from its maker to each
reader stage, so such values (rare: a transformer's stream is read by the next block
only) are charged to a different stage than the one that sends them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tensoropt.cost.cluster import ClusterProfile, Link
from tensoropt.cost.model import (
    RECOMPUTE_KEY,
    Estimate,
    MeshProblem,
    ProblemFamily,
    SearchGraph,
    gathered_bound,
    itemsize,
    micro_choices,
    priced_collectives,
    split_offer,
)
from tensoropt.ir.builder import static_shape
from tensoropt.ir.layout import local_shape
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.passes.units import Crossing
from tensoropt.rules.sharding import MeshSharding


def stage_time(per_micro: float, per_step: float, micro_batches: int, stages: int) -> float:
    """tau_s of a stage: ``per_micro`` (f + b + x) per micro-batch slot, over m + P - 1
    slots, plus its once-per-step work."""
    return (micro_batches + stages - 1) * per_micro + per_step


def in_flight(stage: int, micro_batches: int, stages: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations stage ``stage`` (0 = first) holds at once: under
    1F1B at most ``min(P - s, m)``, under GPipe all m."""
    if schedule == "gpipe":
        return micro_batches
    return min(stages - stage, micro_batches)


def held_micro_batches(stage: int, micro_batches: int, stages: int, schedule: str) -> int:
    """Micro-batches' worth of activations stage ``stage`` is priced to hold at its peak:
    those in flight, plus one for the backward part's own working set when the plan has
    stages (P > 1). A stage runs a micro-batch's backward as one session fed its whole
    stash, so the stash stays while that backward makes its gradients, each of them the
    size of an activation of the same micro-batch; a one-session step frees each
    activation after its last use instead, so a plan of one stage (the micro-batched
    plan) holds no such extra. Measured on ResNet-50 small, 2 stages: the first stage's
    excess over the stashes in flight was 0.9 and 1.4 micro-batches' activations (2 and
    4 micro-batches); docs/design/pipeline.md."""
    return in_flight(stage, micro_batches, stages, schedule) + (1 if stages > 1 else 0)


def stage_link(profile: ClusterProfile, stage: int, ranks_per_stage: int) -> Link:
    """The link between stage ``stage``'s devices and the next stage's: rank r of a stage
    talks to rank r of the next, ``ranks_per_stage`` devices apart. Every such pair
    shares a node exactly when the two stages' ranks all do: a node boundary anywhere
    among them falls between some rank and its partner."""
    per_node = profile.devices_per_node
    first = stage * ranks_per_stage
    same = first // per_node == (first + 2 * ranks_per_stage - 1) // per_node
    return profile.intra if same else profile.inter


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage's share of a pipelined step."""

    segments: tuple[int, int]  # [first, end) segment
    time_s: float
    memory_bytes: float
    p2p_s: float  # of time_s: its sends per step
    p2p_bytes: float  # sent per micro-batch (activations forward, gradients back)
    collectives: int = 0  # issued per step by each of its devices (point-to-point aside)


@dataclass(frozen=True, slots=True)
class PipelineTerms:
    """The per-segment sums of one intra-op plan (see the module doc): prefix sums over
    segments, and the bytes each cut sends. Prices any cut of the plan into stages."""

    mesh: Mesh
    profile: ClusterProfile
    micro_batches: int
    a: np.ndarray  # prefix sums over segments, length segments + 1
    b: np.ndarray
    base: np.ndarray
    act: np.ndarray
    fwd_bytes: np.ndarray  # per cut position j (0..segments): sent across it per micro-batch
    fwd_count: np.ndarray
    bwd_bytes: np.ndarray
    bwd_count: np.ndarray
    constant: float
    # prefix sums over segments of the collectives a device issues per step (zeros when
    # not counted: SegmentTables.terms); a stage's devices issue those of its segments
    collectives: np.ndarray

    @property
    def segments(self) -> int:
        return len(self.a) - 1

    def stage(self, i: int, j: int, s: int, stages: int, schedule: str) -> StageCost:
        """Stage ``s`` of ``stages`` over segments [i, j)."""
        m = self.micro_batches
        slots = m + stages - 1
        n = self.mesh.size
        p2p = 0.0
        sent = 0.0
        if j < self.segments:  # its activations, forward
            link = stage_link(self.profile, s, n)
            p2p += self.fwd_count[j] * link.alpha_s + self.fwd_bytes[j] / link.bandwidth
            sent += self.fwd_bytes[j]
        if i > 0:  # the gradients of what it received, back
            link = stage_link(self.profile, s - 1, n)
            p2p += self.bwd_count[i] * link.alpha_s + self.bwd_bytes[i] / link.bandwidth
            sent += self.bwd_bytes[i]
        per_micro = self.a[j] - self.a[i] + p2p
        time_s = stage_time(per_micro, self.b[j] - self.b[i], m, stages)
        held = self.act[j] - self.act[i] + (self.fwd_bytes[i] if i > 0 else 0.0)
        memory = (
            self.base[j]
            - self.base[i]
            + held_micro_batches(s, m, stages, schedule) * held
            + self.constant
        )
        count = int(self.collectives[j] - self.collectives[i])
        return StageCost((i, j), time_s, memory, slots * p2p, sent, count)

    def price(self, cuts: Sequence[int], schedule: str) -> tuple[Estimate, list[StageCost]]:
        """The plan cut at segment positions ``cuts`` (0 = c_0 < ... < c_P = segments)."""
        stages = len(cuts) - 1
        costs = [self.stage(cuts[s], cuts[s + 1], s, stages, schedule) for s in range(stages)]
        estimate = Estimate(
            max(c.time_s for c in costs),
            max(c.memory_bytes for c in costs),
            max(c.collectives for c in costs),  # the busiest stage's devices
            self.profile.name,
        )
        return estimate, costs


def split_entries(t_plain, t_more, mem, mem_bare, micro_batches: int):
    """One entry's (a, b, base, act) of the module doc (arrays, per strategy or strategy
    pair): from its time in the micro-batched problem and with one more slot, and its
    memory with and without activations."""
    a = np.asarray(t_more) - np.asarray(t_plain)
    base = np.asarray(mem_bare)
    return a, np.asarray(t_plain) - micro_batches * a, base, np.asarray(mem) - base


def split_flat(plain: MeshProblem, more: MeshProblem, bare: MeshProblem):
    """The (a, b, base, act) of :func:`split_entries` of every unit's strategies and every
    edge's strategy pairs (row-major) of one family's micro-batched problem, the problem
    with one more slot and the problem without activations, as four flat arrays (units
    first, then edges, in their problems' order), with each entry's size and each edge's
    columns: one split for all entries, the same floats as one per entry."""
    units = (plain.problem.units, more.problem.units, bare.problem.units)
    edges = (plain.problem.edges, more.problem.edges, bare.problem.edges)
    # repeated layers share their strategy tuples and edge tables: each distinct one is
    # converted once (by identity: the problems hold them while this runs)
    tables: dict[int, np.ndarray] = {}
    rows: dict[tuple[int, str], np.ndarray] = {}

    def table(values) -> np.ndarray:
        found = tables.get(id(values))
        if found is None:
            found = tables[id(values)] = np.asarray(values, dtype=np.float64)
        return found

    def flat(problems, edge_rows, field) -> np.ndarray:
        parts = []
        for u in problems:
            found = rows.get((id(u.strategies), field))
            if found is None:
                found = np.asarray([getattr(s, field) for s in u.strategies], dtype=np.float64)
                rows[(id(u.strategies), field)] = found
            parts.append(found)
        parts += [table(getattr(e, field)).ravel() for e in edge_rows]
        return np.concatenate(parts)

    sizes = [len(u.strategies) for u in units[0]]
    shapes = [table(e.time_s).shape for e in edges[0]]
    edge_cols = [shape[1] for shape in shapes]
    sizes += [shape[0] * shape[1] for shape in shapes]

    t_plain = flat(units[0], edges[0], "time_s")
    t_more = flat(units[1], edges[1], "time_s")
    mem = flat(units[0], edges[0], "memory_bytes")
    mem_bare = flat(units[2], edges[2], "memory_bytes")
    return split_entries(t_plain, t_more, mem, mem_bare, plain.micro_batches), sizes, edge_cols


def _prefix(values: Sequence[float]) -> np.ndarray:
    out = np.zeros(len(values) + 1)
    np.cumsum(values, out=out[1:])
    return out


class SegmentTables:
    """Per unit and strategy (and per edge and strategy pair), the terms of the module
    doc, from three problems of one family's units and strategies: ``plain`` (the
    micro-batched problem), ``more`` (one more micro-batch slot) and ``bare`` (no
    activations). :meth:`terms` sums them for one choice."""

    def __init__(
        self,
        sg: SearchGraph,
        plain: MeshProblem,
        more: MeshProblem,
        bare: MeshProblem,
        segment_of: Sequence[int],
        segments: int,
        profile: ClusterProfile,
        mesh: Mesh,
    ):
        self.sg, self.plain, self.profile, self.mesh = sg, plain, profile, mesh
        self.more, self.bare = more, bare
        self.segment_of = list(segment_of)
        self.segments = segments
        m = plain.micro_batches
        self.m = m

        flat, sizes, edge_cols = split_flat(plain, more, bare)
        self._flat = list(flat)  # (a, b, base, act), units first, then edges
        self.starts = np.cumsum([0, *sizes], dtype=np.int64)[:-1]  # each entry's first
        units = len(plain.problem.units)
        self._unit_offsets = self.starts[:units]
        self._edge_offsets = self.starts[units:]
        edges = plain.problem.edges
        self._edge_src = np.array([e.src for e in edges], dtype=np.int64)
        self._edge_dst = np.array([e.dst for e in edges], dtype=np.int64)
        self._edge_cols = np.asarray(edge_cols, dtype=np.int64)
        edge_segments = [max(self.segment_of[e.src], self.segment_of[e.dst]) for e in edges]
        self._bins = np.array(list(self.segment_of) + edge_segments, dtype=np.int64)
        self._traffic: _CutTraffic | None = None  # made on the first terms()
        # unit 0 holds the problem's constants (ZeRO-3's gathered bound): every stage does
        self.gathered = 0.0
        if any(pr.zero is ZeroStage.PARAMETERS for ps in plain.programs for pr in ps):
            self.gathered = gathered_bound(sg)

    def entries(self) -> tuple[list[np.ndarray], np.ndarray]:
        """The flat (a, b, base, act) of every unit's strategies and edge's strategy pairs
        (:func:`split_flat`) and each entry's first index."""
        return self._flat, self.starts

    def terms(
        self, choice: Sequence[int], working_set: float = 0.0, count: bool = False
    ) -> PipelineTerms:
        """The :class:`PipelineTerms` of one choice; ``working_set``: the recompute
        working-set bound of the choice (``ProblemFamily.working_set_of``), held by every
        stage.
        ``count``: count its collectives per step (what compile reports; the search
        does not need them, and counting costs more than pricing)."""
        n = self.segments
        pick = np.asarray(choice, dtype=np.int64)
        at = np.concatenate(
            [
                self._unit_offsets + pick,
                self._edge_offsets + pick[self._edge_src] * self._edge_cols + pick[self._edge_dst],
            ]
        )
        a, b, base, act = (
            np.bincount(self._bins, weights=flat[at], minlength=n) for flat in self._flat
        )
        base[self.segment_of[0]] -= self.gathered
        if self._traffic is None:
            self._traffic = _CutTraffic(self.plain, cut_spans(self.sg, self.segment_of), n)
        fwd_bytes, fwd_count, bwd_bytes, bwd_count = self._traffic(pick)
        collectives = np.zeros(n, dtype=np.int64)
        if count:
            for c in priced_collectives(self.plain, choice):
                collectives[self.segment_of[c.unit]] += c.times
        return PipelineTerms(
            self.mesh,
            self.profile,
            self.m,
            _prefix(a),
            _prefix(b),
            _prefix(base),
            _prefix(act),
            fwd_bytes,
            fwd_count,
            bwd_bytes,
            bwd_count,
            self.gathered + working_set,
            _prefix(collectives),
        )


def plan_terms(
    sg: SearchGraph,
    roots: Mapping[str, MeshSharding],
    mesh: Mesh,
    profile: ClusterProfile,
    *,
    micro_batches: int,
    segment_of: Sequence[int],
    segments: int,
    zero: Mapping[str, ZeroStage] | None = None,
) -> PipelineTerms:
    """The :class:`PipelineTerms` of one plan: ``roots`` (micro-mesh strategies, as
    ``passes.micro.micro_roots`` gives them) on ``mesh`` with ``micro_batches``;
    ``segment_of[k]``: the segment of unit k (``passes.stages.unit_stages`` with every
    block start as a cut). Priced as the search prices its pipelined points."""
    m = micro_batches
    choices = {name: (s,) for name, s in roots.items()}

    def problem(slots: int, scale: float) -> MeshProblem:
        family = ProblemFamily(
            sg, mesh, profile, micro_batches=m, choices=choices, slots=slots, saved_scale=scale
        )
        return family.problem(zero=zero)

    plain = problem(m, 1.0)
    tables = SegmentTables(
        sg, plain, problem(m + 1, 1.0), problem(m, 0.0), segment_of, segments, profile, mesh
    )
    choice = (0,) * len(plain.units)
    working_set = 0.0
    if any(RECOMPUTE_KEY in node.metadata_props for node in sg.graph):
        choices, _ = split_offer(micro_choices(sg, mesh, m))
        family = ProblemFamily(sg, mesh, profile, micro_batches=m, choices=choices)
        working_set = family.working_set_of(plain, choice)
    return tables.terms(choice, working_set, count=True)


def cut_spans(sg: SearchGraph, segment_of: Sequence[int]) -> list[tuple[int, int, Crossing, bool]]:
    """The forward values that cross a segment boundary: per value, (segment made, last
    segment that reads it, its first such crossing, whether its gradient goes back: a
    floating-point value that is not data)."""
    span: dict[str, tuple[int, int, Crossing, bool]] = {}
    for c in sg.units.crossings:
        made, read = segment_of[c.source], segment_of[c.target]
        if read <= made or not c.forward:
            continue
        name = c.value.name
        found = span.get(name)
        if found is not None:
            span[name] = (found[0], max(found[1], read), found[2], found[3])
            continue
        grad = c.value.dtype.is_floating_point() and name not in sg.data_inputs
        span[name] = (made, read, c, grad)
    return list(span.values())


class _CutTraffic:
    """Per cut position, the bytes and messages of the forward values that cross it per
    micro-batch and of their gradients (``spans``: :func:`cut_spans`), for any choice of
    one problem ``mp``. The messages are the same for every choice; a value's bytes are
    its local bytes under its source unit's strategy, found once per (value, strategy).
    Byte counts are integers, so the sums are exact in any order."""

    def __init__(self, mp: MeshProblem, spans: Sequence[tuple[int, int, Crossing, bool]], n: int):
        self.mp, self.spans, self.n = mp, list(spans), n
        self.first = np.array([made + 1 for made, _, _, _ in spans], dtype=np.int64)
        self.stop = np.array([last + 1 for _, last, _, _ in spans], dtype=np.int64)
        # 1 where the gradient goes back, else 0 (exact)
        self.back = np.array([1.0 if g else 0.0 for *_, g in spans], dtype=np.float64)
        self.source = np.array([c.source for _, _, c, _ in spans], dtype=np.int64)
        sizes = [len(mp.programs[c.source]) for _, _, c, _ in spans]
        self.offsets = np.cumsum([0, *sizes], dtype=np.int64)[:-1]
        self.table = np.full(sum(sizes), np.nan)  # per (value, strategy): local bytes
        self.fwd_count = self._spread(np.ones(len(self.spans)))
        self.bwd_count = self._spread(self.back)

    def _spread(self, weights: np.ndarray) -> np.ndarray:
        # +w at the first position a value crosses, -w after its last: a running sum
        diff = np.bincount(self.first, weights, minlength=self.n + 2)
        diff -= np.bincount(self.stop, weights, minlength=self.n + 2)
        return np.cumsum(diff)[: self.n + 1]

    def __call__(self, choice: np.ndarray):
        """(forward bytes, forward messages, backward bytes, backward messages) per cut
        position of the plan ``choice`` (a strategy index per unit)."""
        at = self.offsets + choice[self.source]
        nbytes = self.table[at]
        for i in np.flatnonzero(np.isnan(nbytes)).tolist():
            c = self.spans[i][2]
            layout = self.mp.programs[c.source][int(choice[c.source])].layout(c.source_ref)
            shape = local_shape(static_shape(c.value), layout, self.mp.mesh)
            nbytes[i] = float(np.prod(shape, dtype=np.float64)) * itemsize(c.value)
            self.table[at[i]] = nbytes[i]
        return (
            self._spread(nbytes),
            self.fwd_count.copy(),
            self._spread(nbytes * self.back),
            self.bwd_count.copy(),
        )
