"""Optimizer updates as graph ops.

SGD with momentum (PyTorch convention): ``v' = m*v + g``, ``p' = p - lr*v'``;
without momentum there is no state and ``p' = p - lr*g``.
Adam: ``t' = t + 1``, ``m' = b1*m + (1-b1)*g``, ``v' = b2*v + (1-b2)*g*g``,
``p' = p - lr * (m'/(1-b1^t')) / (sqrt(v'/(1-b2^t')) + eps)``.
Every node is tagged ``role=optimizer`` with the unit of the parameter's first
consumer, so a parameter's update shares its layer's strategy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tensoropt.ir.builder import Builder, static_shape
from tensoropt.ir.vocab import OptimizerState

STEP_NAME = "__step"


class OptimizerKind(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"


@dataclass(frozen=True, slots=True)
class OptimizerOptions:
    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def to_json(self) -> dict:
        out = {"kind": self.kind.value, "lr": self.lr}
        if self.kind is OptimizerKind.SGD:
            out["momentum"] = self.momentum
        else:
            out.update(beta1=self.beta1, beta2=self.beta2, eps=self.eps)
        return out


@dataclass(frozen=True, slots=True)
class Update:
    """The state inputs an update introduced and its new values (param first)."""

    states: tuple[ir.Value, ...]
    outputs: tuple[ir.Value, ...]


def state_kinds(kind: OptimizerKind, momentum: float) -> tuple[OptimizerState, ...]:
    """The state tensors an optimizer keeps per parameter, in update order."""
    if kind is OptimizerKind.ADAM:
        return (OptimizerState.ADAM_M, OptimizerState.ADAM_V)
    return (OptimizerState.MOMENTUM,) if momentum else ()


def state_names(param: str, kind: OptimizerKind, momentum: float) -> tuple[str, ...]:
    """The names of ``param``'s optimizer-state tensors (the one source of these names)."""
    return tuple(state.of(param) for state in state_kinds(kind, momentum))


def _state_value(graph: ir.Graph, name: str, like: ir.Value) -> ir.Value:
    """A zero-initialised state that is both a graph input and an initializer."""
    shape = static_shape(like)
    dtype = like.dtype.numpy()
    value = ir.Value(name=name, type=ir.TensorType(like.dtype), shape=ir.Shape(shape))
    # Zeros made when read: the search never reads them, and compile streams them.
    value.const_value = ir.LazyTensor(
        lambda: ir.tensor(np.zeros(shape, dtype=dtype)), like.dtype, ir.Shape(shape), name=name
    )
    graph.register_initializer(value)
    graph.inputs.append(value)
    return value


def step_counter(graph: ir.Graph) -> ir.Value:
    """The shared float scalar step count for Adam's bias correction."""
    value = ir.Value(name=STEP_NAME, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    value.const_value = ir.tensor(np.zeros((), dtype=np.float32), name=STEP_NAME)
    graph.register_initializer(value)
    graph.inputs.append(value)
    return value


def build_update(
    b: Builder,
    graph: ir.Graph,
    param: ir.Value,
    grad: ir.Value,
    opts: OptimizerOptions,
    new_step: ir.Value | None,
) -> Update:
    """Append the update of one parameter; returns its states and new values."""
    if opts.kind is OptimizerKind.SGD:
        return _sgd(b, graph, param, grad, opts)
    assert new_step is not None
    return _adam(b, graph, param, grad, opts, new_step)


def _sgd(b, graph, param, grad, opts) -> Update:
    lr = b.factor_like(opts.lr, param)
    if not opts.momentum:
        new_p = b.op("Sub", [param, b.op("Mul", [lr, grad])])
        return Update((), (new_p,))
    (name,) = state_names(param.name, opts.kind, opts.momentum)
    mom = _state_value(graph, name, param)
    new_mom = b.op("Add", [b.op("Mul", [b.factor_like(opts.momentum, param), mom]), grad])
    new_p = b.op("Sub", [param, b.op("Mul", [lr, new_mom])])
    return Update((mom,), (new_p, new_mom))


def _adam(b, graph, param, grad, opts, new_step) -> Update:
    m_name, v_name = state_names(param.name, opts.kind, opts.momentum)
    m = _state_value(graph, m_name, param)
    v = _state_value(graph, v_name, param)
    c = lambda x: b.factor_like(x, param)  # noqa: E731
    new_m = b.op("Add", [b.op("Mul", [c(opts.beta1), m]), b.op("Mul", [c(1 - opts.beta1), grad])])
    g2 = b.op("Mul", [grad, grad])
    new_v = b.op("Add", [b.op("Mul", [c(opts.beta2), v]), b.op("Mul", [c(1 - opts.beta2), g2])])
    step = b.op("Cast", [new_step], {"to": param.dtype.value})
    bias1 = b.op("Sub", [c(1.0), b.op("Pow", [c(opts.beta1), step])])
    bias2 = b.op("Sub", [c(1.0), b.op("Pow", [c(opts.beta2), step])])
    m_hat = b.op("Div", [new_m, bias1])
    denom = b.op("Add", [b.op("Sqrt", [b.op("Div", [new_v, bias2])]), c(opts.eps)])
    delta = b.op("Mul", [c(opts.lr), b.op("Div", [m_hat, denom])])
    new_p = b.op("Sub", [param, delta])
    return Update((m, v), (new_p, new_m, new_v))
