"""Inception-v3 (torchvision layout, without the auxiliary classifier and dropout).

Branches are joined by ``Concat`` on the channel axis, which is what makes this
graph interesting for the planner: elimination cannot fold it, the fallback must.
Every published channel count is scaled by ``hidden / 64``; the smallest image
that keeps every valid-padded reduction alive is 75x75.
"""

from __future__ import annotations

from tensoropt.models._builder import GraphBuilder
from tensoropt.models.cnn import classify, conv_bn, image_input
from tensoropt.models.config import CnnConfig

_EPS = 1e-3


class _Inception:
    """Builds the blocks; holds the builder and config so block code stays short."""

    def __init__(self, b: GraphBuilder, cfg: CnnConfig) -> None:
        self.b = b
        self.cfg = cfg

    def ch(self, channels: int) -> int:
        return self.cfg.scaled(channels)

    def cbr(
        self,
        x: str,
        c_in: int,
        c_out: int,
        scope: str,
        kernel: tuple[int, int] = (1, 1),
        stride: int = 1,
        pad: tuple[int, int] = (0, 0),
    ) -> str:
        """BasicConv2d: conv (no bias), BatchNorm (eps 1e-3), Relu; c_out is already scaled."""
        return conv_bn(
            self.b, x, c_in, c_out, scope, kernel=kernel, stride=stride, pad=pad, eps=_EPS
        )

    def concat(self, parts: list[str], scope: str) -> str:
        return self.b.op("Concat", parts, scope, axis=1)

    def avg_pool(self, x: str, scope: str) -> str:
        return self.b.op(
            "AveragePool",
            [x],
            scope,
            kernel_shape=[3, 3],
            strides=[1, 1],
            pads=[1, 1, 1, 1],
            count_include_pad=1,
        )

    def max_pool(self, x: str, scope: str) -> str:
        return self.b.op("MaxPool", [x], scope, kernel_shape=[3, 3], strides=[2, 2])

    def stem(self, x: str) -> tuple[str, int]:
        c32, c64, c80, c192 = self.ch(32), self.ch(64), self.ch(80), self.ch(192)
        x = self.cbr(x, 3, c32, "Conv2d_1a_3x3", (3, 3), stride=2)
        x = self.cbr(x, c32, c32, "Conv2d_2a_3x3", (3, 3))
        x = self.cbr(x, c32, c64, "Conv2d_2b_3x3", (3, 3), pad=(1, 1))
        x = self.max_pool(x, "maxpool1")
        x = self.cbr(x, c64, c80, "Conv2d_3b_1x1")
        x = self.cbr(x, c80, c192, "Conv2d_4a_3x3", (3, 3))
        return self.max_pool(x, "maxpool2"), c192

    def block_a(self, x: str, c_in: int, pool_features: int, s: str) -> tuple[str, int]:
        c48, c64, c96, cp = self.ch(48), self.ch(64), self.ch(96), self.ch(pool_features)
        b1 = self.cbr(x, c_in, c64, f"{s}/branch1x1")
        b5 = self.cbr(x, c_in, c48, f"{s}/branch5x5_1")
        b5 = self.cbr(b5, c48, c64, f"{s}/branch5x5_2", (5, 5), pad=(2, 2))
        b3 = self.cbr(x, c_in, c64, f"{s}/branch3x3dbl_1")
        b3 = self.cbr(b3, c64, c96, f"{s}/branch3x3dbl_2", (3, 3), pad=(1, 1))
        b3 = self.cbr(b3, c96, c96, f"{s}/branch3x3dbl_3", (3, 3), pad=(1, 1))
        bp = self.cbr(self.avg_pool(x, f"{s}/branch_pool"), c_in, cp, f"{s}/branch_pool")
        return self.concat([b1, b5, b3, bp], s), c64 + c64 + c96 + cp

    def block_b(self, x: str, c_in: int, s: str) -> tuple[str, int]:
        c64, c96, c384 = self.ch(64), self.ch(96), self.ch(384)
        b3 = self.cbr(x, c_in, c384, f"{s}/branch3x3", (3, 3), stride=2)
        bd = self.cbr(x, c_in, c64, f"{s}/branch3x3dbl_1")
        bd = self.cbr(bd, c64, c96, f"{s}/branch3x3dbl_2", (3, 3), pad=(1, 1))
        bd = self.cbr(bd, c96, c96, f"{s}/branch3x3dbl_3", (3, 3), stride=2)
        bp = self.max_pool(x, f"{s}/branch_pool")
        return self.concat([b3, bd, bp], s), c384 + c96 + c_in

    def block_c(self, x: str, c_in: int, c7: int, s: str) -> tuple[str, int]:
        c7, c192 = self.ch(c7), self.ch(192)
        row, col = ((1, 7), (0, 3)), ((7, 1), (3, 0))
        b1 = self.cbr(x, c_in, c192, f"{s}/branch1x1")
        b7 = self.cbr(x, c_in, c7, f"{s}/branch7x7_1")
        b7 = self.cbr(b7, c7, c7, f"{s}/branch7x7_2", row[0], pad=row[1])
        b7 = self.cbr(b7, c7, c192, f"{s}/branch7x7_3", col[0], pad=col[1])
        bd = self.cbr(x, c_in, c7, f"{s}/branch7x7dbl_1")
        for i, (kernel, pad) in enumerate((col, row, col), start=2):
            bd = self.cbr(bd, c7, c7, f"{s}/branch7x7dbl_{i}", kernel, pad=pad)
        bd = self.cbr(bd, c7, c192, f"{s}/branch7x7dbl_5", row[0], pad=row[1])
        bp = self.cbr(self.avg_pool(x, f"{s}/branch_pool"), c_in, c192, f"{s}/branch_pool")
        return self.concat([b1, b7, bd, bp], s), 4 * c192

    def block_d(self, x: str, c_in: int, s: str) -> tuple[str, int]:
        c192, c320 = self.ch(192), self.ch(320)
        b3 = self.cbr(x, c_in, c192, f"{s}/branch3x3_1")
        b3 = self.cbr(b3, c192, c320, f"{s}/branch3x3_2", (3, 3), stride=2)
        b7 = self.cbr(x, c_in, c192, f"{s}/branch7x7x3_1")
        b7 = self.cbr(b7, c192, c192, f"{s}/branch7x7x3_2", (1, 7), pad=(0, 3))
        b7 = self.cbr(b7, c192, c192, f"{s}/branch7x7x3_3", (7, 1), pad=(3, 0))
        b7 = self.cbr(b7, c192, c192, f"{s}/branch7x7x3_4", (3, 3), stride=2)
        bp = self.max_pool(x, f"{s}/branch_pool")
        return self.concat([b3, b7, bp], s), c320 + c192 + c_in

    def block_e(self, x: str, c_in: int, s: str) -> tuple[str, int]:
        c192, c320, c384, c448 = self.ch(192), self.ch(320), self.ch(384), self.ch(448)
        b1 = self.cbr(x, c_in, c320, f"{s}/branch1x1")
        b3 = self.cbr(x, c_in, c384, f"{s}/branch3x3_1")
        b3 = self._split_1x3_3x1(b3, c384, f"{s}/branch3x3_2")
        bd = self.cbr(x, c_in, c448, f"{s}/branch3x3dbl_1")
        bd = self.cbr(bd, c448, c384, f"{s}/branch3x3dbl_2", (3, 3), pad=(1, 1))
        bd = self._split_1x3_3x1(bd, c384, f"{s}/branch3x3dbl_3")
        bp = self.cbr(self.avg_pool(x, f"{s}/branch_pool"), c_in, c192, f"{s}/branch_pool")
        return self.concat([b1, b3, bd, bp], s), c320 + 4 * c384 + c192

    def _split_1x3_3x1(self, x: str, c: int, s: str) -> str:
        """Two parallel convs (1x3 and 3x1) on the same input, concatenated."""
        left = self.cbr(x, c, c, f"{s}a", (1, 3), pad=(0, 1))
        right = self.cbr(x, c, c, f"{s}b", (3, 1), pad=(1, 0))
        return self.concat([left, right], s)


def build_inception_v3(cfg: CnnConfig) -> GraphBuilder:
    """Stem, Mixed_5b..5d (A), 6a (B), 6b..6e (C), 7a (D), 7b..7c (E), pool, fc."""
    b = GraphBuilder("inception_v3")
    net = _Inception(b, cfg)
    x, c = net.stem(image_input(b, cfg))
    for name, pool_features in (("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)):
        x, c = net.block_a(x, c, pool_features, name)
    x, c = net.block_b(x, c, "Mixed_6a")
    for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
        x, c = net.block_c(x, c, c7, name)
    x, c = net.block_d(x, c, "Mixed_7a")
    for name in ("Mixed_7b", "Mixed_7c"):
        x, c = net.block_e(x, c, name)
    classify(b, x, c, cfg)
    return b
