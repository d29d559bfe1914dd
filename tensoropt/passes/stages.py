"""Pipeline stages in the compiled step (``Plan.stages``): stage templates with Send/Recv.

A pipelined plan runs P stages, each on a sub-mesh of its own with the plan's mesh shape;
device ``g`` is rank ``r = g mod n`` of stage ``s = g // n`` (n = mesh.size). The step is
partitioned on the plan's mesh as any micro-batched plan is (annotate, conversions,
micro-batch cut, localize), which gives one rank-independent local template; this module
then cuts that template into one template per stage:

- **Stage of a node.** The forward's units, in the order their forward nodes appear, are
  cut at the first node of each start block (``recompute.find_blocks`` names blocks):
  units before the first start are stage 0, and so on. Every other node of the step
  (backward, conversions, optimizer) carries the unit it belongs to (``tensoropt.unit``)
  and takes that unit's stage; loss nodes, whose units are not forward nodes, are on the
  last stage. A node without a unit takes the latest stage of the values it reads.
- **Free nodes** (reading no parameter and nothing a stage made: Adam's step counter and
  bias corrections, constants, masks of the data) run on every stage that reads them.
  A backward ``Add``/``Sum`` whose inputs all come from one later stage runs there, so
  one gradient crosses back instead of each part.
- **Crossings.** A value made on stage a and read on stage b != a is sent once per
  micro-batch: a ``Send`` node (``ai.tensoropt``; attributes ``peer`` and ``tag``) after
  its producer on stage a, a ``Recv`` node that makes the value before its first reader
  on stage b. Forward crossings (a < b) carry activations, backward ones gradients. A
  micro-batch sum that stage b's step phase reads (a tied parameter's gradient part) is
  sent once per step instead. Rank r of one stage talks to rank r of the other: both
  stages use the same template, so the value has the same local shape on both.
- **Refused** (:class:`~tensoropt.errors.PlanError`, naming the value): a parameter or
  optimizer state read on two stages (its update would need both stages' gradients); a
  value the step phase makes that another stage reads (gradient synchronisation and
  update stay inside a stage); a forward crossing made by backward work (a stage's
  forward of one micro-batch would wait for its own backward: 1F1B would deadlock).

Lowering for a rank runs on a stage template unchanged; :func:`globalize` then renames
the sub-mesh ranks of every collective group, and the peer stage of every Send/Recv, to
device numbers. The runtime (``runtime.pipeline``) splits each stage's micro phase into
its forward and backward parts and runs them per micro-batch in the schedule's order.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import onnx
import onnx_ir as ir
from onnx import helper

from tensoropt.errors import PlanError
from tensoropt.ir.plan import Plan
from tensoropt.ir.vocab import COLLECTIVE_DOMAIN, ROLE_KEY, UNIT_KEY, Role
from tensoropt.passes.micro import MICRO_KEY, PHASE_KEY, MicroCut, Phase
from tensoropt.passes.partition import LocalTemplate
from tensoropt.passes.recompute import Block, find_blocks

STAGE_KEY = "tensoropt.stage"
"""Node metadata of a stage template: the node's pipeline stage."""
PIPELINE_KEY = "tensoropt.pipeline"
"""Model metadata of a stage template: its :class:`StageInfo` as JSON."""
SEND = "Send"
RECV = "Recv"
P2P_OPS = frozenset({SEND, RECV})
"""Point-to-point op types of the ``ai.tensoropt`` domain (not collectives: no group)."""


@dataclass(frozen=True, slots=True)
class Crossing:
    """A value made on stage ``source`` and read on stage ``target``, once per
    micro-batch; ``tag`` tells its messages apart from other crossings'."""

    value: str
    source: int
    target: int
    tag: int
    # once per step: a micro-batch sum (or kept value) that the target's step phase
    # reads, sent after the last micro-batch (a tied parameter's gradient part)
    step: bool = False

    @property
    def forward(self) -> bool:
        return self.target > self.source and not self.step


