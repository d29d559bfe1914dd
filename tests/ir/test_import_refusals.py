"""Files the importer cannot make a static step of are refused in one line (exit 2)
before any rewrite reads what is missing."""

from __future__ import annotations

import onnx

from tensoropt.cli import main
from tensoropt.models import build_model, save_model


def _one_line(capsys, argv) -> str:
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1, captured.err
    assert captured.out == ""
    return err[0]


def test_a_node_reading_what_nothing_makes_is_refused(tmp_path, capsys):
    path = tmp_path / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(path))
    model = onnx.load(str(path))
    first = model.graph.node[0]
    first.input[0] = "does_not_exist"
    onnx.save(model, str(path))
    line = _one_line(capsys, ["train", str(path), "--steps", "1"])
    assert f"node {first.name!r} ({first.op_type}) reads 'does_not_exist'" in line, line
    assert "export it again" in line


def test_pinned_inputs_the_fixed_shapes_contradict_are_refused(tmp_path, capsys):
    """The zoo gpt's Reshapes hold its batch of 8: with the batch made symbolic and
    pinned at 3, shape inference leaves the attention projections unknown."""
    path = tmp_path / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    model = onnx.load(str(path))
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    onnx.save(model, str(path))
    name = model.graph.input[0].name
    line = _one_line(capsys, ["train", str(path), "--steps", "1", "--input-shape", f"{name}=3x8"])
    assert "has no static shape after shape inference" in line and "--input-shape" in line
    # pinned where the model's shapes agree, it trains
    assert main(["train", str(path), "--steps", "1", "--input-shape", f"{name}=8x8"]) == 0
