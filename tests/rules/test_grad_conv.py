"""Finite-difference property tests of Conv, ConvTranspose, MaxPool, AveragePool,
GlobalAveragePool and GlobalMaxPool gradients: 1-D and 2-D, strides, pads, dilations,
output_padding, groups (incl. depthwise), auto_pad, ceil_mode, count_include_pad."""

from __future__ import annotations

import numpy as np
from grad_harness import check_gradients, distinct, node_case, normal, rng_of
from hypothesis import strategies as st


@st.composite
def _geometry(draw, dims: int, max_kernel: int = 3, dilate: bool = True):
    """kernel, strides, dilations, pads (each pad < the dilated kernel) and spatial sizes."""
    kernel = [draw(st.integers(1, max_kernel)) for _ in range(dims)]
    strides = [draw(st.integers(1, 3)) for _ in range(dims)]
    dilations = [draw(st.integers(1, 2)) if dilate else 1 for _ in range(dims)]
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    pads = [draw(st.integers(0, e - 1)) for e in extent] + [
        draw(st.integers(0, e - 1)) for e in extent
    ]
    spatial = [
        max(e - p - q, 1) + draw(st.integers(0, 4))
        for e, p, q in zip(extent, pads[:dims], pads[dims:], strict=True)
    ]
    return kernel, strides, dilations, pads, spatial


@st.composite
def _conv(draw):
    rng = rng_of(draw)
    dims = draw(st.integers(1, 2))
    kernel, strides, dilations, pads, spatial = draw(_geometry(dims))
    mode = draw(st.sampled_from(["plain", "grouped", "depthwise"]))
    group = {"plain": 1, "grouped": 2, "depthwise": draw(st.integers(1, 3))}[mode]
    per_group_in = 1 if mode == "depthwise" else draw(st.integers(1, 2))
    per_group_out = draw(st.integers(1, 2))
    n = draw(st.integers(1, 2))
    x = normal(rng, (n, group * per_group_in, *spatial))
    w = normal(rng, (group * per_group_out, per_group_in, *kernel))
    attrs = {"strides": strides, "dilations": dilations, "group": group}
    pad_mode = draw(st.sampled_from(["pads", "pads", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    if pad_mode.startswith("SAME"):  # onnxruntime has no SAME padding with dilations
        attrs["dilations"] = dilations = [1] * dims
    if pad_mode == "pads":
        attrs["pads"] = pads
    else:
        attrs["auto_pad"] = pad_mode
        extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
        x = normal(rng, (n, group * per_group_in, *np.maximum(spatial, extent)))
    args = [x, w]
    if draw(st.booleans()):
        args.append(normal(rng, (w.shape[0],)))
    return node_case("Conv", args, attrs)


@st.composite
def _conv_transpose(draw):
    """nn.ConvTranspose: explicit pads (each below the dilated kernel) and an
    output_padding below the stride, grouped or not, with or without a bias."""
    rng = rng_of(draw)
    dims = draw(st.integers(1, 2))
    kernel, strides, dilations, pads, spatial = draw(_geometry(dims))
    spatial = [draw(st.integers(1, 4)) for _ in range(dims)]
    group = draw(st.sampled_from([1, 2]))
    per_group_in, per_group_out = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    n = draw(st.integers(1, 2))
    extra = [draw(st.integers(0, max(s - 1, 0))) for s in strides]
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    out = [
        st_ * (i - 1) + o + e - p - q
        for st_, i, o, e, p, q in zip(
            strides, spatial, extra, extent, pads[:dims], pads[dims:], strict=True
        )
    ]
    if min(out) < 1:
        pads = [0] * (2 * dims)
    x = normal(rng, (n, group * per_group_in, *spatial))
    w = normal(rng, (group * per_group_in, per_group_out, *kernel))
    attrs = {"strides": strides, "dilations": dilations, "group": group, "pads": pads}
    if any(extra):
        attrs["output_padding"] = extra
    args = [x, w]
    if draw(st.booleans()):
        args.append(normal(rng, (group * per_group_out,)))
    return node_case("ConvTranspose", args, attrs)


def _pool_attrs(draw, dims: int, dilate: bool):
    """Pool geometry: onnxruntime wants pads < kernel; the input is at least one
    dilated kernel wide (no window lies wholly in the padding)."""
    kernel, strides, dilations, pads, spatial = draw(_geometry(dims, dilate=dilate))
    pads = [min(p, k - 1) for p, k in zip(pads, kernel + kernel, strict=True)]
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    spatial = [max(s, e) for s, e in zip(spatial, extent, strict=True)]
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads}
    if dilate:
        attrs["dilations"] = dilations
    if draw(st.booleans()) and _ceil_is_unambiguous(spatial, extent, strides, pads):
        attrs["ceil_mode"] = 1
    return attrs, spatial


def _ceil_is_unambiguous(spatial, extent, strides, pads) -> bool:
    """ceil_mode where no extra window starts beyond the input and its begin pad:
    there onnx shape inference and onnxruntime disagree on the output size."""
    dims = len(spatial)
    for i, (s, e, st_) in enumerate(zip(spatial, extent, strides, strict=True)):
        span = s + pads[i] + pads[dims + i] - e
        out = -(-span // st_) + 1
        if (out - 1) * st_ >= s + pads[i]:
            return False
    return True


@st.composite
def _max_pool(draw):
    rng = rng_of(draw)
    dims = draw(st.integers(1, 2))
    attrs, spatial = _pool_attrs(draw, dims, dilate=True)
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)), *spatial)
    outputs = draw(st.sampled_from([1, 2]))
    return node_case(
        "MaxPool", distinct(rng, [shape]), attrs, num_outputs=outputs, loss_outputs=[0]
    )


@st.composite
def _average_pool(draw):
    rng = rng_of(draw)
    dims = draw(st.integers(1, 2))
    attrs, spatial = _pool_attrs(draw, dims, dilate=draw(st.booleans()))
    attrs["count_include_pad"] = draw(st.integers(0, 1))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), *spatial)
    return node_case("AveragePool", [normal(rng, shape)], attrs)


def _global(op: str, make):
    @st.composite
    def case(draw):
        rng = rng_of(draw)
        dims = draw(st.integers(1, 2))
        shape = (
            draw(st.integers(1, 2)),
            draw(st.integers(1, 3)),
            *(draw(st.integers(1, 4)) for _ in range(dims)),
        )
        return node_case(op, [make(rng, shape)])

    return case()


CASES = {
    "Conv": _conv(),
    "ConvTranspose": _conv_transpose(),
    "MaxPool": _max_pool(),
    "AveragePool": _average_pool(),
    "GlobalAveragePool": _global("GlobalAveragePool", normal),
    "GlobalMaxPool": _global("GlobalMaxPool", lambda rng, s: distinct(rng, [s])[0]),
}


def test_resnet_stem_conv():
    """7x7 stride-2 pad-3 conv with bias on an odd input, then 3x3/2 max pool."""
    rng = np.random.default_rng(0)
    check_gradients(
        node_case(
            "Conv",
            [normal(rng, (1, 2, 9, 9)), normal(rng, (3, 2, 7, 7)), normal(rng, (3,))],
            {"strides": [2, 2], "pads": [3, 3, 3, 3]},
        )
    )
    x = distinct(rng, [(1, 2, 9, 9)])
    check_gradients(
        node_case("MaxPool", x, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})
    )
