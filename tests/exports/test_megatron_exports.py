"""Megatron-LM plans on real ``torch.onnx.export(dynamo=True)`` output.

For GPT-2 (fused ``c_attn`` + ``split``), HF-style GPT-2 (``Conv1D``: Reshape -> Gemm ->
Reshape), BERT (separate Q/K/V, masked), ViT (fused ``qkv`` + reshape/unbind), Llama
(RMSNorm, rotary, SiLU-gated MLP) and torch's ``nn.TransformerEncoder`` (packed
in-projection taken apart by Gathers, out projection a ``Gemm`` with ``transB``):

* the forward rewrite of ``passes.blocks`` changes nothing a step computes: loss and
  updated parameters equal those of the export's own step (a fused QKV weight compared
  through its ``[C, 3, D]`` view);
* every layer's MLP and attention block is found (counts equal the torch model's layers);
* the device graphs hold exactly one all-reduce forward and one backward per block on
  the tp group, and nothing else on it (meshes 2, 4 and 2x2);
* ``--verify`` passes (3 SGD momentum steps, max relative error <= 1e-4);
* a tp size that does not divide the heads leaves attention whole with a note naming the
  Reshape, tensor, dimension and sizes; a weight split that does not divide is refused
  with exit 2.

Mesh 4 uses 4-head variants of the models (2 heads cannot split 4 ways).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from tensoropt.cli import main  # noqa: E402
from tensoropt.ir.importer import export_model  # noqa: E402
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions  # noqa: E402
from tensoropt.passes.plans import prepare_model  # noqa: E402
from tensoropt.passes.training_step import TrainingOptions, build_training_step  # noqa: E402
from tensoropt.runtime.run import run_steps  # noqa: E402
from tensoropt.runtime.single import StepSession  # noqa: E402
from tests.exports.hf_models import HF_GPT2  # noqa: E402
from tests.exports.models import CASES, Case, export  # noqa: E402
from tests.helpers.compile import compile_model  # noqa: E402
from tests.helpers.steps import import_proto  # noqa: E402
from tests.passes.test_collective_counts import _role, collectives  # noqa: E402

SGD = OptimizerOptions(OptimizerKind.SGD, lr=0.01, momentum=0.9)
NAMES = ("gpt2", "hf_gpt2", "bert", "vit", "llama", "mha")
QUICK = {("gpt2", "2")}


def _case(name: str) -> Case:
    """``name`` or its 4-head variant ``name-h4``."""
    base, _, variant = name.partition("-")
    case = HF_GPT2 if base == "hf_gpt2" else CASES[base]
    if variant == "h4":
        build = case.build
        case = dataclasses.replace(case, name=name, build=lambda: build(heads=4))
    return case


def _layers(case: Case) -> int:
    """The torch model's layer count: the length of its longest ModuleList."""
    model = case.build()
    return max(len(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList))


@pytest.fixture(scope="module")
def export_of(tmp_path_factory):
    folder = tmp_path_factory.mktemp("megatron_exports")
    made = {}

    def get(name: str):
        if name not in made:
            import warnings

            path = folder / f"{name}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                export(_case(name), str(path))
            made[name] = onnx.load(str(path))
        return made[name]

    return get


def _batch(case: Case, logits_shape) -> dict[str, np.ndarray]:
    inputs = case.inputs(torch.Generator().manual_seed(0))
    labels = case.labels(tuple(logits_shape), torch.Generator().manual_seed(7))
    return {k: v.numpy() for k, v in inputs.items()} | {"labels": labels.numpy()}


def _one_step(proto: onnx.ModelProto, prepare: bool, batch_of):
    """(loss, updated params, the rewrite or None) of one SGD step of ``proto``."""
    model = import_proto(proto)
    rewrite = prepare_model("megatron", model) if prepare else None
    step = build_training_step(model, TrainingOptions(optimizer=SGD))
    session = StepSession(export_model(step.model))
    state = session.initial_state()
    logits = proto.graph.output[0].type.tensor_type.shape
    loss, new = session.step(state, batch_of([d.dim_value for d in logits.dim]))
    return loss, {p: new[p] for p in step.signature.params}, rewrite


