"""A generated tensor is made as the local piece its reader needs.

The backward of a gather (GatherElements: the cross-entropy's pick of the target logit;
Gather: an embedding) scatters into zeros made by ConstantOfShape. The fill's node
chooses before its reader and sees no input to convert, so every candidate ties; the
program then re-places it in the layout the reader takes (``_Chooser._relay``).
Otherwise every device makes the zeros whole (GPT-2's logits at batch 8: 1.5 GiB) and
slices its piece out: a transient no estimate counts, in every micro-batch.
"""

from __future__ import annotations

import math

import onnx
import pytest

from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.passes.device_stats import _value_info
from tests.cli.cli_run import cli

ROLE = "tensoropt.role"


@pytest.fixture(scope="module")
def gpt_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("generated") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


def _fills(path) -> list[tuple[str, tuple[int, ...], list[str]]]:
    """Each ConstantOfShape of a device graph: its name, output shape, and the roles of
    the nodes that read it."""
    graph = onnx.load(str(path), load_external_data=False).graph
    info = _value_info(graph)
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        role = next((p.value for p in node.metadata_props if p.key == ROLE), "")
        for name in node.input:
            readers.setdefault(name, []).append(role)
    return [
        (n.name, tuple(info[n.output[0]][0]), readers.get(n.output[0], []))
        for n in graph.node
        if n.op_type == "ConstantOfShape"
    ]


@pytest.mark.parametrize(
    ("plan", "mesh", "micro", "batch"),
    [
        ("data-parallel", "2", "1", 4),
        ("data-parallel", "2", "2", 2),
        ("megatron", "2x2", "1", 4),
        ("megatron", "2x2", "2", 2),
    ],
)
def test_fill_is_made_as_the_local_piece(gpt_tiny, tmp_path, capsys, plan, mesh, micro, batch):
    devices = math.prod(int(n) for n in mesh.split("x"))
    out = tmp_path / "out"
    done = cli(capsys, "compile", gpt_tiny, "--devices", devices, "--mesh", mesh, "--plan",
               plan, "--micro-batches", micro, "-o", out)  # fmt: skip
    assert done.code == 0, done.err
    for rank in range(devices):
        fills = _fills(out / f"device_{rank}.onnx")
        assert fills
        for name, shape, roles in fills:
            assert "redistribution" not in roles, (name, shape, roles)
        # the cross-entropy's zeros: [batch, seq, vocab] of the device's (micro-)batch
        logits = [shape for _, shape, _ in fills if len(shape) == 3]
        assert logits and all(s[0] == batch for s in logits), logits
