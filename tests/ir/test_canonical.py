"""Fused Attention and RMSNormalization (opset 23+) rewritten into primitive ops at import:
the rewritten graph computes what onnxruntime's fused kernels compute, and what the
rewrite cannot spell is refused in one line."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from tensoropt.errors import UnsupportedOpError
from tensoropt.ir.canonical import FUSED
from tensoropt.ir.importer import export_model, import_model


def _model(node, inputs, output_type, opset, initializers=()):
    graph = h.make_graph(
        [node], "g", inputs, [h.make_tensor_value_info("y", output_type, None)], list(initializers)
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


def _both(tmp_path, model, feeds):
    """(fused output, rewritten output), both from onnxruntime; the rewritten graph has no
    fused node left."""
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    rewritten = export_model(import_model(path))
    assert not FUSED & {n.op_type for n in rewritten.graph.node}
    onnx.checker.check_model(rewritten, full_check=True)
    return _run(model, feeds), _run(rewritten, feeds)


def _attention_case(attrs, qs, ks, vs, mask=None, opset=23, seed=0):
    rng = np.random.default_rng(seed)
    names = ["q", "k", "v"]
    shapes = dict(zip(names, (qs, ks, vs), strict=True))
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    inputs = [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in shapes.items()]
    if mask is not None:
        inputs.append(
            h.make_tensor_value_info(
                "m", onnx.helper.np_dtype_to_tensor_dtype(mask.dtype), mask.shape
            )
        )
        feeds["m"] = mask
        names.append("m")
    node = h.make_node("Attention", names, ["y"], name="attn", **attrs)
    return _model(node, inputs, T.FLOAT, opset), feeds


_RNG = np.random.default_rng(1)
_BOOL = _RNG.random((6, 6)) > 0.4
np.fill_diagonal(_BOOL, True)  # every query keeps a key
ATTENTION_CASES = {
    "causal": ({"is_causal": 1}, [2, 4, 6, 8], [2, 4, 6, 8], [2, 4, 6, 8], None),
    "grouped causal": ({"is_causal": 1}, [2, 4, 6, 8], [2, 2, 6, 8], [2, 2, 6, 8], None),
    "multi-query": ({}, [2, 4, 6, 8], [2, 1, 6, 8], [2, 1, 6, 8], None),
    "3-D grouped": (
        {"q_num_heads": 4, "kv_num_heads": 2, "is_causal": 1},
        [2, 6, 32],
        [2, 6, 16],
        [2, 6, 12],
        None,
    ),
    "cross, scale and softcap": (
        {"softcap": 2.0, "scale": 0.3},
        [2, 4, 6, 8],
        [2, 4, 9, 8],
        [2, 4, 9, 5],
        None,
    ),
    "causal cross": ({"is_causal": 1}, [2, 4, 6, 8], [2, 4, 9, 8], [2, 4, 9, 8], None),
    "bool mask": ({}, [2, 4, 6, 8], [2, 4, 6, 8], [2, 4, 6, 8], _BOOL),
    "float mask": (
        {"is_causal": 1},
        [2, 4, 6, 8],
        [2, 4, 6, 8],
        [2, 4, 6, 8],
        _RNG.standard_normal((2, 1, 6, 6)).astype(np.float32),
    ),
    "softmax precision": ({"softmax_precision": 1}, [1, 2, 5, 4], [1, 2, 5, 4], [1, 2, 5, 4], None),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_the_fused_kernel(tmp_path, case):
    attrs, qs, ks, vs, mask = ATTENTION_CASES[case]
    fused, ours = _both(tmp_path, *_attention_case(attrs, qs, ks, vs, mask))
    assert fused.shape == ours.shape
    np.testing.assert_allclose(ours, fused, rtol=1e-5, atol=1e-6)


def test_sliding_windows_of_opset_25_match_the_fused_kernel(tmp_path):
    for attrs in (
        {"left_window_size": 2, "is_causal": 1},
        {"left_window_size": 1, "right_window_size": 2},
    ):
        model, feeds = _attention_case(attrs, [2, 2, 7, 4], [2, 2, 7, 4], [2, 2, 7, 4], opset=25)
        fused, ours = _both(tmp_path, model, feeds)
        np.testing.assert_allclose(ours, fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("shape", "axis", "scale_shape", "dtype"),
    [
        ([2, 6, 16], -1, [16], T.FLOAT),
        ([2, 6, 4, 4], 2, [4, 4], T.FLOAT),
        ([3, 8], -1, [8], T.FLOAT16),  # stage one in float32 (stash_type 1), then back
    ],
)
def test_rms_normalization_matches_the_fused_kernel(tmp_path, shape, axis, scale_shape, dtype):
    rng = np.random.default_rng(2)
    npd = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    scale = onnx.numpy_helper.from_array(
        (1 + 0.1 * rng.standard_normal(scale_shape)).astype(npd), "w"
    )
    node = h.make_node("RMSNormalization", ["x", "w"], ["y"], name="norm", axis=axis, epsilon=1e-3)
    model = _model(node, [h.make_tensor_value_info("x", dtype, shape)], dtype, 23, [scale])
    feeds = {"x": rng.standard_normal(shape).astype(npd)}
    fused, ours = _both(tmp_path, model, feeds)
    tol = 1e-3 if dtype == T.FLOAT16 else 1e-6
    np.testing.assert_allclose(
        ours.astype(np.float32), fused.astype(np.float32), rtol=tol, atol=tol
    )


def test_what_has_no_primitive_spelling_is_refused(tmp_path):
    past = [h.make_tensor_value_info(n, T.FLOAT, [1, 2, 3, 4]) for n in ("q", "k", "v", "pk", "pv")]
    node = h.make_node(
        "Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "pk2", "pv2"], name="att"
    )
    graph = h.make_graph(
        [node],
        "g",
        past,
        [h.make_tensor_value_info(n, T.FLOAT, None) for n in ("y", "pk2", "pv2")],
    )
    path = tmp_path / "cache.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]), path)
    with pytest.raises(UnsupportedOpError, match="'att': a key/value cache .* without a cache"):
        import_model(path)
    mask = np.ones((6, 4), dtype=bool)  # shorter than the 6 keys
    model, _ = _attention_case({}, [1, 2, 6, 4], [1, 2, 6, 4], [1, 2, 6, 4], mask)
    onnx.save(model, path)
    with pytest.raises(UnsupportedOpError, match="does not cover the 6 keys"):
        import_model(path)


def _chain(xs, merged, perm, out):
    """x -> Reshape(merged) -> Transpose(perm) -> Reshape(out) -> y."""
    shapes = [
        onnx.numpy_helper.from_array(np.array(merged, dtype=np.int64), "merged"),
        onnx.numpy_helper.from_array(np.array(out, dtype=np.int64), "out"),
    ]
    nodes = [
        h.make_node("Reshape", ["x", "merged"], ["m"], name="merge"),
        h.make_node("Transpose", ["m"], ["t"], name="turn", perm=perm),
        h.make_node("Reshape", ["t", "out"], ["y"], name="split"),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, xs)],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        shapes,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])


@pytest.mark.parametrize(
    ("xs", "merged", "perm", "out", "ops"),
    [
        # a key transposed through [B*H, S, d]: one 4-D Transpose
        ([2, 3, 4, 5], [6, 4, 5], [0, 2, 1], [2, 3, 5, 4], ["Transpose"]),
        # a grouped-query key [B, Hkv, g, S, d] through [B*Hkv*g, S, d] to [B, Hkv*g, d, S]
        ([2, 2, 3, 4, 5], [12, 4, 5], [0, 2, 1], [2, 6, 5, 4], ["Transpose", "Reshape"]),
        # split back into other dimensions than runs of the merged ones: kept
        ([2, 3, 4, 5], [6, 4, 5], [0, 2, 1], [3, 2, 5, 4], ["Reshape", "Transpose", "Reshape"]),
        # the merged dimension moves: the refined transpose, regrouped
        ([2, 3, 4, 5], [6, 4, 5], [1, 0, 2], [4, 6, 5], ["Transpose", "Reshape"]),
        # nn.MultiheadAttention's [T, B, H*d] -> [T, B*H, d] -> [B*H, T, d] -> [B, H, T, d]
        ([8, 4, 32], [8, 16, 8], [1, 0, 2], [4, 4, 8, 8], ["Reshape", "Transpose"]),
        # shapes without a common refinement: kept
        ([6, 4], [4, 6], [1, 0], [6, 4], ["Reshape", "Transpose", "Reshape"]),
    ],
)
def test_transposes_through_merged_dimensions_are_unmerged(tmp_path, xs, merged, perm, out, ops):
    model = _chain(xs, merged, perm, out)
    path = tmp_path / "chain.onnx"
    onnx.save(model, path)
    rewritten = export_model(import_model(path))
    assert [n.op_type for n in rewritten.graph.node] == ops
    onnx.checker.check_model(rewritten, full_check=True)
    x = {"x": np.random.default_rng(3).standard_normal(xs).astype(np.float32)}
    np.testing.assert_array_equal(_run(rewritten, x), _run(model, x))


def _graph_model(nodes, xs, initializers, opset=20):
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, xs)],
        [h.make_tensor_value_info(f"y{i}", T.FLOAT, None) for i in range(3)],
        [onnx.numpy_helper.from_array(np.array(v, dtype=np.int64), k) for k, v in initializers],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def _rewritten_ops(tmp_path, model, xs):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    rewritten = export_model(import_model(path))
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = {"x": np.random.default_rng(4).standard_normal(xs).astype(np.float32)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    for want, got in zip(session.run(None, feeds), ours.run(None, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
    return [n.op_type for n in rewritten.graph.node]


@pytest.mark.parametrize("clone", [False, True])
def test_an_unbind_by_gathers_becomes_a_split(tmp_path, clone):
    """nn.MultiheadAttention's packed projection [T, B, 3E] taken apart by Reshape,
    Unsqueeze, Transpose, Squeeze and three Gathers: one Split of the last dimension.
    The unoptimized export clones the unbound tensor (an Identity) before the Gathers."""
    xs = [5, 2, 12]
    nodes = [
        h.make_node("Reshape", ["x", "s"], ["v"]),
        h.make_node("Unsqueeze", ["v", "zero"], ["u"]),
        h.make_node("Transpose", ["u"], ["t"], perm=[3, 1, 2, 0, 4]),
        h.make_node("Squeeze", ["t", "minus2"], ["q"]),
        *([h.make_node("Identity", ["q"], ["c"])] if clone else []),
        *[h.make_node("Gather", ["c" if clone else "q", f"i{i}"], [f"y{i}"], axis=0)
          for i in range(3)],
    ]  # fmt: skip
    inits = [("s", [5, 2, 3, 4]), ("zero", [0]), ("minus2", [-2])]
    inits += [(f"i{i}", i) for i in range(3)]
    assert _rewritten_ops(tmp_path, _graph_model(nodes, xs, inits), xs) == ["Split"]


def _slices(bounds, axis=-1):
    nodes, inits = [], [("axis", [axis])]
    for i, (start, end) in enumerate(bounds):
        inits += [(f"b{i}", [start]), (f"e{i}", [end])]
        nodes.append(h.make_node("Slice", ["x", f"b{i}", f"e{i}", "axis"], [f"y{i}"]))
    return nodes, inits


@pytest.mark.parametrize(
    ("bounds", "ops"),
    [
        ([(0, 4), (4, 8), (8, 12)], ["Split"]),  # chunk(3, -1)
        ([(8, 1 << 62), (0, 4), (4, 8)], ["Split"]),  # any order, an end past the dim
        ([(-12, -8), (-8, -4), (-4, 12)], ["Split"]),  # negative bounds
        ([(0, 4), (5, 8), (8, 12)], ["Slice"] * 3),  # a gap
        ([(0, 5), (4, 8), (8, 12)], ["Slice"] * 3),  # an overlap
    ],
)
def test_slices_that_partition_a_dimension_become_one_split(tmp_path, bounds, ops):
    """``unbind``/``chunk`` of an unoptimized export: Slices whose pieces cover the
    dimension exactly once are the pieces of one Split, whatever their order."""
    xs = [2, 3, 12]
    nodes, inits = _slices(bounds)
    assert _rewritten_ops(tmp_path, _graph_model(nodes, xs, inits), xs) == ops


def test_cast_like_becomes_a_cast_to_the_static_type(tmp_path):
    xs = [2, 3]
    nodes = [
        h.make_node("Cast", ["x"], ["d"], to=T.DOUBLE),
        h.make_node("CastLike", ["d", "x"], ["y0"]),
        h.make_node("Relu", ["y0"], ["y1"]),
        h.make_node("Neg", ["y0"], ["y2"]),
    ]
    ops = _rewritten_ops(tmp_path, _graph_model(nodes, xs, []), xs)
    assert ops == ["Cast", "Cast", "Relu", "Neg"]


def test_an_unbind_that_is_no_slice_of_the_last_dimension_is_kept(tmp_path):
    """The pieces come out with the leading dimensions swapped ([B, T, E], not
    [T, B, E]): no piece of a Split of x."""
    xs = [5, 2, 12]
    nodes = [
        h.make_node("Reshape", ["x", "s"], ["v"]),
        h.make_node("Transpose", ["v"], ["q"], perm=[2, 1, 0, 3]),
        *[h.make_node("Gather", ["q", f"i{i}"], [f"y{i}"], axis=0) for i in range(3)],
    ]
    inits = [("s", [5, 2, 3, 4])] + [(f"i{i}", i) for i in range(3)]
    ops = _rewritten_ops(tmp_path, _graph_model(nodes, xs, inits), xs)
    assert ops == ["Reshape", "Transpose", "Gather", "Gather", "Gather"]


def test_two_transposes_compose(tmp_path):
    xs = [2, 3, 4, 5]
    nodes = [
        h.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1, 3]),
        h.make_node("Transpose", ["a"], ["y0"], perm=[3, 0, 2, 1]),
        h.make_node("Transpose", ["x"], ["y1"], perm=[1, 0, 2, 3]),
        h.make_node("Identity", ["y1"], ["y2"]),
    ]
    assert _rewritten_ops(tmp_path, _graph_model(nodes, xs, []), xs) == [
        "Transpose",
        "Transpose",
        "Identity",
    ]


@pytest.mark.parametrize("shape", [[2, 4, 6], [2, 6, 3, 5]])
def test_instance_normalization_matches_the_fused_kernel(tmp_path, shape):
    """nn.GroupNorm exports as Reshape, InstanceNormalization, Reshape, Mul, Add."""
    rng = np.random.default_rng(5)
    c = shape[1]
    inits = [
        onnx.numpy_helper.from_array((1 + 0.1 * rng.standard_normal(c)).astype(np.float32), "s"),
        onnx.numpy_helper.from_array((0.1 * rng.standard_normal(c)).astype(np.float32), "b"),
    ]
    node = h.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], name="norm", epsilon=1e-3)
    model = _model(node, [h.make_tensor_value_info("x", T.FLOAT, shape)], T.FLOAT, 20, inits)
    feeds = {"x": (3 * rng.standard_normal(shape) + 1).astype(np.float32)}
    fused, ours = _both(tmp_path, model, feeds)
    np.testing.assert_allclose(ours, fused, rtol=1e-5, atol=1e-5)


RESIZES = {
    # F.interpolate(scale_factor=2, mode="nearest"): asymmetric, floor
    "nearest up": (
        [2, 3, 4, 5],
        {
            "mode": "nearest",
            "coordinate_transformation_mode": "asymmetric",
            "nearest_mode": "floor",
        },
        [1, 1, 2, 2],
        None,
    ),
    "nearest half-pixel down": ([2, 3, 8, 6], {"mode": "nearest"}, [1, 1, 0.5, 0.5], None),
    "bilinear half-pixel up": ([1, 2, 5, 4], {"mode": "linear"}, [1, 1, 2, 3], None),
    "bilinear align-corners, sizes": (
        [1, 2, 5, 4],
        {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
        None,
        [1, 2, 9, 7],
    ),
    "linear 1-D pytorch half-pixel down": (
        [2, 3, 12],
        {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
        [1, 1, 0.75],
        None,
    ),
    "cubic": ([1, 1, 6, 6], {"mode": "cubic", "cubic_coeff_a": -0.5}, [1, 1, 1.5, 2], None),
    "same size": ([1, 2, 3, 4], {"mode": "linear"}, [1, 1, 1, 1], None),
    "linear antialias down": (
        [1, 1, 9, 8],
        {"mode": "linear", "antialias": 1},
        [1, 1, 0.5, 0.5],
        None,
    ),
}


@pytest.mark.parametrize("case", list(RESIZES))
def test_resize_matches_the_kernel_as_gathers(tmp_path, case):
    """A resize becomes weighted Gathers per resized dimension, whatever its mode."""
    shape, attrs, scales, sizes = RESIZES[case]
    inits = []
    if scales is not None:
        inits.append(onnx.numpy_helper.from_array(np.asarray(scales, np.float32), "scales"))
    else:
        inits.append(onnx.numpy_helper.from_array(np.asarray(sizes, np.int64), "sizes"))
    inputs = ["x", "", "scales"] if scales is not None else ["x", "", "", "sizes"]
    node = h.make_node("Resize", inputs, ["y"], name="resize", **attrs)
    model = _model(node, [h.make_tensor_value_info("x", T.FLOAT, shape)], T.FLOAT, 20, inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    rewritten = export_model(import_model(path))
    ops = {n.op_type for n in rewritten.graph.node}
    assert "Resize" not in ops and ops <= {"Gather", "Mul", "Add", "Identity"}, ops
    assert ("Gather" in ops) != (case == "same size"), ops
    feeds = {"x": np.random.default_rng(6).standard_normal(shape).astype(np.float32)}
    np.testing.assert_allclose(_run(rewritten, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)


def test_a_crop_and_resize_is_kept():
    """tf_crop_and_resize extrapolates: not linear in its input, so not rewritten."""
    from tensoropt.ir.canonical import resize_as_gathers

    node = h.make_node(
        "Resize",
        ["x", "roi", "scales"],
        ["y"],
        mode="linear",
        coordinate_transformation_mode="tf_crop_and_resize",
    )
    inits = [
        onnx.numpy_helper.from_array(
            np.asarray([0, 0, 0.1, 0.1, 1, 1, 0.9, 0.9], np.float32), "roi"
        ),
        onnx.numpy_helper.from_array(np.asarray([1, 1, 2, 2], np.float32), "scales"),
    ]
    model = _model(node, [h.make_tensor_value_info("x", T.FLOAT, [1, 1, 4, 4])], T.FLOAT, 20, inits)
    import onnx_ir as ir

    graph = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(model)).graph
    assert resize_as_gathers(graph) == 0


@pytest.mark.parametrize("trans_b", [0, 1])
def test_a_flattened_gemm_becomes_a_matmul_on_the_unflattened_activation(tmp_path, trans_b):
    """[T, B, H, d] -> [T*B, H*d] -> Gemm -> [T, B, D] (nn.MultiheadAttention's out
    projection, W stored [D, C] with transB; HF Conv1D without): the batch is no longer
    merged with the sequence, and the stored weight keeps its shape."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((6, 8) if trans_b else (8, 6)).astype(np.float32)
    inits = [
        onnx.numpy_helper.from_array(w, "w"),
        onnx.numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b"),
        onnx.numpy_helper.from_array(np.asarray([12, 8], np.int64), "flat"),
        onnx.numpy_helper.from_array(np.asarray([3, 4, 6], np.int64), "back"),
    ]
    nodes = [
        h.make_node("Reshape", ["x", "flat"], ["f"]),
        h.make_node("Gemm", ["f", "w", "b"], ["g"], transB=trans_b),
        h.make_node("Reshape", ["g", "back"], ["y0"]),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [3, 4, 2, 4])],
        [h.make_tensor_value_info("y0", T.FLOAT, None)],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    rewritten = export_model(import_model(path))
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Gemm" not in ops and ops.count("MatMul") == 1, ops
    assert ("Transpose" in ops) == bool(trans_b)
    stored = {t.name: list(t.dims) for t in rewritten.graph.initializer}
    assert stored["w"] == list(w.shape)
    feeds = {"x": rng.standard_normal((3, 4, 2, 4)).astype(np.float32)}
    np.testing.assert_allclose(
        _run_all(rewritten, feeds), _run_all(model, feeds), rtol=1e-5, atol=1e-5
    )


