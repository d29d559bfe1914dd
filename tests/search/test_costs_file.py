"""The --dump-costs file: exact round trip, recomputation, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from search_strategies import problems

from tensoropt.errors import PlanError
from tensoropt.ir.costs import (
    BlockHint,
    CostProblem,
    CostRecord,
    Edge,
    Strategy,
    Unit,
    costs_from_json,
    costs_to_json,
    dump_costs,
    load_costs,
)
from tensoropt.search import solve
from tensoropt.search.synthetic import transformer_problem


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(problems())
def test_round_trip_and_recompute(tmp_path: Path, problem: CostProblem) -> None:
    result = solve(problem, epsilon=None)
    path = tmp_path / "costs.json"
    dump_costs([CostRecord(problem, result.points)], path)
    (record,) = load_costs(path)
    assert record.problem == problem
    assert record.frontier == result.points
    assert record.epsilon is None
    assert "epsilon" not in json.loads(path.read_text())["problems"][0]
    assert solve(record.problem).points == result.points


def test_round_trip_real_floats_blocks_and_epsilon(tmp_path: Path) -> None:
    problem = transformer_problem(3, (2, 2), hint=True)
    result = solve(problem, epsilon=0.1)
    path = tmp_path / "c.json"
    dump_costs([CostRecord(problem, result.points, 0.1)], path)
    (record,) = load_costs(path)
    assert record.problem == problem and record.problem.blocks == (BlockHint(1, 12, 3),)
    assert record.epsilon == 0.1 and json.loads(path.read_text())["problems"][0]["epsilon"] == 0.1
    assert solve(record.problem, epsilon=0.1).points == result.points


def _doc() -> dict:
    p = CostProblem(
        (
            Unit("a", (Strategy("R", 1.0, 2.0),)),
            Unit("b", (Strategy("R", 1.0, 2.0), Strategy("S", 0.5, 4.0))),
        ),
        (Edge(0, 1, ((0.0, 1.0),), ((0.0, 3.0),)),),
        devices=2,
        mesh=(2,),
    )
    return costs_to_json([CostRecord(p)])


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(schema="other/1"), "costs.schema"),
        (lambda d: d["problems"][0].pop("units"), "problems[0].units"),
        (
            lambda d: d["problems"][0]["units"][1]["strategies"][0].update(time_s="x"),
            "problems[0].units[1].strategies[0].time_s",
        ),
        (
            lambda d: d["problems"][0]["units"][0]["strategies"][0].update(memory_bytes=-1),
            "problems[0].units[0].strategies[0].memory_bytes",
        ),
        (lambda d: d["problems"][0]["edges"][0].update(dst=7), "problems[0].edges[0].dst"),
        (
            lambda d: d["problems"][0]["edges"][0]["time_s"][0].append(1.0),
            "problems[0].edges[0].time_s[0]",
        ),
        (
            lambda d: d["problems"][0]["edges"][0].update(memory_bytes=[]),
            "problems[0].edges[0].memory_bytes",
        ),
        (lambda d: d["problems"][0].update(devices=0), "problems[0].devices"),
        (lambda d: d["problems"][0].update(mesh=[0]), "problems[0].mesh"),
        (
            lambda d: d["problems"][0].update(
                frontier=[{"time_s": 1, "memory_bytes": 1, "choice": [0]}]
            ),
            "problems[0].frontier[0].choice",
        ),
        (
            lambda d: d["problems"][0].update(
                blocks=[{"first_unit": 0, "units_per_block": 1, "count": 9}]
            ),
            "problems[0].blocks[0]",
        ),
    ],
)
def test_malformed_file_names_the_field(tmp_path: Path, mutate, field: str) -> None:
    doc = _doc()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_costs(path)


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("{")
    with pytest.raises(PlanError, match="not JSON"):
        load_costs(bad)
    with pytest.raises(PlanError, match="cannot read"):
        load_costs(tmp_path / "missing.json")
    assert costs_from_json(_doc())[0].problem.devices == 2
