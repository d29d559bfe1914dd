"""The gradient-rule interface.

A gradient rule receives a :class:`GradContext` for one forward node and returns
one entry per forward input: the gradient value, or ``None`` where the input is
not differentiable or not needed (``ctx.needs[i]`` is False). The driver checks
the count (tinygrad's gradient table convention).

Rules emit only standard ai.onnx ops (opset >= 20 forms), so that the sharding
rules cover the backward graph too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from tensoropt.ir.builder import Builder, static_shape


@dataclass(frozen=True, slots=True)
class GradContext:
    """What a gradient rule sees for one forward node."""

    b: Builder
    node: ir.Node
    grad_outputs: tuple[ir.Value | None, ...]
    needs: tuple[bool, ...]
    # the batch dimension of the forward values it can be followed to from the data
    # inputs (``passes.blocks.batch_dims``); empty where the caller does not know it
    batch_dims: Mapping[ir.Value, int] = field(default_factory=dict)

    @property
    def inputs(self) -> tuple[ir.Value | None, ...]:
        return tuple(self.node.inputs)

    @property
    def outputs(self) -> tuple[ir.Value, ...]:
        return tuple(self.node.outputs)

    def attr(self, name: str, default=None):
        """The forward node's attribute value, or ``default``."""
        attr = self.node.attributes.get(name)
        return default if attr is None else attr.value

    def shape(self, index: int) -> tuple[int, ...]:
        """Static shape of forward input ``index``."""
        value = self.node.inputs[index]
        assert value is not None
        return static_shape(value)

    def batch_dim(self, index: int) -> int | None:
        """The batch dimension of forward input ``index``, or None when not known."""
        value = self.node.inputs[index]
        return None if value is None else self.batch_dims.get(value)

    def out_shape(self, index: int = 0) -> tuple[int, ...]:
        return static_shape(self.node.outputs[index])

    def const_input(self, index: int) -> np.ndarray | None:
        """The value of a constant input (initializer or Constant node), else None."""
        if index >= len(self.node.inputs) or self.node.inputs[index] is None:
            return None
        return constant_value(self.node.inputs[index])


GradRule = Callable[[GradContext], Sequence[ir.Value | None]]


def constant_value(value: ir.Value) -> np.ndarray | None:
    """The numpy value of an initializer or a Constant node's output, else None."""
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain == "":
        attr = producer.attributes.get("value")
        if attr is not None:
            return attr.value.numpy()
        for key in ("value_int", "value_float"):
            if key in producer.attributes:
                return np.asarray(producer.attributes[key].value)
        for key in ("value_ints", "value_floats"):
            if key in producer.attributes:
                return np.asarray(list(producer.attributes[key].value))
    return None


class GradRegistry:
    """An explicit table op_type -> rule, plus the ops that carry no gradient."""

    def __init__(self) -> None:
        self._rules: dict[str, GradRule] = {}
        self._non_differentiable: set[str] = set()

    def register(self, *op_types: str) -> Callable[[GradRule], GradRule]:
        def deco(fn: GradRule) -> GradRule:
            for op in op_types:
                if op in self._rules:
                    raise ValueError(f"gradient rule for {op} registered twice")
                self._rules[op] = fn
            return fn

        return deco

    def mark_non_differentiable(self, op_types: Iterable[str]) -> None:
        """Ops whose outputs never carry a gradient (shape arithmetic, comparisons...)."""
        self._non_differentiable.update(op_types)

    def is_non_differentiable(self, op_type: str) -> bool:
        return op_type in self._non_differentiable

    def get(self, op_type: str) -> GradRule | None:
        return self._rules.get(op_type)

    def differentiable(self) -> frozenset[str]:
        """The op types that have a gradient rule."""
        return frozenset(self._rules)

    def non_differentiable(self) -> frozenset[str]:
        """The op types marked as carrying no gradient."""
        return frozenset(self._non_differentiable)

    def supported(self) -> frozenset[str]:
        return frozenset(self._rules) | frozenset(self._non_differentiable)


def unbroadcast(b: Builder, grad: ir.Value, grad_shape: Sequence[int], target: Sequence[int]):
    """Sum ``grad`` (of broadcast shape ``grad_shape``) back to ``target`` shape."""
    grad_shape, target = tuple(grad_shape), tuple(target)
    if grad_shape == target:
        return grad
    lead = len(grad_shape) - len(target)
    padded = (1,) * lead + target
    axes = [i for i, (g, t) in enumerate(zip(grad_shape, padded, strict=True)) if t == 1 and g != 1]
    axes = sorted(set(axes) | set(range(lead)))
    out = grad
    if axes:
        out = b.op("ReduceSum", [grad, b.ints(axes)], {"keepdims": 1})
    # keepdims=1 already gives ``target`` when no leading axes were added.
    return b.op("Reshape", [out, b.ints(target)]) if lead else out