def _run_all(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize(
    ("op", "attrs", "xs"),
    [
        ("DepthToSpace", {"blocksize": 2}, [2, 12, 3, 4]),  # DCR, the default
        ("DepthToSpace", {"blocksize": 2, "mode": "CRD"}, [2, 12, 3, 4]),  # pixel_shuffle
        ("DepthToSpace", {"blocksize": 3, "mode": "CRD"}, [1, 18, 2, 2]),
        ("SpaceToDepth", {"blocksize": 2}, [2, 3, 4, 6]),
    ],
)
def test_pixel_shuffles_become_reshape_transpose_reshape(tmp_path, op, attrs, xs):
    nodes = [
        h.make_node(op, ["x"], ["y0"], **attrs),
        h.make_node("Relu", ["y0"], ["y1"]),
        h.make_node("Neg", ["y0"], ["y2"]),
    ]
    ops = _rewritten_ops(tmp_path, _graph_model(nodes, xs, []), xs)
    assert op not in ops and "Transpose" in ops


# (op, scores shape, attributes, class weights, labels ignored, with log_prob output)
SCE, NLL = "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"
LOSS_CASES = {
    "mean": (SCE, [6, 5], {}, False, False, False),
    "mean, ignore_index": (SCE, [6, 5], {"ignore_index": -100}, False, True, False),
    "mean, weights, ignore_index, N-D": (SCE, [3, 5, 2, 4], {"ignore_index": 2}, True, True, False),
    "sum, weights": (SCE, [6, 5], {"reduction": "sum"}, True, False, False),
    "none, log_prob": (SCE, [3, 5, 4], {"reduction": "none", "ignore_index": 1}, False, True, True),
    "nll, weights, ignore_index": (NLL, [6, 5], {"ignore_index": 0}, True, True, False),
    "nll, none, N-D": (NLL, [3, 5, 4], {"reduction": "none"}, False, False, False),
}


@pytest.mark.parametrize("case", LOSS_CASES.values(), ids=LOSS_CASES.keys())
def test_class_losses_match_the_kernel(tmp_path, case):
    op, shape, attrs, weighted, ignoring, log_prob = case
    rng = np.random.default_rng(3)
    each = [shape[0], *shape[2:]]
    labels = rng.integers(0, shape[1], each).astype(np.int64)
    if ignoring:  # some labels ignored (torch's -100 is no class at all), some kept
        flat = labels.reshape(-1)
        flat[::3] = attrs["ignore_index"]
        assert (flat != attrs["ignore_index"]).any()
    feeds = {"x": rng.standard_normal(shape).astype(np.float32), "t": labels}
    inputs = [
        h.make_tensor_value_info("x", T.FLOAT, shape),
        h.make_tensor_value_info("t", T.INT64, each),
    ]
    names, inits = ["x", "t"], []
    if weighted:
        w = rng.uniform(0.5, 2.0, shape[1]).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(w, "w"))
        names.append("w")
    outputs = ["y", "lp"] if log_prob else ["y"]
    node = h.make_node(op, names, outputs, name="loss", **attrs)
    model = _model(node, inputs, T.FLOAT, 20, inits)
    if log_prob:
        model.graph.output.append(h.make_tensor_value_info("lp", T.FLOAT, None))
    fused, rewritten = _both(tmp_path, model, feeds)
    assert fused.shape == rewritten.shape
    np.testing.assert_allclose(rewritten, fused, rtol=1e-5, atol=1e-6)
    if log_prob:
        path = tmp_path / "m.onnx"
        names = ["lp"]
        want = ort.InferenceSession(model.SerializeToString()).run(names, feeds)[0]
        got = ort.InferenceSession(export_model(import_model(path)).SerializeToString())
        np.testing.assert_allclose(got.run(names, feeds)[0], want, rtol=1e-5, atol=1e-6)


