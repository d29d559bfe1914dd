"""Fixtures of the calibration tests: one quick calibration per session, zoo files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tensoropt.cli import main
from tensoropt.models import build_model, save_model
from tests.helpers.shared import made_once


@pytest.fixture(scope="session")
def quick_profile(tmp_path_factory) -> Path:
    """``tensoropt calibrate --quick`` on the default (mpi, 2 ranks) backend, run once
    per test run (shared by the xdist workers; tests only read it). It takes half a
    minute or more, so every test that reads it is marked slow."""

    def calibrate(path: Path) -> None:
        assert main(["calibrate", "-o", str(path), "--quick", "--repeats", "3"]) == 0

    return made_once(tmp_path_factory, "here.json", calibrate)


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory) -> Callable[..., Path]:
    """``zoo_model(name, preset="tiny", **knobs)``: a zoo model file, written once."""
    made: dict[tuple, Path] = {}

    def get(name: str, preset: str = "tiny", **knobs) -> Path:
        key = (name, preset, tuple(sorted(knobs.items())))
        if key not in made:
            path = tmp_path_factory.mktemp("zoo") / f"{name}.onnx"
            save_model(build_model(name, preset, **knobs), str(path))
            made[key] = path
        return made[key]

    return get


def load(path: Path) -> dict:
    return json.loads(path.read_text())
