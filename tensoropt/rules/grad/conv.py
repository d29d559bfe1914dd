"""Gradient rules of convolutions and pooling: Conv, ConvTranspose, MaxPool,
AveragePool, GlobalAveragePool, GlobalMaxPool.

- Conv dX is a ConvTranspose of the gradient with the same weight, strides,
  dilations, group and begin pads; the end crop and ``output_padding`` are chosen
  so the result has exactly the input's spatial size.
- Conv dW is a Conv in which the channels and the batch swap roles, with stride =
  forward dilation and dilation = forward stride: the input viewed as [C, N, S] is
  convolved with the gradient viewed as [M, N, O]; the result [C, M, K'] is cropped
  to K and transposed to [M, C, K]. Grouped (G > 1), the batch joins the groups,
  outermost: the input viewed as [C/G, N*G, S] by the gradient viewed as [N*M, 1, O]
  in N*G groups gives [C/G, N*M, K'], summed over N. A batch split stays one
  contiguous block of the grouped dimension there (with the batch inside the groups,
  [C/G, G*N, S] in G groups, it would be a strided piece no layout holds).
- ConvTranspose (``nn.ConvTranspose``: U-Net and VAE decoders) is the adjoint, in its
  input, of the Conv from its output's shape to its input's with the same geometry:
  dX is that Conv of the gradient, dW that Conv's weight gradient with the gradient as
  its input and X as the gradient of its output. ``auto_pad`` SAME and
  ``output_shape`` are refused by name (torch gives explicit pads).
- MaxPool recomputes MaxPool with its Indices output, turns the flat indices
  into per-(n, c) plane offsets (Mod by the plane size) and scatter-adds the
  gradient into a [N, C, H*W] zero tensor. Ties go to the index MaxPool reports
  (the first maximum in onnxruntime).
- AveragePool divides the gradient by the per-position window count (a constant
  computed at rule time from the static shapes, both count_include_pad modes,
  ceil_mode) and spreads it with a depthwise ConvTranspose of a ones kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tensoropt.rules.grad._common import expand_to, float_dtype, reduce_sum, unsupported
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

Grads = list[ir.Value | None]


@dataclass(frozen=True, slots=True)
class _Window:
    """The static geometry of one sliding-window op, pads made explicit."""

    spatial: tuple[int, ...]  # input S
    kernel: tuple[int, ...]  # K
    out: tuple[int, ...]  # O
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]

    def transpose_pads(self) -> tuple[list[int], list[int]]:
        """ConvTranspose pads and output_padding giving back exactly ``spatial``."""
        ends, extra = [], []
        for s, k, o, st, d, pb in zip(
            self.spatial,
            self.kernel,
            self.out,
            self.strides,
            self.dilations,
            self.pads_begin,
            strict=True,
        ):
            crop_end = st * (o - 1) + (k - 1) * d + 1 - pb - s
            ends.append(max(crop_end, 0))
            extra.append(max(-crop_end, 0))
        return list(self.pads_begin) + ends, extra


def _window(ctx: GradContext, kernel: tuple[int, ...]) -> _Window:
    spatial = tuple(ctx.shape(0)[2:])
    out = tuple(ctx.out_shape()[2:])
    n = len(spatial)
    strides = tuple(int(v) for v in ctx.attr("strides", [1] * n))
    dilations = tuple(int(v) for v in ctx.attr("dilations", [1] * n))
    auto_pad = str(ctx.attr("auto_pad", "NOTSET"))
    if auto_pad in ("NOTSET", ""):
        pads = [int(v) for v in ctx.attr("pads", [0] * (2 * n))]
        begin, end = tuple(pads[:n]), tuple(pads[n:])
    elif auto_pad == "VALID":
        begin = end = (0,) * n
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        totals = [
            max(0, (o - 1) * st + (k - 1) * d + 1 - s)
            for s, k, o, st, d in zip(spatial, kernel, out, strides, dilations, strict=True)
        ]
        small = tuple(t // 2 for t in totals)
        large = tuple(t - t // 2 for t in totals)
        begin, end = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    else:
        raise unsupported(ctx, f"auto_pad={auto_pad!r}")
    return _Window(spatial, kernel, out, strides, dilations, begin, end)


def _transpose_conv(b, win: _Window, grad: ir.Value, weight: ir.Value, group: int) -> ir.Value:
    """ConvTranspose of ``grad`` by ``weight`` back to the forward input's spatial shape."""
    pads, extra = win.transpose_pads()
    attrs = {
        "strides": list(win.strides),
        "dilations": list(win.dilations),
        "pads": pads,
        "group": group,
    }
    if any(extra):
        attrs["output_padding"] = extra
    return b.op("ConvTranspose", [grad, weight], attrs)


