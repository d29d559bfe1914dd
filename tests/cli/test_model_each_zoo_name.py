"""``tensoropt model NAME`` works from the CLI for every zoo name, and the file trains."""

from __future__ import annotations

import json

import onnx
import pytest

from tensoropt.models import MODEL_NAMES, zoo_info
from tests.cli.cli_run import cli


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_command_writes_a_trainable_file(name, tmp_path, capsys):
    path = tmp_path / f"{name}.onnx"
    outcome = cli(capsys, "model", name, "-o", path)
    assert outcome.code == 0, outcome.err
    lines = outcome.out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {path}: {name} (tiny)")
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    info = zoo_info(model)
    assert info is not None and info.name == name
    assert f"{info.params:,} parameters" in lines[0]
    trained = cli(capsys, "train", path, "--steps", 2, "--json")
    assert trained.code == 0, trained.err
    data = json.loads(trained.out)
    assert len(data["losses"]) == 2
    assert all(loss == loss and abs(loss) < 1e6 for loss in data["losses"])  # finite
    assert data["trained_elements"] == info.params
