"""Shared test configuration.

Slow tests (``@pytest.mark.slow``) are skipped in the quick loop (``pytest -x -q``)
and run with ``--run-slow``, which the README's test command and .ci/run pass.
Every test compiles with pass verification on (the autouse fixture below), except the
equivalence cases marked ``numerics_only`` (``tests.helpers.compile.verified_on_two``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "tensoropt",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("tensoropt")

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _verify_passes(monkeypatch, request):
    """Every compile in a test verifies well-formedness between passes (as
    ``tensoropt compile --verify-passes`` does), device graphs included; except in the
    tests marked ``numerics_only``."""
    from tensoropt.passes import pipeline
    from tensoropt.runtime.device_check import check_device_graphs

    if request.node.get_closest_marker("numerics_only"):
        return
    options = pipeline.PipelineOptions(verify=True, device_check=check_device_graphs)
    monkeypatch.setattr(pipeline, "DEFAULT_OPTIONS", options)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> Callable[[str], Path]:
    """``exported(name)``: the path of ``name``'s dynamo export (exported on first use;
    tests read it and write what they make elsewhere); ``NAME-noopt``: exported with
    ``optimize=False``."""
    from tests.exports.models import case_of, export
    from tests.helpers.shared import made_once

    def make(path: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export(case_of(path.stem), str(path))

    def get(name: str) -> Path:  # exported once per test run, shared by the xdist workers
        return made_once(tmp_path_factory, f"{name}.onnx", make)

    return get
