"""The memory-for-time axes together: combinations that compile exactly what they price,
and combinations not built yet refused in one line (never compiled as something else)."""

from __future__ import annotations

import json

import pytest

from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tests.cli.cli_run import cli


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("axes") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


def _one_line_error(result, *words) -> None:
    assert result.code == 2, result.err
    assert len(result.err_lines) == 1, result.err
    assert "Traceback" not in result.err
    for word in words:
        assert word in result.err, result.err


def test_zero_with_micro_batches_is_refused_not_replaced(gpt, tmp_path, capsys):
    """Micro-batched compile does not emit ZeRO's collectives yet: asking for both is
    refused, on the command line and in a plan file, and nothing is written."""
    out = tmp_path / "both"
    args = ("compile", gpt, "--devices", 2, "--plan", "data-parallel", "-o", out)
    result = cli(capsys, *args, "--zero", 1, "--micro-batches", 2)
    _one_line_error(result, "ZeRO", "micro-batches")
    assert not out.exists()
    zeroed = tmp_path / "zeroed"
    assert cli(capsys, *args[:-1], zeroed, "--zero", 3).code == 0
    plan = json.loads((zeroed / "plan.json").read_text())
    plan["micro_batches"] = 2
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    result = cli(capsys, "compile", gpt, "--devices", 2, "--plan", path, "-o", out)
    _one_line_error(result, "ZeRO", "micro-batches")
    assert not out.exists()
