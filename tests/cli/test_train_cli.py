"""``tensoropt train``: bad input, trainable overrides, --json, --data, --save-params,
--export-step (issue "Foundation", "How it is checked")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from tensoropt.passes.training_step import read_signature
from tensoropt.runtime.data import make_batch, specs_from_model
from tests.cli import models
from tests.cli.cli_run import assert_bad_input, cli, cli_process


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _losses(capsys, *argv) -> list[float]:
    outcome = cli(capsys, "train", *argv, "--json")
    assert outcome.code == 0, outcome.err
    data = json.loads(outcome.out)
    assert data["schema"] == "tensoropt.train/1"
    return data["losses"]


# -- bad input: exit 2, one line on stderr, no traceback (real child processes) ------


def _truncated(zoo_file, tmp_path: Path) -> Path:
    data = zoo_file("resnet50").read_bytes()
    path = tmp_path / "half.onnx"
    path.write_bytes(data[: len(data) // 2])
    return path


def test_missing_file(tmp_path):
    outcome = cli_process("train", tmp_path / "nope.onnx", "--steps", 1)
    assert_bad_input(outcome, "train", "nope.onnx", "no such file")


def test_file_that_is_not_onnx(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("these are my notes, not a model\n")
    outcome = cli_process("train", path, "--steps", 1)
    assert_bad_input(outcome, "train", "notes.onnx", "not a readable ONNX model")


def test_truncated_protobuf(zoo_file, tmp_path):
    outcome = cli_process("train", _truncated(zoo_file, tmp_path), "--steps", 1)
    assert_bad_input(outcome, "train", "half.onnx", "truncated")


def test_unsupported_ops_are_all_listed_with_node_names(tmp_path):
    path = _save(models.unsupported_ops_model(), tmp_path / "unsup.onnx")
    outcome = cli_process("train", path, "--steps", 1)
    line = assert_bad_input(outcome, "train", "unsup.onnx", "unsupported ops")
    for op, nodes in {
        "Det": ("det_a", "det_b"),
        "com.acme::Foo": ("acme_foo",),
        "NonMaxSuppression": ("nms",),
    }.items():
        assert op in line, line
        for node in nodes:
            assert node in line, line
    # supported ops are not listed
    assert "MatMul" not in line and "Add " not in line


def test_dynamic_dimension_says_how_to_pin_it(tmp_path):
    path = _save(models.dynamic_batch_model(), tmp_path / "dyn.onnx")
    outcome = cli_process("train", path, "--steps", 1)
    assert_bad_input(outcome, "train", "'x'", "dimension 0", "'batch'", "--input-shape x=Nx4")


def test_relu_only_model_has_no_trainable_parameters(tmp_path):
    path = _save(models.relu_only_model(), tmp_path / "relu.onnx")
    outcome = cli_process("train", path, "--steps", 1)
    assert_bad_input(outcome, "train", "no trainable parameters")


def test_all_frozen_has_no_trainable_parameters(zoo_file):
    outcome = cli_process("train", zoo_file("mlp"), "--steps", 1, "--freeze", ".*")
    assert_bad_input(outcome, "train", "froze every parameter")


def test_bad_input_in_process_matches_the_child_process(zoo_file, tmp_path, capsys):
    """The in-process entry point behaves like the process (used by the tests below)."""
    outcome = cli(capsys, "train", _truncated(zoo_file, tmp_path), "--steps", 1)
    assert_bad_input(outcome, "train", "half.onnx")


# -- --input-shape really pins the shape ------------------------------------------


@pytest.mark.parametrize("batch", [8, 12])
def test_input_shape_pins_the_dimension_and_trains(tmp_path, capsys, batch):
    path = _save(models.dynamic_batch_model(), tmp_path / "dyn.onnx")
    step_path = tmp_path / "step.onnx"
    losses = _losses(
        capsys,
        path,
        "--steps",
        3,
        "--loss",
        "mse",
        "--input-shape",
        f"x={batch}x4",
        "--export-step",
        step_path,
    )
    assert len(losses) == 3 and all(np.isfinite(losses))
    step = onnx.load(str(step_path))
    x = next(i for i in step.graph.input if i.name == "x")
    assert [d.dim_value for d in x.type.tensor_type.shape.dim] == [batch, 4]
    assert all(not d.dim_param for d in x.type.tensor_type.shape.dim)


def test_input_shape_naming_no_input_is_refused(tmp_path, capsys):
    path = _save(models.dynamic_batch_model(), tmp_path / "dyn.onnx")
    outcome = cli(capsys, "train", path, "--input-shape", "y=8x4")
    assert_bad_input(outcome, "train", "'y'", "not a model input")


# -- trainable policy overrides ----------------------------------------------------


def _trained(capsys, *argv) -> int:
    outcome = cli(capsys, "train", *argv, "--steps", 1, "--json")
    assert outcome.code == 0, outcome.err
    count = json.loads(outcome.out)["trained_parameters"]
    assert f"training {count} parameters" in outcome.err
    return count


def test_freeze_and_trainable_change_the_trained_count(zoo_file, tmp_path, capsys):
    mlp = zoo_file("mlp")
    assert _trained(capsys, mlp) == 6
    assert _trained(capsys, mlp, "--freeze", r"\.bias$") == 3
    assert _trained(capsys, mlp, "--freeze", "^fc0") == 4
    scaled = _save(models.scaled_model(), tmp_path / "scaled.onnx")
    assert _trained(capsys, scaled, "--loss", "mse") == 1  # the rank-0 scale is not trained
    assert _trained(capsys, scaled, "--loss", "mse", "--trainable", "^scale$") == 2
    # freeze wins over trainable
    assert _trained(capsys, scaled, "--loss", "mse", "--trainable", "scale", "--freeze", "sc") == 1


def test_trainable_scale_is_updated(tmp_path, capsys):
    scaled = _save(models.scaled_model(), tmp_path / "scaled.onnx")
    out = tmp_path / "p.npz"
    _losses(capsys, scaled, "--loss", "mse", "--trainable", "^scale$", "--save-params", out)
    params = np.load(out)
    assert sorted(params.files) == ["W", "scale"]
    assert params["scale"].shape == () and float(params["scale"]) != 1.5


# -- --data ------------------------------------------------------------------------


def _synthetic_batches(step_path: Path, steps: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The synthetic batches `train` uses, stacked as [steps, ...] arrays."""
    model = onnx.load(str(step_path))
    specs = specs_from_model(model, read_signature(model).to_json())
    batches = [make_batch(specs, k, seed) for k in range(steps)]
    return {name: np.stack([b[name] for b in batches]) for name in batches[0]}