def _conv_input_grad(ctx: GradContext, win: _Window, group: int) -> ir.Value:
    return _transpose_conv(ctx.b, win, ctx.grad_outputs[0], ctx.inputs[1], group)


def _conv_weight_grad(ctx: GradContext, win: _Window, group: int) -> ir.Value:
    return _weight_grad(
        ctx.b, ctx.inputs[0], ctx.grad_outputs[0], ctx.shape(0), ctx.out_shape(), win, group
    )


def _weight_grad(b, x, g, x_shape, g_shape, win: _Window, group: int) -> ir.Value:
    """dW of ``Conv(x, W)`` (``win``, ``group``) given the gradient ``g`` of its output."""
    n, c, *spatial = x_shape
    m, *out = g_shape[1:]
    rank = 2 + len(spatial)
    rest = list(range(2, rank))
    if group == 1:
        x_view = b.op("Transpose", [x], {"perm": [1, 0, *rest]})
        g_view = b.op("Transpose", [g], {"perm": [1, 0, *rest]})
    else:
        # the batch joins the groups, outermost: [C/G, N*G, S] by [N*M, 1, O] in N*G groups
        grouped = b.op("Reshape", [x, b.ints([n, group, c // group, *spatial])])
        swapped = b.op("Transpose", [grouped], {"perm": [2, 0, 1, *range(3, rank + 1)]})
        x_view = b.op("Reshape", [swapped, b.ints([c // group, n * group, *spatial])])
        g_view = b.op("Reshape", [g, b.ints([n * m, 1, *out])])
    attrs = {
        "strides": list(win.dilations),
        "dilations": list(win.strides),
        "pads": list(win.pads_begin) + list(win.pads_end),
        "group": group if group == 1 else n * group,
    }
    full = [
        (size + pb + pe - (st * (o - 1) + 1)) // d + 1
        for size, o, st, d, pb, pe in zip(
            win.spatial,
            win.out,
            win.strides,
            win.dilations,
            win.pads_begin,
            win.pads_end,
            strict=True,
        )
    ]
    dw = b.op("Conv", [x_view, g_view], attrs)
    if group != 1:  # [C/G, N*M, K'] -> the sum over the batch
        per_sample = b.op("Reshape", [dw, b.ints([c // group, n, m, *full])])
        dw = reduce_sum(b, per_sample, [1], keepdims=False)
    if list(full) != list(win.kernel):
        k = len(win.kernel)
        dw = b.op("Slice", [dw, b.ints([0] * k), b.ints(list(win.kernel)), b.ints(rest)])
    return b.op("Transpose", [dw], {"perm": [1, 0, *rest]})


def _conv(ctx: GradContext) -> Grads:
    kernel = tuple(ctx.shape(1)[2:])
    group = int(ctx.attr("group", 1))
    win = _window(ctx, kernel)
    grads: Grads = [None] * len(ctx.inputs)
    if ctx.needs[0]:
        grads[0] = _conv_input_grad(ctx, win, group)
    if ctx.needs[1]:
        grads[1] = _conv_weight_grad(ctx, win, group)
    if len(ctx.inputs) > 2 and ctx.needs[2]:
        axes = [0, *range(2, len(ctx.out_shape()))]
        grads[2] = reduce_sum(ctx.b, ctx.grad_outputs[0], axes, keepdims=False)
    return grads


def _conv_transpose(ctx: GradContext) -> Grads:
    """``Y = ConvTranspose(X, W)`` is the adjoint, in its input, of ``Conv(., W)`` from
    Y's shape to X's with the same strides, dilations, pads and group: dX is that Conv
    of dY, and dW the Conv weight gradient with dY as the Conv's input and X as the
    gradient of its output (``output_padding`` only lengthens Y's end, which the Conv
    does not reach)."""
    b, g, x = ctx.b, ctx.grad_outputs[0], ctx.inputs[0]
    if str(ctx.attr("auto_pad", "NOTSET")) not in ("NOTSET", "", "VALID"):
        raise unsupported(ctx, "auto_pad SAME_* (give explicit pads)")
    if ctx.attr("output_shape") is not None:
        raise unsupported(ctx, "output_shape (give pads and output_padding)")
    x_shape, y_shape = ctx.shape(0), ctx.out_shape()
    kernel = tuple(ctx.shape(1)[2:])
    n = len(kernel)
    group = int(ctx.attr("group", 1))
    strides = tuple(int(v) for v in ctx.attr("strides", [1] * n))
    dilations = tuple(int(v) for v in ctx.attr("dilations", [1] * n))
    pads = [int(v) for v in ctx.attr("pads", [0] * (2 * n))]
    win = _Window(
        tuple(y_shape[2:]), kernel, tuple(x_shape[2:]), strides, dilations,
        tuple(pads[:n]), tuple(pads[n:]),
    )  # fmt: skip
    grads: Grads = [None] * len(ctx.inputs)
    if ctx.needs[0]:
        attrs = {"strides": list(strides), "dilations": list(dilations), "pads": pads}
        grads[0] = b.op("Conv", [g, ctx.inputs[1]], {**attrs, "group": group})
    if ctx.needs[1]:
        grads[1] = _weight_grad(b, g, x, y_shape, x_shape, win, group)
    if len(ctx.inputs) > 2 and ctx.needs[2]:
        grads[2] = reduce_sum(b, g, [0, *range(2, len(y_shape))], keepdims=False)
    return grads


_POOL_ATTRS = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")


def _max_pool(ctx: GradContext) -> Grads:
    b, x = ctx.b, ctx.inputs[0]
    n, c, *spatial = ctx.shape(0)
    plane = int(np.prod(spatial, dtype=np.int64))
    if len(ctx.outputs) > 1 and not int(ctx.attr("storage_order", 0)):
        indices = ctx.outputs[1]
    else:
        attrs = {k: ctx.attr(k) for k in _POOL_ATTRS if k in ctx.node.attributes}
        _, indices = b.op("MaxPool", [x], attrs, num_outputs=2)
    local = b.op("Mod", [indices, b.const(np.int64(plane))])
    flat_idx = b.op("Reshape", [local, b.ints([n, c, -1])])
    flat_g = b.op("Reshape", [ctx.grad_outputs[0], b.ints([n, c, -1])])
    base = b.op(
        "ConstantOfShape",
        [b.ints([n, c, plane])],
        {"value": ir.tensor(np.zeros([1], dtype=float_dtype(x)))},
    )
    scattered = b.op("ScatterElements", [base, flat_idx, flat_g], {"axis": 2, "reduction": "add"})
    return [b.op("Reshape", [scattered, b.ints(ctx.shape(0))])]


def _window_counts(win: _Window, include_pad: bool) -> np.ndarray:
    """Number of taps AveragePool divides by, per output position (shape O)."""
    counts = np.ones((), dtype=np.int64)
    for s, k, o, st, d, pb, pe in zip(
        win.spatial,
        win.kernel,
        win.out,
        win.strides,
        win.dilations,
        win.pads_begin,
        win.pads_end,
        strict=True,
    ):
        taps = np.arange(o)[:, None] * st - pb + np.arange(k)[None, :] * d
        lo, hi = (-pb, s + pe) if include_pad else (0, s)
        per_dim = ((taps >= lo) & (taps < hi)).sum(axis=1)
        counts = np.multiply.outer(counts, per_dim)
    return counts


def _average_pool(ctx: GradContext) -> Grads:
    b, x = ctx.b, ctx.inputs[0]
    c = ctx.shape(0)[1]
    kernel = tuple(int(k) for k in ctx.attr("kernel_shape"))
    win = _window(ctx, kernel)
    counts = _window_counts(win, bool(ctx.attr("count_include_pad", 0)))
    if np.any(counts == 0):
        raise unsupported(ctx, "a pooling window that lies wholly in the padding")
    dtype = float_dtype(x)
    scaled = b.op("Mul", [ctx.grad_outputs[0], b.const((1.0 / counts).astype(dtype))])
    ones = b.op(
        "ConstantOfShape",
        [b.ints([c, 1, *kernel])],
        {"value": ir.tensor(np.ones([1], dtype=dtype))},
    )
    return [_transpose_conv(b, win, scaled, ones, c)]


def _global_average_pool(ctx: GradContext) -> Grads:
    b, shape = ctx.b, ctx.shape(0)
    area = int(np.prod(shape[2:], dtype=np.int64))
    scaled = b.op("Mul", [ctx.grad_outputs[0], b.scalar_like(1.0 / area, ctx.inputs[0])])
    return [expand_to(b, scaled, shape)]


def _global_max_pool(ctx: GradContext) -> Grads:
    """Gradient split among the positions equal to the maximum of each plane."""
    b, x, shape = ctx.b, ctx.inputs[0], ctx.shape(0)
    axes = list(range(2, len(shape)))
    mask = b.op("Cast", [b.op("Equal", [x, ctx.outputs[0]])], {"to": int(x.dtype)})
    count = reduce_sum(b, mask, axes, keepdims=True)
    return [b.op("Mul", [mask, b.op("Div", [ctx.grad_outputs[0], count])])]


_RULES: tuple[tuple[str, GradRule], ...] = (
    ("Conv", _conv),
    ("ConvTranspose", _conv_transpose),
    ("MaxPool", _max_pool),
    ("AveragePool", _average_pool),
    ("GlobalAveragePool", _global_average_pool),
    ("GlobalMaxPool", _global_max_pool),
)


def register_into(registry: GradRegistry) -> None:
    """Add this family's rules to ``registry``."""
    for op_type, rule in _RULES:
        registry.register(op_type)(rule)
