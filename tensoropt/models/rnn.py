"""An LSTM language model, unrolled over the sequence with standard ops only.

Per layer, the input projection of all time steps is one MatMul ([B, S, H] @ [H, 4H]);
the recurrent projection is one MatMul per step ([B, H] @ [H, 4H]). Every step has
the same node structure (initial state is a zero Constant, not a special case),
so a repeated-block detector can see the recurrence. Gate order is i, f, g, o.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from tensoropt.models._builder import GraphBuilder, Init
from tensoropt.models.config import RnnConfig


def build_rnnlm(cfg: RnnConfig) -> GraphBuilder:
    """input_ids int64 [B, S] -> Gather -> `layers` LSTM layers -> Linear -> logits [B, S, V]."""
    b = GraphBuilder("rnnlm")
    ids = b.input("input_ids", TensorProto.INT64, (cfg.batch, cfg.seq))
    emb = b.param("embedding.weight", (cfg.vocab, cfg.hidden), Init.NORMAL, 0.02)
    x = b.op("Gather", [emb, ids], "embedding", axis=0)
    for layer in range(cfg.layers):
        x = _lstm_layer(b, x, cfg, f"lstm{layer}")
    logits = b.linear(x, cfg.hidden, cfg.vocab, "decoder")
    b.output(logits, "logits", TensorProto.FLOAT, (cfg.batch, cfg.seq, cfg.vocab))
    return b


def _lstm_layer(b: GraphBuilder, x: str, cfg: RnnConfig, scope: str) -> str:
    """[B, S, H] -> [B, S, H]: the hidden state of every step, concatenated on axis 1."""
    h_dim, gates = cfg.hidden, 4 * cfg.hidden
    std = 1.0 / math.sqrt(h_dim)
    name = scope.replace("/", ".")
    w_ih = b.param(f"{name}.weight_ih", (h_dim, gates), Init.NORMAL, std)
    w_hh = b.param(f"{name}.weight_hh", (h_dim, gates), Init.NORMAL, std)
    bias = b.param(f"{name}.bias", (gates,), Init.ZEROS)
    xw = b.op("Add", [b.op("MatMul", [x, w_ih], f"{scope}/input"), bias], f"{scope}/input")
    steps = b.op_multi("Split", [xw], cfg.seq, f"{scope}/input", axis=1, num_outputs=cfg.seq)
    zeros = np.zeros((cfg.batch, h_dim), dtype=np.float32)
    h = b.const(zeros, f"{scope}/h0")
    c = b.const(zeros, f"{scope}/c0")
    outs = []
    for t, step_in in enumerate(steps):
        step = f"{scope}/t{t}"
        h, c = _lstm_cell(b, step_in, h, c, w_hh, step)
        outs.append(b.op("Unsqueeze", [h, b.shape_const([1], step)], step))
    if len(outs) == 1:
        return outs[0]
    return b.op("Concat", outs, f"{scope}/output", axis=1)


def _lstm_cell(
    b: GraphBuilder, step_in: str, h: str, c: str, w_hh: str, scope: str
) -> tuple[str, str]:
    """One step: gates = x_t W_ih + b + h W_hh; c' = f*c + i*g; h' = o*tanh(c')."""
    x_t = b.op("Squeeze", [step_in, b.shape_const([1], scope)], scope)
    pre = b.op("Add", [x_t, b.op("MatMul", [h, w_hh], scope)], scope)
    i, f, g, o = b.op_multi("Split", [pre], 4, scope, axis=1, num_outputs=4)
    i = b.op("Sigmoid", [i], f"{scope}/i")
    f = b.op("Sigmoid", [f], f"{scope}/f")
    g = b.op("Tanh", [g], f"{scope}/g")
    o = b.op("Sigmoid", [o], f"{scope}/o")
    c_new = b.op("Add", [b.op("Mul", [f, c], scope), b.op("Mul", [i, g], scope)], scope)
    h_new = b.op("Mul", [o, b.op("Tanh", [c_new], scope)], scope)
    return h_new, c_new
