"""``F.scaled_dot_product_attention`` with a boolean mask, on heads made by ``view`` and
``transpose`` (how HuggingFace transformers 5 writes GPT-2, BERT, ViT and BART): the
export merges the key's batch and heads again to transpose it (two overlapping
Reshape -> Transpose -> Reshape chains) and zeroes empty rows with ``Where(IsNaN(p),
0, p)``. The importer unmerges both chains, and Megatron finds the block and splits
its heads with one all-reduce each way and no all-to-all."""

from __future__ import annotations

import warnings
from collections import Counter

import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from tensoropt.ir.importer import import_model  # noqa: E402
from tensoropt.ir.vocab import COLLECTIVE_DOMAIN  # noqa: E402
from tensoropt.runtime.run import run_steps  # noqa: E402
from tests.helpers.compile import compile_model  # noqa: E402

BATCH, SEQ, VOCAB, WIDTH, HEADS = 2, 6, 30, 16, 2


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, mask):
        x = self.embed(ids)
        d = WIDTH // HEADS
        q, k, v = (
            t.view(BATCH, SEQ, HEADS, d).transpose(1, 2) for t in self.qkv(x).split(WIDTH, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].bool())
        return self.head(x + self.out(y.transpose(1, 2).reshape(BATCH, SEQ, WIDTH)))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdpa_masked") / "m.onnx"
    torch.manual_seed(0)
    inputs = (torch.randint(0, VOCAB, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.long))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Masked().eval(), inputs, str(path), input_names=["ids", "mask"], dynamo=True
        )
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "IsNaN" in ops and ops.count("Transpose") >= 5, ops  # the form under test
    return path


def test_the_keys_merged_transposes_are_unmerged(export):
    """No value of the imported graph merges batch and heads ([B * H, ...])."""
    graph = import_model(str(export)).graph
    shapes = [tuple(v.shape) for node in graph for v in node.outputs]
    assert not [s for s in shapes if s and s[0] == BATCH * HEADS], shapes


def test_megatron_splits_the_heads_with_one_all_reduce_each_way(export, tmp_path):
    _, built = compile_model(onnx.load(str(export)), "megatron", "2", tmp_path / "out")
    assert any("0 MLP and 1 attention blocks" in note for note in built.notes), built.notes
    nodes = onnx.load(str(tmp_path / "out" / "device_0.onnx"), load_external_data=False)
    kinds = Counter(n.op_type for n in nodes.graph.node if n.domain == COLLECTIVE_DOMAIN)
    assert kinds == {"AllReduce": 2}, kinds  # the block's output, its input's gradient
    report = run_steps(tmp_path / "out", 3, "local", verify=True, threads=1).verify
    assert report is not None and report.max_rel_error_params <= 1e-4, report.to_json()