# What the rewrite does per 2-layer export: (projection groups stacked (Q/K/V;
# gate/up), fused QKV weights viewed). HF Conv1D projections and nn.MultiheadAttention's
# out projections arrive as MatMuls (the importer unflattens their Gemms).
REWRITES = {
    "gpt2": (0, 2),
    "hf_gpt2": (0, 2),
    "bert": (2, 0),
    "vit": (0, 2),
    "llama": (4, 0),
    "mha": (0, 2),
}


def _models(quick=("gpt2",)):
    return [pytest.param(n, marks=() if n in quick else (pytest.mark.slow,), id=n) for n in NAMES]


@pytest.mark.parametrize("name", _models())
def test_prepared_step_trains_exactly_as_the_export(name, export_of):
    proto = export_of(name)
    case = _case(name)
    loss, params, _ = _one_step(proto, False, lambda shape: _batch(case, shape))
    loss2, params2, rewrite = _one_step(proto, True, lambda shape: _batch(case, shape))
    assert (rewrite.stacked, len(rewrite.fused)) == REWRITES[name]
    assert loss2 == pytest.approx(loss, rel=1e-6)
    assert params.keys() == params2.keys()
    reshaped = 0
    for key, want in params.items():
        got = params2[key]
        if got.shape != want.shape:  # a fused QKV weight or bias, now its [.., 3, D] view
            assert got.size == want.size and 3 in got.shape[:2], (key, got.shape, want.shape)
            got = got.reshape(want.shape)
            reshaped += 1
        scale = max(float(np.abs(want).max()), 1e-6)
        assert float(np.abs(got - want).max()) / scale <= 1e-6, key
    fused = name in ("gpt2", "hf_gpt2", "vit", "mha")
    assert reshaped == (4 if fused else 0)  # weight and bias of each layer's fused QKV


def _mesh_cases():
    for name in NAMES:
        for mesh in ("2", "2x2", "4"):
            target = f"{name}-h4" if mesh == "4" else name
            marks = () if (name, mesh) in QUICK else (pytest.mark.slow,)
            yield pytest.param(target, mesh, marks=marks, id=f"{target}-{mesh}")


def _tp_group(mesh: str, rank: int) -> tuple[int, ...]:
    if mesh == "2x2":
        return (rank - rank % 2, rank - rank % 2 + 1)
    return tuple(range(int(mesh)))


@pytest.mark.parametrize(("name", "mesh"), list(_mesh_cases()))
def test_every_block_found_with_one_allreduce_each_way(name, mesh, export_of, tmp_path):
    layers = _layers(_case(name))
    out = tmp_path / "out"
    _, built = compile_model(export_of(name), "megatron", mesh, out, TrainingOptions(optimizer=SGD))
    tp = 1 if mesh == "2x2" else 0
    assert built.notes[0] == (
        f"megatron: {layers} MLP and {layers} attention blocks on mesh axis {tp} (tp)"
    ), built.notes
    assert not any("left whole" in n or "unsharded" in n for n in built.notes), built.notes
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["ranks"]:
        found = collectives(onnx.load(str(out / entry["file"])))
        group = _tp_group(mesh, entry["rank"])
        on_tp = Counter((c.kind, _role(c)) for c in found if c.group == group)
        assert on_tp == Counter(
            {("AllReduce", "forward"): 2 * layers, ("AllReduce", "backward"): 2 * layers}
        ), (entry["rank"], on_tp)
        if mesh != "2x2":  # pure tp: the blocks' all-reduces are every collective
            assert len(found) == 4 * layers
        else:  # everything else runs over a dp column
            assert all(
                len(c.group) == 2 and set(c.group) != set(group) for c in found if c.group != group
            )
    report = run_steps(out, 3, "local", verify=True, threads=1).verify
    assert report is not None and len(report.per_step) == 3
    assert report.max_rel_error_loss <= 1e-4, report.to_json()
    assert report.max_rel_error_params <= 1e-4, report.to_json()


def _cli_compile(export_of, tmp_path, devices: str):
    model = tmp_path / "gpt2.onnx"
    onnx.save(export_of("gpt2"), str(model))
    out = tmp_path / "out"
    rc = main(["compile", str(model), "--devices", devices, "--plan", "megatron", "-o", str(out)])
    return rc, out


