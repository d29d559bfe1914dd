"""Embeddings whose export forgets what training does with them:

* ``nn.EmbeddingBag`` exports as a Loop over its bags, which is refused with the
  rewrite that plans: ``nn.Embedding`` on the ``[batch, bag]`` indices and a sum over
  the bag, whose export trains like the EmbeddingBag model in torch;
* ``nn.Embedding(padding_idx=p)`` exports as a plain Gather; the padding row gets no
  gradient all the same (read back from the exporter's record of the call,
  ``ir/torch_calls``), and ``scale_grad_by_freq`` is refused by name."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from torch import nn  # noqa: E402

from tensoropt.errors import UnsupportedOpError  # noqa: E402
from tensoropt.ir.importer import import_model  # noqa: E402
from tensoropt.passes.loss import LossKind  # noqa: E402
from tests.exports.mapping import step_gradients  # noqa: E402
from tests.helpers.steps import step_proto  # noqa: E402

ROWS, WIDTH, BAG, BATCH, CLASSES = 20, 4, 3, 4, 5


class Bags(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, WIDTH, mode="sum")
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, idx):
        return self.head(self.bag(idx))


class Summed(nn.Module):
    """The rewrite the refusal names, with the same parameters."""

    def __init__(self, bags: Bags):
        super().__init__()
        self.bag = nn.Embedding(ROWS, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.load_state_dict(bags.state_dict())

    def forward(self, idx):
        return self.head(self.bag(idx).sum(1))


def _export(model, idx, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(), (idx,), str(path), input_names=["idx"], dynamo=True,
            external_data=False,
        )  # fmt: skip


def _table_step(path, idx, labels, model: nn.Module, table: str) -> tuple[float, np.ndarray]:
    """(loss, gradient of the torch parameter ``table``) of one step of the export."""
    params = {k: p.detach().numpy() for k, p in model.named_parameters()}
    feeds = {"idx": idx.numpy(), "labels": labels.numpy()}
    loss, grads, _ = step_gradients(path, feeds, LossKind.CE, params)
    return loss, grads[table]


def test_an_embedding_bag_is_refused_with_the_rewrite_that_trains_like_it(tmp_path):
    torch.manual_seed(0)
    bags = Bags()
    idx = torch.tensor([[0, 3, 3], [5, 1, 0], [7, 7, 7], [2, 9, 4]])
    _export(bags, idx, tmp_path / "bags.onnx")
    with pytest.raises(UnsupportedOpError, match=r"nn\.Embedding on the \[batch, bag\] indices"):
        import_model(str(tmp_path / "bags.onnx"))

    _export(Summed(bags), idx, tmp_path / "summed.onnx")
    labels = torch.tensor([1, 0, 4, 2])
    loss = nn.functional.cross_entropy(bags(idx), labels)
    loss.backward()
    ours, table = _table_step(tmp_path / "summed.onnx", idx, labels, bags, "bag.weight")
    assert ours == pytest.approx(loss.item(), rel=1e-5)
    np.testing.assert_allclose(table, bags.bag.weight.grad.numpy(), rtol=1e-5, atol=1e-7)


class Padded(nn.Module):
    def __init__(self, scale_grad_by_freq: bool = False):
        super().__init__()
        self.embed = nn.Embedding(ROWS, WIDTH, padding_idx=1, scale_grad_by_freq=scale_grad_by_freq)
        self.head = nn.Linear(WIDTH, CLASSES)
        with torch.no_grad():  # a padding row that is not zero still gets no gradient
            self.embed.weight[1] = 0.5

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_the_padding_row_of_an_embedding_gets_no_gradient(tmp_path):
    torch.manual_seed(0)
    model = Padded()
    ids = torch.tensor([[1, 3, 1, 4], [1, 1, 2, 0]])  # padding read five times
    _export(model, ids, tmp_path / "padded.onnx")
    labels = torch.tensor([[1, 0, 4, 2], [3, 3, 0, 1]])
    loss = nn.functional.cross_entropy(model(ids).reshape(-1, CLASSES), labels.reshape(-1))
    loss.backward()
    want = model.embed.weight.grad.numpy()
    assert not want[1].any() and want[3].any()
    ours, got = _table_step(tmp_path / "padded.onnx", ids, labels, model, "embed.weight")
    assert ours == pytest.approx(loss.item(), rel=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_an_embedding_that_scales_its_gradient_by_frequency_is_refused(tmp_path):
    torch.manual_seed(0)
    _export(Padded(scale_grad_by_freq=True), torch.tensor([[1, 3]]), tmp_path / "freq.onnx")
    with pytest.raises(UnsupportedOpError, match=r"scale_grad_by_freq"):
        step_proto(onnx.load(str(tmp_path / "freq.onnx")))
