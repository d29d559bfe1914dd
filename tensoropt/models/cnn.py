"""Image classifiers: VGG-16, ResNet-50 and Wide ResNet (WRN-50-k), plus shared conv layers.

Topologies are the published ones (torchvision layouts, v1.5 ResNet with the stride
on the 3x3 conv, no dropout); only channel widths scale with ``hidden / 64``, so the
tiny presets keep every layer and branch of the real network. Classifier heads use
``Gemm`` with ``transB=1`` (weight [out, in]), the form exporters emit for Linear.
"""

from __future__ import annotations

import math

from onnx import TensorProto

from tensoropt.models._builder import GraphBuilder, Init
from tensoropt.models.config import CnnConfig

_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
_RESNET50_BLOCKS = (3, 4, 6, 3)
_RESIDUAL_GAMMA = 0.25
"""Initial scale of each bottleneck's last BatchNorm. BatchNorm runs in inference form
(frozen statistics), so it does not renormalise; with scale 1 the residual sum grows
block by block (tiny ResNet-50 logits reach std ~50). 0.25 keeps them O(1) while every
branch still gets a nonzero gradient (unlike torchvision's zero_init_residual)."""


def image_input(b: GraphBuilder, cfg: CnnConfig) -> str:
    return b.input("image", TensorProto.FLOAT, (cfg.batch, 3, cfg.image_size, cfg.image_size))


def conv(
    b: GraphBuilder,
    x: str,
    c_in: int,
    c_out: int,
    scope: str,
    *,
    kernel: tuple[int, int] = (3, 3),
    stride: int = 1,
    pad: tuple[int, int] = (0, 0),
    bias: bool = False,
) -> str:
    """Conv with fan-in scaled (He) init; weight [c_out, c_in, kh, kw]."""
    kh, kw = kernel
    std = math.sqrt(2.0 / (c_in * kh * kw))
    name = scope.replace("/", ".")
    inputs = [x, b.param(f"{name}.weight", (c_out, c_in, kh, kw), Init.NORMAL, std)]
    if bias:
        inputs.append(b.param(f"{name}.bias", (c_out,), Init.ZEROS))
    return b.op(
        "Conv",
        inputs,
        scope,
        kernel_shape=[kh, kw],
        strides=[stride, stride],
        pads=[pad[0], pad[1], pad[0], pad[1]],
    )


def batch_norm(
    b: GraphBuilder, x: str, channels: int, scope: str, eps: float = 1e-5, gamma: float = 1.0
) -> str:
    """Inference-form BatchNormalization: scale/bias trained, running mean/var frozen."""
    name = scope.replace("/", ".")
    inputs = [
        x,
        b.param(f"{name}.weight", (channels,), Init.CONSTANT, gamma),
        b.param(f"{name}.bias", (channels,), Init.ZEROS),
        b.param(f"{name}.running_mean", (channels,), Init.ZEROS, frozen=True),
        b.param(f"{name}.running_var", (channels,), Init.ONES, frozen=True),
    ]
    return b.op("BatchNormalization", inputs, scope, epsilon=eps)


def conv_bn(
    b: GraphBuilder,
    x: str,
    c_in: int,
    c_out: int,
    scope: str,
    *,
    kernel: tuple[int, int] = (3, 3),
    stride: int = 1,
    pad: tuple[int, int] = (0, 0),
    relu: bool = True,
    eps: float = 1e-5,
    gamma: float = 1.0,
) -> str:
    """Conv (no bias) -> BatchNorm (scale initialised to `gamma`) -> optional Relu."""
    y = conv(b, x, c_in, c_out, f"{scope}/conv", kernel=kernel, stride=stride, pad=pad)
    y = batch_norm(b, y, c_out, f"{scope}/bn", eps, gamma)
    return b.op("Relu", [y], scope) if relu else y


def linear_head(b: GraphBuilder, x: str, d_in: int, d_out: int, scope: str) -> str:
    """Gemm(x, W^T) + b with W [d_out, d_in]."""
    name = scope.replace("/", ".")
    w = b.param(f"{name}.weight", (d_out, d_in), Init.NORMAL, math.sqrt(1.0 / d_in))
    bias = b.param(f"{name}.bias", (d_out,), Init.ZEROS)
    return b.op("Gemm", [x, w, bias], scope, transB=1)


