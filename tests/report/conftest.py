"""Fixtures of the report tests: the tiny gpt and its exploration over 1, 2, 4 devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensoropt.models import build_model, save_model

DEVICES = [1, 2, 4]


@pytest.fixture(scope="session")
def gpt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zoo") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


@pytest.fixture(scope="session")
def explored(gpt_file):
    """(search graph, profile, exploration) of the tiny gpt, as `report` computes them."""
    from tensoropt.cli import build_parser
    from tensoropt.cli.cmd_search import explore_from_args

    args = build_parser().parse_args(
        ["report", str(gpt_file), "--devices", "1,2,4", "-o", "unused"]
    )
    return explore_from_args(args, DEVICES)
