"""Tiny torch models written the way the standard architectures are written.

Each class follows the published reference code of its family (the HuggingFace /
timm / torchvision style), not tensoropt's zoo: fused or separate projections,
masks built the way those libraries build them, the usual activations. Sizes are
tiny so that one training step runs in milliseconds. Every ``Case`` knows its
example inputs (fixed shapes), the loss tensoropt should build (``ce`` or ``mse``)
and the labels; ``torch_loss`` computes the same loss in torch.

Parameters are drawn from a seeded generator, and LayerNorm/RMSNorm weights and
biases are perturbed away from 1/0: a fresh model's identical ones/zeros would
be merged into one initializer by the exporter (see docs/design/exports.md), and
unique values also make the value-based name mapping unambiguous.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

BATCH = 2
SEQ = 8
VOCAB = 48
CLASSES = 5


# --- GPT-2 -----------------------------------------------------------------------------


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written out as HuggingFace's NewGELUActivation does."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)  # fused QKV
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)
        bias = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq)
        self.register_buffer("bias", bias, persistent=False)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(v.size(-1))
        mask_value = torch.finfo(w.dtype).min
        w = torch.where(self.bias[:, :, :t, :t], w, torch.full([], mask_value, dtype=w.dtype))
        w = F.softmax(w, dim=-1)
        y = torch.matmul(w, v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(gelu_new(self.c_fc(self.ln_2(x))))


class GPT2(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, tied lm_head."""

    def __init__(self, vocab=VOCAB, dim=32, heads=2, layers=2, max_pos=16, seq=SEQ):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_pos, dim)  # more rows than used: the exporter cuts them
        self.h = nn.ModuleList([GPT2Block(dim, heads, max_pos) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --- BERT ------------------------------------------------------------------------------


class BertLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.attn_out = nn.Linear(dim, dim)
        self.attn_ln = nn.LayerNorm(dim, eps=1e-12)
        self.intermediate = nn.Linear(dim, 4 * dim)
        self.output = nn.Linear(4 * dim, dim)
        self.out_ln = nn.LayerNorm(dim, eps=1e-12)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.view(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, ext_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(f(x)) for f in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1))
        probs = F.softmax(scores + ext_mask, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        ctx = ctx.view(x.shape)
        x = self.attn_ln(self.attn_out(ctx) + x)  # post-LN
        return self.out_ln(self.output(F.gelu(self.intermediate(x))) + x)


class Bert(nn.Module):
    """Word + position + token-type embeddings, post-LN encoder, tanh pooler, classifier."""

    def __init__(self, vocab=VOCAB, dim=32, heads=2, layers=2, max_pos=16, types=2):
        super().__init__()
        self.word = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_pos, dim)
        self.token_type = nn.Embedding(types, dim)
        self.emb_ln = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList([BertLayer(dim, heads) for _ in range(layers)])
        self.pooler = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, CLASSES)

    def forward(self, input_ids, token_type_ids, attention_mask):
        t = input_ids.shape[1]
        pos = torch.arange(t, dtype=torch.long).unsqueeze(0)
        x = self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids)
        x = self.emb_ln(x)
        ext = attention_mask[:, None, None, :].to(x.dtype)
        ext = (1.0 - ext) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, ext)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(pooled)


