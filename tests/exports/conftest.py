"""Exports of the standard-architecture models, made once per test session."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> Callable[[str], Path]:
    """``exported(name)``: the path of ``name``'s dynamo export (exported on first use)."""
    from tests.exports.models import CASES, export

    folder = tmp_path_factory.mktemp("exports")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            path = folder / f"{name}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                export(CASES[name], str(path))
            made[name] = path
        return made[name]

    return get
