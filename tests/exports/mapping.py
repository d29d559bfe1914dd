"""Map the initializers of a torch.onnx export back to the torch parameters, by value.

The exporter renames parameters it folds (``val_9`` for ``h.0.c_attn.weight``
transposed), cuts position embeddings to the rows used, broadcasts a cls token to
the batch, and folds BatchNorm into Conv. Names therefore say little; values say
everything, because the test models have unique random values (see models.py).

An initializer ``V`` maps to a torch parameter ``P`` through one of:

* ``same``: ``V == P``;
* ``transposed``: ``V == P.T`` (a Linear weight stored as ``[in, out]``);
* ``rows``: ``V`` viewed as rows of ``P.shape[-1]`` equals the first rows of ``P``
  (a position table cut to the sequence length, with leading 1-dims added);
* ``broadcast``: ``P`` has a leading 1-dim and every ``V[i]`` equals ``P[0]`` (a
  cls token expanded to the batch);
* ``reshaped``: ``V`` is ``P`` with 1-dims added (a GroupNorm weight ``[C]`` stored
  as ``[C, 1, 1]`` for the affine Mul after the normalisation).

Equality is ``allclose`` at float32 precision (BN folding rounds differently in
onnxscript and torch). Each mapping turns the gradient of ``V`` into a
contribution to the gradient of ``P``; contributions of several initializers to
one parameter add up (a tie the exporter did not keep).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


class How(enum.Enum):
    SAME = "same"
    TRANSPOSED = "transposed"
    ROWS = "rows"
    BROADCAST = "broadcast"
    RESHAPED = "reshaped"


@dataclass(frozen=True, slots=True)
class Match:
    initializer: str
    param: str
    how: How


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.allclose(
        a, b, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(b).max())
    )


def _how(v: np.ndarray, p: np.ndarray) -> How | None:
    if _close(v, p):
        return How.SAME
    if v.ndim == 2 and p.ndim == 2 and _close(v, p.T):
        return How.TRANSPOSED
    if p.ndim == 2 and v.size % p.shape[-1] == 0 and v.shape[-1] == p.shape[-1]:
        rows = v.size // p.shape[-1]
        if rows < p.shape[0] and _close(v.reshape(rows, -1), p[:rows]):
            return How.ROWS
    broadcast = p.ndim >= 2 and p.shape[0] == 1 and v.shape[1:] == p.shape[1:]
    if broadcast and v.shape[0] > 1 and all(_close(v[i : i + 1], p) for i in range(v.shape[0])):
        return How.BROADCAST
    squeezed = tuple(d for d in v.shape if d != 1)
    ones_added = v.shape != p.shape and squeezed == tuple(d for d in p.shape if d != 1)
    if ones_added and _close(v.reshape(p.shape), p):
        return How.RESHAPED
    return None


def match_initializers(
    initializers: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray]
) -> dict[str, Match]:
    """initializer name -> its torch parameter, for every float initializer that has one.

    Raises if an initializer matches more than one parameter (the mapping would be a
    guess).
    """
    found: dict[str, Match] = {}
    for name, v in initializers.items():
        if v.dtype.kind != "f":
            continue
        if v.ndim == 0:  # scalar constants abound: a scalar parameter is matched by name
            p = params.get(name)
            if p is not None and p.ndim == 0 and _close(v, p):
                found[name] = Match(name, name, How.SAME)
            continue
        hits = [(p, how) for p, arr in params.items() if (how := _how(v, arr)) is not None]
        if len(hits) > 1:
            raise AssertionError(f"initializer {name} matches several parameters: {hits}")
        if hits:
            found[name] = Match(name, hits[0][0], hits[0][1])
    return found


def to_param_grad(match: Match, grad: np.ndarray, param_shape: tuple[int, ...]) -> np.ndarray:
    """The contribution of the initializer's gradient to the parameter's gradient."""
    if match.how is How.SAME:
        return grad
    if match.how is How.TRANSPOSED:
        return grad.T
    if match.how is How.ROWS:
        out = np.zeros(param_shape, grad.dtype)
        rows = grad.size // param_shape[-1]
        out[:rows] = grad.reshape(rows, -1)
        return out
    if match.how is How.RESHAPED:
        return grad.reshape(param_shape)
    return grad.sum(axis=0, keepdims=True)


def step_gradients(path, feeds: Mapping[str, np.ndarray], loss, params: Mapping[str, np.ndarray]):
    """(loss, {torch parameter: its gradient}, trained initializers that map to no
    parameter) of the training step built from the export at ``path`` with loss kind
    ``loss``. Each gradient is the step's own value (the ``g`` of plain SGD's
    ``p - lr * g``), made an output of the step and run in onnxruntime."""
    import onnx
    from onnx import numpy_helper

    from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
    from tensoropt.passes.training_step import TrainingOptions
    from tests.helpers.steps import step_proto

    model = onnx.load(str(path))
    sgd = OptimizerOptions(OptimizerKind.SGD, lr=1.0, momentum=0.0)
    proto, step = step_proto(model, TrainingOptions(loss, sgd))
    value, gradient = run_gradients(proto, step.signature, feeds)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    matches = match_initializers(inits, params)
    grads: dict[str, np.ndarray] = {}
    for init, g in gradient.items():
        if init in matches:
            m = matches[init]
            part = to_param_grad(m, g, params[m.param].shape)
            grads[m.param] = grads.get(m.param, 0) + part
    return value, grads, set(step.signature.params) - set(matches)


def run_gradients(proto, signature, feeds: Mapping[str, np.ndarray]):
    """(loss, {trained initializer: its gradient}) of a plain-SGD training step ``proto``
    run in onnxruntime on its initial values and ``feeds``: each gradient is the step's
    own value (:func:`sgd_gradients`), made an output of a copy of ``proto``."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    gradient = sgd_gradients(proto, signature)
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for name in gradient.values():
        copy.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    state = {
        t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if t.name in gradient
    }
    session = ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
    value, *values = session.run([signature.loss, *gradient.values()], {**feeds, **state})
    return float(value), dict(zip(gradient, values, strict=True))


