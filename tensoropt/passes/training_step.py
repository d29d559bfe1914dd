"""Build one training-step graph from a forward model.

Pre: an imported model (static shapes, named and tagged nodes; see importer).
Post: the graph of docs/design/CONTRACTS.md ("Training-step graph"): inputs are
data, labels, parameters and optimizer state (parameters and state are also
initializers holding their initial values); outputs are ``loss`` and the new
parameters and state; the step signature is stored as model metadata.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from tensoropt.errors import TensorOptError
from tensoropt.ir.builder import Builder, static_shape
from tensoropt.ir.importer import SHAPE_ONLY_BYTES
from tensoropt.ir.vocab import Role
from tensoropt.passes.autodiff import build_gradients, unit_of
from tensoropt.passes.blocks import batch_dims
from tensoropt.passes.loss import LossKind, build_loss, labels_high
from tensoropt.passes.optimizer import (
    OptimizerKind,
    OptimizerOptions,
    build_update,
    step_counter,
)
from tensoropt.passes.trainable import TrainableSelection, select_trainable
from tensoropt.rules.grad import GRAD_RULES

log = logging.getLogger(__name__)

STEP_KEY = "tensoropt.step"
STEP_SCHEMA = "tensoropt.step/1"


@dataclass(frozen=True, slots=True)
class TrainingOptions:
    """Options of the training-step pass (CLI: --loss, --optimizer, --lr, ...)."""

    loss: LossKind = LossKind.AUTO
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    trainable: str | None = None
    freeze: str | None = None


@dataclass(frozen=True, slots=True)
class StepSignature:
    """The names a runner needs: what to feed and what carries to the next step."""

    loss: str
    data_inputs: tuple[str, ...]
    labels: str | None
    labels_high: int | None
    params: tuple[str, ...]
    states: tuple[str, ...]
    carry: tuple[tuple[str, str], ...]  # (output, input)
    optimizer: dict
    input_high: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict:
        return {
            "schema": STEP_SCHEMA,
            "loss": self.loss,
            "data_inputs": list(self.data_inputs),
            "labels": self.labels,
            "labels_high": self.labels_high,
            "input_high": dict(self.input_high),
            "params": list(self.params),
            "states": list(self.states),
            "carry": dict(self.carry),
            "optimizer": self.optimizer,
        }

    @staticmethod
    def from_json(data: dict) -> StepSignature:
        if data.get("schema") != STEP_SCHEMA:
            raise TensorOptError(f"unknown step schema {data.get('schema')!r}; recompile")
        return StepSignature(
            loss=data["loss"],
            data_inputs=tuple(data["data_inputs"]),
            labels=data["labels"],
            labels_high=data.get("labels_high"),
            params=tuple(data["params"]),
            states=tuple(data["states"]),
            carry=tuple(data["carry"].items()),
            optimizer=data["optimizer"],
            input_high=tuple(data.get("input_high", {}).items()),
        )


@dataclass(frozen=True, slots=True)
class TrainingStep:
    model: ir.Model
    signature: StepSignature
    selection: TrainableSelection


def read_signature(model: onnx.ModelProto | ir.Model) -> StepSignature:
    """The step signature stored in a training-step model's metadata."""
    if isinstance(model, ir.Model):
        raw = model.metadata_props.get(STEP_KEY)
    else:
        raw = next((p.value for p in model.metadata_props if p.key == STEP_KEY), None)
    if raw is None:
        raise TensorOptError(
            "this ONNX file is not a tensoropt training step (no tensoropt.step metadata); "
            "make one with `tensoropt train --export-step`"
        )
    return StepSignature.from_json(json.loads(raw))


# ops that carry an integer input's values to an index unchanged: (op, data slots)
_INDEX_CARRIERS = {
    "Reshape": (0,),
    "Slice": (0,),
    "Unsqueeze": (0,),
    "Squeeze": (0,),
    "Flatten": (0,),
    "Transpose": (0,),
    "Identity": (0,),
    "Expand": (0,),
    "Where": (1, 2),
}


def _index_high(graph: ir.Graph) -> dict[str, int]:
    """For int64 data inputs that index a table: its size along the indexed axis (the
    synthetic data bound). An index is a ``Gather``'s or ``GatherElements``' indices (a
    class loss's labels, ``ir/canonical._class_loss``), reached from the input through
    ops that move its values unchanged (a shift of the labels, a flattening)."""
    highs: dict[str, int] = {}
    for value in graph.inputs:
        if value.dtype != ir.DataType.INT64:
            continue
        todo, seen = [value], {value}
        while todo:
            carried = todo.pop()
            for use in carried.uses():
                node = use.node
                if node.op_type in ("Gather", "GatherElements") and use.idx == 1:
                    if node.inputs[0] is None:
                        continue
                    axis = node.attributes.get("axis")
                    axis_v = axis.value if axis is not None else 0
                    bound = static_shape(node.inputs[0])[axis_v]
                    highs[value.name] = min(highs.get(value.name, bound), bound)
                elif use.idx in _INDEX_CARRIERS.get(node.op_type, ()):
                    for out in node.outputs:
                        if out not in seen:
                            seen.add(out)
                            todo.append(out)
    return highs