def test_data_file_with_the_synthetic_batches_gives_the_same_losses(zoo_file, tmp_path, capsys):
    gpt = zoo_file("gpt")
    step_path = tmp_path / "step.onnx"
    synthetic = _losses(capsys, gpt, "--steps", 3, "--export-step", step_path)
    arrays = _synthetic_batches(step_path, 3)
    assert set(arrays) == {"input_ids", "labels"}
    np.savez(tmp_path / "same.npz", **arrays)
    assert _losses(capsys, gpt, "--steps", 3, "--data", tmp_path / "same.npz") == synthetic


def test_data_file_is_used_in_both_forms(zoo_file, tmp_path, capsys):
    mlp = zoo_file("mlp")
    synthetic = _losses(capsys, mlp, "--steps", 3)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    labels = rng.integers(0, 16, size=(8,)).astype(np.int64)
    np.savez(tmp_path / "global.npz", x=x, labels=labels)
    reused = _losses(capsys, mlp, "--steps", 3, "--data", tmp_path / "global.npz")
    assert reused != synthetic
    # [steps, ...] holding the same batch three times is the same as the global form
    np.savez(tmp_path / "steps.npz", x=np.stack([x] * 3), labels=np.stack([labels] * 3))
    assert _losses(capsys, mlp, "--steps", 3, "--data", tmp_path / "steps.npz") == reused
    # a different second batch changes the losses from step 1 on, not step 0
    x2 = np.stack([x, -x, x])
    np.savez(tmp_path / "varied.npz", x=x2, labels=np.stack([labels] * 3))
    varied = _losses(capsys, mlp, "--steps", 3, "--data", tmp_path / "varied.npz")
    assert varied[0] == reused[0] and varied[1] != reused[1]


def test_data_file_with_too_few_steps_is_refused_before_training(zoo_file, tmp_path, capsys):
    x = np.zeros((2, 8, 32), np.float32)
    np.savez(tmp_path / "short.npz", x=x, labels=np.zeros((2, 8), np.int64))
    outcome = cli(capsys, "train", zoo_file("mlp"), "--steps", 3, "--data", tmp_path / "short.npz")
    assert_bad_input(outcome, "train", "'x'", "2 steps", "at least 3")
    assert outcome.out == ""  # refused before the first step


def test_data_file_with_a_wrong_shape_names_array_and_shapes(zoo_file, tmp_path, capsys):
    np.savez(tmp_path / "d.npz", x=np.zeros((8, 31), np.float32), labels=np.zeros(8, np.int64))
    outcome = cli(capsys, "train", zoo_file("mlp"), "--data", tmp_path / "d.npz")
    assert_bad_input(outcome, "train", "'x'", "[8, 31]", "[8, 32]")


# -- --save-params and --export-step -------------------------------------------------


def test_save_params_keys_are_the_original_initializer_names(zoo_file, tmp_path, capsys):
    gpt = zoo_file("gpt")
    out = tmp_path / "params.npz"
    _losses(capsys, gpt, "--steps", 2, "--save-params", out)
    initial = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(gpt)).graph.initializer}
    saved = np.load(out)
    assert set(saved.files) <= set(initial)
    assert len(saved.files) == 37  # every trained parameter of the tiny gpt
    changed = 0
    for name in saved.files:
        assert saved[name].shape == initial[name].shape and saved[name].dtype == np.float32
        changed += not np.array_equal(saved[name], initial[name])
    assert changed >= len(saved.files) - 2  # all but the key biases (zero gradient) moved


