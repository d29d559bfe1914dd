"""``F.scaled_dot_product_attention`` with a boolean mask, on heads made by ``view`` and
``transpose`` (how HuggingFace transformers 5 writes GPT-2, BERT, ViT and BART): the
export merges the key's batch and heads again to transpose it (two overlapping
Reshape -> Transpose -> Reshape chains) and zeroes empty rows with ``Where(IsNaN(p),
0, p)``; transformers 5 index the padding mask at (batch, key) for every position (a
GatherND of constant indices). The importer unmerges both chains and makes the gather a
Reshape; Megatron finds the block and splits its heads with one all-reduce each way and
no all-to-all, and data parallelism and micro-batches keep the mask split."""

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

BATCH, SEQ, VOCAB, WIDTH, HEADS = 4, 6, 30, 16, 2


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
        # transformers 5 index the padding mask at (batch, key) for every position
        rows = torch.arange(BATCH)[:, None, None, None]
        keys = torch.arange(SEQ)[None, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bool()[rows, keys])
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
    assert "IsNaN" in ops and "GatherND" in ops and ops.count("Transpose") >= 5, ops
    return path


def test_the_keys_merged_transposes_are_unmerged_and_the_mask_is_a_view(export):
    """No value of the imported graph merges batch and heads ([B * H, ...]), and the
    mask's GatherND of constant (batch, key) indices is a Reshape."""
    graph = import_model(str(export)).graph
    shapes = [tuple(v.shape) for node in graph for v in node.outputs]
    assert not [s for s in shapes if s and s[0] == BATCH * HEADS], shapes
    assert "GatherND" not in {node.op_type for node in graph}


def test_megatron_splits_the_heads_with_one_all_reduce_each_way(export, tmp_path):
    _, built = compile_model(onnx.load(str(export)), "megatron", "2", tmp_path / "out")
    assert any("0 MLP and 1 attention blocks" in note for note in built.notes), built.notes
    nodes = onnx.load(str(tmp_path / "out" / "device_0.onnx"), load_external_data=False)
    kinds = Counter(n.op_type for n in nodes.graph.node if n.domain == COLLECTIVE_DOMAIN)
    assert kinds == {"AllReduce": 2}, kinds  # the block's output, its input's gradient
    report = run_steps(tmp_path / "out", 3, "local", verify=True, threads=1).verify
    assert report is not None and report.max_rel_error_params <= 1e-4, report.to_json()


def test_data_parallel_keeps_the_mask_split_and_micro_batches_verify(export, tmp_path):
    """The mask indexed at every sample is a view, so data parallelism moves no
    activation and a micro-batched plan compiles and trains like one device."""
    from tests.exports.mapping import moved_activations

    compile_model(onnx.load(str(export)), "data-parallel", "2", tmp_path / "dp")
    assert moved_activations(tmp_path / "dp") == []
    from tensoropt.cli import main

    out = tmp_path / "micro"
    rc = main(["compile", str(export), "--plan", "data-parallel", "--devices", "2",
               "--micro-batches", "2", "-o", str(out)])  # fmt: skip
    assert rc == 0
    report = run_steps(out, 3, "local", verify=True, threads=1).verify
    assert report is not None and report.max_rel_error_params <= 1e-4, report.to_json()