def test_a_class_loss_with_labels_of_another_shape_is_refused(tmp_path):
    node = h.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["y"], name="loss")
    inputs = [
        h.make_tensor_value_info("x", T.FLOAT, [6, 5]),
        h.make_tensor_value_info("t", T.INT64, [5]),
    ]
    path = tmp_path / "m.onnx"
    onnx.save(_model(node, inputs, T.FLOAT, 20), path)
    with pytest.raises(UnsupportedOpError, match="SoftmaxCrossEntropyLoss node 'loss'.*labels"):
        import_model(path)


@pytest.mark.parametrize(
    ("op", "slope_shape"), [("PRelu", [3, 1, 1]), ("PRelu", [1]), ("Mish", None)]
)
def test_activations_match_the_kernel(tmp_path, op, slope_shape):
    """nn.PReLU (a learned slope per channel, or one) and nn.Mish."""
    rng = np.random.default_rng(9)
    shape = [2, 3, 4, 5]
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, 0, 0, :2] = 0.0  # the branch at 0
    inits, names = [], ["x"]
    if slope_shape is not None:
        slope = rng.uniform(0.1, 0.5, slope_shape).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(slope, "slope"))
        names.append("slope")
    node = h.make_node(op, names, ["y"], name="act")
    model = _model(node, [h.make_tensor_value_info("x", T.FLOAT, shape)], T.FLOAT, 20, inits)
    fused, ours = _both(tmp_path, model, {"x": x})
    np.testing.assert_allclose(ours, fused, rtol=1e-6, atol=1e-6)


