"""A decoder classifier pooling its last non-padding position, as HuggingFace's
``*ForSequenceClassification`` (GPT-2, Llama, Qwen2) do: the position is an ``ArgMax``
over the tokens' positions masked by padding, and the pooled logits are
``logits[arange(B), last]``, a ``GatherND`` whose indices name every sample.

ArgMax has a sharding rule (every dim but its axis), and the per-sample GatherND
becomes a GatherElements (``canonical.sample_gathers``), which a batch split keeps:
the gradients equal torch's, and data parallelism with micro-batches trains like one
device (the GatherND gathered the whole batch's logits, which micro-batching refused)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from torch import nn  # noqa: E402

from tensoropt.cli import main  # noqa: E402
from tensoropt.runtime.run import run_steps  # noqa: E402
from tests.exports.mapping import assert_ce_gradients_equal_torch  # noqa: E402

BATCH, SEQ, VOCAB, WIDTH, CLASSES, PAD = 4, 6, 30, 16, 3, 0


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.score = nn.Linear(WIDTH, CLASSES, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        x = x + torch.tanh(self.mix(x))
        logits = self.score(self.norm(x))
        kept = (input_ids != PAD).int()
        last = (torch.arange(SEQ) * kept).argmax(-1)
        return logits[torch.arange(BATCH), last]


def _ids(gen) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    ids[0, 3:] = PAD  # right padding of different lengths
    ids[2, 5:] = PAD
    return ids


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = Classifier().eval()
    ids = _ids(torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("classifier") / "classifier.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (ids,), str(path), input_names=["input_ids"], dynamo=True, external_data=False
        )
    return model, path


def test_the_gradients_equal_torch_autograd(exported):
    model, path = exported
    ids = _ids(torch.Generator().manual_seed(2))
    labels = torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(3))
    feeds = {"input_ids": ids.numpy(), "labels": labels.numpy()}
    assert_ce_gradients_equal_torch(model, path, feeds, model(ids))


def test_data_parallel_micro_batches_train_like_one_device(exported, tmp_path):
    _, path = exported
    gen = torch.Generator().manual_seed(4)
    data = tmp_path / "data.npz"
    np.savez(
        data,
        input_ids=np.stack([_ids(gen).numpy() for _ in range(3)]),
        labels=torch.randint(0, CLASSES, (3, BATCH), generator=gen).numpy(),
    )
    out = tmp_path / "out"
    assert main(["compile", str(path), "--plan", "data-parallel", "--devices", "2",
                 "--micro-batches", "2", "-o", str(out)]) == 0  # fmt: skip
    report = run_steps(out, 3, "local", verify=True, threads=1, data=str(data)).verify
    assert report is not None and len(report.per_step) == 3
    assert report.max_rel_error_params <= 1e-4, report.to_json()
