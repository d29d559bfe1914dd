"""GPT-2 written as HuggingFace's modeling_gpt2 writes it: ``Conv1D`` projections.

HF's ``Conv1D`` stores its weight as ``[in, out]`` and computes ``view -> addmm ->
view``, which the dynamo exporter writes as ``Reshape -> Gemm -> Reshape`` (the
``nn.Linear`` models of ``models.py`` export as ``MatMul + Add``). Attention splits the
fused ``c_attn`` output with ``split`` and uses the tanh GELU, as in HF.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from tests.exports.models import SEQ, VOCAB, Case, _ids, gelu_new


class Conv1D(nn.Module):
    """HF ``transformers.pytorch_utils.Conv1D``: ``x @ W + b`` with ``W [nx, nf]``."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class HFGPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = Conv1D(3 * dim, dim)
        self.c_proj = Conv1D(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = Conv1D(4 * dim, dim)
        self.mlp_proj = Conv1D(dim, 4 * dim)
        bias = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq)
        self.register_buffer("bias", bias, persistent=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        return x.view(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (self._heads(z) for z in self.c_attn(x).split(c, dim=2))
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(v.size(-1))
        mask_value = torch.finfo(w.dtype).min
        w = torch.where(self.bias[:, :, :t, :t], w, torch.full([], mask_value, dtype=w.dtype))
        w = F.softmax(w, dim=-1)
        y = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous().view(b, t, c)
        return self.c_proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(gelu_new(self.c_fc(self.ln_2(x))))


class HFGPT2(nn.Module):
    def __init__(self, vocab=VOCAB, dim=32, heads=2, layers=2, max_pos=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_pos, dim)
        self.h = nn.ModuleList([HFGPT2Block(dim, heads, max_pos) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(SEQ, dtype=torch.long).unsqueeze(0)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


HF_GPT2 = Case("hf_gpt2", HFGPT2, lambda g: {"input_ids": _ids(g)}, "ce")