# --- ViT -------------------------------------------------------------------------------


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # timm style
        a = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
        a = a.softmax(dim=-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """Patch Conv2d, cls token, learned positions, pre-LN blocks, head on the cls token."""

    def __init__(self, image=16, patch=4, dim=32, heads=2, layers=2):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))
        self.blocks = nn.ModuleList([ViTBlock(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


# --- Llama -----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


class LlamaLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.input_layernorm = RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.post_attention_layernorm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def attn(self, x, cos, sin, mask):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = (
            p(x).view(b, t, self.heads, d).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d) + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(w, v).transpose(1, 2).reshape(b, t, c)
        return self.o_proj(y)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """RMSNorm, rotary embeddings, SiLU-gated MLP, no biases, causal + padding mask."""

    def __init__(self, vocab=VOCAB, dim=32, heads=2, layers=2, hidden=48):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LlamaLayer(dim, heads, hidden) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.rotary = Rotary(dim // heads)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def causal_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = attention_mask.shape[1]
        min_value = torch.finfo(dtype).min
        causal = torch.triu(torch.full((t, t), min_value, dtype=dtype), diagonal=1)
        causal = causal[None, None].expand(attention_mask.shape[0], 1, t, t).clone()
        padding = attention_mask[:, None, None, :] == 0
        return causal.masked_fill(padding, min_value)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], dtype=torch.long)[None].expand(
            input_ids.shape[0], -1
        )
        cos, sin = self.rotary(positions)
        mask = self.causal_mask(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


# --- SDPA: the fused building blocks of current torch models ---------------------------


class SdpaLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        d = dim // heads
        self.norm_1 = nn.RMSNorm(dim, eps=1e-6)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * d, bias=False)
        self.v = nn.Linear(dim, kv_heads * d, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.norm_2 = nn.RMSNorm(dim, eps=1e-6)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def attn(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        d = c // self.heads
        q = self.q(x).view(b, t, self.heads, d).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, d).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
        return self.o(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), mask)
        return x + self.down(F.silu(self.up(self.norm_2(x))))


class Sdpa(nn.Module):
    """``F.scaled_dot_product_attention`` (grouped-query: 4 query heads share 2 key/value
    heads) and ``nn.RMSNorm``: exported at opset 20 as primitive ops, at opset 23 as
    ``Attention`` and ``RMSNormalization``. The first layer is ``is_causal``; the second
    takes the additive mask HuggingFace builds from ``attention_mask`` (``torch.zeros``
    filled with ``finfo.min`` where a key is in the future or padding)."""

    def __init__(self, vocab=VOCAB, dim=32, heads=4, kv_heads=2, layers=2, hidden=48):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [SdpaLayer(dim, heads, kv_heads, hidden) for _ in range(layers)]
        )
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        allowed = allowed & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(b, 1, t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask if i % 2 else None)
        return self.head(self.norm(x))


# --- relative position bias (T5, Swin): a table gathered at constant buckets -----------


class RelBias(nn.Module):
    """Attention whose scores add a learned bias per head and relative-distance bucket
    (``rel_bias[bucket(j - i)]``, T5 and Swin style): the buckets are constant, so the
    exporter's optimizer folds the gathered table into a ``[1, H, T, T]`` tensor that
    repeats the table's values; the case is exported with ``optimize=False``, which keeps
    the table a parameter and the Gather (and shape arithmetic) in the graph."""

    def __init__(self, vocab=VOCAB, dim=32, heads=2, layers=2, buckets=8):
        super().__init__()
        self.heads, self.buckets = heads, buckets
        self.embed = nn.Embedding(vocab, dim)
        self.rel_bias = nn.Embedding(2 * buckets, heads)
        self.qkv = nn.ModuleList([nn.Linear(dim, 3 * dim) for _ in range(layers)])
        self.out = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        pos = torch.arange(t)
        rel = pos[None, :] - pos[:, None]
        bucket = torch.where(rel > 0, self.buckets, 0) + rel.abs().clamp(max=self.buckets - 1)
        bias = self.rel_bias(bucket).permute(2, 0, 1).unsqueeze(0)  # [1, H, T, T]
        x = self.embed(input_ids)
        for qkv, out, norm in zip(self.qkv, self.out, self.norms, strict=True):
            q, k, v = qkv(norm(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
            y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
            x = x + out(y)
        return self.head(x)


# --- decoder: transposed convolution and pixel shuffle ---------------------------------


class Decoder(nn.Module):
    """A U-Net-style encoder-decoder: a strided Conv down, ``nn.ConvTranspose2d`` up
    (stride 2, output_padding 1), a skip connection, ``F.pixel_shuffle`` (exported as
    ``DepthToSpace``, mode CRD), per-pixel logits."""

    def __init__(self, classes=5):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1)
        self.mix = nn.Conv2d(8 + 3, 4 * 6, 3, padding=1)
        self.out = nn.Conv2d(6, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.up(F.relu(self.down(x))))
        h = F.pixel_shuffle(self.mix(torch.cat([h, x], 1)), 2)  # [B, 6, 2H, 2W]
        return self.out(h).permute(0, 2, 3, 1)


# --- recurrent: nn.LSTM and nn.GRU -----------------------------------------------------


class Recurrent(nn.Module):
    """A two-layer ``nn.LSTM`` (batch first) under a bidirectional ``nn.GRU``: exported
    as one ``LSTM`` node per layer and a ``GRU`` node (``linear_before_reset``), their
    weights refolded into ONNX's gate orders; unrolled at import (``ir/recurrent.py``)."""

    def __init__(self, vocab=VOCAB, dim=16, hidden=12):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, _ = self.lstm(self.embed(input_ids))
        x, _ = self.gru(x)
        return self.head(x)


# --- mixture of experts: top-k routing, dense dispatch ---------------------------------


class Moe(nn.Module):
    """A mixture-of-experts MLP (Switch/Mixtral-style top-2 routing over 4 experts) in
    the static-shape form an export can hold: softmax gates, ``torch.topk``, the kept
    gates renormalised and scattered back over the experts, every expert run on every
    token as one batched ``einsum`` and weighted by its gate (zero where not routed)."""

    def __init__(self, vocab=VOCAB, dim=32, experts=4, top=2, hidden=24):
        super().__init__()
        self.top = top
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(0.2 * torch.randn(experts, dim, hidden))
        self.w_out = nn.Parameter(0.2 * torch.randn(experts, hidden, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        h = self.norm(x)
        probs = self.gate(h).softmax(-1)
        kept, chosen = torch.topk(probs, self.top, dim=-1)
        kept = kept / kept.sum(-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, chosen, kept)  # [B, T, E]
        inner = F.silu(torch.einsum("btd,edf->btef", h, self.w_in))
        out = torch.einsum("btef,efd->bted", inner, self.w_out)
        return self.head(x + (out * gates.unsqueeze(-1)).sum(2))


# --- nn.TransformerEncoder: torch's own MultiheadAttention ------------------------------


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder`` of pre-LN ``nn.TransformerEncoderLayer`` (batch first,
    GELU): ``nn.MultiheadAttention`` exports its packed in-projection taken apart by
    Unsqueeze/Transpose/Squeeze and Gathers, heads merged with the batch, and the out
    projection as a ``Gemm`` with ``transB``."""

    def __init__(self, vocab=VOCAB, dim=32, heads=2, layers=2, hidden=48):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, hidden, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        with torch.no_grad():  # the encoder deep-copies one layer: make the copies differ
            for p in self.encoder.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(input_ids)))


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (encoder-decoder, pre-LN, batch first): the decoder's
    cross-attention takes its packed in-projection apart into a q weight read by the
    decoder and a kv weight read by the encoder's memory (``Split`` of the ``[3D, C]``
    parameter), which Megatron views as ``[3, D, C]`` and splits head-wise."""

    def __init__(self, vocab=VOCAB, dim=32, heads=2, hidden=48):
        super().__init__()
        self.src = nn.Embedding(vocab, dim)
        self.tgt = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(
            dim, heads, 1, 1, hidden, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        t = tgt_ids.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        y = self.transformer(
            self.src(src_ids), self.tgt(tgt_ids), tgt_mask=mask, tgt_is_causal=True
        )  # torch.export needs tgt_is_causal with a mask (a data-dependent check otherwise)
        return self.head(y)


# --- ResNet ----------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """torchvision's ResNet shape: stem Conv/BN/ReLU/MaxPool, basic blocks, avgpool, fc."""

    def __init__(self, width=8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ConvNet(nn.Module):
    """``nn.GroupNorm`` (exported through InstanceNormalization), a depthwise and a
    pointwise Conv, SiLU and HardSwish, a bilinear ``F.interpolate`` (Resize) and a Conv,
    global average pooling, Linear."""

    def __init__(self, width=8, classes=CLASSES):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.norm = nn.GroupNorm(2, width)
        self.depthwise = nn.Conv2d(width, width, 3, padding=1, groups=width)
        self.pointwise = nn.Conv2d(width, 2 * width, 1)
        self.mix = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.norm(self.stem(x)))
        x = F.hardswish(self.pointwise(self.depthwise(x)))
        # a Conv after the resize makes the gradient depend on where each value lands
        x = F.relu(self.mix(F.interpolate(x, scale_factor=1.5, mode="bilinear")))
        return self.fc(x.mean(dim=(2, 3)))


def fuse_batchnorm(model: nn.Module) -> nn.Module:
    """A copy of an eval-mode ResNet with every BatchNorm folded into its Conv.

    This is the network an eval-mode export holds (the exporter folds BN), so it is
    the torch reference whose parameters the exported initializers are.
    """
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    fused = copy.deepcopy(model).eval()
    pairs = [(fused, "conv1", "bn1")]
    for block in (fused.layer1, fused.layer2):
        pairs += [(block, "conv1", "bn1"), (block, "conv2", "bn2")]
        if block.downsample is not None:
            pairs.append((block.downsample, "0", "1"))
    for owner, conv, bn in pairs:
        merged = fuse_conv_bn_eval(getattr(owner, conv), getattr(owner, bn))
        setattr(owner, conv, merged)
        setattr(owner, bn, nn.Identity())
    for p in fused.parameters():
        p.requires_grad_(True)  # fuse_conv_bn_eval copies the conv bias's False
    return fused


# --- cases -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One architecture: how to build it, its inputs, and its loss."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]
    loss: str  # "ce": logits [..., C] against int64 labels
    reference: Callable[[nn.Module], nn.Module] = lambda m: m  # what the export holds
    opset: int | None = None  # the exporter's default when None
    optimize: bool = True  # torch.onnx.export's optimize: fold constants, drop CastLike

    def model(self) -> nn.Module:
        """The seeded model in eval() mode (how exports for inference are made)."""
        torch.manual_seed(0)
        module = self.build()
        _perturb_norms(module)
        return module.eval()

    def labels(self, logits_shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, logits_shape[-1], logits_shape[:-1], generator=gen)


def torch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy averaged over every position (what tensoropt's ``ce`` builds)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _perturb_norms(module: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 or "cls_token" in name or "pos_embed" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(1 + 0.1 * torch.rand(m.running_var.shape, generator=gen))


def _ids(gen: torch.Generator, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, high, (BATCH, SEQ), generator=gen)


def _ones_mask() -> torch.Tensor:
    return torch.ones(BATCH, SEQ, dtype=torch.long)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("gpt2", GPT2, lambda g: {"input_ids": _ids(g)}, "ce"),
        Case(
            "bert",
            Bert,
            lambda g: {
                "input_ids": _ids(g),
                "token_type_ids": _ids(g, 2),
                "attention_mask": _ones_mask(),
            },
            "ce",
        ),
        Case(
            "vit", ViT, lambda g: {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)}, "ce"
        ),
        Case(
            "llama", Llama, lambda g: {"input_ids": _ids(g), "attention_mask": _ones_mask()}, "ce"
        ),
        Case(
            "resnet",
            ResNet,
            lambda g: {"x": torch.randn(BATCH, 3, 32, 32, generator=g)},
            "ce",
            fuse_batchnorm,
        ),
        Case("convnet", ConvNet, lambda g: {"x": torch.randn(BATCH, 3, 16, 16, generator=g)}, "ce"),
        Case("mha", TorchEncoder, lambda g: {"input_ids": _ids(g)}, "ce"),
        Case("sdpa", Sdpa, lambda g: {"input_ids": _ids(g), "attention_mask": _ones_mask()}, "ce"),
        Case("relbias", RelBias, lambda g: {"input_ids": _ids(g)}, "ce", optimize=False),
        Case("moe", Moe, lambda g: {"input_ids": _ids(g)}, "ce"),
        Case("recurrent", Recurrent, lambda g: {"input_ids": _ids(g)}, "ce"),
        Case("decoder", Decoder, lambda g: {"x": torch.randn(BATCH, 3, 8, 8, generator=g)}, "ce"),
        Case("seq2seq", Seq2Seq, lambda g: {"src_ids": _ids(g), "tgt_ids": _ids(g)}, "ce"),
        Case(
            "sdpa23",
            Sdpa,
            lambda g: {"input_ids": _ids(g), "attention_mask": _ones_mask()},
            "ce",
            opset=23,
        ),
    )
}


def case_of(name: str) -> Case:
    """``CASES[name]``; ``NAME-noopt``: that case exported with ``optimize=False`` (every
    parameter under its torch name and layout, the computations on them and the shape
    arithmetic kept: ``tensoropt/ir/fold.py``); ``NAME-opt``: with ``optimize=True``."""
    base, _, variant = name.partition("-")
    case = CASES[base]
    if variant in ("noopt", "opt"):
        return dataclasses.replace(case, name=name, optimize=variant == "opt")
    if variant:
        raise KeyError(name)
    return case


def export(case: Case, path: str, *, train_mode: bool = False) -> None:
    """``torch.onnx.export(..., dynamo=True)`` at the case's fixed shapes."""
    model = case.model().train(train_mode)
    inputs = case.inputs(torch.Generator().manual_seed(0))
    torch.onnx.export(
        model,
        (),
        path,
        kwargs=inputs,
        input_names=list(inputs),
        dynamo=True,
        external_data=False,
        optimize=case.optimize,
        **({} if case.opset is None else {"opset_version": case.opset}),
    )
