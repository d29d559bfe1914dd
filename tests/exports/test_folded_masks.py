"""An attention mask that masks nothing, built from positions in forward (as
HuggingFace models build a ``[batch, 1, S, S]`` float mask when no padding is given),
is folded by the exporter into an all-zero initializer. It is frozen: trained, it
would become a learned bias per sample and position pair (``trainable._empty_mask``);
the step's gradients then equal torch's with no initializer left over."""

from __future__ import annotations

import ast
import warnings

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


def test_a_folded_mask_that_masks_nothing_is_not_trained(tmp_path):
    torch.manual_seed(0)
    model = Masked().eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "masked.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), str(path), input_names=["ids"], dynamo=True)
    folded = [
        v
        for v in ir.load(str(path)).graph.initializers.values()
        if tuple(v.shape) == (BATCH, 1, SEQ, SEQ)
    ]
    assert len(folded) == 1 and not folded[0].const_value.numpy().any()
    sources = ast.literal_eval(folded[0].metadata_props["pkg.onnxscript.optimizer.folded_from"])
    assert "arange" in sources and "ge" in sources and not any("." in s for s in sources)
    _, step = step_proto(onnx.load(str(path)))
    assert folded[0].name not in step.signature.params

    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    feeds = {"ids": ids.numpy(), "labels": labels.numpy()}
    assert_ce_gradients_equal_torch(model, path, feeds, model(ids))
