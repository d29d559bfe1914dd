"""Plan files: round trip, defaults, and precise errors with JSON paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensoropt.errors import PlanError
from tensoropt.ir.layout import Layout
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import PLAN_SCHEMA, DefaultStrategy, Plan, UnitStrategy

GOOD = {
    "schema": "tensoropt.plan/1",
    "source": "hand-written Megatron MLP",
    "mesh": {"shape": [2, 4], "axis_names": ["dp", "tp"]},
    "default": "data-parallel",
    "units": {
        "fc1": {"inputs": ["S(0)R", "RS(1)", "RS(0)"], "outputs": ["S(0)S(1)"]},
        "fc2": {"inputs": ["S(0)S(1)", "RS(0)", None], "outputs": ["S(0)P"]},
        "gelu": {"index": 3},
    },
}


def test_round_trip_through_file(tmp_path: Path) -> None:
    plan = Plan.loads(json.dumps(GOOD))
    assert plan.mesh == Mesh((2, 4), ("dp", "tp"))
    assert plan.default is DefaultStrategy.DATA_PARALLEL
    fc2 = plan.unit("fc2")
    assert fc2 is not None and fc2.inputs == (Layout.parse("S(0)S(1)"), Layout.parse("RS(0)"), None)
    assert plan.unit("gelu") == UnitStrategy(index=3)
    assert plan.unit("other") is None
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert json.loads(path.read_text())["units"]["fc1"] == GOOD["units"]["fc1"]


def test_units_are_read_only_and_output_is_sorted() -> None:
    plan = Plan(Mesh.parse("2"), {"b": UnitStrategy(index=0), "a": UnitStrategy(index=1)}, "t")
    with pytest.raises(TypeError):
        plan.units["c"] = UnitStrategy(index=0)  # type: ignore[index]
    assert list(plan.to_json()["units"]) == ["a", "b"]
    assert plan.to_json()["schema"] == PLAN_SCHEMA


def _with(**changes) -> str:
    obj = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        target = obj
        keys = path.split("__")
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", r"plan: not valid JSON at line 1 column 2"),
        ("[]", r"plan: expected a JSON object, found list"),
        (_with(schema="tensoropt.plan/9"), r"plan\.schema: expected 'tensoropt.plan/1'"),
        (_with(mesh={"shape": [2, "4"]}), r"plan\.mesh\.shape: expected a list of integers"),
        (_with(default="magic"), r"plan\.default: expected one of data-parallel, replicated"),
        (
            _with(units__fc1__inputs=["S(0)R", "RS(x)", "RS(0)"]),
            r"plan\.units\['fc1'\]\.inputs\[1\]: bad placement string 'RS\(x\)'",
        ),
        (
            _with(units__fc1__outputs=["S(0)"]),
            r"plan\.units\['fc1'\]\.outputs\[0\]: 'S\(0\)' has 1 placements but the mesh 2x4",
        ),
        (_with(units__fc1__outputs=[None]), r"units\['fc1'\]\.outputs\[0\]: expected a placement"),
        (_with(units__gelu={}), r"plan\.units\['gelu'\]: .*give 'inputs' and 'outputs', or an"),
        (_with(units__gelu={"idx": 1}), r"plan\.units\['gelu'\]: unknown keys \['idx'\]"),
        (_with(units__gelu={"index": "3"}), r"plan\.units\['gelu'\]\.index: expected an integer"),
        (_with(units__gelu={"inputs": ["RR"]}), r"give both 'inputs' and 'outputs'"),
        (_with(units=[]), r"plan\.units: expected an object keyed by node name"),
        (_with(extra=1), r"plan: unknown keys \['extra'\]"),
    ],
)
def test_errors_name_the_json_path(text: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Plan.loads(text)


def test_missing_file_is_a_plan_error(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read plan file"):
        Plan.load(tmp_path / "missing.json")


def test_unit_layouts_must_fit_the_mesh() -> None:
    unit = UnitStrategy((Layout.parse("R"),), (Layout.parse("R"),))
    with pytest.raises(PlanError, match="plan unit 'x': layout R has 1 placements"):
        Plan(Mesh.parse("2x2"), {"x": unit})


def test_memory_axes_round_trip_and_plain_plans_unchanged():
    from tensoropt.ir.plan import ZeroStage

    mesh = Mesh((2, 2), ("dp", "tp"))
    plain = Plan(mesh, {"MatMul_0": UnitStrategy(index=1)})
    assert set(plain.to_json()) == {"schema", "source", "mesh", "default", "data_axes", "units"}
    plan = Plan(
        mesh,
        {"MatMul_0": UnitStrategy(index=1, zero=ZeroStage.PARAMETERS)},
        micro_batches=4,
        recompute=("block_0",),
    )
    back = Plan.loads(plan.dumps())
    assert back == plan
    assert back.units["MatMul_0"].zero is ZeroStage.PARAMETERS
    assert back.to_json()["micro_batches"] == 4


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"micro_batches": 0}, "micro_batches"),
        ({"micro_batches": True}, "micro_batches"),
        ({"recompute": "block_0"}, "recompute"),
        ({"recompute": ["b", "b"]}, "listed twice"),
        ({"units": {"MatMul_0": {"index": 0, "zero": 4}}}, "ZeRO stage"),
    ],
)
def test_memory_axes_bad_values_name_the_key(patch, message):
    obj = Plan(Mesh((2,), ("dp",)), {}).to_json() | patch
    with pytest.raises(PlanError, match=message):
        Plan.from_json(obj)
