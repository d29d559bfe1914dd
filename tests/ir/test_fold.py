"""Constant shape arithmetic and sequences of unoptimized exports folded at import
(``tensoropt/ir/fold.py``): the folded graph computes what the file computes (checked
with onnxruntime), what a parameter feeds stays a node, and the constants made are never
trained."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from tensoropt.ir.importer import export_model, import_model
from tensoropt.ir.vocab import MADE_KEY
from tensoropt.passes.training_step import TrainingOptions, build_training_step


def _model(nodes, inputs, outputs, initializers=()):
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in inputs.items()],
        [h.make_tensor_value_info(n, T.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])


def _imported(tmp_path, model, inputs) -> onnx.ModelProto:
    """The model as imported, exported again; outputs checked equal to the file's."""
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    ours = export_model(import_model(path))
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(ours.SerializeToString(), providers=["CPUExecutionProvider"])
    for a, b in zip(want.run(None, feeds), got.run(None, feeds), strict=True):
        np.testing.assert_array_equal(b, a)
    return ours


def test_shape_arithmetic_folds_into_constants(tmp_path):
    """x.view(x.shape[0], -1, 3) * (1 / sqrt(x.shape[-1])), spelled as an unoptimized
    export does: Shape, Gather, Unsqueeze, Concat, Cast, Sqrt, CastLike."""
    inputs = {"x": [2, 4, 6]}
    nodes = [
        h.make_node("Shape", ["x"], ["shape"]),
        h.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        h.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        h.make_node("Concat", ["batch1", "rest"], ["target"], axis=0),
        h.make_node("Reshape", ["x", "target"], ["view"]),
        h.make_node("Gather", ["shape", "last"], ["width"], axis=0),
        h.make_node("Cast", ["width"], ["widthf"], to=T.FLOAT),
        h.make_node("Sqrt", ["widthf"], ["root"]),
        h.make_node("Reciprocal", ["root"], ["scale"]),
        h.make_node("CastLike", ["scale", "view"], ["scale_like"]),
        h.make_node("Mul", ["view", "scale_like"], ["y"]),
    ]
    inits = [
        ("zero", np.int64(0)),
        ("last", np.int64(-1)),
        ("axes0", np.array([0], np.int64)),
        ("rest", np.array([-1, 3], np.int64)),
    ]
    ours = _imported(tmp_path, _model(nodes, inputs, ["y"], inits), inputs)
    assert [n.op_type for n in ours.graph.node] == ["Reshape", "Mul"]


def test_a_sequence_read_at_constant_positions_becomes_a_split(tmp_path):
    """``torch.split`` unoptimized: SplitToSequence read by SequenceAt. Kept pieces are
    the Split's outputs; ``keepdims=0`` pieces (``unbind``) are squeezed."""
    inputs = {"x": [2, 3, 6]}
    nodes = [
        h.make_node("SplitToSequence", ["x", "sizes"], ["seq"], axis=2),
        h.make_node("SequenceAt", ["seq", "p0"], ["y0"]),
        h.make_node("SequenceAt", ["seq", "p1"], ["y1"]),
        h.make_node("SequenceAt", ["seq", "pm1"], ["y2"]),
        h.make_node("SplitToSequence", ["x"], ["each"], axis=1, keepdims=0),
        h.make_node("SequenceAt", ["each", "p1"], ["y3"]),
    ]
    inits = [
        ("sizes", np.array([2, 2, 2], np.int64)),
        ("p0", np.int64(0)),
        ("p1", np.int64(1)),
        ("pm1", np.int64(-1)),
    ]
    ours = _imported(tmp_path, _model(nodes, inputs, ["y0", "y1", "y2", "y3"], inits), inputs)
    assert sorted(n.op_type for n in ours.graph.node) == ["Split", "Split", "Squeeze"]


def test_what_a_parameter_feeds_stays_in_the_graph_and_trains(tmp_path):
    """A relative position bias: a table gathered at constant buckets. The buckets
    (integers) fold; the Gather of the table (a float initializer) is no fold, so the
    table is what trains; the folded buckets and the Constant node's value are
    initializers the importer made, never trained."""
    inputs = {"x": [2, 4, 4]}
    nodes = [
        h.make_node("Constant", [], ["four"], value=numpy_helper.from_array(np.int64(4))),
        h.make_node("Range", ["zero", "four", "one"], ["pos"]),
        h.make_node("Unsqueeze", ["pos", "axes0"], ["row"]),
        h.make_node("Unsqueeze", ["pos", "axes1"], ["col"]),
        h.make_node("Sub", ["row", "col"], ["rel"]),
        h.make_node("Abs", ["rel"], ["bucket"]),
        h.make_node("Gather", ["table", "bucket"], ["bias"], axis=0),
        h.make_node("Add", ["x", "bias"], ["y"]),
    ]
    table = np.arange(4, dtype=np.float32) / 10
    inits = [
        ("zero", np.int64(0)),
        ("one", np.int64(1)),
        ("axes0", np.array([0], np.int64)),
        ("axes1", np.array([1], np.int64)),
        ("table", table),
    ]
    model = _model(nodes, inputs, ["y"], inits)
    ours = _imported(tmp_path, model, inputs)
    assert [n.op_type for n in ours.graph.node] == ["Gather", "Add"]
    path = tmp_path / "m.onnx"
    imported = import_model(path)
    made = {n for n, v in imported.graph.initializers.items() if MADE_KEY in v.metadata_props}
    assert "bucket" in made
    step = build_training_step(imported, TrainingOptions())
    assert step.signature.params == ("table",)


def test_a_scalar_shaped_parameter_is_no_constant(tmp_path):
    """A learned scale of shape [1] (``nn.Parameter(torch.ones(1))``): ``exp(scale)``
    reads only it and constants, but it may be trained, so the Exp stays."""
    inputs = {"x": [2, 3]}
    nodes = [h.make_node("Exp", ["scale"], ["e"]), h.make_node("Mul", ["x", "e"], ["y"])]
    model = _model(nodes, inputs, ["y"], [("scale", np.array([0.5], np.float32))])
    ours = _imported(tmp_path, model, inputs)
    assert [n.op_type for n in ours.graph.node] == ["Exp", "Mul"]
    step = build_training_step(import_model(tmp_path / "m.onnx"), TrainingOptions())
    assert step.signature.params == ("scale",)
