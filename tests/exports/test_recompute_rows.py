"""Recomputation of blocks whose input is the batch's rows flattened, as OPT's decoder
layers hold their hidden states (``[B * T, C]``) while the gradient that reaches the
block's output is ``[B, T, C]``: the recompute waits on each gradient row's flag,
repeated over that row's positions (``recompute._dependency``), so a batch split keeps
it. Summed to a scalar, the wait cost an all-reduce and an all-gather of the block input
per block under data parallelism, and micro-batching refused the step."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from torch import nn  # noqa: E402

from tensoropt.cli import main  # noqa: E402
from tensoropt.runtime.run import run_steps  # noqa: E402
from tests.helpers.compile import recompute_collectives  # noqa: E402

BATCH, SEQ, VOCAB, WIDTH = 4, 6, 30, 16


class FlatLayers(nn.Module):
    """OPT's layer shape: attention on [B, T, C], the MLP on the rows [B * T, C]."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.norm = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(WIDTH, 2 * WIDTH) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(2 * WIDTH, WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for mix, norm, up, down in zip(self.mix, self.norm, self.up, self.down, strict=True):
            x = x + torch.tanh(mix(x)).cumsum(1) / SEQ  # mixes positions: a [B, T, C] op
            rows = x.reshape(-1, WIDTH)
            rows = rows + down(torch.relu(up(norm(rows))))
            x = rows.view(BATCH, SEQ, WIDTH)
        return self.head(x)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("rows") / "rows.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            FlatLayers().eval(), (ids,), str(path), input_names=["ids"], dynamo=True,
            external_data=False,
        )  # fmt: skip
    return path


def test_recomputing_flattened_blocks_adds_no_collective(exported, tmp_path, capsys):
    plain, recomputed = recompute_collectives(exported, tmp_path, capsys)
    assert plain == recomputed


def test_recomputed_flattened_blocks_micro_batch_like_one_device(exported, tmp_path):
    out = tmp_path / "out"
    assert main(["compile", str(exported), "--plan", "data-parallel", "--devices", "2",
                 "--recompute", "all", "--micro-batches", "2", "-o", str(out)]) == 0  # fmt: skip
    report = run_steps(out, 3, "local", verify=True, threads=1).verify
    assert report is not None and report.max_rel_error_params <= 1e-4, report.to_json()
