"""Cluster files (``--cluster FILE.json``) are checked whole when loaded: every field a
command reads later (the rates, and the ``accuracy``, ``spread`` and ``calibration``
sections that the error band and ``validate`` read) is refused at load time with one
line naming the file and the field, exit 2, before a command does work or writes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tensoropt.cli import main
from tensoropt.cli.cmd_demo import CPU_PROFILE
from tensoropt.cost.accuracy import band_of, record
from tensoropt.cost.cluster import Link, builtin, load_cluster
from tensoropt.models import build_model, save_model

H100 = {"base": "h100"}
PLAN = {"devices": 1, "time": 0.1, "memory": -0.05}
BIG = int("1" + "0" * 400)  # a JSON integer beyond a float's range

# (file content, the field the refusal names: None for the file as a whole)
MALFORMED: list[tuple[object, str | None]] = [
    ({"base": 5}, "base"),
    ({"base": ["h100"]}, "base"),
    ({"base": "nope"}, "base"),
    ({**H100, "name": 5}, "name"),
    ({**H100, "description": []}, "description"),
    ({**H100, "schema": "tensoropt.cluster/9"}, "schema"),
    ({**H100, "machine": 5}, "machine"),
    ({**H100, "versions": "1.0"}, "versions"),
    ({**H100, "efficiency": 5}, "efficiency"),
    ({**H100, "efficiency": -0.5}, "efficiency"),
    ({**H100, "memory_bytes": 1}, "memory_bytes"),
    ({**H100, "memory_bytes": 80}, "memory_bytes"),
    ({**H100, "peak_flops": "989e12"}, "peak_flops"),
    ({**H100, "peak_flops": BIG}, "peak_flops"),
    ({**H100, "op_floor_s": True}, "op_floor_s"),
    ({**H100, "devices_per_node": 2.5}, "devices_per_node"),
    ({**H100, "intra": 5}, "intra"),
    ({**H100, "inter": {"bandwidth": "fast"}}, "inter.bandwidth"),
    ({**H100, "op_throughput": {"MatMul": "abc"}}, "op_throughput.MatMul"),
    ({**H100, "op_throughput": {"Mat\nMul": 1e12, "x": "y"}}, "op_throughput.x"),
    ({**H100, "op_curves": {"matmul": {"work": "flops", "points": [[1e6, "x"]]}}},
     "op_curves.matmul.points[0][1]"),
    ({**H100, "op_train_grids": {"matmul": {"kernel_\u00b2": {}}}},
     "op_train_grids.matmul.kernel_\u00b2"),
    ({**H100, "collectives": {"per_kind": {"AllReduce": {"alpha_s": 1e-5, "bandwidth": 0}}}},
     "collectives.per_kind.AllReduce.bandwidth"),
    ({**H100, "collective_links": 5}, "collective_links"),
    ({**H100, "collective_links": {"AllReduce": {"alpha_s": -1, "bandwidth": 1e9}}},
     "collective_links.AllReduce.alpha_s"),
    ({**H100, "spread": 5}, "spread"),
    ({**H100, "spread": {"op_throughput": 5}}, "spread.op_throughput"),
    ({**H100, "spread": {"op_throughput": {"MatMul": "abc"}}}, "spread.op_throughput.MatMul"),
    ({**H100, "spread": {"op_throughput": {"MatMul": -0.1}}}, "spread.op_throughput.MatMul"),
    ({**H100, "calibration": 5}, "calibration"),
    ({**H100, "calibration": {"threads_per_rank": 0}}, "calibration.threads_per_rank"),
    ({**H100, "calibration": {"host_reference_s": "x"}}, "calibration.host_reference_s"),
    ({**H100, "calibration": {"memory_link": 5}}, "calibration.memory_link"),
    ({**H100, "calibration": {"memory_link": [5]}}, "calibration.memory_link[0]"),
    ({**H100, "calibration": {"memory_link": [{"ratio": "x"}]}},
     "calibration.memory_link[0].ratio"),
    ({**H100, "calibration": {"memory_link": [{"ratio": 0.5, "shared": "yes"}]}},
     "calibration.memory_link[0].shared"),
    ({**H100, "accuracy": 5}, "accuracy"),
    ({**H100, "accuracy": {"definition": 5}}, "accuracy.definition"),
    ({"accuracy": {"plans": 5}, **H100}, "accuracy.plans"),
    ({**H100, "accuracy": {"plans": [5]}}, "accuracy.plans[0]"),
    ({**H100, "accuracy": {"plans": [{"foo": 1}]}}, "accuracy.plans[0]"),
    ({**H100, "accuracy": {"plans": [PLAN, {**PLAN, "devices": 0}]}}, "accuracy.plans[1].devices"),
    ({**H100, "accuracy": {"plans": [{**PLAN, "devices": "2"}]}}, "accuracy.plans[0].devices"),
    ({**H100, "accuracy": {"plans": [{**PLAN, "time": "x"}]}}, "accuracy.plans[0].time"),
    ({**H100, "accuracy": {"plans": [{**PLAN, "memory": None}]}}, "accuracy.plans[0].memory"),
    ({**H100, "accuracy": {"plans": [{**PLAN, "run": [1]}]}}, "accuracy.plans[0].run"),
    ({**H100, "accuracy": {"plans": [{**PLAN, "model": 3}]}}, "accuracy.plans[0].model"),
    ({**H100, "accuracy": {"plans": [{**PLAN, "link": "both"}]}}, "accuracy.plans[0].link"),
    ('{"base": "h100", "accuracy": {"plans": [{"devices": 1, "time": NaN, "memory": 0}]}}',
     "accuracy.plans[0].time"),
    ([1], None),
    ("", None),
    (b"\xff\xfe", None),
    ('{"base": "h100", "machine": ' + "[" * 100000, None),
]  # fmt: skip


def _write(path: Path, content) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.fixture(scope="module")
def gpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zoo") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


def _refused(capsys, argv: list, path: Path, field: str | None) -> str:
    """Run ``tensoropt ARGV``: exit 2 and one stderr line naming ``path`` and ``field``."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, (argv, captured.err)
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    named = str(path) if field is None else f"{path}.{field}"
    assert named in lines[0], (named, lines[0])
    return lines[0]


