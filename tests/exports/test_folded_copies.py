"""Folded copies that broadcast a parameter (``importer._collapse_broadcast_copies``).

The exporter's optimizer folds an embedding looked up at constant indices and expanded
to the batch into a ``[B, S, D]`` initializer: BART's learned positions (``arange``) and
BERT's token-type row (the all-zero ``token_type_ids`` buffer). Trained as such, each
copy learned on its own, so the model left torch's after one step, and a batch-sized
parameter refused micro-batching. Each is trained as its first slice along the axes it
repeats, which the Add that reads it broadcasts: three SGD steps equal torch's, and the
model micro-batches like one device."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from tensoropt.cli import main  # noqa: E402
from tensoropt.passes.loss import LossKind  # noqa: E402
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions  # noqa: E402
from tensoropt.passes.training_step import TrainingOptions  # noqa: E402
from tensoropt.runtime.run import run_steps  # noqa: E402
from tensoropt.runtime.single import StepSession  # noqa: E402
from tests.helpers.steps import step_proto  # noqa: E402

BATCH, SEQ, VOCAB, WIDTH, LR = 4, 6, 30, 16, 0.5


class Embeds(nn.Module):
    """Token, learned-position and token-type embeddings, summed as BERT and BART do."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(SEQ + 2, WIDTH)
        self.types = nn.Embedding(2, WIDTH)
        self.register_buffer("type_ids", torch.zeros(1, SEQ, dtype=torch.long))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        positions = torch.arange(2, SEQ + 2).expand(BATCH, SEQ)  # BART's offset of 2
        x = self.tokens(ids) + self.positions(positions)
        x = x + self.types(self.type_ids.expand(BATCH, SEQ))
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = Embeds().eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("copies") / "embeds.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), str(path), input_names=["ids"], dynamo=True)
    return model, path


def _batches(steps: int) -> list[dict[str, np.ndarray]]:
    gen = torch.Generator().manual_seed(2)
    return [
        {
            "ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).numpy(),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).numpy(),
        }
        for _ in range(steps)
    ]


def test_the_copies_train_as_the_parameter_they_broadcast(exported):
    model, path = exported
    copies = {
        name: v.const_value.numpy()
        for name, v in ir.load(str(path)).graph.initializers.items()
        if tuple(v.shape) == (BATCH, SEQ, WIDTH)
    }
    assert len(copies) == 2, sorted(copies)  # the file holds both lookups, folded
    sgd = OptimizerOptions(OptimizerKind.SGD, lr=LR, momentum=0.0)
    session = StepSession(step_proto(onnx.load(str(path)), TrainingOptions(LossKind.CE, sgd))[0])
    state = session.initial_state()
    shapes = {name: state[name].shape for name in copies}
    assert sorted(shapes.values()) == [(1, 1, WIDTH), (1, SEQ, WIDTH)], shapes

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in _batches(3):
        loss, state = session.step(state, batch)
        optimizer.zero_grad()
        logits = model(torch.from_numpy(batch["ids"]))
        want = F.cross_entropy(
            logits.reshape(-1, VOCAB), torch.from_numpy(batch["labels"]).reshape(-1)
        )
        want.backward()
        optimizer.step()
        assert loss == pytest.approx(want.item(), rel=1e-5)
    rows = {tuple(v.shape): v for k, v in state.items() if k in copies}
    np.testing.assert_allclose(
        rows[(1, SEQ, WIDTH)][0], model.positions.weight.detach().numpy()[2:], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        rows[(1, 1, WIDTH)][0, 0], model.types.weight.detach().numpy()[0], rtol=1e-5, atol=1e-6
    )


def test_the_collapsed_copies_micro_batch_like_one_device(exported, tmp_path):
    """A batch-sized parameter would be split with the micro-batches (refused)."""
    _, path = exported
    argv = ["compile", str(path), "--plan", "data-parallel", "--devices", "2",
            "--micro-batches", "2", "--loss", "ce", "-o", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    report = run_steps(tmp_path / "out", 3, "local", verify=True, threads=1).verify
    assert report is not None and report.max_rel_error_params <= 1e-4, report.to_json()
