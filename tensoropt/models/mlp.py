"""A plain multilayer perceptron: the smallest model every pass should handle."""

from __future__ import annotations

import math

from onnx import TensorProto

from tensoropt.models._builder import GraphBuilder, Init
from tensoropt.models.config import MlpConfig


def build_mlp(cfg: MlpConfig) -> GraphBuilder:
    """x float [B, features] -> `layers` x (MatMul+Add, Relu) -> MatMul+Add -> logits [B, classes].

    Weights are [in, out] with He init; consecutive layers form the canonical
    Megatron MLP pair (column-split then row-split).
    """
    b = GraphBuilder("mlp")
    x = b.input("x", TensorProto.FLOAT, (cfg.batch, cfg.features))
    d_in = cfg.features
    for i in range(cfg.layers):
        x = b.op("Relu", [_dense(b, x, d_in, cfg.hidden, f"fc{i}")], f"fc{i}")
        d_in = cfg.hidden
    logits = _dense(b, x, d_in, cfg.classes, "out")
    b.output(logits, "logits", TensorProto.FLOAT, (cfg.batch, cfg.classes))
    return b


def _dense(b: GraphBuilder, x: str, d_in: int, d_out: int, scope: str) -> str:
    w = b.param(f"{scope}.weight", (d_in, d_out), Init.NORMAL, math.sqrt(2.0 / d_in))
    bias = b.param(f"{scope}.bias", (d_out,), Init.ZEROS)
    return b.op("Add", [b.op("MatMul", [x, w], scope), bias], scope)
