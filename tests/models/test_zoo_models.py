"""Zoo models: valid ONNX, run in onnxruntime, shapes follow the knobs, metadata is right."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

from tensoropt.errors import TensorOptError
from tensoropt.models import (
    MODEL_NAMES,
    ZooError,
    build_model,
    knobs_for,
    preset_config,
    zoo_info,
)

ALLOWED_OPS = {
    "MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Tanh", "Erf", "Gelu",
    "Sigmoid", "Relu", "Softmax", "LayerNormalization", "ReduceMean", "ReduceSum", "Reshape",
    "Transpose", "Split", "Slice", "Concat", "Unsqueeze", "Squeeze", "Expand", "Gather",
    "Where", "Cast", "Conv", "MaxPool", "AveragePool", "GlobalAveragePool",
    "BatchNormalization", "Flatten", "Constant", "Identity",
}  # fmt: skip


def _meta(model: onnx.ModelProto) -> dict:
    props = {p.key: p.value for p in model.metadata_props}
    return json.loads(props["tensoropt.zoo"])


def _random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    meta = _meta(model)
    feeds = {}
    for spec in meta["inputs"]:
        if spec["dtype"] == "int64":
            high = meta["labels"]["num_classes"]
            feeds[spec["name"]] = rng.integers(0, high, size=spec["shape"], dtype=np.int64)
        else:
            feeds[spec["name"]] = rng.standard_normal(spec["shape"]).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(["logits"], feeds)[0]


def _declared_output_shape(model: onnx.ModelProto) -> tuple[int, ...]:
    (out,) = model.graph.output
    return tuple(d.dim_value for d in out.type.tensor_type.shape.dim)


@pytest.fixture(scope="module", params=MODEL_NAMES)
def tiny(request: pytest.FixtureRequest) -> tuple[str, onnx.ModelProto]:
    return request.param, build_model(request.param, "tiny")


def test_tiny_model_is_valid_onnx(tiny: tuple[str, onnx.ModelProto]) -> None:
    name, model = tiny
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 20)]
    ops = {n.op_type for n in model.graph.node}
    assert ops <= ALLOWED_OPS, f"{name} uses {sorted(ops - ALLOWED_OPS)}"
    assert len({n.name for n in model.graph.node}) == len(model.graph.node)


def test_tiny_model_has_only_static_shapes(tiny: tuple[str, onnx.ModelProto]) -> None:
    _, model = tiny
    values = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    produced = {o for n in model.graph.node for o in n.output}
    assert produced <= {v.name for v in values}, "every intermediate has inferred shape info"
    for vi in values:
        dims = vi.type.tensor_type.shape.dim
        assert all(d.HasField("dim_value") and d.dim_value > 0 for d in dims), vi.name


def test_tiny_model_runs_with_declared_shape(tiny: tuple[str, onnx.ModelProto]) -> None:
    _, model = tiny
    logits = _run(model, _random_feeds(model))
    assert logits.shape == _declared_output_shape(model)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert logits.std() > 0, "logits must depend on inputs and weights"


def test_tiny_model_parameters_are_float32_initializers(tiny: tuple[str, onnx.ModelProto]) -> None:
    name, model = tiny
    inits = model.graph.initializer
    assert inits, f"{name} has no parameters"
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in inits)
    meta = _meta(model)
    frozen = set(meta["frozen"])
    trained = sum(int(np.prod(t.dims)) for t in inits if t.name not in frozen)
    assert meta["params"] == trained
    assert meta["weight_bytes"] == sum(numpy_helper.to_array(t).nbytes for t in inits)
    assert meta["weights"] == "embedded"
    biases = [numpy_helper.to_array(t) for t in inits if t.name.endswith(".bias")]
    assert biases and all(not b.any() for b in biases), "biases start at zero"


def test_tiny_model_metadata_states_label_convention(tiny: tuple[str, onnx.ModelProto]) -> None:
    name, model = tiny
    meta = _meta(model)
    info = zoo_info(model)
    assert info is not None and info.name == name and info.preset == "tiny"
    assert meta["schema"] == "tensoropt.zoo/1"
    config = preset_config(name, "tiny")
    batch = config.batch
    if meta["task"] == "lm":
        assert meta["labels"] == {
            "shape": [batch, config.seq],
            "dtype": "int64",
            "num_classes": config.vocab,
        }
        assert meta["outputs"][0]["shape"] == [batch, config.seq, config.vocab]
    else:
        assert meta["task"] == "classification"
        assert meta["labels"] == {"shape": [batch], "dtype": "int64", "num_classes": config.classes}
        assert meta["outputs"][0]["shape"] == [batch, config.classes]
    assert [i["name"] for i in meta["inputs"]] == [i.name for i in model.graph.input]


def test_batchnorm_statistics_are_frozen_initializers() -> None:
    model = build_model("resnet50", "tiny")
    frozen = set(_meta(model)["frozen"])
    bn_stats = {
        name
        for node in model.graph.node
        if node.op_type == "BatchNormalization"
        for name in node.input[3:5]
    }
    assert bn_stats and frozen == bn_stats
    bn_nodes = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert len(bn_nodes) == 53  # stem + 16 blocks x 3 + 4 downsample shortcuts


def test_published_parameter_counts_at_paper_width() -> None:
    """Param counts match torchvision (no aux head for Inception), which pins the topology."""
    expected = {
        "vgg16": 138_357_544,
        "resnet50": 25_557_032,
        "wide_resnet": 68_883_240,
        "inception_v3": 23_834_568,
    }
    for name, count in expected.items():
        assert _meta(build_model(name, "paper"))["params"] == count, name


def test_knobs_change_transformer_shapes() -> None:
    model = build_model("gpt", "tiny", layers=3, batch=4, seq=16, vocab=128, hidden=48, heads=6)
    assert _declared_output_shape(model) == (4, 16, 128)
    ln = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert len(ln) == 2 * 3 + 1
    logits = _run(model, _random_feeds(model))
    assert logits.shape == (4, 16, 128)


def test_knobs_change_cnn_shapes_and_widths() -> None:
    model = build_model("resnet50", "tiny", image_size=64, classes=10, batch=2)
    assert _declared_output_shape(model) == (2, 10)
    assert _run(model, _random_feeds(model)).shape == (2, 10)
    narrow = _meta(build_model("wide_resnet", "tiny", widen=2))["params"]
    wide = _meta(build_model("wide_resnet", "tiny", widen=4))["params"]
    assert wide > narrow
    w = {
        t.name: tuple(t.dims) for t in build_model("wide_resnet", "tiny", widen=4).graph.initializer
    }
    assert w["layer1.0.a.conv.weight"] == (8 * 4, 8, 1, 1)


def test_knobs_change_rnn_and_mlp_shapes() -> None:
    rnn = build_model("rnnlm", "tiny", seq=5, vocab=40, hidden=16, layers=3)
    assert _run(rnn, _random_feeds(rnn)).shape == (8, 5, 40)
    mlp = build_model("mlp", "tiny", layers=4, classes=3, features=7)
    assert _run(mlp, _random_feeds(mlp)).shape == (8, 3)
    assert sum(n.op_type == "Relu" for n in mlp.graph.node) == 4


@settings(max_examples=8, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 4, 8]),
    seq=st.integers(1, 6),
    batch=st.integers(1, 3),
)
def test_gpt_any_consistent_knobs_run(
    layers: int, heads: int, head_dim: int, seq: int, batch: int
) -> None:
    model = build_model(
        "gpt", layers=layers, heads=heads, hidden=heads * head_dim, seq=seq, batch=batch, vocab=11
    )
    logits = _run(model, _random_feeds(model))
    assert logits.shape == (batch, seq, 11)
    assert np.isfinite(logits).all()


def test_seed_fixes_weights() -> None:
    a = build_model("gpt", "tiny", seed=3)
    b = build_model("gpt", "tiny", seed=3)
    c = build_model("gpt", "tiny", seed=4)
    assert a.SerializeToString() == b.SerializeToString()
    wa = numpy_helper.to_array(a.graph.initializer[0])
    wc = numpy_helper.to_array(c.graph.initializer[0])
    assert not np.array_equal(wa, wc)


def _change_last_token(name: str) -> tuple[np.ndarray, np.ndarray]:
    model = build_model(name, "tiny")
    feeds = _random_feeds(model)
    other = {k: v.copy() for k, v in feeds.items()}
    other["input_ids"][:, -1] = (other["input_ids"][:, -1] + 1) % 64
    return _run(model, feeds), _run(model, other)


@pytest.mark.parametrize("name", ["gpt", "rnnlm"])
def test_causal_models_ignore_future_tokens(name: str) -> None:
    before, after = _change_last_token(name)
    np.testing.assert_array_equal(before[:, :-1], after[:, :-1])
    assert not np.allclose(before[:, -1], after[:, -1])


def test_bert_attends_both_ways() -> None:
    before, after = _change_last_token("bert")
    assert not np.allclose(before[:, 0], after[:, 0])


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


def test_gpt_blocks_are_megatron_matmul_chains() -> None:
    """Each MLP is MatMul(W_in) -> Add -> Gelu -> MatMul(W_out); attention has Q,K,V MatMuls."""
    model = build_model("gpt", "tiny")
    inits = {t.name for t in model.graph.initializer}
    consumers = _consumers(model)
    param_matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    assert len(param_matmuls) == 6 * 2 + 1  # q, k, v, o, fc_in, fc_out per layer; lm head
    fc_in = [n for n in param_matmuls if n.input[1].endswith("mlp.fc_in.weight")]
    assert len(fc_in) == 2
    for node in fc_in:
        (add,) = consumers[node.output[0]]
        (gelu,) = consumers[add.output[0]]
        (second,) = consumers[gelu.output[0]]
        assert (add.op_type, gelu.op_type, second.op_type) == ("Add", "Gelu", "MatMul")
        assert second.input[1].endswith("mlp.fc_out.weight")


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: build_model("gpt3"), "choose one of: mlp, gpt"),
        (lambda: build_model("gpt", "huge"), "tiny, small, paper"),
        (lambda: build_model("resnet50", heads=2), "--heads does not apply"),
        (lambda: build_model("gpt", widen=2), "--widen does not apply"),
        (lambda: build_model("gpt", layers=0), "--layers must be >= 1"),
        (lambda: build_model("gpt", hidden=30, heads=4), "not divisible"),
        (lambda: build_model("inception_v3", image_size=64), "--image-size 75"),
        (lambda: build_model("vgg16", batch=2.5), "must be an integer"),
    ],
)
def test_bad_requests_raise_zoo_error(call, fragment: str) -> None:
    with pytest.raises(ZooError) as info:
        call()
    assert isinstance(info.value, TensorOptError)
    assert fragment in str(info.value)


def test_knobs_for_lists_config_fields() -> None:
    assert "widen" in knobs_for("wide_resnet")
    assert "widen" not in knobs_for("resnet50")
    assert "heads" in knobs_for("gpt") and "heads" not in knobs_for("rnnlm")
