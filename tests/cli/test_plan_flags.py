"""Flags that would change a plan compile was given: refused in one line (exit 2) when
they cannot apply as asked, never applied behind the plan's back."""

from __future__ import annotations

import json

import pytest

from tensoropt.cli import main
from tensoropt.models import build_model, save_model


@pytest.fixture(scope="module")
def model_and_plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    model = root / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(model))
    assert main(["compile", str(model), "--devices", "2", "-o", str(root / "dp")]) == 0
    return str(model), str(root / "dp" / "plan.json")


def _refused(capsys, argv, out) -> str:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not out.exists()
    return err[0]


def test_a_plan_files_mesh_is_not_reshaped_by_mesh(model_and_plan, tmp_path, capsys):
    """A plan file on mesh 2 given --mesh 2x1 (the same devices, another shape) is
    refused: its layouts are written for its own mesh."""
    model, plan = model_and_plan
    out = tmp_path / "o"
    line = _refused(
        capsys, ["compile", model, "--plan", plan, "--mesh", "2x1", "-o", str(out)], out
    )
    assert "--mesh 2x1" in line and "plan for mesh 2," in line and "drop --mesh" in line, line
    # the plan's own shape is no change: it compiles
    assert main(["compile", model, "--plan", plan, "--mesh", "2", "-o", str(out)]) == 0
    assert json.loads((out / "plan.json").read_text())["mesh"]["shape"] == [2]


def test_a_picked_point_keeps_its_micro_batches(model_and_plan, tmp_path, capsys):
    """--micro-batches on a --pick would compile another plan than the point picked (its
    estimate, not the point's, under the point's name): refused, as --zero is."""
    model, _ = model_and_plan
    out = tmp_path / "o"
    argv = ["compile", model, "--devices", "2", "--pick", "fastest", "--micro-batches", "2"]
    line = _refused(capsys, [*argv, "-o", str(out)], out)
    assert "--micro-batches 2" in line and "--pick point carries its own micro-batches" in line
