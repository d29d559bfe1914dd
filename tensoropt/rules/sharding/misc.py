"""Logic, comparison, casts, constants and shape queries, Trilu, CumSum, OneHot.

- Identity, Cast (float -> float), Where (condition ``R``, both branches ``P``), Trilu and
  CumSum are linear and offer Partial-in -> Partial-out.
- Shape and Size read only the shape: their input may be ``P`` (and, for Shape, sharded on
  a dim outside the ``start:end`` window); the output is always ``R``.
- ConstantOfShape may shard any output dim: the local shape constant is rewritten; a
  float zero fill may also be made as a partial sum (zeros on every rank).
- Constant and Range produce one global value: ``R`` only (slicing a constant per rank is
  the partitioner's job). OneHot may shard the indices dims, never the depth dim.
"""

from __future__ import annotations

import numpy as np

from tensoropt.ir.layout import Partial, Replicate, Shard
from tensoropt.rules.sharding.base import (
    FLOAT_DTYPES,
    FactorRule,
    FactorSpec,
    LocalOp,
    OpSharding,
    OpView,
    ShardingRule,
    check_member,
    elementwise_labels,
    norm_axis,
    partial_strategy,
    plain_local,
    replace_const,
    replicated,
)
from tensoropt.rules.sharding.elementwise import elementwise_rule

R = Replicate()
P = Partial()


def _cast_spec(op: OpView) -> FactorSpec:
    ins, out = elementwise_labels(op)
    linear = op.input_dtypes[0] in FLOAT_DTYPES and op.output_dtypes[0] in FLOAT_DTYPES
    return FactorSpec(ins, (out,), partial=(partial_strategy(op, (0,)),) if linear else ())


def _where_spec(op: OpView) -> FactorSpec:
    ins, out = elementwise_labels(op)
    return FactorSpec(ins, (out,), partial=(partial_strategy(op, (1, 2)),))


def _keep_axes_spec(axes_of: str) -> FactorRule:
    """Linear op on input 0 that must not shard the dims named by ``axes_of``."""

    def spec(op: OpView) -> FactorSpec:
        rank = len(op.output_shapes[0])
        blocked = _blocked_dims(op, axes_of, rank)
        x = tuple(None if d in blocked else f"d{d}" for d in range(rank))
        rest = tuple(() if op.has_input(i) else None for i in range(1, len(op.input_shapes)))
        return FactorSpec((x, *rest), (x,), partial=(partial_strategy(op, (0,)),))

    return FactorRule(spec)


def _blocked_dims(op: OpView, axes_of: str, rank: int) -> set[int]:
    if axes_of == "trilu":
        return {rank - 2, rank - 1}
    axis = op.const_ints(1)
    if axis is None:
        return set(range(rank))  # CumSum axis not constant: shard nothing
    return {norm_axis(axis[0], rank, "CumSum axis")}


class ShapeRule:
    """Shape / Size: the output is ``R``; the input may be ``P`` or sharded off-window."""

    def strategies(self, op: OpView, n: int) -> list[OpSharding]:
        out = [replicated(op)]
        if n < 2:
            return out
        shape = op.input_shapes[0] or ()
        if op.op_type == "Shape":
            window = set(range(len(shape))[slice(op.attr("start", 0), op.attr("end", None))])
            for d, size in enumerate(shape):
                if d not in window and size % n == 0 and size >= n:
                    out.append(OpSharding((Shard(d),), (R,)))
        if op.is_float_input(0):
            out.append(OpSharding((P,), (R,)))
        return out

    def localize(self, op: OpView, s: OpSharding, n: int) -> LocalOp:
        check_member(self, op, s, n)
        return plain_local(op, s, n)


class ReplicatedOnly:
    """Ops that produce one global value from replicated inputs (Constant, Range)."""

    def strategies(self, op: OpView, n: int) -> list[OpSharding]:
        return [replicated(op)]

    def localize(self, op: OpView, s: OpSharding, n: int) -> LocalOp:
        check_member(self, op, s, n)
        return plain_local(op, s, n)


def _constant_of_shape_spec(op: OpView) -> FactorSpec:
    labels = tuple(f"o{d}" for d in range(len(op.output_shapes[0])))
    ins = (() if op.const_ints(0) is not None else None,)
    if ins[0] is None:  # shape not constant: nothing can be rewritten
        return FactorSpec(((),), (tuple(None for _ in labels),))
    value = op.attr("value")
    zeros = (value is None or not np.any(np.asarray(value))) and op.is_float_output(0)
    # zeros are also a partial sum (of zeros on every rank): a reader that accumulates
    # into a partial sum takes them as made, not converted from the replicated fill
    partial = (partial_strategy(op, ()),) if zeros else ()
    return FactorSpec(ins, (labels,), generated=True, partial=partial)


def _constant_of_shape_rewrite(
    op: OpView, s: OpSharding, n: int, local: LocalOp
) -> tuple[dict, tuple[np.ndarray | None, ...]]:
    shape = np.asarray(local.output_shapes[0], dtype=np.int64)
    return dict(op.attributes), replace_const(op, 0, shape)


def _onehot_spec(op: OpView) -> FactorSpec:
    indices = op.input_shapes[0] or ()
    rank = len(indices) + 1
    axis = norm_axis(op.attr("axis", -1), rank, "OneHot axis")
    labels = tuple(f"i{d}" for d in range(len(indices)))
    out = labels[:axis] + (None,) + labels[axis:]
    return FactorSpec((labels, (), ()), (out,))


RULES: dict[str, ShardingRule] = {
    "Identity": elementwise_rule(lambda op: ((0,),)),
    "Cast": FactorRule(_cast_spec),
    "Where": FactorRule(_where_spec),
    **{
        op: elementwise_rule()
        for op in (
            *("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"),
            *("And", "Or", "Xor", "Not", "IsNaN", "IsInf"),
        )
    },
    "Trilu": _keep_axes_spec("trilu"),
    "CumSum": _keep_axes_spec("cumsum"),
    "Shape": ShapeRule(),
    "Size": ShapeRule(),
    "Constant": ReplicatedOnly(),
    "Range": ReplicatedOnly(),
    "ConstantOfShape": FactorRule(_constant_of_shape_spec, _constant_of_shape_rewrite),
    "OneHot": FactorRule(_onehot_spec),
}