def sgd_gradients(proto, signature) -> dict[str, str]:
    """parameter -> the name of its gradient in a plain-SGD step (``optimizer._sgd``
    without momentum: the parameter's carried new value is ``Sub(p, Mul(lr, g))``)."""
    producer = {out: node for node in proto.graph.node for out in node.output}
    new_of = {old: new for new, old in signature.carry}
    found = {}
    for p in signature.params:
        sub = producer[new_of[p]]
        mul = producer[sub.input[1]]
        assert sub.op_type == "Sub" and sub.input[0] == p and mul.op_type == "Mul", (sub, mul)
        found[p] = mul.input[1]
    return found


def assert_ce_gradients_equal_torch(model, path, feeds: Mapping[str, np.ndarray], logits) -> None:
    """The cross-entropy step built from the export at ``path``, fed ``feeds`` (its
    ``labels`` among them), has torch's loss on ``logits`` (``model``'s output on the same
    inputs) and every parameter's gradient to 1e-4 relative (each element, with a floor
    of 1e-6 of the largest); every trained initializer is a parameter."""
    import pytest
    import torch
    from torch.nn import functional as F

    from tensoropt.passes.loss import LossKind

    labels = torch.from_numpy(feeds["labels"])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    params = {k: p.detach().numpy() for k, p in model.named_parameters()}
    value, grads, unmatched = step_gradients(path, feeds, LossKind.CE, params)
    assert value == pytest.approx(loss.item(), rel=1e-5) and not unmatched, unmatched
    for name, p in model.named_parameters():
        want = p.grad.numpy()
        floor = 1e-6 * np.abs(want).max()
        np.testing.assert_array_less(np.abs(grads[name] - want), 1e-4 * np.abs(want) + floor)


def moved_activations(out) -> list[str]:
    """The collectives of device 0 other than all-reduces (of gradients and the loss),
    leaving out the gathers read by a ScatterND: an embedding's gradient, which the
    completion gathers where the batch's rows cost less than an all-reduce of the table.
    A data-parallel plan that keeps the batch split through the backward has none: a
    seq-first block's linear layers and a grouped convolution's weight gradient keep it
    in one contiguous block of rows or groups (rules/grad)."""
    import onnx

    from tensoropt.ir.vocab import COLLECTIVE_DOMAIN

    nodes = onnx.load(str(out / "device_0.onnx"), load_external_data=False).graph.node
    readers: dict[str, list[str]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    return [
        f"{node.op_type} {node.name} of {node.input[0]}"
        for node in nodes
        if node.domain == COLLECTIVE_DOMAIN
        and node.op_type != "AllReduce"
        and not (node.op_type == "AllGather" and set(readers[node.output[0]]) == {"ScatterND"})
    ]
