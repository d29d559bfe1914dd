"""``nn.EmbeddingBag`` exports as a Loop over its bags, which is refused with the
rewrite that plans: ``nn.Embedding`` on the ``[batch, bag]`` indices and a sum over the
bag, whose export trains like the EmbeddingBag model in torch."""

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
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions  # noqa: E402
from tensoropt.passes.training_step import TrainingOptions  # noqa: E402
from tensoropt.runtime.single import StepSession  # noqa: E402
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
    sgd = OptimizerOptions(OptimizerKind.SGD, lr=1.0, momentum=0.0)
    proto, _ = step_proto(
        onnx.load(str(tmp_path / "summed.onnx")), TrainingOptions(LossKind.CE, sgd)
    )
    session = StepSession(proto)
    state = session.initial_state()
    ours, new = session.step(state, {"idx": idx.numpy(), "labels": labels.numpy()})
    assert ours == pytest.approx(loss.item(), rel=1e-5)
    table = state["bag.weight"] - new["bag.weight"]  # plain SGD, lr 1: the gradient
    np.testing.assert_allclose(table, bags.bag.weight.grad.numpy(), rtol=1e-5, atol=1e-7)
