"""Indexing ops: Gather, GatherElements, GatherND, ScatterND, ScatterElements.

Gather (e.g. an embedding lookup ``W[V, D]``, ``ids[B, S]``) may shard the indices dims
and the data dims other than ``axis``; the gathered (vocab) dim is never sharded, because a
vocab-sharded lookup needs a masked local lookup (extra ops) that a rule cannot express.
Dims that index positions (the gather/scatter axis, GatherND's indexed dims, indices'
last dim) are never sharded. A data dim and an indices dim share a factor only when their
sizes are equal (then position p means the same thing on both).

All five are linear in their data operands: Gather* with data ``P`` and indices ``R``;
Scatter* (reduction none/add) with data and updates both ``P``. ScatterND with reduction
``add`` may also split its updates' leading dims with the matching indices dims: the
output is then ``P`` (each shard adds its updates) and the data ``P``.
"""

from __future__ import annotations

from tensoropt.rules.sharding.base import (
    FactorRule,
    FactorSpec,
    Labels,
    OpView,
    Reduction,
    ShardingRule,
    norm_axis,
    partial_strategy,
)


def _gather_spec(op: OpView) -> FactorSpec:
    data, idx = op.input_shapes[0] or (), op.input_shapes[1] or ()
    axis = norm_axis(op.attr("axis", 0), len(data), "Gather axis")
    ldata = tuple(None if d == axis else f"d{d}" for d in range(len(data)))
    lidx = tuple(f"i{d}" for d in range(len(idx)))
    out = ldata[:axis] + lidx + ldata[axis + 1 :]
    return FactorSpec((ldata, lidx), (out,), partial=(partial_strategy(op, (0,)),))


def _same_size_labels(a: tuple[int, ...], b: tuple[int, ...], axis: int) -> Labels:
    return tuple(
        f"d{d}" if d != axis and a[d] == b[d] else None for d in range(min(len(a), len(b)))
    )


def _gather_elements_spec(op: OpView) -> FactorSpec:
    data, idx = op.input_shapes[0] or (), op.input_shapes[1] or ()
    axis = norm_axis(op.attr("axis", 0), len(data), "GatherElements axis")
    lab = _same_size_labels(data, idx, axis)
    return FactorSpec((lab, lab), (lab,), partial=(partial_strategy(op, (0,)),))


def _gather_nd_spec(op: OpView) -> FactorSpec:
    data, idx = op.input_shapes[0] or (), op.input_shapes[1] or ()
    b = int(op.attr("batch_dims", 0))
    k = idx[-1]
    batch = tuple(f"b{d}" if data[d] == idx[d] else None for d in range(b))
    lidx = batch + tuple(f"i{d}" for d in range(b, len(idx) - 1)) + (None,)
    trailing = tuple(f"d{d}" for d in range(b + k, len(data)))
    ldata = batch + (None,) * k + trailing
    out = lidx[:-1] + trailing
    return FactorSpec((ldata, lidx), (out,), partial=(partial_strategy(op, (0,)),))


def _scatter_linear(op: OpView) -> tuple:
    if op.attr("reduction", "none") not in ("none", "add"):
        return ()
    return (partial_strategy(op, (0, 2)),)


def _scatter_nd_spec(op: OpView) -> FactorSpec:
    data, idx = op.input_shapes[0] or (), op.input_shapes[1] or ()
    k = idx[-1]
    trailing = tuple(f"d{d}" for d in range(k, len(data)))
    ldata = (None,) * k + trailing
    if op.attr("reduction", "none") == "add":
        # Each update adds into the output on its own, so the updates (and their
        # indices) may be split: every shard scatters its part, the sum is the whole.
        lead = tuple(f"n{d}" for d in range(len(idx) - 1))
        return FactorSpec(
            (ldata, (*lead, None), lead + trailing),
            (ldata,),
            reduce={f: Reduction.SUM for f in lead},
            additive=frozenset({0}),
            partial=_scatter_linear(op),
        )
    lupd = (None,) * (len(idx) - 1) + trailing
    lidx = (None,) * len(idx)
    return FactorSpec((ldata, lidx, lupd), (ldata,), partial=_scatter_linear(op))


def _scatter_elements_spec(op: OpView) -> FactorSpec:
    data, idx = op.input_shapes[0] or (), op.input_shapes[1] or ()
    axis = norm_axis(op.attr("axis", 0), len(data), "ScatterElements axis")
    lab = _same_size_labels(data, idx, axis)
    return FactorSpec((lab, lab, lab), (lab,), partial=_scatter_linear(op))


RULES: dict[str, ShardingRule] = {
    "Gather": FactorRule(_gather_spec),
    "GatherElements": FactorRule(_gather_elements_spec),
    "GatherND": FactorRule(_gather_nd_spec),
    "ScatterND": FactorRule(_scatter_nd_spec),
    "ScatterElements": FactorRule(_scatter_elements_spec),
}
