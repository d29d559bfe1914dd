"""Models that compute their own loss (a HuggingFace model given ``labels``, a CLIP-style
contrastive objective, a weighted NLL): torch exports ``F.cross_entropy`` and
``F.nll_loss`` as ``SoftmaxCrossEntropyLoss`` and ``NegativeLogLikelihoodLoss``, which the
importer spells out (``ir/canonical._class_loss``; ``tests/ir/test_canonical.py``
checks both against onnxruntime's kernels, and torch spells a weighted ``F.nll_loss``
out itself). The step's loss is the model's own
scalar output (``--loss auto``):

* loss and the gradient of every trained initializer equal torch autograd's, with
  ``label_smoothing`` (which the exporter drops: ``ir/torch_calls`` reads it back),
  class weights and ignored labels under every reduction;
* synthetic labels are drawn below the class count (``training_step._index_high``),
  so ``train`` runs finite steps on them;
* data parallelism on 2 devices verifies against the single-device step, the
  contrastive loss included (every sample's logits read the whole batch of the other
  tower);
* micro-batches of HF's loss divide by the labels kept over the whole batch (the count
  runs whole in every micro-step), with recomputed blocks too; a loss divided by a sum
  of the model's own outputs is refused.
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from tensoropt.cli import main  # noqa: E402
from tensoropt.passes.loss import LossKind  # noqa: E402
from tensoropt.passes.training_step import TrainingOptions  # noqa: E402
from tensoropt.runtime.run import run_steps  # noqa: E402
from tests.exports.mapping import step_gradients  # noqa: E402
from tests.helpers.compile import compile_model, recompute_collectives  # noqa: E402
from tests.helpers.steps import step_proto  # noqa: E402

BATCH, SEQ, VOCAB, WIDTH = 4, 6, 40, 16


class LmWithLabels(nn.Module):
    """A causal LM that returns HF's loss when given labels: logits shifted by one
    against the labels, -100 (padding) ignored."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, labels):
        x = self.wte(input_ids)
        q, k, v = self.qkv(x).view(BATCH, SEQ, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(BATCH, SEQ, WIDTH))
        logits = self.head(self.ln(x))
        shifted = logits[:, :-1].reshape(-1, VOCAB)
        return F.cross_entropy(shifted, labels[:, 1:].reshape(-1))


class Contrastive(nn.Module):
    """CLIP's objective: normalized image and text embeddings, a learned temperature,
    cross entropy over the batch both ways."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.image = nn.Linear(8 * 4, WIDTH)
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.text = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, image, text):
        a = F.normalize(self.image(self.patch(image).flatten(1)), dim=-1)
        b = F.normalize(self.text(self.tokens(text).mean(1)), dim=-1)
        logits = self.scale.exp() * a @ b.t()
        labels = torch.arange(a.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


class WeightedNll(nn.Module):
    """Per-position classes with class weights (a buffer, never trained), summed."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 5, 3, padding=1)
        self.register_buffer("weight", torch.tensor([0.5, 1.0, 2.0, 1.5, 0.75]))

    def forward(self, x, target):
        logp = F.log_softmax(self.conv(x), dim=1)
        return F.nll_loss(logp, target, weight=self.weight, reduction="sum")


class Smoothed(nn.Module):
    """``F.cross_entropy`` with ``label_smoothing`` over ``[N, C, T]`` scores: the
    exporter drops the smoothing (the file's SoftmaxCrossEntropyLoss has no such
    attribute); the importer reads it back from the recorded call."""

    def __init__(self, reduction: str, weighted: bool):
        super().__init__()
        self.reduction = reduction
        self.conv = nn.Conv1d(3, 5, 3, padding=1)
        weight = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.75]) if weighted else None
        self.register_buffer("weight", weight)

    def forward(self, x, target):
        loss = F.cross_entropy(
            self.conv(x), target, weight=self.weight, ignore_index=2, label_smoothing=0.2,
            reduction=self.reduction,
        )  # fmt: skip
        return loss.mean() if self.reduction == "none" else loss


