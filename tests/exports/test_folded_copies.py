"""Folded copies that broadcast a parameter (``importer._collapse_broadcast_copies``).

The exporter's optimizer folds an embedding looked up at constant indices and expanded
to the batch into a ``[B, S, D]`` initializer: BART's learned positions (``arange``) and
BERT's token-type row (the all-zero ``token_type_ids`` buffer); ViT's class token
expanded to the batch folds to ``[B, 1, D]``. Trained as such, each copy learned on its
own, so the model left torch's after one step, and a batch-sized parameter refused
micro-batching. Each is trained as its first slice along the axes it repeats, which the
Add that reads it broadcasts (the Concat that reads the class token reads it through an
Expand, laid out like the batch): three SGD steps equal torch's, and the model
micro-batches like one device. A token read directly as well is the slice of its
copy: one parameter. A parameter that is batch-sized in torch too is refused
micro-batching, in one line."""

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
from tests.exports.mapping import moved_activations  # noqa: E402
from tests.helpers.steps import import_proto, step_proto  # noqa: E402

BATCH, SEQ, VOCAB, WIDTH, LR = 4, 6, 30, 16, 0.5
HEADS = 2


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


class ClassToken(Embeds):
    """ViT's class token, expanded to the batch and put before the positions; the
    logits of every position but the token's."""

    def __init__(self):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, WIDTH))

    def forward(self, ids):
        x = self.tokens(ids)[:, 1:]
        x = torch.cat([self.cls_token.expand(BATCH, -1, -1), x], dim=1)
        return self.head(self.norm(x + self.positions.weight[:SEQ]))


class TokenReadTwice(ClassToken):
    """The class token expanded to the batch and also added to every position as it is:
    the file holds the token and its folded copy."""

    def forward(self, ids):
        x = self.tokens(ids)[:, 1:] + self.cls_token
        x = torch.cat([self.cls_token.expand(BATCH, -1, -1), x], dim=1)
        return self.head(self.norm(x + self.positions.weight[:SEQ]))


class TokenRepeated(ClassToken):
    """The class token ``.repeat``-ed to the batch: unoptimized, an Expand of the token to
    its own shape and a Tile (``canonical.tiles_as_expands``)."""

    def forward(self, ids):
        x = self.tokens(ids)[:, 1:]
        x = torch.cat([self.cls_token.repeat(BATCH, 1, 1), x], dim=1)
        return self.head(self.norm(x + self.positions.weight[:SEQ]))


class RelativeBias(Embeds):
    """T5's relative position bias: a ``[buckets, heads]`` table gathered at the
    constant bucket of ``j - i``, permuted to ``[1, heads, T, T]`` and added to the
    attention scores; the exporter folds the gathered table into that tensor."""

    def __init__(self, rounded: bool = False):
        super().__init__()
        self.bias = nn.Embedding(2 * SEQ, HEADS)
        if rounded:  # values repeat within the table: which copies were one is unknown
            with torch.no_grad():
                self.bias.weight.copy_(torch.round(self.bias.weight * 2) / 2)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, ids):
        pos = torch.arange(SEQ)
        bias = self.bias(pos[None, :] - pos[:, None] + SEQ).permute(2, 0, 1).unsqueeze(0)
        x = self.tokens(ids)
        q, k, v = self.qkv(x).view(BATCH, SEQ, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2) + bias).softmax(-1)
        return self.head(self.norm(x + (scores @ v).transpose(1, 2).reshape(BATCH, SEQ, WIDTH)))


class PerSample(Embeds):
    """A parameter of batch size in torch too: each sample its own learned offset."""

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.randn(BATCH, 1, WIDTH))

    def forward(self, ids):
        return self.head(self.norm(self.tokens(ids) + self.offset))


MODELS = {
    "embeds": Embeds,
    "class_token": ClassToken,
    "token_read_twice": TokenReadTwice,
    "token_repeated": TokenRepeated,
    "relative_bias": RelativeBias,
    "rounded_bias": lambda: RelativeBias(rounded=True),
    "per_sample": PerSample,
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made = {}

    def get(name: str):
        """The model ``name`` and its export; ``NAME-noopt`` exported with
        ``optimize=False``."""
        if name not in made:
            torch.manual_seed(0)
            base, _, noopt = name.partition("-")
            model = MODELS[base]().eval()
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
            path = tmp_path_factory.mktemp("copies") / f"{name}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    model, (ids,), str(path), input_names=["ids"], dynamo=True, optimize=not noopt
                )
            made[name] = (model, path)
        return made[name]

    return get


def _batches(steps: int) -> list[dict[str, np.ndarray]]:
    gen = torch.Generator().manual_seed(2)
    return [
        {
            "ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).numpy(),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).numpy(),
        }
        for _ in range(steps)
    ]


def _copies(path, shape) -> dict:
    return {
        name: v.const_value.numpy()
        for name, v in ir.load(str(path)).graph.initializers.items()
        if tuple(v.shape) == shape
    }


