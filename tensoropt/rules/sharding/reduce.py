"""Reductions in the opset-18 form (``axes`` is input 1).

Kept dims are free factors. A reduced dim is a contracting factor: sharding it gives ``P``
for ReduceSum and ``P`` scaled by 1/n for ReduceMean (the local op takes the mean of its
piece); ReduceMax / ReduceMin and the nonlinear ReduceL1 / ReduceL2 / ReduceSumSquare /
ReduceLogSumExp never shard a reduced dim (that would need their own combination).
ReduceSum and ReduceMean are linear: ``P`` in -> ``P`` out.

TopK (values and indices along ``axis``) shards every dim but ``axis``, both outputs
alike; ``K`` is a replicated constant. ArgMax and ArgMin likewise shard every dim but
``axis``.
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


def _reduced_axes(op: OpView, rank: int) -> set[int] | None:
    """Reduced dims, or None when the axes input is not a constant."""
    if op.has_input(1):
        axes = op.const_ints(1)
        if axes is None:
            return None
    else:
        axes = []
    if not axes:
        return set() if op.attr("noop_with_empty_axes", 0) else set(range(rank))
    return {norm_axis(a, rank, f"{op.op_type} axes") for a in axes}


def reduce_rule(reduction: Reduction | None) -> ShardingRule:
    """Rule for one Reduce* op; ``reduction`` None: reduced dims are never sharded."""

    def spec(op: OpView) -> FactorSpec:
        x = op.input_shapes[0] or ()
        axes_in: tuple[Labels | None, ...] = (
            ((),) if op.has_input(1) else ((None,) if len(op.input_shapes) > 1 else ())
        )
        reduced = _reduced_axes(op, len(x))
        if reduced is None:
            return FactorSpec(((None,) * len(x), *axes_in), ((None,) * len(op.output_shapes[0]),))
        labels = tuple(f"d{d}" if size != 1 else None for d, size in enumerate(x))
        keepdims = bool(op.attr("keepdims", 1))
        out = tuple(
            None if d in reduced else lab
            for d, lab in enumerate(labels)
            if keepdims or d not in reduced
        )
        contract = {labels[d]: reduction for d in reduced if labels[d] and reduction}
        partial = (partial_strategy(op, (0,)),) if reduction else ()
        return FactorSpec((labels, *axes_in), (out,), reduce=contract, partial=partial)

    return FactorRule(spec)


def _top_k_spec(op: OpView) -> FactorSpec:
    rank = len(op.input_shapes[0] or ())
    axis = norm_axis(op.attr("axis", -1), rank, "TopK axis")
    labels = tuple(None if d == axis else f"d{d}" for d in range(rank))
    return FactorSpec((labels, ()), (labels, labels))


def _arg_spec(op: OpView) -> FactorSpec:
    """ArgMax / ArgMin: every dim but ``axis`` (the index of a piece's extreme is not the
    whole's); ``axis`` kept as 1 or dropped (``keepdims``)."""
    x = op.input_shapes[0] or ()
    axis = norm_axis(op.attr("axis", 0), len(x), f"{op.op_type} axis")
    labels = tuple(None if d == axis or size == 1 else f"d{d}" for d, size in enumerate(x))
    keepdims = bool(op.attr("keepdims", 1))
    out = tuple(lab for d, lab in enumerate(labels) if keepdims or d != axis)
    return FactorSpec((labels,), (out,))


RULES: dict[str, ShardingRule] = {
    "TopK": FactorRule(_top_k_spec),
    "ArgMax": FactorRule(_arg_spec),
    "ArgMin": FactorRule(_arg_spec),
    "ReduceSum": reduce_rule(Reduction.SUM),
    "ReduceMean": reduce_rule(Reduction.MEAN),
    "ReduceMax": reduce_rule(None),
    "ReduceMin": reduce_rule(None),
    # not linear: a reduced dim is never sharded
    "ReduceL1": reduce_rule(None),
    "ReduceL2": reduce_rule(None),
    "ReduceSumSquare": reduce_rule(None),
    "ReduceLogSumExp": reduce_rule(None),
}