class ShiftedLabels(nn.Module):
    """A decoder fed its labels shifted right (BART's ``shift_tokens_right``: -100 read
    as the pad token 0), with HF's loss over the labels kept."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, labels):
        shifted = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
        shifted = shifted.masked_fill(shifted == -100, 0)
        x = self.wte(shifted) + self.wte(input_ids).mean(1, keepdim=True)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class SelfNormalized(nn.Module):
    """A loss divided by a sum of the model's own outputs over the batch: each
    micro-batch would divide by its own, and the sum is known only after every
    micro-batch's forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = self.lin(x)
        return (y * y).sum() / y.abs().sum()


def _smoothed_inputs(g):
    return {
        "x": torch.randn(BATCH, 3, 7, generator=g),
        "target": torch.randint(0, 5, (BATCH, 7), generator=g),  # 2s among them: ignored
    }


def _lm_inputs(gen):
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, -2:] = -100  # padding
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), "labels": labels}


CASES = {
    "lm": (LmWithLabels, _lm_inputs),
    "smooth_mean": (lambda: Smoothed("mean", weighted=True), _smoothed_inputs),
    "smooth_sum": (lambda: Smoothed("sum", weighted=False), _smoothed_inputs),
    "smooth_none": (lambda: Smoothed("none", weighted=True), _smoothed_inputs),
    "contrastive": (
        Contrastive,
        lambda g: {
            "image": torch.randn(BATCH, 3, 8, 8, generator=g),
            "text": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        },
    ),
    "shifted": (ShiftedLabels, _lm_inputs),
    "normalized": (
        SelfNormalized,
        lambda g: {"x": torch.randn(BATCH, WIDTH, generator=g)},
    ),
    "nll": (
        WeightedNll,
        lambda g: {
            "x": torch.randn(BATCH, 3, 7, generator=g),
            "target": torch.randint(0, 5, (BATCH, 7), generator=g),
        },
    ),
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = CASES[name][0]()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # distinct biases: the exporter merges identical initializers
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _inputs(name: str) -> dict:
    return CASES[name][1](torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made = {}

    def get(name: str):
        """``NAME-noopt``: exported with ``optimize=False``."""
        if name not in made:
            path = tmp_path_factory.mktemp("own_loss") / f"{name}.onnx"
            base, _, variant = name.partition("-")
            inputs = _inputs(base)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    _model(base), (), str(path), kwargs=inputs, input_names=list(inputs),
                    dynamo=True, external_data=False, optimize=variant != "noopt",
                )  # fmt: skip
            made[name] = path
        return made[name]

    return get


# the optimized contrastive export folds ``scale.exp()`` into a constant: the
# parameter is gone (test_a_temperature_folded_by_the_exporter_is_named); the optimized
# nll export folds the class-weight buffer's view into an initializer that no longer
# says it is a buffer (docs/design/exports.md)
NAMES = [
    "lm",
    pytest.param("contrastive-noopt", marks=pytest.mark.slow),
    "nll-noopt",
    "smooth_mean",
    pytest.param("smooth_sum", marks=pytest.mark.slow),
    pytest.param("smooth_none", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name", NAMES)
def test_the_models_own_loss_and_gradients_equal_torch_autograd(name, exported):
    """Every torch parameter trained, the scalar temperature of the contrastive model
    included (a scalar the exporter records as a parameter)."""
    path = exported(name)
    name = name.partition("-")[0]
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    # F.nll_loss with class weights exports spelled out (Gather, Where, ReduceSum)
    assert ("SoftmaxCrossEntropyLoss" in ops) == (not name.startswith("nll")), ops
    model = _model(name)
    inputs = _inputs(name)
    loss = model(**inputs)
    loss.backward()
    params = {k: p.detach().numpy().copy() for k, p in model.named_parameters()}
    grads = {k: p.grad.numpy().copy() for k, p in model.named_parameters()}

    feeds = {k: v.numpy() for k, v in inputs.items()}
    ours_loss, ours, unmatched = step_gradients(path, feeds, LossKind.AUTO, params)
    assert ours_loss == pytest.approx(loss.item(), rel=1e-5)
    assert not unmatched  # every trained initializer is a parameter; buffers stay frozen
    assert ours.keys() == grads.keys()
    for key, want in grads.items():
        err = float(np.abs(ours[key] - want).max()) / max(float(np.abs(want).max()), 1e-6)
        assert err <= 1e-4, (key, err)


def test_synthetic_labels_index_the_classes(exported, capsys):
    """The labels input reaches the loss's GatherElements through a shift and a
    flattening: synthetic labels are drawn below the vocabulary, not fed as ones."""
    path = exported("lm")
    capsys.readouterr()
    assert main(["train", str(path), "--steps", "3", "--json", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert np.all(np.isfinite(report["losses"]))
    assert "all ones" not in captured.err
    proto, step = step_proto(onnx.load(str(path)), TrainingOptions(LossKind.AUTO))
    assert dict(step.signature.input_high) == {"input_ids": VOCAB, "labels": VOCAB}


@pytest.mark.parametrize("name", ["lm", "contrastive", "nll", "smooth_mean"])
def test_data_parallel_plan_of_a_model_with_its_own_loss_verifies(name, exported, tmp_path):
    compile_model(onnx.load(str(exported(name))), "data-parallel", "2", tmp_path / "out")
    report = run_steps(tmp_path / "out", 3, "local", verify=True, threads=1).verify
    assert report is not None and len(report.per_step) == 3
    assert report.max_rel_error_loss <= 1e-4, report.to_json()
    assert report.max_rel_error_params <= 1e-4, report.to_json()


def test_a_temperature_folded_by_the_exporter_is_named(exported, capsys):
    """The optimized export computes ``scale.exp()`` ahead of time into a scalar
    constant: the parameter is gone, and the constant is not trained. ``train`` says so,
    naming the parameter and the fix."""
    path = exported("contrastive")
    capsys.readouterr()
    assert main(["train", str(path), "--steps", "1", "--threads", "1"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "ahead of time" in line]
    assert len(warned) == 1, warned
    assert "from 'scale'" in warned[0] and "optimize=False" in warned[0], warned[0]
    path = exported("contrastive-noopt")
    capsys.readouterr()
    assert main(["train", str(path), "--steps", "1", "--threads", "1"]) == 0
    assert "ahead of time" not in capsys.readouterr().err


def test_the_search_offers_no_micro_batched_point_of_a_loss_that_couples_the_batch(
    exported, capsys, tmp_path
):
    """A loss divided by a sum of the model's outputs over the batch, which one
    micro-batch knows only of itself: compile refuses micro-batches, so the search
    offers none and says why."""
    path = exported("normalized")
    capsys.readouterr()
    rc = main(["search", str(path), "--devices", "1,2", "--axes", "split,micro", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert "couples the samples of a batch" in report["axes_idle"]["micro"], report["axes_idle"]
    uses = [p.get("uses", "") for p in report["frontier"]]
    assert uses and not any("micro" in u for u in uses), uses
    rc = main(["compile", str(path), "--plan", "data-parallel", "--devices", "2",
               "--micro-batches", "2", "-o", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "couples the samples of a batch" in err, err
    rc = main(["search", str(path), "--devices", "1,2", "--axes", "split,micro"])
    out = capsys.readouterr().out
    assert "micro has no plan here: no plan compiles micro-batched" in out, out


def _padded_batches(tmp_path) -> str:
    """Three global batches of the lm case whose ignored labels (-100) fall unevenly: the
    first micro-batch of 2 (and of 4) keeps far fewer labels than the others."""
    gen = np.random.default_rng(0)
    labels = gen.integers(0, VOCAB, (3, BATCH, SEQ))
    labels[:, 0, :5] = -100
    labels[:, 1, 2:] = -100
    path = tmp_path / "padded.npz"
    np.savez(path, input_ids=gen.integers(0, VOCAB, (3, BATCH, SEQ)), labels=labels)
    return str(path)


@pytest.mark.parametrize(
    "name,devices,flags",
    [
        ("lm", "2", ["--micro-batches", "2"]),
        ("lm", "1", ["--micro-batches", "4", "--recompute", "all"]),
        pytest.param("lm", "2", ["--plan", "fsdp", "--micro-batches", "2"], marks=pytest.mark.slow),
        pytest.param(
            "lm", "2", ["--plan", "megatron", "--micro-batches", "2"], marks=pytest.mark.slow
        ),
        ("shifted", "2", ["--micro-batches", "2"]),
    ],
)
def test_a_loss_divided_by_the_labels_kept_trains_micro_batched_like_one_device(
    name, devices, flags, exported, tmp_path, capsys
):
    """HF's loss divides by the count of labels not ignored over the whole batch, before
    any micro-batch's backward. The count is made of the labels alone, which a rank holds
    for every micro-batch at once: the labels are fed whole, the count's units run on
    them whole in each micro-step (``passes.micro.micro_along``), and three steps on
    batches padded unevenly across the micro-batches equal the single-device step. The
    ``shifted`` decoder reads its labels in the forward too: the unit that places them
    (the shift) runs whole as well, so that they are fed whole."""
    out = tmp_path / "out"
    argv = ["compile", str(exported(name)), "--devices", devices, *flags, "-o", str(out)]
    if "--plan" not in flags:
        argv += ["--plan", "data-parallel"]
    assert main(argv) == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert "micro_dim" in manifest["inputs"]["input_ids"]
    assert "micro_dim" not in manifest["inputs"]["labels"]  # fed whole
    report = run_steps(out, 3, "local", verify=True, threads=1, data=_padded_batches(tmp_path))
    assert report.verify is not None and len(report.verify.per_step) == 3
    assert report.verify.max_rel_error_loss <= 1e-4, report.verify.to_json()
    assert report.verify.max_rel_error_params <= 1e-4, report.verify.to_json()


@pytest.mark.slow
def test_every_micro_batched_point_of_a_loss_divided_by_the_labels_kept_compiles_as_priced(
    exported, tmp_path, capsys
):
    """The search offers micro-batched points of HF's loss, and they compile to the
    estimates the search gave them (every point of 4 micro-batches, every fourth of 2):
    4 micro-batches on 2 devices among them, where the embedding's plan keeps the token
    ids whole over the devices (4 per rank) while the labels, fed whole to every
    micro-step, are split over them (2 per rank); the first and last of those train
    like one device."""
    from tensoropt.cli.search_json import load_search

    path = exported("lm")
    doc = tmp_path / "s.json"
    assert main(["search", str(path), "--devices", "2", "--axes", "split,recompute,micro",
                 "--micro-batches", "1,2,4", "--json-out", str(doc)]) == 0  # fmt: skip
    capsys.readouterr()
    rows = load_search(str(doc)).rows(2)
    two = [i for i, row in enumerate(rows) if row["axes"]["micro_batches"] == 2]
    four = [i for i, row in enumerate(rows) if row["axes"]["micro_batches"] == 4]
    assert two and four, [r["axes"] for r in rows]
    checked = {four[0], four[-1]}
    for index in [*four, *two[::4], two[-1]]:
        assert main(["compile", str(path), "--search", str(doc), "--devices", "2",
                     "--pick", str(index), "-o", str(tmp_path / f"p{index}"),
                     "--json"]) == 0  # fmt: skip
        estimate = json.loads(capsys.readouterr().out)["estimate"]
        assert estimate["time_s"] == pytest.approx(rows[index]["time_s"], rel=1e-12)
        assert estimate["memory_bytes"] == rows[index]["memory_bytes"]
        if index in checked:
            data = _padded_batches(tmp_path)
            report = run_steps(tmp_path / f"p{index}", 2, "local", verify=True, data=data)
            assert report.verify is not None
            assert report.verify.max_rel_error_params <= 1e-4, report.verify.to_json()


def test_recomputing_the_blocks_of_a_flattened_loss_adds_no_collective(exported, tmp_path, capsys):
    """The recompute waits for the gradient at its block's output, here [B * (S - 1), V]
    against the block input's [B, S, C]: viewed as [B, S - 1, V] the wait stays per
    sample, so a batch-split plan adds no collective (summed to a scalar, it cost an
    all-reduce and an all-gather of the block input per block)."""
    plain, recomputed = recompute_collectives(exported("lm"), tmp_path, capsys)
    assert plain == recomputed