@pytest.mark.slow
def test_tp_that_would_cut_heads_leaves_attention_whole_and_says_why(export_of, tmp_path, capsys):
    """2 heads on 4 tp ranks: the MLP blocks split, attention stays whole, a note says
    which Reshape, tensor, dim and sizes; the step still verifies."""
    rc, out = _cli_compile(export_of, tmp_path, "4")
    assert rc == 0
    err = capsys.readouterr().err
    assert "megatron: 2 MLP and 0 attention blocks" in err, err
    [note] = [line for line in err.splitlines() if "cut heads apart" in line]
    # mesh 4 has no data-parallel axis: the blocks are replicated, and the note says so
    assert "attention blocks left whole, replicated over the tp axis's 4 devices," in note, note
    assert "weight 'val_9'" in note and "Reshape" in note, note
    assert "dim 2 (size 32)" in note and "2 heads of 16, and 4 does not divide 2" in note, note
    assert main(["run", str(out), "--steps", "3", "--verify", "--threads", "1"]) == 0


def test_weight_split_that_does_not_divide_is_refused_through_the_cli(export_of, tmp_path, capsys):
    rc, out = _cli_compile(export_of, tmp_path, "3")
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    line = err[-1]
    assert "which 3 does not divide" in line and "dim 1 has size 128" in line, line
    assert "weight 'val_" in line, line
    assert not out.exists()


def test_fused_qkv_shards_hold_the_same_heads_of_q_k_and_v(tmp_path, capsys):
    """Through the CLI on an export with external data (weights streamed, never loaded
    by compile): rank r's fused weight is columns r*D/n..(r+1)*D/n of each of W's q, k
    and v thirds, and so is its bias; the step verifies."""
    import warnings

    case = CASES["gpt2"]
    inputs = case.inputs(torch.Generator().manual_seed(0))
    path = tmp_path / "gpt2.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            case.model(), (), str(path), kwargs=inputs, dynamo=True, external_data=True
        )
    original = onnx.load(str(path))
    by_name = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    out = tmp_path / "out"
    rc = main(["compile", str(path), "--devices", "2", "--plan", "megatron", "-o", str(out)])
    assert rc == 0
    [note] = [n for n in capsys.readouterr().err.splitlines() if "fused QKV" in n]
    fused = note.split(": ")[-1].split(", ")
    assert len(fused) == _layers(case)
    external = {
        t.name
        for t in onnx.load(str(path), load_external_data=False).graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    }
    assert set(fused) <= external
    manifest = json.loads((out / "manifest.json").read_text())
    for name in fused:
        w = by_name[name]  # [C, 3D]: [q | k | v]
        c, d = w.shape[0], w.shape[1] // 3
        (bias_name,) = _bias_of(original, name)
        for entry in manifest["ranks"]:
            r = entry["rank"]
            device = {
                t.name: numpy_helper.to_array(t)
                for t in onnx.load(str(out / entry["file"])).graph.initializer
            }
            cols = slice(r * d // 2, (r + 1) * d // 2)
            want = np.stack([w[:, j * d : (j + 1) * d][:, cols] for j in range(3)], axis=1)
            np.testing.assert_array_equal(device[name], want)  # [C, 3, D/2]
            b = by_name[bias_name]
            want_b = np.stack([b[j * d : (j + 1) * d][cols] for j in range(3)])[:, None, :]
            np.testing.assert_array_equal(device[bias_name], want_b)  # [3, 1, D/2]
            assert device[name].shape == (c, 3, d // 2)
    assert main(["run", str(out), "--steps", "3", "--verify", "--threads", "1"]) == 0


def _bias_of(model: onnx.ModelProto, weight: str) -> list[str]:
    """The initializer added to ``weight``'s MatMul output (its Linear bias)."""
    made = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type != "Add":
            continue
        for i, name in enumerate(node.input):
            src = made.get(name)
            if src is not None and src.op_type == "MatMul" and weight in src.input:
                other = node.input[1 - i]
                if other in inits:
                    out.append(other)
    return out