def test_export_step_passes_the_checker_and_runs(zoo_file, tmp_path, capsys):
    gpt = zoo_file("gpt")
    step_path = tmp_path / "step.onnx"
    losses = _losses(capsys, gpt, "--steps", 1, "--export-step", step_path)
    model = onnx.load(str(step_path))
    onnx.checker.check_model(model, full_check=True)
    sig = read_signature(model)
    batch = {k: v[0] for k, v in _synthetic_batches(step_path, 1).items()}
    session = ort.InferenceSession(str(step_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(names, batch), strict=True))
    assert names[0] == sig.loss == "loss"
    assert float(out["loss"]) == pytest.approx(losses[0], rel=1e-6)
    for new, old in sig.carry:
        assert out[new].shape == tuple(
            d.dim_value
            for d in next(i for i in model.graph.input if i.name == old).type.tensor_type.shape.dim
        )


def _padding_masked(tmp_path: Path) -> Path:
    """y = Softmax(Where(mask, -inf, x * w)): a torch-style padding mask, where true
    means masked, so an all-true mask masks every position and the softmax is NaN."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["s"]),
            helper.make_node("Where", ["mask", "low", "s"], ["m"]),
            helper.make_node("Softmax", ["m"], ["y"], axis=-1),
        ],
        "masked",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [
            numpy_helper.from_array(np.asarray([0.5, 1.0, 1.5], np.float32), "w"),
            numpy_helper.from_array(np.asarray(-np.inf, np.float32), "low"),
        ],
    )
    return _save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), tmp_path / "m.onnx"
    )


def test_a_loss_that_is_not_finite_is_null_in_json_and_named_with_the_inputs_fed_ones(
    tmp_path, capsys
):
    path = _padding_masked(tmp_path)
    outcome = cli(capsys, "train", path, "--steps", "2", "--loss", "mse", "--json")
    assert outcome.code == 0, outcome.err
    doc = json.loads(outcome.out, parse_constant=lambda c: pytest.fail(f"JSON holds {c}"))
    assert doc["losses"] == [None, None]
    [line] = [x for x in outcome.err.splitlines() if "warning" in x]
    assert "the loss is nan from step 0" in line and "'mask' all ones" in line, line
    assert "--data FILE.npz" in line
    # with real inputs (no position masked) the loss is finite and nothing is said
    data = tmp_path / "d.npz"
    np.savez(data, x=np.ones((2, 3), np.float32), mask=np.zeros((2, 3), bool),
             labels=np.zeros((2, 3), np.float32))  # fmt: skip
    fine = cli(capsys, "train", path, "--steps", "1", "--loss", "mse", "--data", data)
    assert fine.code == 0 and "warning" not in fine.err, fine.err


def test_run_says_the_same_of_a_loss_that_is_not_finite(tmp_path, capsys):
    """``run`` of the compiled step prints the losses it computes and the same warning."""
    path = _padding_masked(tmp_path)
    out = tmp_path / "out"
    made = cli(capsys, "compile", path, "--devices", "1", "--loss", "mse", "-o", out)
    assert made.code == 0, made.err
    outcome = cli(capsys, "run", out, "--steps", "2", "--json")
    assert outcome.code == 0, outcome.err
    assert json.loads(outcome.out)["losses"] == [None, None]
    [line] = [x for x in outcome.err.splitlines() if "warning" in x]
    assert line.startswith("run: warning: the loss is nan from step 0"), line
    assert "'mask' all ones" in line, line


def test_a_model_onnxruntime_cannot_run_is_said_in_one_line(tmp_path):
    """A float16 ScatterND with reduction add (valid ONNX, which onnxruntime's CPU
    kernels do not run): exit 1, one line naming the node and onnxruntime's reason, no
    traceback and no onnxruntime log line (a real child process)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    table = np.ones((6, 4), np.float16)
    nodes = [
        h.make_node("Unsqueeze", ["ids", "axis"], ["index"]),
        h.make_node("ScatterND", ["table", "index", "bump"], ["bumped"], reduction="add"),
        h.make_node("Gather", ["bumped", "ids"], ["x"]),
        h.make_node("Cast", ["x"], ["logits"], to=T.FLOAT),
    ]
    graph = h.make_graph(
        nodes,
        "fp16_scatter",
        [
            h.make_tensor_value_info("ids", T.INT64, [2, 3]),
            h.make_tensor_value_info("bump", T.FLOAT16, [2, 3, 4]),
        ],
        [h.make_tensor_value_info("logits", T.FLOAT, [2, 3, 4])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([2]), "axis")],
    )
    path = _save(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)]), tmp_path / "m.onnx")
    outcome = cli_process("train", path, "--steps", "1")
    assert outcome.code == 1, outcome
    # the summary of what is trained, then the error: nothing from onnxruntime's log
    assert len(outcome.err_lines) == 2 and "training 1 parameters" in outcome.err_lines[0]
    line = outcome.err_lines[1]
    assert line.startswith("tensoropt train: error: onnxruntime could not run the step"), line
    assert "ScatterND" in line and "Traceback" not in outcome.err
