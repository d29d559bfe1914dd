"""Micro-batching on real ``torch.onnx.export(dynamo=True)`` models (tests/exports).

The exports' batch is 2, so each runs as 2 micro-batches of one sample under Megatron on
a mesh of 2 (no data-parallel axis) and verifies against the single-device full-batch
step (max relative error <= 1e-4 over 3 SGD steps). GPT-2 is the quick model;
``nn.TransformerEncoder`` runs its attention seq-first ([T, B, C]), where the micro axis
splits dimension 1; ViT's export folds the class token's expansion to the batch into a
tensor of batch size, which the importer gives back as the token
(``importer._collapse_broadcast_copies``). Five are refused, each in one line: ResNet,
the ConvNet, the mixture of experts, the recurrent model and the decoder have no
Megatron block, so their plan is data parallel over both devices and leaves one sample
per rank.
"""

from __future__ import annotations

import dataclasses

import onnx
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from tensoropt.passes.compile import compile_step  # noqa: E402
from tensoropt.passes.micro import MicroError  # noqa: E402
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions  # noqa: E402
from tensoropt.passes.plans import builtin_plan, prepare_model  # noqa: E402
from tensoropt.passes.training_step import TrainingOptions, build_training_step  # noqa: E402
from tensoropt.runtime.run import run_steps  # noqa: E402
from tests.exports.models import CASES  # noqa: E402
from tests.helpers.compile import make_mesh  # noqa: E402
from tests.helpers.steps import import_proto  # noqa: E402

SGD = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind.SGD, lr=0.01, momentum=0.9))


_ONE_PER_RANK = (
    r"--micro-batches 2 does not divide the batch: input 'x' has batch 2 over "
    r"data-parallel size 2 \(1 per rank\)"
)
REFUSED = {
    "resnet": _ONE_PER_RANK,
    "convnet": _ONE_PER_RANK,
    "moe": _ONE_PER_RANK.replace("'x'", "'input_ids'"),
    "recurrent": _ONE_PER_RANK.replace("'x'", "'input_ids'"),
    "decoder": _ONE_PER_RANK,
}


def _cases(refused: bool):
    for name in CASES:
        if (name in REFUSED) != refused:
            continue
        marks = () if name in ("gpt2", "vit") else (pytest.mark.slow,)
        yield pytest.param(name, marks=marks, id=name)


def _compile(name: str, exported, out):
    model = import_proto(onnx.load(str(exported(name))))
    prepare_model("megatron", model)
    step = build_training_step(model, SGD)
    built = builtin_plan("megatron", step.model.graph, step.signature, make_mesh("2", "megatron"))
    plan = dataclasses.replace(built.plan, micro_batches=2)
    compile_step(step, plan, built.data_axes, str(out))


@pytest.mark.parametrize("name", list(_cases(refused=True)))
def test_micro_batches_the_export_cannot_take_are_refused(name, exported, tmp_path):
    with pytest.raises(MicroError, match=REFUSED[name]):
        _compile(name, exported, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", list(_cases(refused=False)))
def test_micro_batched_export_verifies(name, exported, tmp_path):
    _compile(name, exported, tmp_path / "out")
    report = run_steps(tmp_path / "out", 3, "local", verify=True, threads=1).verify
    assert report is not None and len(report.per_step) == 3
    assert report.max_rel_error_loss <= 1e-4, report.to_json()
    assert report.max_rel_error_params <= 1e-4, report.to_json()
