"""Elementwise arithmetic and math ops (numpy-style broadcasting).

Every output dim is a factor; an input carries it when its aligned dim has the output's
size (a broadcast dim of size 1, or a missing leading dim, stays ``R``). Linear ops also
offer Partial-in -> Partial-out: Add/Sub/Sum with every input ``P``, Mul with one ``P``
factor and the other ``R``, Div with a ``P`` numerator, Neg with a ``P`` input.
"""

from __future__ import annotations

from collections.abc import Callable

from tensoropt.rules.sharding.base import (
    FactorRule,
    FactorSpec,
    OpView,
    ShardingRule,
    elementwise_labels,
    partial_strategy,
)

PartialFn = Callable[[OpView], tuple[tuple[int, ...], ...]]


def _no_partial(op: OpView) -> tuple[tuple[int, ...], ...]:
    return ()


def _all_partial(op: OpView) -> tuple[tuple[int, ...], ...]:
    return (tuple(i for i in range(len(op.input_shapes)) if op.has_input(i)),)


def _each_partial(op: OpView) -> tuple[tuple[int, ...], ...]:
    return tuple((i,) for i in range(len(op.input_shapes)) if op.has_input(i))


def _first_partial(op: OpView) -> tuple[tuple[int, ...], ...]:
    return ((0,),)


def elementwise_rule(partial: PartialFn = _no_partial) -> ShardingRule:
    """Broadcasting elementwise rule; ``partial`` lists the input sets that may be P."""

    def spec(op: OpView) -> FactorSpec:
        ins, out = elementwise_labels(op)
        outs = tuple(out for _ in op.output_shapes)
        extra = tuple(partial_strategy(op, group) for group in partial(op))
        return FactorSpec(ins, outs, partial=extra)

    return FactorRule(spec)


NONLINEAR_UNARY = (
    "Sqrt",
    "Reciprocal",
    "Tanh",
    "Erf",
    "Gelu",
    "Sigmoid",
    "Relu",
    "Exp",
    "Log",
    "Abs",
    "Sign",
    "Floor",
    "Ceil",
    "Clip",
    "Cos",
    "Sin",
    "Elu",
    "LeakyRelu",
    "HardSigmoid",
    "HardSwish",
    "Softplus",
    "Round",
)
NONLINEAR_NARY = ("Pow", "Max", "Min", "Mod", "Mean")

RULES: dict[str, ShardingRule] = {
    **{op: elementwise_rule() for op in NONLINEAR_UNARY + NONLINEAR_NARY},
    "Neg": elementwise_rule(_first_partial),
    "Add": elementwise_rule(_all_partial),
    "Sub": elementwise_rule(_all_partial),
    "Sum": elementwise_rule(_all_partial),
    "Mul": elementwise_rule(_each_partial),
    "Div": elementwise_rule(_first_partial),
}
