"""GPT (decoder-only, pre-LN, causal) and BERT (encoder, post-LN, MLM head).

Every projection is ``MatMul`` then ``Add`` with the weight stored [in, out], and
Q, K, V are three separate projections. That keeps each attention block and each
MLP block a plain "MatMul -> ... -> MatMul" chain that a Megatron pattern matcher
(column-split first MatMul, row-split second) finds without special cases.
Reshape targets are explicit static shapes (no 0 or -1), so shape inference needs
no data propagation.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from tensoropt.models._builder import GraphBuilder, Init
from tensoropt.models.config import TransformerConfig

_MASK_FILL = -1.0e9
"""Added to masked attention scores; exp() of it underflows to exactly 0."""


def build_gpt(cfg: TransformerConfig) -> GraphBuilder:
    """input_ids int64 [B, S] -> logits [B, S, V]; GPT-2 layout with an untied LM head."""
    b = GraphBuilder("gpt")
    x = _embeddings(b, cfg)
    for i in range(cfg.layers):
        scope = f"h{i}"
        a = b.layer_norm(x, cfg.hidden, f"{scope}/ln_1", eps=1e-5)
        x = b.op("Add", [x, _attention(b, a, cfg, f"{scope}/attn", causal=True)], scope)
        m = b.layer_norm(x, cfg.hidden, f"{scope}/ln_2", eps=1e-5)
        x = b.op("Add", [x, _mlp(b, m, cfg, f"{scope}/mlp", approximate="tanh")], scope)
    x = b.layer_norm(x, cfg.hidden, "ln_f", eps=1e-5)
    logits = b.linear(x, cfg.hidden, cfg.vocab, "lm_head", bias=False)
    b.output(logits, "logits", TensorProto.FLOAT, (cfg.batch, cfg.seq, cfg.vocab))
    return b


def build_bert(cfg: TransformerConfig) -> GraphBuilder:
    """input_ids int64 [B, S] -> MLM logits [B, S, V]; BERT layout (no segment embedding)."""
    b = GraphBuilder("bert")
    x = b.layer_norm(_embeddings(b, cfg), cfg.hidden, "embeddings/ln", eps=1e-12)
    for i in range(cfg.layers):
        scope = f"layer{i}"
        attn = _attention(b, x, cfg, f"{scope}/attn", causal=False)
        x = b.layer_norm(b.op("Add", [x, attn], scope), cfg.hidden, f"{scope}/ln_1", eps=1e-12)
        mlp = _mlp(b, x, cfg, f"{scope}/mlp", approximate="none")
        x = b.layer_norm(b.op("Add", [x, mlp], scope), cfg.hidden, f"{scope}/ln_2", eps=1e-12)
    h = b.op("Gelu", [b.linear(x, cfg.hidden, cfg.hidden, "mlm/transform")], "mlm/transform")
    h = b.layer_norm(h, cfg.hidden, "mlm/ln", eps=1e-12)
    logits = b.linear(h, cfg.hidden, cfg.vocab, "mlm/decoder")
    b.output(logits, "logits", TensorProto.FLOAT, (cfg.batch, cfg.seq, cfg.vocab))
    return b


def _embeddings(b: GraphBuilder, cfg: TransformerConfig) -> str:
    """Token embedding Gather plus a learned [S, H] position table (broadcast Add)."""
    ids = b.input("input_ids", TensorProto.INT64, (cfg.batch, cfg.seq))
    wte = b.param("wte.weight", (cfg.vocab, cfg.hidden), Init.NORMAL, 0.02)
    wpe = b.param("wpe.weight", (cfg.seq, cfg.hidden), Init.NORMAL, 0.02)
    tok = b.op("Gather", [wte, ids], "embeddings", axis=0)
    return b.op("Add", [tok, wpe], "embeddings")


def _split_heads(
    b: GraphBuilder, t: str, cfg: TransformerConfig, scope: str, perm: list[int]
) -> str:
    """[B, S, H] -> [B, S, heads, head_dim] -> transposed by `perm`."""
    shape = (cfg.batch, cfg.seq, cfg.heads, cfg.head_dim)
    r = b.op("Reshape", [t, b.shape_const(shape, scope)], scope)
    return b.op("Transpose", [r], scope, perm=perm)


def _attention(b: GraphBuilder, x: str, cfg: TransformerConfig, scope: str, *, causal: bool) -> str:
    """Multi-head self-attention; returns the output projection (before the residual)."""
    h = cfg.hidden
    q = _split_heads(b, b.linear(x, h, h, f"{scope}/q_proj"), cfg, f"{scope}/q", [0, 2, 1, 3])
    k = _split_heads(b, b.linear(x, h, h, f"{scope}/k_proj"), cfg, f"{scope}/k", [0, 2, 3, 1])
    v = _split_heads(b, b.linear(x, h, h, f"{scope}/v_proj"), cfg, f"{scope}/v", [0, 2, 1, 3])
    scores = b.op("MatMul", [q, k], f"{scope}/scores")  # [B, heads, S, S]
    scale = b.scalar(1.0 / math.sqrt(cfg.head_dim), f"{scope}/scores")
    scores = b.op("Mul", [scores, scale], f"{scope}/scores")
    if causal:
        scores = b.op("Add", [scores, _causal_mask(b, cfg.seq)], f"{scope}/scores")
    probs = b.op("Softmax", [scores], f"{scope}/scores", axis=-1)
    ctx = b.op("MatMul", [probs, v], f"{scope}/context")  # [B, heads, S, head_dim]
    ctx = b.op("Transpose", [ctx], f"{scope}/context", perm=[0, 2, 1, 3])
    merged = (cfg.batch, cfg.seq, cfg.hidden)
    ctx = b.op("Reshape", [ctx, b.shape_const(merged, f"{scope}/context")], f"{scope}/context")
    return b.linear(ctx, h, h, f"{scope}/o_proj")


def _causal_mask(b: GraphBuilder, seq: int) -> str:
    """One shared float [S, S] Constant: 0 on and below the diagonal, -1e9 above."""
    mask = np.triu(np.full((seq, seq), _MASK_FILL, dtype=np.float32), k=1)
    return b.const(mask, "causal_mask", share_key="causal_mask")


def _mlp(b: GraphBuilder, x: str, cfg: TransformerConfig, scope: str, *, approximate: str) -> str:
    """hidden -> 4*hidden, Gelu, -> hidden."""
    up = b.linear(x, cfg.hidden, cfg.ffn, f"{scope}/fc_in")
    act = b.op("Gelu", [up], f"{scope}/act", approximate=approximate)
    return b.linear(act, cfg.ffn, cfg.hidden, f"{scope}/fc_out")