def classify(b: GraphBuilder, x: str, channels: int, cfg: CnnConfig) -> None:
    """GlobalAveragePool -> Flatten -> Gemm -> graph output ``logits`` [B, classes]."""
    pooled = b.op("GlobalAveragePool", [x], "head")
    flat = b.op("Flatten", [pooled], "head", axis=1)
    logits = linear_head(b, flat, channels, cfg.classes, "fc")
    b.output(logits, "logits", TensorProto.FLOAT, (cfg.batch, cfg.classes))


def build_vgg16(cfg: CnnConfig) -> GraphBuilder:
    """VGG-16 (configuration D): 13 conv3x3+Relu, 5 max-pools, 3 fully connected layers."""
    b = GraphBuilder("vgg16")
    x = image_input(b, cfg)
    c_in, conv_i, pool_i = 3, 0, 0
    for item in _VGG16:
        if item == "M":
            x = b.op("MaxPool", [x], f"pool{pool_i}", kernel_shape=[2, 2], strides=[2, 2])
            pool_i += 1
            continue
        c_out = cfg.scaled(int(item))
        x = conv(b, x, c_in, c_out, f"features/conv{conv_i}", pad=(1, 1), bias=True)
        x = b.op("Relu", [x], f"features/conv{conv_i}")
        c_in, conv_i = c_out, conv_i + 1
    side = cfg.image_size // 32
    fc = 64 * cfg.hidden  # 4096 at the published width
    x = b.op("Flatten", [x], "classifier", axis=1)
    x = b.op("Relu", [linear_head(b, x, c_in * side * side, fc, "classifier/fc0")], "classifier")
    x = b.op("Relu", [linear_head(b, x, fc, fc, "classifier/fc1")], "classifier")
    logits = linear_head(b, x, fc, cfg.classes, "classifier/fc2")
    b.output(logits, "logits", TensorProto.FLOAT, (cfg.batch, cfg.classes))
    return b


def build_resnet50(cfg: CnnConfig) -> GraphBuilder:
    """ResNet-50: stem, 3-4-6-3 bottleneck blocks, global pool, fc."""
    return _resnet(cfg, "resnet50", widen=1)


def build_wide_resnet(cfg: CnnConfig) -> GraphBuilder:
    """WRN-50-k: ResNet-50 with every bottleneck's inner width times k (``widen``)."""
    return _resnet(cfg, "wide_resnet", widen=cfg.widen)


def _resnet(cfg: CnnConfig, name: str, widen: int) -> GraphBuilder:
    b = GraphBuilder(name)
    x = image_input(b, cfg)
    c = cfg.scaled(64)
    x = conv_bn(b, x, 3, c, "stem", kernel=(7, 7), stride=2, pad=(3, 3))
    x = b.op("MaxPool", [x], "stem", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    for stage, blocks in enumerate(_RESNET50_BLOCKS):
        width = cfg.scaled(64 * 2**stage) * widen
        out = cfg.scaled(256 * 2**stage)
        for i in range(blocks):
            stride = 2 if (i == 0 and stage > 0) else 1
            x = _bottleneck(b, x, c, width, out, stride, f"layer{stage + 1}/{i}")
            c = out
    classify(b, x, c, cfg)
    return b


def _bottleneck(
    b: GraphBuilder, x: str, c_in: int, width: int, c_out: int, stride: int, scope: str
) -> str:
    """1x1 reduce -> 3x3 (strided) -> 1x1 expand, plus identity or projection shortcut."""
    y = conv_bn(b, x, c_in, width, f"{scope}/a", kernel=(1, 1))
    y = conv_bn(b, y, width, width, f"{scope}/b", kernel=(3, 3), stride=stride, pad=(1, 1))
    y = conv_bn(b, y, width, c_out, f"{scope}/c", kernel=(1, 1), relu=False, gamma=_RESIDUAL_GAMMA)
    shortcut = x
    if stride != 1 or c_in != c_out:
        shortcut = conv_bn(
            b, x, c_in, c_out, f"{scope}/downsample", kernel=(1, 1), stride=stride, relu=False
        )
    return b.op("Relu", [b.op("Add", [y, shortcut], scope)], scope)
