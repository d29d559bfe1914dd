"""The training-step pass on every zoo model: valid ONNX, right gradients, learns."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tensoropt.models import MODEL_NAMES, build_model
from tensoropt.passes.loss import LossKind
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
from tensoropt.passes.training_step import TrainingOptions, read_signature
from tensoropt.runtime.data import input_specs, make_batch
from tensoropt.runtime.single import StepSession
from tests.helpers.f64 import to_float64
from tests.helpers.steps import step_proto, zoo_step

# ORT's CPU build has no float64 Conv or Erf kernels: those models are checked in float32.
FLOAT32_ONLY = {"bert", "vgg16", "resnet50", "wide_resnet", "inception_v3"}
PLAIN_SGD = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind.SGD, lr=1.0, momentum=0.0))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_step_graph_is_valid_onnx_with_contract(name):
    proto, step = zoo_step(name)
    onnx.checker.check_model(proto, full_check=True)
    sig = read_signature(proto)
    outputs = [o.name for o in proto.graph.output]
    assert outputs[0] == "loss"
    assert outputs[1:] == [f"{n}__new" for n in (*sig.params, *sig.states)]
    inputs = {i.name for i in proto.graph.input}
    assert set(sig.params) <= inputs and set(sig.states) <= inputs
    roles = {
        p.value for n in proto.graph.node for p in n.metadata_props if p.key == "tensoropt.role"
    }
    assert {"forward", "loss", "backward", "optimizer"} <= roles


def _loss_and_grads(proto, batch, params):
    """Loss at ``params`` and the gradient, read off one plain-SGD step with lr = 1."""
    session = StepSession(proto)
    state = {**session.initial_state(), **params}
    loss, new = session.step(state, batch)
    grads = {k: state[k] - new[k] for k in session.signature.params}
    return loss, grads, session


def _directions(params, rng):
    """A random unit direction over all parameters, then single random coordinates."""
    direction = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    norm = np.sqrt(sum(np.sum(v * v) for v in direction.values()))
    yield {k: (v / norm).astype(params[k].dtype) for k, v in direction.items()}
    keys = list(params)
    while True:
        key = keys[rng.integers(len(keys))]
        d = {k: np.zeros_like(v) for k, v in params.items()}
        flat = d[key].reshape(-1)
        flat[rng.integers(flat.size)] = 1.0
        yield d


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_whole_model_gradient_matches_finite_differences(name):
    """Directional derivatives of the loss equal the gradient's projections.

    float64 models: central differences at h = 1e-6 on a random unit direction and
    three coordinates. float32 models (ORT has no float64 Conv/Erf): float32 differences
    need h ~ 1e-2, where ReLU kinks are crossed everywhere, so these models are checked
    with ReLU swapped for Softplus (same graph otherwise; ReLU's own rule is checked in
    float64 by the rule tests), and a direction counts only where differences at h and
    h/2 agree (no MaxPool argmax flip within +-h); at least four such directions must be
    found among twenty and all must match.
    """
    forward = build_model(name, "tiny")
    f64 = name not in FLOAT32_ONLY
    if f64:
        forward = to_float64(forward)
    else:
        for node in forward.graph.node:  # see the docstring: kinks defeat float32 FD
            if node.op_type == "Relu":
                node.op_type = "Softplus"
    proto, step = step_proto(forward, PLAIN_SGD)
    batch = make_batch(input_specs(proto, step.signature), 0, seed=1)
    session0 = StepSession(proto)
    params = {k: v for k, v in session0.initial_state().items() if k in step.signature.params}
    loss, grads, session = _loss_and_grads(proto, batch, params)
    state0 = session.initial_state()

    def fd(d, h):
        plus = {**state0, **{k: params[k] + h * d[k] for k in params}}
        minus = {**state0, **{k: params[k] - h * d[k] for k in params}}
        return (session.step(plus, batch)[0] - session.step(minus, batch)[0]) / (2 * h)

    # float64: accurate to ~1e-8 relative. float32: round-off eps*|L|/h ~ 3e-5 at h = 5e-3.
    h, rtol, atol = (1e-6, 1e-5, 1e-8) if f64 else (1e-2, 2e-2, 1e-4)
    checked = 0
    directions = _directions(params, np.random.default_rng(0))
    for _ in range(4 if f64 else 20):
        d = next(directions)
        estimate = fd(d, h)
        if not f64:
            half = fd(d, h / 2)
            if abs(estimate - half) > atol + rtol * max(abs(estimate), abs(half)):
                continue  # a kink within +-h: differences say nothing here
            estimate = half
        analytic = float(sum(np.sum(grads[k].astype(np.float64) * d[k]) for k in params))
        close = abs(estimate - analytic) <= atol + rtol * max(abs(estimate), abs(analytic))
        assert close, (name, estimate, analytic)
        checked += 1
    assert checked >= 4, f"only {checked} smooth directions found for {name}"


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_ten_steps_lower_the_loss(name, optimizer):
    lr = 0.05 if optimizer == "sgd" else 0.01
    opts = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind(optimizer), lr=lr))
    proto, step = zoo_step(name, opts)
    session = StepSession(proto)
    specs = input_specs(proto, step.signature)
    batch = make_batch(specs, 0, seed=3)  # one fixed batch: the loss must fall on it
    state = session.initial_state()
    losses = []
    for _ in range(10):
        loss, state = session.step(state, batch)
        losses.append(loss)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0], losses


def test_tied_parameter_gradients_accumulate():
    """One initializer used by two MatMuls: its gradient is the sum of both uses."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 4))
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3, 4])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("MatMul", ["h", "W"], ["y"]),
        ],
        "tied",
        [x],
        [y],
        [numpy_helper.from_array(w, "W")],
    )
    proto, step = step_proto(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]),
        TrainingOptions(
            loss=LossKind.MSE,
            optimizer=PLAIN_SGD.optimizer,
        ),
    )
    assert step.signature.params == ("W",)
    batch = make_batch(input_specs(proto, step.signature), 0, seed=0)
    _, grads, _ = _loss_and_grads(proto, batch, {"W": w})
    xb, lab = batch["x"], batch["labels"]
    h = xb @ w
    dy = 2 * (h @ w - lab) / lab.size
    expected = h.T @ dy + xb.T @ (dy @ w.T)
    np.testing.assert_allclose(grads["W"], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_optimizer_factors_match_the_parameter_rank(optimizer):
    """The update's constant factors have the rank of the tensor they scale: onnxruntime
    broadcasts a rank-0 factor against a [.., 1] tensor element by element (~20x slower
    on a 1x1 convolution's weight), so a scalar there would be a performance bug."""
    opts = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind(optimizer)))
    proto, _ = zoo_step("resnet50", opts)
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    values = (*inferred.input, *inferred.value_info, *inferred.output)
    rank = {v.name: len(v.type.tensor_type.shape.dim) for v in values}
    consts = {
        n.output[0]: len(onnx.numpy_helper.to_array(n.attribute[0].t).shape)
        for n in proto.graph.node
        if n.op_type == "Constant"
    }
    checked = 0
    for node in proto.graph.node:
        role = {p.key: p.value for p in node.metadata_props}.get("tensoropt.role")
        if role != "optimizer" or node.op_type not in ("Mul", "Add", "Sub", "Div"):
            continue
        factors = [consts[i] for i in node.input if i in consts]
        tensors = [rank[i] for i in node.input if i not in consts and rank.get(i, 0) > 0]
        if factors and tensors:
            assert factors == [max(tensors)] * len(factors), node.name
            checked += 1
    assert checked > 100  # every conv weight's update, at least
