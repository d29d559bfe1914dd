"""LSTM, GRU and RNN unrolled at import (``tensoropt/ir/recurrent.py``): every output
equals onnxruntime's kernel on the node itself (batch-first layouts, which it does not
run, through ONNX's reference), over directions, biases, initial states, peepholes and
activations; what does not unroll is refused in one line."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from tensoropt.errors import UnsupportedOpError
from tensoropt.ir.importer import export_model, import_model
from tensoropt.ir.recurrent import RECURRENT

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
STEPS, BATCH, INPUT, HIDDEN = 5, 3, 4, 6


def _case(
    op, *, dirs=1, layout=0, bias=True, initial=False, zero=False, peep=False, seed=0, **attrs
):
    """A one-node model: X an input, the weights and states initializers; every output
    of the node is a graph output."""
    rng = np.random.default_rng(seed)
    g = GATES[op]

    def f(*shape):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)

    xs = [BATCH, STEPS, INPUT] if layout else [STEPS, BATCH, INPUT]
    state = [BATCH, dirs, HIDDEN] if layout else [dirs, BATCH, HIDDEN]
    inits = {"W": f(dirs, g * HIDDEN, INPUT), "R": f(dirs, g * HIDDEN, HIDDEN)}
    names = ["x", "W", "R"]
    if bias:
        inits["B"] = f(dirs, 2 * g * HIDDEN)
    names.append("B" if bias else "")
    names.append("")  # sequence_lens
    if initial:  # zero: the state torch exports for nn.LSTM's default, an all-zero constant
        inits["h0"] = f(*state) * (0 if zero else 1)
        names.append("h0")
        if op == "LSTM":
            inits["c0"] = f(*state) * (0 if zero else 1)
            names.append("c0")
    if peep:
        names += [""] * (7 - len(names))
        inits["P"] = f(dirs, 3 * HIDDEN)
        names.append("P")
    while names and names[-1] == "":
        names.pop()
    outs = ["y", "y_h", "y_c"] if op == "LSTM" else ["y", "y_h"]
    direction = {1: "forward", 2: "bidirectional"}[dirs]
    direction = attrs.pop("direction", direction)
    node = h.make_node(
        op, names, outs, name="rnn", hidden_size=HIDDEN, direction=direction, layout=layout,
        **attrs,
    )  # fmt: skip
    graph = h.make_graph(
        [node],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, xs)],
        [h.make_tensor_value_info(o, T.FLOAT, None) for o in outs],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])
    return model, {"x": f(*xs)}


def _run(model, feeds, reference: bool = False):
    if reference:
        return ReferenceEvaluator(model).run(None, feeds)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


CASES = {
    "lstm": ("LSTM", {}),
    "lstm reverse": ("LSTM", {"direction": "reverse"}),
    "lstm bidirectional, states": ("LSTM", {"dirs": 2, "initial": True}),
    "lstm batch first": ("LSTM", {"layout": 1, "initial": True}),
    "lstm peepholes": ("LSTM", {"peep": True, "initial": True}),
    "lstm peepholes, zero states": ("LSTM", {"peep": True, "initial": True, "zero": True}),
    "gru zero states": ("GRU", {"dirs": 2, "initial": True, "zero": True}),
    "lstm no bias, activations": (
        "LSTM", {"bias": False, "activations": ["Sigmoid", "Relu", "Tanh"]},
    ),
    "gru (torch: linear before reset)": ("GRU", {"linear_before_reset": 1, "initial": True}),
    "gru reset before linear": ("GRU", {"dirs": 2, "initial": True}),
    "gru batch first": ("GRU", {"layout": 1, "linear_before_reset": 1}),
    "rnn tanh": ("RNN", {"initial": True}),
    "rnn relu bidirectional": ("RNN", {"dirs": 2, "activations": ["Relu", "Relu"]}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_unrolled_recurrence_matches_the_kernel(tmp_path, case):
    op, kwargs = CASES[case]
    model, feeds = _case(op, **kwargs)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    ours = export_model(import_model(path))
    assert not RECURRENT & {n.op_type for n in ours.graph.node}
    onnx.checker.check_model(ours, full_check=True)  # the shapes declared are inferred ones
    want_all = _run(model, feeds, reference=bool(kwargs.get("layout")))
    for want, got in zip(want_all, _run(ours, feeds), strict=True):
        assert want.shape == got.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_unused_cell_state_is_not_computed(tmp_path):
    """torch reads Y only: the steps that make Y_c alone are left out."""
    model, _ = _case("LSTM")
    del model.graph.output[1:]
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    ours = export_model(import_model(path))
    assert [o.name for o in ours.graph.output] == ["y"]
    assert not [n for n in ours.graph.node if n.output[0].startswith("rnn__y_c")]


@pytest.mark.parametrize(
    ("attrs", "why"), [({"input_forget": 1}, "input_forget=1"), ({"clip": 0.5}, "clip")]
)
def test_a_recurrence_that_does_not_unroll_is_refused(tmp_path, attrs, why):
    model, _ = _case("LSTM", **attrs)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(UnsupportedOpError, match=f"LSTM node 'rnn': {why}"):
        import_model(path)
