"""Read-only statistics of a device graph: ops, collectives, traffic, memory.

Used by ``tensoropt inspect`` and by the cost-model checks. Memory is the static
liveness peak of the graph in its node order: graph inputs and initializers live
for the whole step, every other value from its producer to its last consumer.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from tensoropt.ir.vocab import COLLECTIVE_DOMAIN, COMMUNICATING_KINDS
from tensoropt.passes.micro import MICRO_KEY, PHASE_KEY, MicroCut, Phase
from tensoropt.passes.stages import P2P_OPS, PIPELINE_KEY, RECV, SEND

_COLLECTIVE_OPS = frozenset(k.value for k in COMMUNICATING_KINDS)


@dataclass(frozen=True, slots=True)
class CollectiveStat:
    kind: str
    group: tuple[int, ...]
    count: int
    bytes_sent: float


@dataclass(frozen=True, slots=True)
class DeviceStats:
    ops: int
    op_types: dict[str, int]
    collectives: tuple[CollectiveStat, ...]
    bytes_sent: float
    param_shapes: dict[str, tuple[int, ...]]
    state_bytes: int
    peak_bytes: int
    micro_batches: int = 1  # micro-batches per step (collectives of that phase count k x)
    accumulated: int = 0  # values summed over the micro-batches
    stage: dict | None = None  # pipeline stages: passes.stages.StageInfo as JSON
    bytes_received: float = 0.0  # by Recv from other stages, per step


def _value_info(graph: onnx.GraphProto) -> dict[str, tuple[tuple[int, ...], int]]:
    info = {}
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        tt = vi.type.tensor_type
        info[vi.name] = (tuple(d.dim_value for d in tt.shape.dim), tt.elem_type)
    for t in graph.initializer:
        info[t.name] = (tuple(t.dims), t.data_type)
    return info


def _nbytes(entry: tuple[tuple[int, ...], int] | None) -> int:
    if entry is None:
        return 0
    shape, dtype = entry
    itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize if dtype else 4
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def collective_bytes(kind: str, in_bytes: int, out_bytes: int, n: int) -> float:
    """Bytes one rank sends (ring algorithms): DESIGN §4's volume terms."""
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if kind == "AllReduce":
        return 2 * frac * in_bytes
    if kind == "AllGather":
        return frac * out_bytes
    if kind == "ReduceScatter":
        return frac * in_bytes
    return frac * in_bytes  # AllToAll


def _peak(graph: onnx.GraphProto, info) -> int:
    last_use: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            if name:
                last_use[name] = i
    resident = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    live = sum(_nbytes(info.get(n)) for n in resident)
    peak = live
    for i, node in enumerate(graph.node):
        produced = [o for o in node.output if o]
        live += sum(_nbytes(info.get(o)) for o in produced)
        peak = max(peak, live)
        for name in {*node.input, *produced}:
            if name in resident or name in outputs or not name:
                continue
            if last_use.get(name, -1) <= i:
                live -= _nbytes(info.get(name))
    return peak


def device_stats(model: onnx.ModelProto, params: list[str], states: list[str]) -> DeviceStats:
    graph = model.graph
    info = _value_info(graph)
    groups: Counter = Counter()
    traffic: dict[tuple[str, tuple[int, ...]], float] = {}
    cut = _micro_cut(model)
    k = cut.batches if cut is not None else 1
    received = 0.0
    for node in graph.node:
        if node.domain == COLLECTIVE_DOMAIN and node.op_type in P2P_OPS:
            times = k if _phase(node) == Phase.MICRO.value else 1
            if node.op_type == RECV:
                received += _nbytes(info.get(node.output[0])) * times
                continue
            key = (SEND, (int(_attr(node, "peer", -1)),))
            groups[key] += times
            sent = _nbytes(info.get(node.input[0])) * times
            traffic[key] = traffic.get(key, 0.0) + sent
            continue
        if node.domain != COLLECTIVE_DOMAIN or node.op_type not in _COLLECTIVE_OPS:
            continue
        group = tuple(_attr(node, "group", []))
        key = (node.op_type, group)
        times = k if _phase(node) == Phase.MICRO.value else 1  # issued per step
        groups[key] += times
        sent = collective_bytes(
            node.op_type,
            _nbytes(info.get(node.input[0])),
            _nbytes(info.get(node.output[0])),
            len(group),
        )
        traffic[key] = traffic.get(key, 0.0) + sent * times
    collectives = tuple(
        CollectiveStat(kind, group, count, traffic[(kind, group)])
        for (kind, group), count in sorted(groups.items())
    )
    return DeviceStats(
        ops=len(graph.node),
        op_types=dict(Counter(n.op_type for n in graph.node).most_common()),
        collectives=collectives,
        bytes_sent=sum(c.bytes_sent for c in collectives),
        param_shapes={p: info[p][0] for p in params if p in info},
        state_bytes=sum(_nbytes(info.get(n)) for n in [*params, *states]),
        peak_bytes=_peak(graph, info),
        micro_batches=k,
        accumulated=len(cut.accumulate) if cut is not None else 0,
        stage=_stage(model),
        bytes_received=received,
    )


def collectives_per_step(graph: onnx.GraphProto, micro_batches: int = 1) -> int:
    """The collectives a device graph issues per step: those of the micro phase once per
    micro-batch, the others once; point-to-point Send and Recv between pipeline stages
    are not collectives (no group) and do not count. The figure every command reports as
    "collectives per device" (the cost model's ``Estimate.collectives``)."""
    micro_phase = Phase.MICRO.value
    return sum(
        micro_batches if _phase(node) == micro_phase else 1
        for node in graph.node
        if node.domain == COLLECTIVE_DOMAIN and node.op_type in _COLLECTIVE_OPS
    )


def _stage(model: onnx.ModelProto) -> dict | None:
    raw = next((p.value for p in model.metadata_props if p.key == PIPELINE_KEY), None)
    return None if raw is None else json.loads(raw)


def _micro_cut(model: onnx.ModelProto) -> MicroCut | None:
    raw = next((p.value for p in model.metadata_props if p.key == MICRO_KEY), None)
    return None if raw is None else MicroCut.from_json(json.loads(raw))


def _phase(node: onnx.NodeProto) -> str | None:
    return next((p.value for p in node.metadata_props if p.key == PHASE_KEY), None)
