"""Neural-network ops: Softmax, LogSoftmax, LayerNormalization, Conv, ConvTranspose,
MaxPool, AveragePool, GlobalAveragePool, BatchNormalization, Dropout.

- Softmax / LogSoftmax: any dim but ``axis``. LayerNormalization: any dim before ``axis``
  (the normalised dims ``axis..`` never), also in the Mean / InvStdDev outputs.
- Conv / ConvTranspose (``group == 1``): batch ``S(0)``; output channels (weight dim 0 for
  Conv, 1 for ConvTranspose; bias dim 0) give ``S(1)`` outputs; sharding the contracting
  input channels gives ``P`` outputs with a ``P`` bias. Spatial dims are never sharded: a
  spatial split needs halo exchange, which the IR does not model. Grouped convolutions
  shard the batch, or whole groups: input channels, weight dim 0 (the grouped dimension of
  both Conv and ConvTranspose), bias and output channels split together when the split
  divides ``group``, and the local node runs ``group / n`` groups.
- Pools: batch and channel. MaxPool with an ``Indices`` output: ``R`` only (the indices are
  flat offsets into the whole input), unless they are read only modulo the input's
  spatial plane (``OpView.reduced_indices``: the gradient rule's use), where a batch or
  channel split's offsets cancel: then batch and channel too.
- BatchNormalization: inference form is per channel elementwise (every dim may be sharded);
  training form (``training_mode=1``) shards channels only, since batch or spatial sharding
  would change the batch statistics.
- Dropout is elementwise. In eval form (training_mode absent / false) or with ratio 0 it is
  the identity and linear (``P`` in -> ``P`` out); in training with ratio > 0 it keeps its
  elementwise shardings but ranks draw their masks independently.
"""

from __future__ import annotations

from tensoropt.ir.layout import Partial, Replicate, Shard
from tensoropt.rules.sharding.base import (
    FactorRule,
    FactorSpec,
    Labels,
    OpSharding,
    OpView,
    Reduction,
    ShardingRule,
    elementwise_labels,
    norm_axis,
    partial_strategy,
)

R = Replicate()
P = Partial()


def _softmax_spec(op: OpView) -> FactorSpec:
    rank = len(op.output_shapes[0])
    axis = norm_axis(op.attr("axis", -1), rank, f"{op.op_type} axis")
    lab = tuple(None if d == axis else f"d{d}" for d in range(rank))
    return FactorSpec((lab,), (lab,))


def _layer_norm_spec(op: OpView) -> FactorSpec:
    rank = len(op.input_shapes[0] or ())
    axis = norm_axis(op.attr("axis", -1), rank, "LayerNormalization axis")
    lab = tuple(f"d{d}" if d < axis else None for d in range(rank))
    params = tuple(None if sh is None else (None,) * len(sh) for sh in op.input_shapes[1:])
    stats = tuple(lab[: len(sh)] for sh in op.output_shapes[1:])
    return FactorSpec((lab, *params), (lab, *stats))


def _spatial(n: int) -> Labels:
    return (None,) * n


def _conv_spec(op: OpView) -> FactorSpec:
    x = op.input_shapes[0] or ()
    transpose = op.op_type == "ConvTranspose"
    grouped = int(op.attr("group", 1)) != 1
    sp = _spatial(len(x) - 2)
    if grouped:  # "g": whole groups, channels in and out together (_whole_groups)
        lx: Labels = ("n", "g", *sp)
        lw: Labels = ("g", None, *sp)
        m = "g"
    else:
        lx = ("n", "c", *sp)
        lw = (("c", "m") if transpose else ("m", "c")) + sp
        m = "m"
    has_b = op.has_input(2)
    ins: tuple[Labels | None, ...] = (lx, lw)
    if len(op.input_shapes) > 2:
        ins += ((m,) if has_b else None,)
    bias = (2,) if has_b else ()
    partial = (partial_strategy(op, (0, *bias)), partial_strategy(op, (1, *bias)))
    return FactorSpec(
        ins,
        (("n", m, *sp),),
        reduce={"c": Reduction.SUM},
        additive=frozenset(bias),
        partial=partial,
    )


def _groups_split(op: OpView, s: OpSharding) -> bool:
    return int(op.attr("group", 1)) != 1 and s.outputs[0] == Shard(1)


def _whole_groups(op: OpView, s: OpSharding, n: int) -> bool:
    """A grouped convolution's channel split holds whole groups: ``n`` divides ``group``
    (the channel counts dividing is not enough: a group's channels are contiguous)."""
    return not _groups_split(op, s) or int(op.attr("group", 1)) % n == 0


def _local_groups(op: OpView, s: OpSharding, n: int, local) -> tuple[dict, tuple]:
    attrs = dict(local.attributes)
    if _groups_split(op, s):
        attrs["group"] = int(op.attr("group", 1)) // n
    return attrs, local.const_inputs


def _pool_spec(op: OpView) -> FactorSpec:
    x = op.input_shapes[0] or ()
    lab: Labels = ("n", "c", *_spatial(len(x) - 2))
    if len(op.output_shapes) > 1 and not op.reduced_indices:
        lab = _spatial(len(x))  # MaxPool Indices: offsets into the whole input
    linear = op.op_type in ("AveragePool", "GlobalAveragePool")
    partial = (partial_strategy(op, (0,)),) if linear else ()
    return FactorSpec((lab,), tuple(lab for _ in op.output_shapes), partial=partial)


def _batch_norm_spec(op: OpView) -> FactorSpec:
    x = op.input_shapes[0] or ()
    training = bool(op.attr("training_mode", 0))
    if training:
        lx: Labels = (None, "c", *_spatial(len(x) - 2))
    else:
        lx = ("n", "c", *(f"s{d}" for d in range(len(x) - 2)))
    per_channel = tuple(None if sh is None else ("c",) for sh in op.input_shapes[1:])
    stats = tuple(("c",) for _ in op.output_shapes[1:])
    return FactorSpec((lx, *per_channel), (lx, *stats))


def _dropout_deterministic(op: OpView) -> bool:
    if not op.has_input(2):
        return True
    training = op.const_inputs[2]
    if training is not None and not bool(training.reshape(-1)[0]):
        return True
    ratio = op.const_inputs[1] if op.has_input(1) else None
    return ratio is not None and float(ratio.reshape(-1)[0]) == 0.0


def _dropout_spec(op: OpView) -> FactorSpec:
    ins, out = elementwise_labels(op)
    scalars = tuple(None if sh is None else () for sh in ins[1:])
    partial: tuple[OpSharding, ...] = ()
    if _dropout_deterministic(op):
        partial = (partial_strategy(op, (0,), (P, *(R for _ in op.output_shapes[1:]))),)
    return FactorSpec((ins[0], *scalars), tuple(out for _ in op.output_shapes), partial=partial)


RULES: dict[str, ShardingRule] = {
    "Softmax": FactorRule(_softmax_spec),
    "LogSoftmax": FactorRule(_softmax_spec),
    "LayerNormalization": FactorRule(_layer_norm_spec),
    "Conv": FactorRule(_conv_spec, _local_groups, _whole_groups),
    "ConvTranspose": FactorRule(_conv_spec, _local_groups, _whole_groups),
    "MaxPool": FactorRule(_pool_spec),
    "AveragePool": FactorRule(_pool_spec),
    "GlobalAveragePool": FactorRule(_pool_spec),
    "BatchNormalization": FactorRule(_batch_norm_spec),
    "Dropout": FactorRule(_dropout_spec),
}
