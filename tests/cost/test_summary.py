"""Plan summaries (cost.summary): a plan that splits nothing says so plainly."""

from __future__ import annotations

import os
import tempfile

import pytest

from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import build_problem
from tensoropt.cost.summary import ALL_REPLICATED, REPLICATED, summarize, unit_kind
from tensoropt.ir.mesh import Mesh
from tensoropt.models import build_model, save_model
from tensoropt.search.driver import reference_choices
from tests.helpers.program import graph_of


@pytest.fixture(scope="module")
def mlp():
    path = os.path.join(tempfile.mkdtemp(), "mlp.onnx")
    save_model(build_model("mlp", "tiny"), path)
    return graph_of(path)


def _replicated_choice(mp, sg) -> tuple[int, ...]:
    """Per unit, a strategy that splits nothing on any mesh axis."""
    choice = []
    for k, info in enumerate(mp.units):
        s = next(s for s in range(len(info.strategies)) if unit_kind(mp, sg, k, s) == REPLICATED)
        choice.append(s)
    return tuple(choice)


def test_an_all_replicated_plan_says_it_is_no_faster_than_one_device(mlp):
    mp = build_problem(mlp, Mesh((4,), ("dp",)), builtin("h100"))
    assert summarize(mp, mlp, _replicated_choice(mp, mlp)) == ALL_REPLICATED
    assert ALL_REPLICATED == "replicated (no faster than 1 device)"


def test_a_data_parallel_plan_is_not_summarised_as_replicated(mlp):
    mp = build_problem(mlp, Mesh((4,), ("dp",)), builtin("h100"))
    choice = reference_choices(mlp, mp)["data-parallel"]
    summary = summarize(mp, mlp, choice)
    assert "dp=4" in summary and "replicated" not in summary


def test_one_device_is_replicated_once_not_per_op(mlp):
    mp = build_problem(mlp, Mesh((1,), ("dp",)), builtin("h100"))
    assert summarize(mp, mlp, _replicated_choice(mp, mlp)) == REPLICATED
