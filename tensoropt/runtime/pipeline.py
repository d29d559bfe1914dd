"""Run a pipelined step: each stage's micro-batches in its schedule, Send/Recv between.

A pipelined device graph (``passes.stages``) is a micro-batched graph (``runtime.micro``)
of one stage, whose micro phase holds ``Send`` and ``Recv`` nodes (``ai.tensoropt``,
attributes ``peer``: the other device, ``tag``). Here its micro phase becomes two parts:

- **forward**: the forward and loss nodes, the makers of values sent to later stages,
  and what they read (none of which depends on a backward Recv: compile refuses a
  forward crossing made by backward work); its inputs are the graph's and the forward
  Recv values, its outputs the values it sends, the cut values it makes, and the
  *stash*: values the backward part reads;
- **backward**: the rest (gradients, and backward work that needs no gradient, such as a
  weight's transpose, so that the stash holds activations only); its inputs are the
  graph's, the backward Recv values and the stash.

Each part is split at its collectives (``runtime.split``) like any device graph. A step
runs, on every stage, the actions of :func:`schedule` (forward or backward of one
micro-batch): receive the part's Recv values of that micro-batch, run the part, send its
Send values, keep or take the micro-batch's stash, and add its cut values to the step's
sums; then the step phase once, as for any micro-batched step. Every Send is matched by
one Recv of the same tag per micro-batch, in micro-batch order on both sides.

Engines: :class:`PipelineLocalEngine` holds every device and runs each stage's devices in
lockstep, the stages in turn, each action as soon as its Recv values have been sent;
:class:`PipelineMpiEngine` holds one device and uses blocking receives and buffered
non-blocking sends (mpi4py), so no schedule that the local engine can finish deadlocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from tensoropt.errors import TensorOptError
from tensoropt.ir.vocab import ROLE_KEY, Role
from tensoropt.passes.micro import MicroCut
from tensoropt.passes.stages import P2P_OPS, RECV, SEND
from tensoropt.runtime.collectives import CollectiveCall
from tensoropt.runtime.comm import LocalWorld
from tensoropt.runtime.inplace import mark_in_place
from tensoropt.runtime.manifest import Manifest
from tensoropt.runtime.micro import micro_feeds, phase_models, reads_of, sub_model
from tensoropt.runtime.profiling import StepClock
from tensoropt.runtime.program import (
    RankProgram,
    SessionConfig,
    check_collective_order,
    check_lockstep,
    lockstep,
)
from tensoropt.runtime.split import SplitPlan, split_graph

Feeds = Mapping[str, np.ndarray]
FORWARD = "forward"
BACKWARD = "backward"


def schedule(stage: int, stages: int, micro_batches: int, kind: str) -> list[tuple[str, int]]:
    """The actions of ``stage`` in one step, in order: (FORWARD | BACKWARD, micro-batch).

    ``1f1b``: ``min(P - s - 1, m)`` forwards, then alternately one forward and one
    backward, then the remaining backwards, so stage s holds at most ``min(P - s, m)``
    micro-batches' stashes. ``gpipe``: every forward, then every backward."""
    m = micro_batches
    if kind == "gpipe":
        return [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    out = [(FORWARD, i) for i in range(warm)]
    for i in range(m - warm):
        out += [(FORWARD, warm + i), (BACKWARD, i)]
    return out + [(BACKWARD, i) for i in range(m - warm, m)]


@dataclass(frozen=True, slots=True)
class P2P:
    """One Send or Recv of a part: the value, the other device, the message tag."""

    value: str
    peer: int
    tag: int


@dataclass(frozen=True, slots=True, eq=False)
class Part:
    """The forward or backward part of a stage's micro-step."""

    plan: SplitPlan
    recvs: tuple[P2P, ...]
    sends: tuple[P2P, ...]


@dataclass(frozen=True, slots=True, eq=False)
class StagedPlan:
    """One device's pipelined step: its parts, its step phase and its schedule."""

    rank: int
    stage: int
    stages: int
    kind: str
    forward: Part
    backward: Part | None
    step: SplitPlan
    cut: MicroCut  # the cut values this device makes
    micro_dims: Mapping[str, int]
    stash: tuple[str, ...]
    # once per step, after the last micro-batch: step-phase inputs received from other
    # stages, and this stage's sums that other stages' step phases read
    step_recvs: tuple[P2P, ...] = ()
    step_sends: tuple[P2P, ...] = ()

    @property
    def actions(self) -> list[tuple[str, int]]:
        return schedule(self.stage, self.stages, self.cut.batches, self.kind)

    def part(self, kind: str) -> Part | None:
        return self.forward if kind == FORWARD else self.backward

    @property
    def collectives(self) -> tuple[CollectiveCall, ...]:
        """Collectives of a forward part, a backward part, then the step phase (the stage's
        devices issue the same ones, in the same actions)."""
        back = self.backward.plan.collectives if self.backward else ()
        return self.forward.plan.collectives + back + self.step.collectives

    @property
    def num_segments(self) -> int:
        back = self.backward.plan.num_segments if self.backward else 0
        return self.forward.plan.num_segments + back + self.step.num_segments


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


_FORWARD_ROLES = frozenset({Role.FORWARD.value, Role.LOSS.value})


def _role(node: onnx.NodeProto) -> str | None:
    return next((p.value for p in node.metadata_props if p.key == ROLE_KEY), None)


def split_parts(micro: onnx.ModelProto, rank: int, cut: MicroCut):
    """The forward and backward models of a stage's micro graph (see the module doc):
    (forward model, backward model or None, forward recvs, forward sends, backward
    recvs, backward sends, stash)."""
    graph = micro.graph
    types = {vi.name: vi for vi in [*graph.input, *graph.output, *graph.value_info]}
    recvs: list[P2P] = []
    sends: list[P2P] = []
    compute: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain and node.op_type in P2P_OPS:
            a = _attrs(node)
            if node.op_type == RECV:
                recvs.append(P2P(node.output[0], int(a["peer"]), int(a["tag"])))
            elif node.op_type == SEND:
                sends.append(P2P(node.input[0], int(a["peer"]), int(a["tag"])))
            continue
        compute.append(node)
    late = {c.value for c in recvs if c.peer > rank}
    waits = [False] * len(compute)  # depends on a backward Recv: backward part
    for i, node in enumerate(compute):
        if reads_of([node]) & late:
            waits[i] = True
            late.update(node.output)
    # The forward part is what the forward needs: the forward and loss nodes, the values
    # sent to later stages, and what they read; the rest (gradients, a weight's
    # transpose for the backward) waits for the backward, so that a micro-batch's stash
    # holds activations only.
    maker = {v: i for i, node in enumerate(compute) for v in node.output}
    forward_sends = {c.value for c in sends if c.peer > rank}
    needed: set[int] = set()
    todo = [
        i
        for i, node in enumerate(compute)
        if not waits[i] and (_role(node) in _FORWARD_ROLES or forward_sends & set(node.output))
    ]
    while todo:
        i = todo.pop()
        if i in needed:
            continue
        needed.add(i)
        todo += [maker[v] for v in reads_of([compute[i]]) if v in maker]
    forward = [node for i, node in enumerate(compute) if i in needed]
    backward = [node for i, node in enumerate(compute) if i not in needed]
    late.update(v for node in backward for v in node.output)
    f_made = {v for n in forward for v in n.output}
    b_reads = reads_of(backward) | {s.value for s in sends if s.value in late}
    early_recvs = tuple(c for c in recvs if c.peer < rank)
    stash = tuple(
        sorted((f_made | {c.value for c in early_recvs}) & b_reads - {i.name for i in graph.input})
    )
    cut_values = [*cut.accumulate, *cut.keep]
    missing = [v for v in [c.value for c in recvs] + list(stash) if v not in types]
    if missing:
        raise TensorOptError(
            f"rank {rank}: the device graph has no type for {missing}; recompile the model"
        )

    def part(nodes, extra_inputs, made, name):
        reads = reads_of(nodes)
        outs = [s.value for s in sends if s.value in made]
        outs += [v for v in cut_values if v in made]
        if name == FORWARD:
            outs += [v for v in stash if v in made]
        outs = list(dict.fromkeys(outs))
        inputs = [i for i in graph.input if i.name in reads]
        inputs += [types[v] for v in extra_inputs if v in reads]
        return sub_model(micro, nodes, inputs, [types[v] for v in outs], name)

    f_model = part(forward, [c.value for c in early_recvs], f_made, FORWARD)
    f_sends = tuple(s for s in sends if s.value in f_made)
    if not backward:
        return f_model, None, early_recvs, f_sends, (), (), ()
    b_made = {v for n in backward for v in n.output}
    b_recvs = tuple(c for c in recvs if c.peer > rank)
    b_model = part(backward, [c.value for c in b_recvs] + list(stash), b_made, BACKWARD)
    b_sends = tuple(s for s in sends if s.value in b_made)
    return f_model, b_model, early_recvs, f_sends, b_recvs, b_sends, stash


def split_staged(
    manifest: Manifest,
    model: onnx.ModelProto,
    rank: int,
    fed: Iterable[str],
    weights: Mapping[str, np.ndarray],
) -> StagedPlan:
    """Split one device's pipelined graph into its parts and its step phase."""
    assert manifest.micro is not None and manifest.pipeline is not None
    info = manifest.ranks[rank]
    held = set(info.inputs or ())
    fed = {n for n in fed if n in held}
    made = {v for n in model.graph.node if n.op_type not in P2P_OPS for v in n.output}
    whole = manifest.micro
    cut = MicroCut(
        whole.batches,
        tuple(v for v in whole.accumulate if v in made),
        tuple(v for v in whole.keep if v in made),
        whole.index if whole.index in held else None,
    )
    if cut.index:
        fed.add(cut.index)
    micro, step = phase_models(model, cut, rank)
    f_model, b_model, f_recvs, f_sends, b_recvs, b_sends, stash = split_parts(micro, rank, cut)
    world = manifest.world_size
    f_fed = fed | {c.value for c in f_recvs}
    forward = Part(split_graph(f_model, rank, world, f_fed, weights), f_recvs, f_sends)
    backward = None
    if b_model is not None:
        b_fed = fed | {c.value for c in b_recvs} | set(stash)
        backward = Part(split_graph(b_model, rank, world, b_fed, weights), b_recvs, b_sends)
    step, step_recvs, step_sends = _step_p2p(step)
    step_fed = fed | set(cut.accumulate) | set(cut.keep) | {c.value for c in step_recvs}
    step_plan = mark_in_place(
        split_graph(step, rank, world, step_fed, weights), manifest.carry_of(rank)
    )
    dims = {
        i.name: i.micro_dim
        for i in manifest.inputs.values()
        if i.micro_dim is not None and i.name in held
    }
    return StagedPlan(
        rank,
        info.stage,
        int(manifest.pipeline["stages"]),
        str(manifest.pipeline["schedule"]),
        forward,
        backward,
        step_plan,
        cut,
        dims,
        stash,
        step_recvs,
        step_sends,
    )


def _step_p2p(step: onnx.ModelProto):
    """The step graph without its Send/Recv nodes: (graph, recvs, sends). A received
    value becomes an input of the graph."""
    graph = step.graph
    types = {vi.name: vi for vi in [*graph.input, *graph.output, *graph.value_info]}
    recvs, sends, kept = [], [], []
    for node in graph.node:
        if node.domain and node.op_type in P2P_OPS:
            a = _attrs(node)
            if node.op_type == RECV:
                recvs.append(P2P(node.output[0], int(a["peer"]), int(a["tag"])))
            else:
                sends.append(P2P(node.input[0], int(a["peer"]), int(a["tag"])))
            continue
        kept.append(node)
    if not recvs and not sends:
        return step, (), ()
    reads = reads_of(kept)
    inputs = [i for i in graph.input if i.name in reads]
    inputs += [types[c.value] for c in recvs if c.value in reads]
    model = sub_model(step, kept, inputs, list(graph.output), "step")
    return model, tuple(recvs), tuple(sends)


def add_cut(total: dict[str, np.ndarray], outs: Mapping[str, np.ndarray], cut: MicroCut):
    """Add the cut values among ``outs`` into ``total`` (a part makes some of them)."""
    for name in cut.accumulate:
        if name in outs:
            if name in total:
                np.add(total[name], outs[name], out=total[name])
            else:
                total[name] = np.array(outs[name], copy=True)
    for name in cut.keep:
        if name in outs:
            total[name] = outs[name]


def check_stages(plans: Mapping[int, StagedPlan]) -> None:
    """The collective pre-check, per stage: a stage's devices issue the same collectives
    (other stages' collectives are their own)."""
    by_stage: dict[int, dict[int, StagedPlan]] = {}
    for r, p in plans.items():
        by_stage.setdefault(p.stage, {})[r] = p
    for members in by_stage.values():
        check_collective_order({r: p.collectives for r, p in members.items()})


class PipelineLocalEngine:
    """Every device in this process: a stage's devices in lockstep, the stages in turn."""

    def __init__(
        self, plans: Mapping[int, StagedPlan], loss: str, config: SessionConfig | None = None
    ):
        check_stages(plans)
        sessions = sum(p.num_segments for p in plans.values())
        config = (config or SessionConfig()).for_sessions(sessions)
        self._plans = dict(sorted(plans.items()))
        self._loss = loss
        self._world = LocalWorld(len(plans))
        self._stage_ranks: dict[int, list[int]] = {}
        for r, p in self._plans.items():
            self._stage_ranks.setdefault(p.stage, []).append(r)
        self._programs: dict[tuple[str, int], RankProgram] = {}
        for kind in (FORWARD, BACKWARD):
            for ranks in self._stage_ranks.values():
                parts = {r: self._plans[r].part(kind) for r in ranks}
                if any(part is None for part in parts.values()):
                    continue
                check_lockstep({r: part.plan for r, part in parts.items()})  # type: ignore[union-attr]
                for r, part in parts.items():
                    self._programs[(kind, r)] = RankProgram(part.plan, config)  # type: ignore[union-attr]
        for ranks in self._stage_ranks.values():
            check_lockstep({r: self._plans[r].step for r in ranks})
        self._steps = {r: RankProgram(p.step, config) for r, p in self._plans.items()}

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self._plans)

    @property
    def is_root(self) -> bool:
        return True

    def step(self, feeds: Mapping[int, Feeds]) -> dict[int, dict[str, np.ndarray]]:
        pending = {s: self._plans[rs[0]].actions for s, rs in self._stage_ranks.items()}
        mailbox: dict[tuple[int, int, int], np.ndarray] = {}
        stash: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        totals: dict[int, dict[str, np.ndarray]] = {r: {} for r in self._plans}
        while any(pending.values()):
            progressed = False
            for s, ranks in self._stage_ranks.items():
                while pending[s]:
                    kind, i = pending[s][0]
                    ready = self._run(s, ranks, kind, i, feeds, mailbox, stash, totals)
                    if not ready:
                        break
                    pending[s] = pending[s][1:]
                    progressed = True
            if not progressed:
                waiting = {s: a[0] for s, a in pending.items() if a}
                raise TensorOptError(
                    f"the pipeline schedule stalls: stages wait at {waiting} for values no "
                    "stage sends; recompile the model"
                )
        for r, plan in self._plans.items():
            for c in plan.step_sends:
                mailbox[(c.peer, c.tag, -1)] = totals[r][c.value]
        for r, plan in self._plans.items():
            totals[r].update((c.value, mailbox.pop((r, c.tag, -1))) for c in plan.step_recvs)
        outs: dict[int, dict[str, np.ndarray]] = {}
        for ranks in self._stage_ranks.values():
            step_feeds = {r: {**self._rest(r, feeds[r]), **totals[r]} for r in ranks}
            outs.update(
                lockstep(
                    self._world, {r: self._steps[r] for r in ranks}, step_feeds, self._add_comm
                )
            )
        loss = next(o[self._loss] for o in outs.values() if self._loss in o)
        for o in outs.values():
            o[self._loss] = loss
        return outs

    def _rest(self, r: int, feeds: Feeds) -> dict[str, np.ndarray]:
        dims = self._plans[r].micro_dims
        return {n: v for n, v in feeds.items() if n not in dims}

    def _run(self, s, ranks, kind, i, feeds, mailbox, stash, totals) -> bool:
        """Run action (kind, i) on stage ``s`` if its Recv values are there."""
        parts = {r: self._plans[r].part(kind) for r in ranks}
        if any(p is None for p in parts.values()):
            return True
        if not all((r, c.tag, i) in mailbox for r, p in parts.items() for c in p.recvs):  # type: ignore[union-attr]
            return False
        inputs = {}
        for r, part in parts.items():
            plan = self._plans[r]
            f = micro_feeds(feeds[r], plan.cut, plan.micro_dims, i)
            f.update((c.value, mailbox.pop((r, c.tag, i))) for c in part.recvs)  # type: ignore[union-attr]
            if kind == BACKWARD:
                f.update(stash.pop((r, i)))
            inputs[r] = f
        outs = lockstep(
            self._world, {r: self._programs[(kind, r)] for r in ranks}, inputs, self._add_comm
        )
        for r, part in parts.items():
            plan = self._plans[r]
            for c in part.sends:  # type: ignore[union-attr]
                mailbox[(c.peer, c.tag, i)] = outs[r][c.value]
            if kind == FORWARD and plan.backward is not None:
                stash[(r, i)] = {n: outs[r].get(n, inputs[r].get(n)) for n in plan.stash}
            add_cut(totals[r], outs[r], plan.cut)
        return True

    def gather(self, per_rank: Mapping[int, Any]) -> dict[int, Any] | None:
        return dict(per_rank)

    def barrier(self) -> None:
        """Every device is in this process and each call covers them all."""

    def enable_profiling(self) -> dict[int, StepClock]:
        clocks = {r: StepClock() for r in self._plans}
        for (_, r), program in self._programs.items():
            program.clock = clocks[r]
        for r, program in self._steps.items():
            program.clock = clocks[r]
        return clocks

    def _add_comm(self, seconds: float) -> None:
        """A batch of collectives, run in lockstep: it counts for every device's clock
        (as the local engine of unpipelined steps counts it)."""
        for program in self._steps.values():
            if program.clock is not None:
                program.clock.add_comm(seconds)