def build_training_step(model: ir.Model, options: TrainingOptions) -> TrainingStep:
    """Append loss, backward and optimizer update to ``model`` (mutated in place)."""
    graph = model.graph
    data_inputs = tuple(v.name for v in graph.inputs if v.name not in graph.initializers)
    highs = _index_high(graph)
    builder = Builder(graph, prefix="t_")
    spec = build_loss(graph, options.loss, builder)
    selection = select_trainable(
        graph,
        [spec.source],
        GRAD_RULES.is_non_differentiable,
        trainable=options.trainable,
        freeze=options.freeze,
    )
    params = [graph.initializers[n] for n in selection.trained]
    batch = batch_dims(graph, data_inputs)
    grads = build_gradients(graph, spec.loss, params, GRAD_RULES, builder, batch)
    _remove_initializer_inputs(graph)
    for p in params:
        graph.inputs.append(p)
    opts = options.optimizer
    new_step = None
    states: list[ir.Value] = []
    new_states: list[ir.Value] = []
    new_params: list[ir.Value] = []
    if opts.kind is OptimizerKind.ADAM:
        step = step_counter(graph)
        sb = builder.tagged(role=Role.OPTIMIZER, unit="optimizer")
        new_step = sb.op("Add", [step, sb.scalar_like(1.0, step)])
        states.append(step)
        new_states.append(new_step)
    for p, g in zip(params, grads, strict=True):
        uses = p.uses()
        unit = unit_of(uses[0].node) if uses else p.name
        b = builder.tagged(role=Role.OPTIMIZER, unit=unit, param=p.name)
        update = build_update(b, graph, p, g, opts, new_step)
        new_params.append(update.outputs[0])
        states.extend(update.states)
        new_states.extend(update.outputs[1:])
    carry = []
    for old, new in zip([*params, *states], [*new_params, *new_states], strict=True):
        new.name = f"{old.name}__new"
        new.dtype = old.dtype
        new.shape = ir.Shape(static_shape(old))
        graph.outputs.append(new)
        carry.append((new.name, old.name))
    signature = StepSignature(
        loss=spec.loss.name,
        data_inputs=data_inputs,
        labels=spec.labels.name if spec.labels is not None else None,
        labels_high=labels_high(spec),
        params=tuple(p.name for p in params),
        states=tuple(s.name for s in states),
        carry=tuple(carry),
        optimizer=opts.to_json(),
        input_high=tuple(sorted(highs.items())),
    )
    model.metadata_props[STEP_KEY] = json.dumps(signature.to_json())
    model = _infer_shapes(model)
    log.info(selection.summary(model.graph))
    return TrainingStep(model, signature, selection)


def _remove_initializer_inputs(graph: ir.Graph) -> None:
    """Drop graph inputs that are initializers (IR<4 style); params are re-added."""
    keep = [v for v in graph.inputs if v.name not in graph.initializers]
    graph.inputs.clear()
    graph.inputs.extend(keep)


def _infer_shapes(model: ir.Model) -> ir.Model:
    """Whole-model ONNX shape inference over the step graph (data propagation only when
    plain inference leaves a shape open).

    The inferred types are copied by name onto the model's own values, which keeps every
    IR object (and its metadata) as it is; deserializing the inferred proto instead cost
    as much again as serializing it (GPT-2-medium step: 0.7 s of 1.6 s).
    """
    weights = _detach_large_weights(model.graph)
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        _attach_weights(model.graph, weights)
    values = {v.name: v for node in model.graph for v in node.outputs if v.name}
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
        if not _all_static(inferred, values):
            inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception as exc:
        raise AssertionError(f"shape inference failed on the training step: {exc}") from exc
    proto = inferred
    for info in (*proto.graph.value_info, *proto.graph.output):
        value = values.get(info.name)
        if value is None or not info.type.HasField("tensor_type"):
            continue
        tensor_type = info.type.tensor_type
        if tensor_type.elem_type:
            value.dtype = ir.DataType(tensor_type.elem_type)
        if tensor_type.HasField("shape"):
            value.shape = ir.serde.deserialize_type_proto_for_shape(info.type)
    return model


def _all_static(proto: onnx.ModelProto, values: dict[str, ir.Value]) -> bool:
    """Whether plain inference gave every named node output a type and static shape.

    Data propagation only adds to what plain inference finds, so when nothing is left
    open its result is the same; it costs superlinearly in the graph (GPT-3 175B shape's
    step, 66k nodes: 16 s against 0.3 s without), so it runs only when needed."""
    found = set()
    for info in (*proto.graph.value_info, *proto.graph.output):
        tensor_type = info.type.tensor_type
        if not tensor_type.elem_type or not tensor_type.HasField("shape"):
            continue
        if all(d.HasField("dim_value") for d in tensor_type.shape.dim):
            found.add(info.name)
    return all(name in found for name in values)


def _detach_large_weights(graph: ir.Graph) -> dict[str, ir.TensorProtocol]:
    """Swap large float initializers for data-free stand-ins; return the originals.

    Shape inference needs only their type and dims (see importer.without_large_weights);
    serializing the weights and parameter-sized optimizer state would cost several
    copies of them in time and memory.
    """
    detached: dict[str, ir.TensorProtocol] = {}
    for name, value in graph.initializers.items():
        tensor = value.const_value
        if tensor is None:
            continue
        if isinstance(tensor, ir.ExternalTensor):
            # Serialized as a reference (no bytes); re-attached so that it keeps the
            # base directory its data file is found in, which a round trip drops.
            detached[name] = tensor
            continue
        if not tensor.dtype.is_floating_point() or tensor.nbytes <= SHAPE_ONLY_BYTES:
            continue
        detached[name] = tensor
        value.const_value = ir.ExternalTensor(
            "__tensoropt_shape_only__",
            0,
            tensor.nbytes,
            tensor.dtype,
            shape=tensor.shape,
            name=name,
        )
    return detached


def _attach_weights(graph: ir.Graph, weights: dict[str, ir.TensorProtocol]) -> None:
    for name, tensor in weights.items():
        graph.initializers[name].const_value = tensor