@dataclass(frozen=True, slots=True)
class StageInfo:
    """What the runtime and the manifest need to know of one stage."""

    stage: int
    stages: int
    schedule: str
    micro_batches: int
    ranks_per_stage: int
    starts: tuple[str, ...]

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"starts": list(self.starts)}


def even_starts(blocks: Sequence[Block], stages: int) -> tuple[str, ...]:
    """Start blocks that give ``stages`` stages of as equal a block count as possible."""
    if stages < 1:
        raise PlanError(f"--stages {stages}: expected an integer >= 1")
    if stages > len(blocks):
        raise PlanError(
            f"--stages {stages}: the model has {len(blocks)} blocks to cut between "
            f"stages; use at most {len(blocks)} stages"
        )
    return tuple(blocks[(i * len(blocks)) // stages].name for i in range(1, stages))


def _meta(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def unit_stages(
    forward_units: Sequence[str], starts: Sequence[str], blocks: Sequence[Block]
) -> Callable[[str], int]:
    """unit name -> its stage: ``forward_units`` are the units of the forward's nodes in
    graph order, cut at the first node of each start block; a unit that is not a
    forward unit (the loss) is on the last stage."""
    by_name = {b.name: b for b in blocks}
    unknown = [s for s in starts if s not in by_name]
    if unknown:
        names = ", ".join(b.name for b in blocks) or "none"
        raise PlanError(
            f"plan pipeline.starts: {unknown} are not blocks of this model (blocks: {names})"
        )
    position: dict[str, int] = {}
    for unit in forward_units:
        position.setdefault(unit, len(position))
    cuts = []
    for name in starts:
        first = by_name[name].nodes[0]
        if first not in position:
            raise AssertionError(f"block {name}'s first node {first!r} is not a forward unit")
        cuts.append(position[first])
    if sorted(cuts) != cuts or 0 in cuts:
        raise PlanError(
            f"plan pipeline.starts {list(starts)}: list blocks in forward order, after block_0"
        )
    last = len(starts)

    def stage_of(unit: str) -> int:
        where = position.get(unit)
        return last if where is None else bisect.bisect_right(cuts, where)

    return stage_of


@dataclass(frozen=True, slots=True)
class Segments:
    """A training step cut at every block start (``cost.pipeline``'s segments): the
    segment of each unit, and the cut positions of a plan's start blocks."""

    blocks: tuple[Block, ...]
    segment_of: Callable[[str], int]
    # cut positions (a stage starting at that segment) that would put the readers of
    # one parameter on two stages, which compile refuses (:func:`_check_state`): a
    # parameter tied across blocks (an exporter that folds equal initializers into one)
    tied: frozenset[int] = frozenset()

    @property
    def count(self) -> int:
        return len(self.blocks)

    def cuts(self, starts: Sequence[str]) -> list[int]:
        """0, the segment index of each start block, and the segment count."""
        index = {b.name: i for i, b in enumerate(self.blocks)}
        unknown = [s for s in starts if s not in index]
        if unknown:
            names = ", ".join(b.name for b in self.blocks) or "none"
            raise PlanError(
                f"plan pipeline.starts: {unknown} are not blocks of this model (blocks: {names})"
            )
        return [0, *(index[s] for s in starts), self.count]


def step_segments(
    graph: ir.Graph, data_inputs: Sequence[str], params: Collection[str] = ()
) -> Segments:
    """The :class:`Segments` of a training step (before partitioning); ``params``: the
    trained parameters, whose tied readers :attr:`Segments.tied` keeps in one stage."""
    blocks = find_blocks(graph, data_inputs)
    forward = [
        node.metadata_props.get(UNIT_KEY, node.name)
        for node in graph
        if node.metadata_props.get(ROLE_KEY) == Role.FORWARD.value
    ]
    segment_of = unit_stages(forward, [b.name for b in blocks[1:]], blocks)
    return Segments(tuple(blocks), segment_of, _tied_cuts(graph, set(params), segment_of))


def _tied_cuts(
    graph: ir.Graph, params: set[str], segment_of: Callable[[str], int]
) -> frozenset[int]:
    """The cut positions between the first and the last segment that reads a parameter.
    Its forward readers count: its backward and update nodes carry their units, so
    compile places every node that reads it on the stages of these."""
    spans: dict[str, tuple[int, int]] = {}
    for node in graph:
        if node.metadata_props.get(ROLE_KEY) != Role.FORWARD.value:
            continue
        segment = segment_of(node.metadata_props.get(UNIT_KEY, node.name))
        for value in node.inputs:
            if value is not None and value.name in params:
                lo, hi = spans.get(value.name, (segment, segment))
                spans[value.name] = (min(lo, segment), max(hi, segment))
    return frozenset(c for lo, hi in spans.values() for c in range(lo + 1, hi + 1))


def stage_of_nodes(
    graph: onnx.GraphProto,
    starts: Sequence[str],
    blocks: Sequence[Block],
    params: set[str],
) -> list[tuple[int, ...]]:
    """The stages of every node of a local template (see the module doc): one stage per
    node, except *free* nodes (which read no parameter and nothing a stage made, such as
    Adam's step counter and its bias corrections), which run on every stage that reads
    them (every stage when they make a graph output)."""
    forward = []
    for node in graph.node:
        meta = _meta(node)
        if meta.get(ROLE_KEY) == Role.FORWARD.value:
            forward.append(meta.get(UNIT_KEY, node.name))
    stage_of = unit_stages(forward, starts, blocks)
    last = len(starts)
    every = tuple(range(last + 1))
    free_values = {i.name for i in graph.input if i.name not in params}
    free_values |= {t.name for t in graph.initializer if t.name not in params}
    made: dict[str, int] = {}
    out: list[tuple[int, ...] | None] = []
    for node in graph.node:
        if all(v in free_values for v in node.input if v):
            free_values.update(node.output)
            out.append(None)  # decided below, from its readers
            continue
        unit = _meta(node).get(UNIT_KEY)
        if unit is not None:
            stage = stage_of(unit)
        else:
            stage = max((made.get(v, 0) for v in node.input if v), default=0)
        sources = {made[v] for v in node.input if v in made}
        if node.op_type in _SUMS and len(sources) == 1 and _is_backward(node):
            # a gradient's parts made on one later stage are summed there: one value
            # crosses back instead of each part
            stage = max(stage, *sources)
        out.append((stage,))
        made.update((v, stage) for v in node.output)
    outputs = {o.name for o in graph.output}
    readers: dict[str, set[int]] = {}
    for i in range(len(graph.node) - 1, -1, -1):
        node = graph.node[i]
        if out[i] is None:
            where = set(every) if outputs & set(node.output) else set()
            for v in node.output:
                where |= readers.get(v, set())
            out[i] = tuple(sorted(where)) or (last,)
        for v in node.input:
            readers.setdefault(v, set()).update(out[i])  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


_SUMS = frozenset({"Add", "Sum"})


def _is_backward(node: onnx.NodeProto) -> bool:
    return _meta(node).get(ROLE_KEY) == Role.BACKWARD.value


def _crossings(graph: onnx.GraphProto, stages: list[tuple[int, ...]]) -> list[Crossing]:
    """Every (value, source stage, target stage) a stage template must send."""
    made: dict[str, tuple[tuple[int, ...], onnx.NodeProto]] = {}
    for node, where in zip(graph.node, stages, strict=True):
        made.update((v, (where, node)) for v in node.output)
    found: dict[tuple[str, int], tuple[int, bool]] = {}
    for node, where in zip(graph.node, stages, strict=True):
        for s in where:
            for v in node.input:
                if v not in made or s in made[v][0]:
                    continue
                (source,), producer = made[v]  # a free node runs on each stage reading it
                made_in = _meta(producer).get(PHASE_KEY)
                read_in = _meta(node).get(PHASE_KEY)
                if made_in != Phase.MICRO.value:
                    raise PlanError(
                        f"value {v!r} is made on pipeline stage {source} in the step phase "
                        f"(gradient synchronisation or update) and read on stage {s}; cut "
                        "the stages elsewhere"
                    )
                step = read_in != Phase.MICRO.value
                if found.get((v, s), (source, step))[1] != step:
                    raise PlanError(
                        f"value {v!r} of pipeline stage {source} is read on stage {s} both "
                        "per micro-batch and per step; cut the stages elsewhere"
                    )
                found[(v, s)] = (source, step)
    return [
        Crossing(value, source, target, tag, step)
        for tag, ((value, target), (source, step)) in enumerate(sorted(found.items()), start=1)
    ]


def _check_state(graph: onnx.GraphProto, stages: list[tuple[int, ...]], names: set[str]):
    readers: dict[str, set[int]] = {}
    for node, where in zip(graph.node, stages, strict=True):
        if len(where) > 1:
            continue  # a free node: each stage reads its own copy of the input
        for v in node.input:
            if v in names:
                readers.setdefault(v, set()).update(where)
    for name, where in sorted(readers.items()):
        if len(where) > 1:
            raise PlanError(
                f"parameter {name!r} is read on pipeline stages {sorted(where)}, and a "
                "parameter must live on one stage: it is one tensor read by several blocks "
                "(tied in the model, or equal initializers that the exporter merged, as a "
                "fresh model's LayerNorm weights and zero biases); compile a pipelined "
                "point of `tensoropt search --axes split,micro,stages` (its cuts keep such "
                "readers on one stage), or export a model whose parameters differ (a "
                "trained checkpoint, or torch.onnx.export(..., optimize=False))"
            )


def _backward_made(graph: onnx.GraphProto, stages, crossings: list[Crossing]):
    """Values whose making waits for a backward crossing (on the stage that makes them)."""
    late = {(c.value, c.target) for c in crossings if not c.forward and not c.step}
    waits: set[tuple[str, int]] = set()
    for node, where in zip(graph.node, stages, strict=True):
        for s in where:
            if any((v, s) in late or (v, s) in waits for v in node.input):
                waits.update((v, s) for v in node.output)
    return waits


def _p2p(op: str, value: str, peer: int, tag: int, unit: str, phase: Phase) -> onnx.NodeProto:
    inputs, outputs = ([value], []) if op == SEND else ([], [value])
    node = helper.make_node(
        op,
        inputs,
        outputs,
        name=f"{op.lower()}_{tag}_{value}",
        domain=COLLECTIVE_DOMAIN,
        peer=peer,
        tag=tag,
    )
    for key, val in (
        (PHASE_KEY, phase.value),
        (ROLE_KEY, Role.PIPELINE.value),
        (UNIT_KEY, unit),
    ):
        node.metadata_props.add(key=key, value=val)
    return node


def require_micro_batches(plan: Plan) -> None:
    """A pipelined ``plan`` must run 2 or more micro-batches (PlanError otherwise)."""
    if plan.stages and plan.micro_batches < 2:
        raise PlanError(
            f"a pipelined plan runs micro-batches through its {plan.num_stages} stages; "
            "give --micro-batches 2 or more"
        )


def cut_stages(
    template: LocalTemplate,
    plan: Plan,
    blocks: Sequence[Block],
    params: set[str],
    states: set[str],
) -> list[LocalTemplate]:
    """One local template per stage of ``plan`` (see the module doc)."""
    require_micro_batches(plan)
    proto = template.proto
    graph = proto.graph
    stage = stage_of_nodes(graph, plan.stages, blocks, params)
    _check_state(graph, stage, params | states)
    crossings = _crossings(graph, stage)
    waits = _backward_made(graph, stage, crossings)
    for c in crossings:
        if c.forward and (c.value, c.source) in waits:
            raise PlanError(
                f"value {c.value!r} goes from pipeline stage {c.source} to {c.target} but "
                "waits for the backward of its own stage; cut the stages elsewhere"
            )
    cut = _micro_cut(proto)
    return [
        _stage_template(template, plan, s, stage, crossings, cut) for s in range(plan.num_stages)
    ]


def _phase_of(c: Crossing) -> Phase:
    return Phase.STEP if c.step else Phase.MICRO


def _micro_cut(proto: onnx.ModelProto) -> MicroCut:
    raw = next(p.value for p in proto.metadata_props if p.key == MICRO_KEY)
    return MicroCut.from_json(json.loads(raw))


def _stage_template(
    template: LocalTemplate,
    plan: Plan,
    s: int,
    stage: list[tuple[int, ...]],
    crossings: list[Crossing],
    cut: MicroCut,
) -> LocalTemplate:
    graph = template.proto.graph
    recv_at: dict[str, Crossing] = {c.value: c for c in crossings if c.target == s}
    sends: dict[str, list[Crossing]] = {}
    for c in crossings:
        if c.source == s:
            sends.setdefault(c.value, []).append(c)
    nodes: list[onnx.NodeProto] = []
    received: set[str] = set()
    for node, where in zip(graph.node, stage, strict=True):
        if s not in where:
            continue
        unit = _meta(node).get(UNIT_KEY, node.name)
        for v in node.input:
            c = recv_at.get(v)
            if c is not None and v not in received:
                received.add(v)
                nodes.append(_p2p(RECV, v, c.source, c.tag, unit, _phase_of(c)))
        copied = copy.deepcopy(node)
        copied.metadata_props.add(key=STAGE_KEY, value=str(s))
        nodes.append(copied)
        for v in node.output:
            for c in sends.get(v, ()):
                nodes.append(_p2p(SEND, v, c.target, c.tag, unit, _phase_of(c)))
    reads = {v for n in nodes for v in n.input}
    made = {v for n in nodes if n.op_type not in P2P_OPS for v in n.output}
    proto = onnx.ModelProto()
    proto.CopyFrom(template.proto)
    g = proto.graph
    del g.node[:]
    g.node.extend(nodes)
    inputs = [i for i in graph.input if i.name in reads]
    outputs = [o for o in graph.output if o.name in made]
    inits = [t for t in graph.initializer if t.name in reads]
    del g.input[:], g.output[:], g.initializer[:]
    g.input.extend(inputs)
    g.output.extend(outputs)
    g.initializer.extend(inits)
    mine = MicroCut(
        cut.batches,
        tuple(v for v in cut.accumulate if v in made),
        tuple(v for v in cut.keep if v in made),
        cut.index if cut.index in {i.name for i in inputs} else None,
    )
    info = StageInfo(
        s, plan.num_stages, plan.schedule, plan.micro_batches, plan.mesh.size, plan.stages
    )
    kept = [p for p in proto.metadata_props if p.key not in (MICRO_KEY, PIPELINE_KEY)]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    proto.metadata_props.add(key=MICRO_KEY, value=json.dumps(mine.to_json()))
    proto.metadata_props.add(key=PIPELINE_KEY, value=json.dumps(info.to_json()))
    return dataclasses.replace(template, proto=proto)


def globalize(
    proto: onnx.ModelProto, stage: int, rank: int, ranks_per_stage: int
) -> onnx.ModelProto:
    """Rank ``rank``'s lowered graph of stage ``stage``, with device numbers: every
    collective group's sub-mesh ranks, and every Send/Recv's peer stage (rank r of stage
    s is device ``s * n + r``; its peer is rank r of the other stage)."""
    for node in proto.graph.node:
        if node.domain != COLLECTIVE_DOMAIN:
            continue
        for attr in node.attribute:
            if attr.name == "group":
                attr.ints[:] = [stage * ranks_per_stage + g for g in attr.ints]
            elif attr.name == "peer" and node.op_type in P2P_OPS:
                attr.i = attr.i * ranks_per_stage + rank
    return proto
