"""Reverse-mode automatic differentiation over an onnx-ir graph.

``build_gradients`` appends the backward graph of ``loss`` with respect to
``wrt`` to the same graph, using a :class:`GradRegistry` of per-op rules.

Pre: the graph is topologically sorted, every forward value on a path from
``wrt`` to ``loss`` has a static shape. Post: returns one gradient value per
``wrt`` entry (zeros where the value does not reach the loss); every new node
is tagged ``tensoropt.role=backward`` and ``tensoropt.unit=<forward node>``.
Gradients of a value used several times (tied parameters) accumulate with Add.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from tensoropt.errors import UnsupportedOpError
from tensoropt.ir.builder import Builder, static_shape
from tensoropt.ir.vocab import UNIT_KEY, Role
from tensoropt.rules.grad.api import GradContext, GradRegistry

_FLOAT_TYPES = {
    ir.DataType.FLOAT,
    ir.DataType.DOUBLE,
    ir.DataType.FLOAT16,
    ir.DataType.BFLOAT16,
}


GRAD_OF_KEY = "tensoropt.grad_of"
# node metadata of an Add that sums two gradient contributions of a value used more than
# once (the value's name): the cost model prices these (cost.model.accumulations)
ACCUMULATES_KEY = "tensoropt.accumulates"


def mark_grad_of(grad: ir.Value, primal: ir.Value) -> None:
    """Record that ``grad`` is the gradient of ``primal``. A rule that passes a gradient
    through (Add, Sub, Identity) makes one value the gradient of several primals: all are
    kept, comma-separated."""
    name = primal.name or ""
    names = grad.metadata_props.get(GRAD_OF_KEY)
    if names is None:
        grad.metadata_props[GRAD_OF_KEY] = name
    elif name not in names.split(","):
        grad.metadata_props[GRAD_OF_KEY] = f"{names},{name}"


def grad_of(value: ir.Value) -> list[str]:
    """The primals ``value`` is the gradient of (empty: not a gradient)."""
    names = value.metadata_props.get(GRAD_OF_KEY)
    return names.split(",") if names else []


def is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in _FLOAT_TYPES


def _may_be_float(value: ir.Value | None) -> bool:
    """Float, or of unknown dtype (values made by a Builder before shape inference,
    e.g. the loss nodes): such values may carry a gradient."""
    return value is not None and (value.dtype is None or value.dtype in _FLOAT_TYPES)


def _reaching(graph: ir.Graph, wrt: Sequence[ir.Value], registry: GradRegistry) -> set[ir.Value]:
    """Float values that depend differentiably on some ``wrt`` value."""
    live: set[ir.Value] = set(wrt)
    for node in graph:
        if registry.is_non_differentiable(node.op_type):
            continue
        if any(v in live for v in node.inputs if v is not None):
            live.update(v for v in node.outputs if _may_be_float(v))
    return live


def _contributing(graph: ir.Graph, loss: ir.Value) -> set[ir.Node]:
    """Nodes whose outputs the loss depends on."""
    needed: set[ir.Node] = set()
    stack = [loss.producer()]
    while stack:
        node = stack.pop()
        if node is None or node in needed:
            continue
        needed.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None)
    return needed


def unit_of(node: ir.Node) -> str:
    return node.metadata_props.get(UNIT_KEY, node.name or "")


def build_gradients(
    graph: ir.Graph,
    loss: ir.Value,
    wrt: Sequence[ir.Value],
    registry: GradRegistry,
    builder: Builder,
    batch_dims: Mapping[ir.Value, int] | None = None,
) -> list[ir.Value]:
    """Append the backward graph; return d(loss)/d(w) for each ``w`` in ``wrt``.
    ``batch_dims``: the batch dimension of forward values, for the rules that lay out
    their backward by it (a linear layer's weight gradient)."""
    live = _reaching(graph, wrt, registry)
    contributing = _contributing(graph, loss)
    order = [n for n in graph if n in contributing]
    missing = sorted(
        {
            f"{n.op_type} (node {n.name})"
            for n in order
            if registry.get(n.op_type) is None
            and not registry.is_non_differentiable(n.op_type)
            and any(v in live for v in n.inputs if v is not None)
        }
    )
    if missing:
        raise UnsupportedOpError(
            f"no gradient rule for: {', '.join(missing)}; freeze the parameters that feed "
            "them (--freeze REGEX) or file an issue for the op"
        )
    grads: dict[ir.Value, list[ir.Value]] = {}
    seed_b = builder.tagged(role=Role.BACKWARD, unit=unit_of(loss.producer()))
    seed_dtype = loss.dtype.numpy() if loss.dtype is not None else np.float32
    grads[loss] = [seed_b.const(np.ones(static_shape(loss), dtype=seed_dtype))]
    for node in reversed(order):
        if registry.is_non_differentiable(node.op_type):
            continue
        needs = tuple(v in live and _may_be_float(v) for v in node.inputs)
        if not any(needs):
            continue
        b = builder.tagged(role=Role.BACKWARD, unit=unit_of(node))
        grad_outputs = tuple(_total(b, grads.get(v), v) for v in node.outputs)
        if all(g is None for g in grad_outputs):
            continue
        rule = registry.get(node.op_type)
        assert rule is not None
        results = list(rule(GradContext(b, node, grad_outputs, needs, batch_dims or {})))
        if len(results) < len(node.inputs):
            results += [None] * (len(node.inputs) - len(results))
        if len(results) != len(node.inputs):
            raise AssertionError(
                f"gradient rule for {node.op_type} returned {len(results)} gradients "
                f"for {len(node.inputs)} inputs"
            )
        for value, grad, need in zip(node.inputs, results, needs, strict=True):
            if need and grad is not None:
                mark_grad_of(grad, value)
                grads.setdefault(value, []).append(grad)
    out = []
    for w in wrt:
        consumers = [u.node for u in w.uses()]
        unit = unit_of(consumers[0]) if consumers else w.name or ""
        b = builder.tagged(role=Role.BACKWARD, unit=unit)
        total = _total(b, grads.get(w), w)
        if total is None:
            dtype = w.dtype.numpy() if w.dtype is not None else np.float32
            total = b.const(np.zeros(static_shape(w), dtype=dtype))
        out.append(total)
    return out


def _total(b: Builder, parts: list[ir.Value] | None, primal: ir.Value) -> ir.Value | None:
    """Sum of gradient contributions (pairwise Adds, deterministic order)."""
    if not parts:
        return None
    total = parts[0]
    for part in parts[1:]:
        total = b.op("Add", [total, part])
        mark_grad_of(total, primal)
        producer = total.producer()
        assert producer is not None
        producer.metadata_props[ACCUMULATES_KEY] = primal.name or ""
    parts[:] = [total]
    return total