class PipelineMpiEngine:
    """This process's single device of a pipelined step."""

    def __init__(
        self,
        plan: StagedPlan,
        loss: str,
        loss_rank: int,
        comm: Any = None,
        config: SessionConfig | None = None,
    ):
        from tensoropt.runtime.mpi_comm import MpiCommunicator

        self.comm = MpiCommunicator(comm)
        world = self.comm.world
        stages = world.allgather((plan.stage, plan.collectives))
        mine = {r: calls for r, (s, calls) in enumerate(stages) if s == plan.stage}
        check_collective_order(mine)
        self.comm.prepare({c.group for _, calls in stages for c in calls})
        self._p2p = world.Dup()  # messages between stages never meet the collectives'
        config = (config or SessionConfig()).for_sessions(plan.num_segments)
        self._plan = plan
        self._loss = loss
        self._loss_rank = loss_rank
        self._parts = {FORWARD: RankProgram(plan.forward.plan, config)}
        if plan.backward is not None:
            self._parts[BACKWARD] = RankProgram(plan.backward.plan, config)
        self._step = RankProgram(plan.step, config)

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.comm.rank,)

    @property
    def is_root(self) -> bool:
        return self.comm.rank == 0

    def step(self, feeds: Mapping[int, Feeds]) -> dict[int, dict[str, np.ndarray]]:
        from mpi4py import MPI

        plan = self._plan
        rank = self.comm.rank
        mine = feeds[rank]
        total: dict[str, np.ndarray] = {}
        stash: dict[int, dict[str, np.ndarray]] = {}
        sent: list[Any] = []
        for kind, i in plan.actions:
            self._act(kind, i, mine, total, stash, sent)
        for c in plan.step_sends:
            sent.append(self._p2p.isend(total[c.value], dest=c.peer, tag=c.tag))
        for c in plan.step_recvs:
            total[c.value] = self._p2p.recv(source=c.peer, tag=c.tag)
        MPI.Request.waitall(sent)
        rest = {n: v for n, v in mine.items() if n not in plan.micro_dims}
        out = self._step.run({**rest, **total}, self.comm)
        out[self._loss] = self.comm.world.bcast(out.get(self._loss), root=self._loss_rank)
        return {rank: out}

    def _act(self, kind: str, i: int, mine: Feeds, total, stash, sent: list) -> None:
        """Run action (kind, i): its feeds and outputs live only here, so that a
        backward's micro-batch gradients (summed into ``total``) are gone before the next
        action makes its activations."""
        plan = self._plan
        part = plan.part(kind)
        if part is None:
            return
        f = micro_feeds(mine, plan.cut, plan.micro_dims, i)
        for c in part.recvs:
            f[c.value] = self._p2p.recv(source=c.peer, tag=c.tag)
        if kind == BACKWARD:
            f.update(stash.pop(i))
        outs = self._parts[kind].run(f, self.comm)
        for c in part.sends:
            sent.append(self._p2p.isend(outs[c.value], dest=c.peer, tag=c.tag))
        if kind == FORWARD and plan.backward is not None:
            stash[i] = {n: outs.get(n, f.get(n)) for n in plan.stash}
        add_cut(total, outs, plan.cut)

    def enable_profiling(self) -> dict[int, StepClock]:
        clock = StepClock()
        for program in (*self._parts.values(), self._step):
            program.clock = clock
        return {self.comm.rank: clock}

    def gather(self, per_rank: Mapping[int, Any]) -> dict[int, Any] | None:
        gathered = self.comm.world.gather(per_rank[self.comm.rank], root=0)
        return dict(enumerate(gathered)) if gathered is not None else None

    def barrier(self) -> None:
        self.comm.barrier()
