"""Fixtures of the CLI tests: zoo model files written once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tensoropt.models import build_model, save_model


@pytest.fixture(scope="session")
def zoo_file(tmp_path_factory) -> Callable[[str], Path]:
    """``zoo_file(name)``: the path of the tiny zoo model ``name`` (written once)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            path = tmp_path_factory.mktemp("zoo") / f"{name}.onnx"
            save_model(build_model(name, "tiny"), str(path))
            made[name] = path
        return made[name]

    return get