def _trains_like_torch(model, path) -> dict:
    """Three SGD steps of the export's step equal torch's; the last state."""
    sgd = OptimizerOptions(OptimizerKind.SGD, lr=LR, momentum=0.0)
    session = StepSession(step_proto(onnx.load(str(path)), TrainingOptions(LossKind.CE, sgd))[0])
    state = session.initial_state()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in _batches(3):
        loss, state = session.step(state, batch)
        optimizer.zero_grad()
        logits = model(torch.from_numpy(batch["ids"]))
        labels = torch.from_numpy(batch["labels"]).reshape(-1)
        want = F.cross_entropy(logits.reshape(-1, VOCAB), labels)
        want.backward()
        optimizer.step()
        assert loss == pytest.approx(want.item(), rel=1e-5)
    return state


def test_the_copies_train_as_the_parameter_they_broadcast(exported):
    model, path = exported("embeds")
    copies = _copies(path, (BATCH, SEQ, WIDTH))
    assert len(copies) == 2, sorted(copies)  # the file holds both lookups, folded
    state = _trains_like_torch(model, path)
    shapes = {name: state[name].shape for name in copies}
    assert sorted(shapes.values()) == [(1, 1, WIDTH), (1, SEQ, WIDTH)], shapes
    rows = {tuple(v.shape): v for k, v in state.items() if k in copies}
    np.testing.assert_allclose(
        rows[(1, SEQ, WIDTH)][0], model.positions.weight.detach().numpy()[2:], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        rows[(1, 1, WIDTH)][0, 0], model.types.weight.detach().numpy()[0], rtol=1e-5, atol=1e-6
    )


def test_a_class_token_expanded_to_the_batch_trains_as_the_token(exported):
    model, path = exported("class_token")
    (name,) = _copies(path, (BATCH, 1, WIDTH))
    state = _trains_like_torch(model, path)
    np.testing.assert_allclose(state[name], model.cls_token.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_token_also_read_directly_is_one_parameter(exported):
    """The copy's slice is the token the file also holds: trained once, its gradient
    the sum of both uses, as torch's (apart, each copy learned half of it)."""
    model, path = exported("token_read_twice")
    (copy,) = _copies(path, (BATCH, 1, WIDTH))
    assert "cls_token" in _copies(path, (1, 1, WIDTH))
    state = _trains_like_torch(model, path)
    assert copy not in state
    np.testing.assert_allclose(
        state["cls_token"], model.cls_token.detach().numpy(), rtol=1e-5, atol=1e-6
    )


def test_a_bias_table_gathered_at_constant_buckets_trains_as_the_table(exported, capsys):
    """The folded ``[1, H, T, T]`` bias becomes the table of its distinct rows gathered
    at the positions that read them: each row's gradient sums its copies, as torch's
    does (trained per copy, the loss left torch's at the second step); train does not
    warn of it."""
    model, path = exported("relative_bias")
    (name,) = _copies(path, (1, HEADS, SEQ, SEQ))
    state = _trains_like_torch(model, path)
    used = model.bias.weight.detach().numpy()[1 : 2 * SEQ]  # buckets 1 .. 2 SEQ - 1
    assert state[name].shape == used.shape

    def rows(a):
        return a[np.lexsort(a.T[::-1])]

    np.testing.assert_allclose(rows(state[name]), rows(used), rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert main(["train", str(path), "--steps", "1", "--threads", "1", "--loss", "ce"]) == 0
    assert "repeats values" not in capsys.readouterr().err


def test_a_table_whose_values_repeat_is_left_and_warned_of(exported, capsys):
    """Rounded to halves, the table's scalars repeat: the file cannot say which copies
    were one element, so the folded tensor stays as it is and train names it."""
    _, path = exported("rounded_bias")
    (name,) = _copies(path, (1, HEADS, SEQ, SEQ))
    graph = import_proto(onnx.load(str(path))).graph
    assert tuple(graph.initializers[name].shape) == (1, HEADS, SEQ, SEQ)
    capsys.readouterr()
    assert main(["train", str(path), "--steps", "1", "--threads", "1", "--loss", "ce"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "repeats values" in line]
    assert len(warned) == 1 and repr(name) in warned[0] and "optimize=False" in warned[0], warned


@pytest.mark.parametrize(
    "name",
    ["embeds", "class_token", "token_read_twice", "relative_bias", "token_repeated-noopt"],
)
def test_the_collapsed_copies_micro_batch_like_one_device(name, exported, tmp_path):
    """A batch-sized parameter would be split with the micro-batches (refused); the data
    parallel plan moves no activation (the class token's Expand splits the batch; the
    unoptimized export's repeat of it, a Tile, becomes that Expand)."""
    _, path = exported(name)
    out = tmp_path / "out"
    argv = ["compile", str(path), "--plan", "data-parallel", "--devices", "2",
            "--micro-batches", "2", "--loss", "ce", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert moved_activations(out) == []
    report = run_steps(out, 3, "local", verify=True, threads=1).verify
    assert report is not None and report.max_rel_error_params <= 1e-4, report.to_json()


def test_a_parameter_of_batch_size_in_torch_is_refused_micro_batches(exported, tmp_path, capsys):
    _, path = exported("per_sample")
    argv = ["compile", str(path), "--plan", "data-parallel", "--devices", "1",
            "--micro-batches", "2", "--loss", "ce", "-o", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "parameter 'offset' (shape [4, 1, 16]) is split with the batch" in err[0]
    )
    assert not (tmp_path / "out").exists()