def test_search_refuses_every_malformed_field_naming_file_and_field(gpt, tmp_path, capsys):
    for k, (content, field) in enumerate(MALFORMED):
        path = _write(tmp_path / f"c{k}.json", content)
        argv = ["search", gpt, "--devices", "2", "--jobs", "1", "--cluster", path]
        line = _refused(capsys, argv, path, field)
        assert line.startswith("tensoropt search: error: "), line
        assert "expected" in line or "missing" in line or "not valid JSON" in line, line


@pytest.mark.parametrize(
    "content",
    [
        {**H100, "spread": {"op_throughput": {"MatMul": "abc"}}},
        {**H100, "accuracy": {"plans": [{"foo": 1}]}},
        {**H100, "efficiency": 5},
    ],
)
@pytest.mark.parametrize("how", [["--plan", "data-parallel"], ["--pick", "fastest"]])
def test_compile_with_a_malformed_cluster_file_writes_nothing(gpt, tmp_path, capsys, content, how):
    path = _write(tmp_path / "bad.json", content)
    out = tmp_path / "out"
    field = next(k for k in content if k != "base")
    argv = ["compile", gpt, "--devices", "2", "--cluster", path, *how, "-o", out]
    _refused(capsys, argv, path, field)
    assert not out.exists()


def test_validate_refuses_a_malformed_profile_before_measuring(gpt, tmp_path, capsys):
    """--record would append to the file only after the whole validation: the file is
    refused first (and left as it was)."""
    for content, field in [
        ({**H100, "calibration": 5}, "calibration"),
        ({**H100, "calibration": {"threads_per_rank": "2"}}, "calibration.threads_per_rank"),
        ({**H100, "accuracy": {"plans": [{"foo": 1}]}}, "accuracy.plans[0]"),
    ]:
        path = _write(tmp_path / "p.json", content)
        before = path.read_text()
        argv = ["validate", gpt, "--devices", "1", "--cluster", path, "--record", "--points",
                "1", "--steps", "2", "--warmup", "1", "--backend", "local"]  # fmt: skip
        _refused(capsys, argv, path, field)
        assert path.read_text() == before


def test_valid_cluster_files_still_load(gpt, tmp_path, capsys):
    for name in ("v100", "a100", "h100", "h200"):
        assert load_cluster(name) is builtin(name)
        assert load_cluster(str(_write(tmp_path / f"{name}.json", {"base": name}))).peak_flops
    demo = _write(tmp_path / "cpu.json", CPU_PROFILE)  # the demo's own profile
    assert load_cluster(str(demo)).name == "cpu-class"
    # a profile as to_json writes it (search --json's "cluster") loads back equal, its
    # per-kind collective links included
    kinds = {"AllReduce": Link(1e-5, 2e9)}
    profile = dataclasses.replace(builtin("h100"), collective_links=kinds)
    assert load_cluster(str(_write(tmp_path / "dumped.json", profile.to_json()))) == profile
    # a profile with the history `validate --record` writes (accuracy.record), plans of
    # one device and of several, on each kind of memory link
    banded = _write(tmp_path / "banded.json", {**H100, "spread": {"op_throughput": {"m": 0.02}}})
    results = [(1, 0.1, -0.05, None), (2, -0.2, 0.1, True), (2, 0.3, 0.0, False)]
    assert record(str(banded), "gpt.onnx", results) == 3
    load_cluster(str(banded))
    assert band_of(str(banded)).source.startswith("validated: median error of 3 plans")
    out = tmp_path / "s.json"
    argv = ["search", gpt, "--devices", "2", "--jobs", "1", "--cluster", banded, "--json-out", out]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["error_band"]["time_several_devices"] == pytest.approx(0.25)


def test_a_partial_link_override_keeps_the_same_links_other_rate(tmp_path):
    """``"inter": {"bandwidth": B}`` keeps the base's inter-node latency, not its
    intra-node one."""
    path = _write(tmp_path / "slow.json", {**H100, "inter": {"bandwidth": 1e9}})
    inter = load_cluster(str(path)).inter
    assert (inter.alpha_s, inter.bandwidth) == (builtin("h100").inter.alpha_s, 1e9)
    assert inter.alpha_s != builtin("h100").intra.alpha_s