def _mask_index(batch, t, s, order=None):
    """transformers 5's padding-mask indices: (b, k) at every [b, 0, q, k]."""
    b, _, q, k = np.meshgrid(np.arange(batch), [0], np.arange(t), np.arange(s), indexing="ij")
    if order is not None:
        k = order[k]
    return np.stack([b, k], axis=-1).astype(np.int64)


@pytest.mark.parametrize(
    ("index", "ops"),
    [
        (_mask_index(3, 1, 5), ["Reshape"]),
        (_mask_index(3, 4, 5), ["Reshape", "Expand"]),
        (_mask_index(3, 1, 5, order=np.array([4, 3, 2, 1, 0])), ["GatherND"]),  # reversed
        (_mask_index(3, 1, 5)[:2], ["GatherND"]),  # not every sample
    ],
)
def test_a_gather_that_only_views_its_data_becomes_a_reshape(tmp_path, index, ops):
    """A GatherND of constant indices that read the data in order (and broadcast it)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    node = h.make_node("GatherND", ["x", "i"], ["y"], name="index")
    inits = [onnx.numpy_helper.from_array(index, "i")]
    model = _model(node, [h.make_tensor_value_info("x", T.FLOAT, [3, 5])], T.FLOAT, 20, inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    rewritten = export_model(import_model(path))
    assert [n.op_type for n in rewritten.graph.node] == ops
    want = _run(model, {"x": x})
    np.testing.assert_array_equal(_run(rewritten, {"x": x}), want)


@pytest.mark.parametrize(
    ("numbers", "rest", "ops"),
    [
        (np.arange(4), [3], ["Reshape", "Expand", "GatherElements", "Reshape"]),
        (np.arange(4), [], ["Reshape", "GatherElements", "Reshape"]),
        (np.arange(4), [2, 3], ["Reshape", "Expand", "GatherElements", "Reshape"]),
        (np.array([1, 0, 2, 3]), [3], ["Concat", "GatherND"]),  # not each its own sample
    ],
)
def test_a_gather_of_one_position_per_sample_becomes_gather_elements(tmp_path, numbers, rest, ops):
    """``data[arange(B), i]``: HuggingFace's sequence classifiers pool the last
    non-padding position so (``canonical.sample_gathers``), negative positions included."""
    rng = np.random.default_rng(3)
    shape = [4, 5, *rest]
    x = rng.standard_normal(shape).astype(np.float32)
    i = np.array([[4], [0], [-1], [2]], dtype=np.int64)
    nodes = [
        h.make_node("Concat", ["samples", "i"], ["index"], name="cat", axis=-1),
        h.make_node("GatherND", ["x", "index"], ["y"], name="pool"),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [
            h.make_tensor_value_info("x", T.FLOAT, shape),
            h.make_tensor_value_info("i", T.INT64, [4, 1]),
        ],
        [h.make_tensor_value_info("y", T.FLOAT, [4, *rest])],
        [onnx.numpy_helper.from_array(numbers.reshape(4, 1).astype(np.int64), "samples")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    rewritten = export_model(import_model(path))
    assert [n.op_type for n in rewritten.graph.node] == ops
    feeds = {"x": x, "i": i}
    np.testing.assert_array_equal(_run(rewritten, feeds), _run(model, feeds))


@pytest.mark.parametrize(
    ("shape", "repeats", "ops"),
    [
        ([1, 1, 4], [3, 1, 1], ["Expand"]),  # a token repeated to the batch
        ([1, 2, 1], [3, 1, 5], ["Expand"]),
        ([2, 1, 4], [3, 1, 1], ["Tile"]),  # a dim of 2 tiled: stays a Tile
    ],
)
def test_a_tile_of_ones_is_an_expand_and_an_expand_to_its_own_shape_goes(
    tmp_path, shape, repeats, ops
):
    """``cls.repeat(B, 1, 1)`` exported unoptimized: an Expand of the token to its own
    shape, then a Tile (``canonical.tiles_as_expands``); the values stay the same."""
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    out = [d * r for d, r in zip(shape, repeats, strict=True)]
    nodes = [
        h.make_node("Expand", ["x", "same"], ["e"], name="noop"),
        h.make_node("Tile", ["e", "repeats"], ["t"], name="tile"),
        h.make_node("Expand", ["t", "wide"], ["y"], name="wide"),
    ]
    inits = [
        onnx.numpy_helper.from_array(np.asarray(shape, np.int64), "same"),
        onnx.numpy_helper.from_array(np.asarray(repeats, np.int64), "repeats"),
        onnx.numpy_helper.from_array(np.asarray([2, *out], np.int64), "wide"),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, shape)],
        [h.make_tensor_value_info("y", T.FLOAT, [2, *out])],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    rewritten = export_model(import_model(path))
    assert [n.op_type for n in rewritten.graph.node] == [*ops, "Expand"]
    np.testing.assert_array_equal(_run(rewritten, {"x": x}), _run(model, {"x": x}))
