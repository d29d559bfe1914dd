"""An attention mask that masks nothing, built from positions in forward (as
HuggingFace models build a ``[batch, 1, S, S]`` float mask when no padding is given),
is folded by the exporter into an all-zero initializer. It is frozen: trained, it
would become a learned bias per sample and position pair (``trainable._empty_mask``);
the step's gradients then equal torch's with no initializer left over."""

from __future__ import annotations

import ast
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from tests.exports.mapping import assert_ce_gradients_equal_torch  # noqa: E402
from tests.helpers.steps import step_proto  # noqa: E402

BATCH, SEQ, VOCAB, WIDTH = 2, 6, 30, 16


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(BATCH, SEQ, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        pos = torch.arange(SEQ)
        allowed = (pos[None, :] >= 0) & (pos[:, None] >= 0)  # bidirectional, no padding
        mask = torch.zeros(BATCH, 1, SEQ, SEQ).masked_fill(~allowed, torch.finfo(x.dtype).min)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(x + y.transpose(1, 2).reshape(BATCH, SEQ, WIDTH))


def _frozen_and_exact(model_class, shape, tmp_path) -> np.ndarray:
    """Export ``model_class``; its one folded initializer of ``shape``, recorded as folded
    from ``arange`` and no dotted (parameter) name, is not trained, and the step's
    gradients equal torch's with no initializer left over. Returns its values."""
    torch.manual_seed(0)
    model = model_class().eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), str(path), input_names=["ids"], dynamo=True)
    folded = [v for v in ir.load(str(path)).graph.initializers.values() if tuple(v.shape) == shape]
    assert len(folded) == 1
    sources = ast.literal_eval(folded[0].metadata_props["pkg.onnxscript.optimizer.folded_from"])
    assert "arange" in sources and not any("." in s for s in sources), sources
    _, step = step_proto(onnx.load(str(path)))
    assert folded[0].name not in step.signature.params

    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    feeds = {"ids": ids.numpy(), "labels": labels.numpy()}
    assert_ce_gradients_equal_torch(model, path, feeds, model(ids))
    return folded[0].const_value.numpy()


def test_a_folded_mask_that_masks_nothing_is_not_trained(tmp_path):
    assert not _frozen_and_exact(Masked, (BATCH, 1, SEQ, SEQ), tmp_path).any()


class Alibi(Masked):
    """BLOOM's ALiBi: a per-head slope times the key position, made in forward from
    constants and repeated to the batch; the exporter folds it into a [B, H, 1, S]
    initializer recorded as folded from ``full``, ``pow``, ``arange``, ``mul`` and
    ``repeat``, none of them a parameter."""

    heads = 2

    def forward(self, ids):
        h = self.heads
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(BATCH, SEQ, 3, h, WIDTH // h).permute(2, 0, 3, 1, 4)
        slopes = torch.pow(torch.full((h,), 0.5), torch.arange(1, h + 1))
        alibi = (slopes[:, None] * torch.arange(SEQ)[None, :])[None, :, None, :]
        scores = q @ k.transpose(-1, -2) / (WIDTH // h) ** 0.5 + alibi.repeat(BATCH, 1, 1, 1)
        y = torch.softmax(scores, -1) @ v
        return self.head(x + y.transpose(1, 2).reshape(BATCH, SEQ, WIDTH))


def test_a_position_table_folded_from_torch_ops_alone_is_not_trained(tmp_path):
    """Trained, the table took gradients (1e-4 on BLOOM's) that torch never applies."""
    assert _frozen_and_exact(Alibi, (BATCH, Alibi.heads, 1, SEQ), tmp_path).any()
