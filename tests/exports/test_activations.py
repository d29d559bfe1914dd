"""``nn.PReLU`` (a learned slope per channel) and ``nn.Mish`` export as ``PRelu`` and
``Mish``, spelled as primitives at import (``ir/canonical._activation``): the loss and
every gradient, the slope's included, equal torch autograd's. The literal of
``log1p``, which the exporter folds into a scalar folded from one it names ``const``, is
not taken for a parameter computed ahead of time (``trainable.folded_scalar``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from tensoropt.cli import main  # noqa: E402
from tensoropt.passes.loss import LossKind  # noqa: E402
from tests.exports.mapping import step_gradients  # noqa: E402


class Activated(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.prelu = nn.PReLU(4, init=0.2)
        self.mish = nn.Mish()
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        y = self.mish(self.prelu(self.conv(x)))
        return self.head(F.softplus(y.mean((2, 3))).log1p())


def test_prelu_and_mish_train_like_torch(tmp_path, capsys):
    torch.manual_seed(0)
    model = Activated().eval()
    with torch.no_grad():
        model.prelu.weight.copy_(torch.tensor([0.1, 0.2, 0.3, 0.4]))  # distinct slopes
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(tmp_path / "m.onnx"), input_names=["x"], dynamo=True)
    labels = torch.tensor([1, 3])
    loss = nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    params = {k: p.detach().numpy() for k, p in model.named_parameters()}
    feeds = {"x": x.numpy(), "labels": labels.numpy()}
    value, grads, unmatched = step_gradients(tmp_path / "m.onnx", feeds, LossKind.CE, params)
    assert value == pytest.approx(loss.item(), rel=1e-5) and not unmatched
    assert grads.keys() == params.keys()
    for name, p in model.named_parameters():
        want = p.grad.numpy()
        np.testing.assert_allclose(grads[name], want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    # log1p's 1 folds into a scalar from one the exporter names itself ("const"): no
    # warning about a parameter computed ahead of time
    capsys.readouterr()
    assert main(["train", str(tmp_path / "m.onnx"), "--steps", "1", "--threads", "1"]) == 0
    assert "ahead of time" not in capsys.readouterr().err
