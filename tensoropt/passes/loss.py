"""Loss construction: turn a model output into a scalar ``loss`` value.

``auto``: a scalar float output is the loss itself; a float output of rank >= 2
(logits) gets cross entropy against integer labels of shape ``logits[:-1]``; a
rank-1 float output gets mean squared error. With several outputs, the first one
is used and the others are dropped from the step graph (said in the log).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import onnx_ir as ir

from tensoropt.errors import TensorOptError
from tensoropt.ir.builder import Builder, static_shape
from tensoropt.ir.vocab import ROLE_KEY, UNIT_KEY, Role
from tensoropt.passes.autodiff import is_float

log = logging.getLogger(__name__)


class LossKind(enum.Enum):
    AUTO = "auto"
    CE = "ce"
    MSE = "mse"


@dataclass(frozen=True, slots=True)
class LossSpec:
    """What was built: the loss value, the labels input (if any) and its shape."""

    loss: ir.Value
    labels: ir.Value | None
    source: ir.Value


def _pick_output(graph: ir.Graph) -> ir.Value:
    floats = [v for v in graph.outputs if is_float(v)]
    if not floats:
        raise TensorOptError(
            "the model has no float output to build a loss from; export the logits or the loss"
        )
    if len(graph.outputs) > 1:
        log.warning(
            "model has %d outputs; the loss uses %r, the others are dropped",
            len(graph.outputs),
            floats[0].name,
        )
    return floats[0]


def resolve_kind(kind: LossKind, output: ir.Value) -> LossKind | None:
    """The concrete loss for ``auto`` (None means: the output is the loss)."""
    rank = len(static_shape(output))
    if kind is LossKind.AUTO:
        if rank == 0:
            return None
        return LossKind.CE if rank >= 2 else LossKind.MSE
    if kind is LossKind.CE and rank < 2:
        raise TensorOptError(
            f"--loss ce needs logits of rank >= 2 ([..., classes]); output {output.name!r} "
            f"has shape {list(static_shape(output))}; use --loss mse"
        )
    return kind


def _free_name(graph: ir.Graph, name: str) -> None:
    """Rename a value the model itself calls ``name`` (its own scalar loss, say) to
    ``model_<name>``, so that the step's ``name`` is defined once; a graph input or
    initializer of that name is fed or trained by it and is refused."""
    for value in (*graph.inputs, *graph.initializers.values()):
        if value.name == name:
            raise TensorOptError(
                f"the model's input or initializer {name!r} has the name the training step "
                f"gives its {name}; re-export the model with another name for it"
            )
    taken = {v.name for node in graph for v in node.outputs}
    for node in graph:
        for value in node.outputs:
            if value.name == name:
                new = f"model_{name}"
                while new in taken:
                    new = f"model_{new}"
                value.name = new


def build_loss(graph: ir.Graph, kind: LossKind, builder: Builder) -> LossSpec:
    """Append loss nodes (role=loss); the scalar result is named ``loss``."""
    output = _pick_output(graph)
    _free_name(graph, "loss")
    concrete = resolve_kind(kind, output)
    b = builder.tagged(role=Role.LOSS, unit="loss")
    labels = None
    if concrete is None:
        loss = b.op("Identity", [output], dtype=output.dtype, shape=static_shape(output))
    elif concrete is LossKind.CE:
        _free_name(graph, "labels")
        shape = static_shape(output)
        labels = ir.Value(
            name="labels", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(shape[:-1])
        )
        dt = output.dtype
        picked_shape = (*shape[:-1], 1)
        last = len(shape) - 1  # a positive axis: some evaluators mishandle -1 here
        logp = b.op("LogSoftmax", [output], {"axis": last}, dtype=dt, shape=shape)
        index = b.op(
            "Unsqueeze", [labels, b.ints([last])], dtype=ir.DataType.INT64, shape=picked_shape
        )
        picked = b.op("GatherElements", [logp, index], {"axis": last}, dtype=dt, shape=picked_shape)
        mean = b.op("ReduceMean", [picked], {"keepdims": 0}, dtype=dt, shape=())
        loss = b.op("Neg", [mean])
    else:
        _free_name(graph, "labels")
        shape = static_shape(output)
        labels = ir.Value(name="labels", type=ir.TensorType(output.dtype), shape=ir.Shape(shape))
        dt = output.dtype
        diff = b.op("Sub", [output, labels], dtype=dt, shape=shape)
        square = b.op("Mul", [diff, diff], dtype=dt, shape=shape)
        loss = b.op("ReduceMean", [square], {"keepdims": 0})
    loss.name = "loss"
    loss.dtype = output.dtype
    loss.shape = ir.Shape([])
    if labels is not None:
        graph.inputs.append(labels)
    # Each loss node is a decision unit of its own, like a forward node: its backward
    # nodes carry its name as their unit.
    for node in graph:
        if node.metadata_props.get(ROLE_KEY) == "loss":
            node.metadata_props[UNIT_KEY] = node.name
    graph.outputs.clear()
    graph.outputs.append(loss)
    return LossSpec(loss, labels, output)


def labels_high(spec: LossSpec) -> int | None:
    """Exclusive upper bound of synthetic integer labels (the class count)."""
    if spec.labels is None or spec.labels.dtype != ir.DataType.INT64:
        return None
    return int(static_shape(spec.source)[-1])


__all__ = ["LossKind", "LossSpec", "build_loss", "labels_high", "resolve_kind"]
