"""``tensoropt compile`` and ``run`` on bad input, and output-directory atomicity
(issue "Sharded execution", "How it is checked")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import pytest

import tensoropt.passes.compile as compile_mod
from tests.cli import models
from tests.cli.cli_run import assert_bad_input, cli, cli_process


@pytest.fixture
def block(tmp_path) -> Path:
    path = tmp_path / "block.onnx"
    onnx.save(models.mlp_block(), str(path))
    return path


def _write(path: Path, obj) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def _plan(tp: int, units: dict) -> dict:
    plan = models.megatron_block_plan(tp)
    plan["units"] = units
    return plan


def _entries(directory: Path) -> set[str]:
    return set(os.listdir(directory))


# -- a split that does not divide ---------------------------------------------------


def test_plan_split_that_does_not_divide_names_tensor_dim_and_sizes(block, tmp_path, capsys):
    # x is [8, 8]: dim 0 of size 8 cannot go to 3 devices
    plan = _write(
        tmp_path / "p.json", _plan(3, {"mm0": {"inputs": ["S(0)", "R"], "outputs": ["S(0)"]}})
    )
    before = _entries(tmp_path)
    outcome = cli(
        capsys,
        "compile",
        block,
        "--devices",
        3,
        "--plan",
        plan,
        "--loss",
        "mse",
        "-o",
        tmp_path / "out",
    )
    assert outcome.code == 2 and "Traceback" not in outcome.err
    line = outcome.err_lines[-1]
    for fragment in (
        "plan unit 'mm0'",
        "tensor 'x'",
        "dim 0",
        "size 8",
        "3 pieces",
        "fix the plan file",
    ):
        assert fragment in line, line
    assert _entries(tmp_path) == before  # no OUTDIR, no temp directory


def test_plan_split_of_a_weight_that_does_not_divide(block, tmp_path, capsys):
    # W1 is [8, 16]: column split over 3 does not divide 16
    plan = _write(
        tmp_path / "p.json", _plan(3, {"mm1": {"inputs": ["R", "S(1)"], "outputs": ["S(1)"]}})
    )
    outcome = cli(
        capsys,
        "compile",
        block,
        "--devices",
        3,
        "--plan",
        plan,
        "--loss",
        "mse",
        "-o",
        tmp_path / "o",
    )
    assert outcome.code == 2
    line = outcome.err_lines[-1]
    assert "tensor 'W1'" in line and "dim 1" in line and "size 16" in line and "3 pieces" in line


def test_plan_shard_of_a_missing_dimension_is_named(block, tmp_path, capsys):
    plan = _write(
        tmp_path / "p.json", _plan(2, {"mm0": {"inputs": ["S(2)", "R"], "outputs": ["S(0)"]}})
    )
    outcome = cli(
        capsys,
        "compile",
        block,
        "--devices",
        2,
        "--plan",
        plan,
        "--loss",
        "mse",
        "-o",
        tmp_path / "o",
    )
    assert outcome.code == 2
    assert "tensor 'x'" in outcome.err_lines[-1] and "rank 2" in outcome.err_lines[-1]


def test_plan_unit_that_names_no_node_is_refused(block, tmp_path, capsys):
    plan = _write(
        tmp_path / "p.json", _plan(2, {"nosuch": {"inputs": ["R", "R"], "outputs": ["R"]}})
    )
    outcome = cli(
        capsys,
        "compile",
        block,
        "--devices",
        2,
        "--plan",
        plan,
        "--loss",
        "mse",
        "-o",
        tmp_path / "o",
    )
    assert outcome.code == 2 and "'nosuch'" in outcome.err_lines[-1]
    assert not (tmp_path / "o").exists()


def test_compile_error_after_the_step_is_built_is_one_stderr_line(block, tmp_path, capsys):
    plan = _write(
        tmp_path / "p.json", _plan(3, {"mm0": {"inputs": ["S(0)", "R"], "outputs": ["S(0)"]}})
    )
    outcome = cli(
        capsys,
        "compile",
        block,
        "--devices",
        3,
        "--plan",
        plan,
        "--loss",
        "mse",
        "-o",
        tmp_path / "o",
    )
    assert_bad_input(outcome, "compile", "tensor 'x'")


# -- devices, mesh and malformed plans: one line, exit 2 (child processes) ---------


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--devices", 3, "--mesh", "2x2"], ["--mesh 2x2 has 4 devices", "--devices is 3"]),
        (["--devices", 4, "--mesh", "3"], ["--mesh 3 has 3 devices", "--devices is 4"]),
        (["--devices", 4, "--mesh", "2x2x1"], ["--mesh '2x2x1'"]),
        (["--devices", 2, "--mesh", "two"], ["--mesh 'two'"]),
    ],
    ids=["2x2-vs-3", "3-vs-4", "3-axes", "not-a-mesh"],
)
def test_device_count_that_does_not_match_the_mesh(block, tmp_path, argv, fragments):
    outcome = cli_process("compile", block, *argv, "-o", tmp_path / "o")
    assert_bad_input(outcome, "compile", *fragments)
    assert not (tmp_path / "o").exists()


def test_a_plan_spans_its_devices_without_devices(block, tmp_path, capsys):
    """--plan with --mesh (and --stages) or a plan file: --devices defaults to what the
    plan spans; without either, and for --pick, the line asks for --devices."""
    out = cli(capsys, "compile", block, "--plan", "megatron", "--mesh", "2x2", "--loss",
              "mse", "-o", tmp_path / "a", "--json")  # fmt: skip
    assert out.code == 0, out.err
    assert json.loads(out.out)["mesh"] == [2, 2]
    again = cli(capsys, "compile", block, "--plan", tmp_path / "a" / "plan.json", "--loss",
                "mse", "-o", tmp_path / "b", "--json")  # fmt: skip
    assert again.code == 0, again.err
    assert json.loads(again.out)["mesh"] == [2, 2]
    missing = cli(capsys, "compile", block, "--plan", "megatron", "-o", tmp_path / "c")
    assert_bad_input(missing, "compile", "give --devices N, or --mesh like 2x4")
    picked = cli(capsys, "compile", block, "--pick", "fastest", "-o", tmp_path / "c")
    assert_bad_input(picked, "compile", "--pick needs --devices N")
    assert not (tmp_path / "c").exists()


MALFORMED = {
    "bad-json": ('{"schema": "tensoropt.plan/1", "mesh": ', ["not valid JSON", "line 1"]),
    "wrong-schema": (
        {"schema": "tensoropt.plan/9", "mesh": {"shape": [2]}},
        [".schema", "tensoropt.plan/9"],
    ),
    "unknown-key": (
        {"schema": "tensoropt.plan/1", "mesh": {"shape": [2]}, "oops": 1},
        ["unknown keys", "oops"],
    ),
    "no-mesh": ({"schema": "tensoropt.plan/1", "units": {}}, [".mesh", "missing"]),
    "no-units": (
        {"schema": "tensoropt.plan/1", "mesh": {"shape": [2], "axis_names": ["dp"]}},
        [".units", "missing", "give {}"],
    ),
    "bad-placement": (
        _plan(2, {"mm0": {"inputs": ["Q(0)", "R"], "outputs": ["R"]}}),
        ["units['mm0'].inputs[0]", "'Q(0)'"],
    ),
    "placements-per-axis": (
        _plan(2, {"mm0": {"inputs": ["RR", "R"], "outputs": ["R"]}}),
        ["units['mm0'].inputs[0]", "2 placements", "1 axes"],
    ),
    "inputs-without-outputs": (
        _plan(2, {"mm0": {"inputs": ["R", "R"]}}),
        ["units['mm0']", "both 'inputs' and 'outputs'"],
    ),
    "mesh-vs-devices": (_plan(2, {}), ["mesh 2 has 2 devices", "--devices is 4"]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_plan_file(block, tmp_path, case, capsys):
    # in this process (a child process costs 3-4 s of imports): the exit code and the
    # one line are main()'s; the cases above check them through a real process
    content, fragments = MALFORMED[case]
    plan = _write(tmp_path / "plan.json", content)
    outcome = cli(capsys, "compile", block, "--devices", 4, "--plan", plan, "-o", tmp_path / "o")
    assert_bad_input(outcome, "compile", "plan.json", *fragments)
    assert not (tmp_path / "o").exists()


def test_missing_plan_file(block, tmp_path, capsys):
    outcome = cli(
        capsys,
        "compile",
        block,
        "--devices",
        2,
        "--plan",
        tmp_path / "none.json",
        "-o",
        tmp_path / "o",
    )
    assert_bad_input(outcome, "compile", "none.json", "cannot read plan file")


def test_written_plan_file_compiles_again(block, tmp_path, capsys):
    first = cli(
        capsys,
        "compile",
        block,
        "--devices",
        2,
        "--plan",
        "megatron",
        "--loss",
        "mse",
        "-o",
        tmp_path / "a",
    )
    assert first.code == 0, first.err
    again = cli(
        capsys,
        "compile",
        block,
        "--devices",
        2,
        "--plan",
        tmp_path / "a" / "plan.json",
        "--loss",
        "mse",
        "-o",
        tmp_path / "b",
    )
    assert again.code == 0, again.err
    for k in range(2):
        assert (tmp_path / "a" / f"device_{k}.onnx").read_bytes() == (
            tmp_path / "b" / f"device_{k}.onnx"
        ).read_bytes()


def test_a_megatron_plan_file_of_a_rewritten_forward_compiles_again(tmp_path, capsys):
    """Megatron rewrites gpt's forward (stacked projections, named megatron_*), and its
    plan.json names those nodes: compiling the file rewrites the forward the same way and
    gives the same device graphs."""
    from tensoropt.models import build_model, save_model

    model = tmp_path / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(model))
    first = cli(capsys, "compile", model, "--devices", 2, "--plan", "megatron", "-o",
                tmp_path / "a")  # fmt: skip
    assert first.code == 0, first.err
    units = json.loads((tmp_path / "a" / "plan.json").read_text())["units"]
    assert any(name.startswith("megatron_") for name in units)  # the case is real
    again = cli(capsys, "compile", model, "--devices", 2, "--plan",
                tmp_path / "a" / "plan.json", "-o", tmp_path / "b")  # fmt: skip
    assert again.code == 0, again.err
    for k in range(2):
        assert (tmp_path / "a" / f"device_{k}.onnx").read_bytes() == (
            tmp_path / "b" / f"device_{k}.onnx"
        ).read_bytes()


# -- output directory atomicity -----------------------------------------------------


def _fail_on_rank(monkeypatch, bad_rank: int) -> None:
    real = compile_mod.lower_for_rank

    def lower(template, rank, values):
        if rank == bad_rank:
            raise OSError(28, "No space left on device (injected)")
        return real(template, rank, values)

    monkeypatch.setattr(compile_mod, "lower_for_rank", lower)


def test_compile_failing_part_way_leaves_nothing_behind(block, tmp_path, capsys, monkeypatch):
    parent = tmp_path / "work"
    parent.mkdir()
    _fail_on_rank(monkeypatch, 2)  # ranks 0 and 1 are written first
    with pytest.raises(OSError, match="injected"):
        cli(capsys, "compile", block, "--devices", 4, "--loss", "mse", "-o", parent / "out")
    assert _entries(parent) == set()


def test_failed_recompile_keeps_the_old_output_intact(block, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    first = cli(capsys, "compile", block, "--devices", 2, "--loss", "mse", "-o", out)
    assert first.code == 0, first.err
    snapshot = {name: (out / name).read_bytes() for name in os.listdir(out)}
    _fail_on_rank(monkeypatch, 1)
    with pytest.raises(OSError, match="injected"):
        cli(
            capsys,
            "compile",
            block,
            "--devices",
            2,
            "--plan",
            "megatron",
            "--loss",
            "mse",
            "-o",
            out,
        )
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == snapshot
    assert _entries(tmp_path) == {"block.onnx", "out"}


def test_recompile_replaces_an_old_output(block, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(capsys, "compile", block, "--devices", 4, "--loss", "mse", "-o", out).code == 0
    assert cli(capsys, "compile", block, "--devices", 2, "--loss", "mse", "-o", out).code == 0
    assert sorted(os.listdir(out)) == [
        "annotated.onnx",
        "device_0.onnx",
        "device_1.onnx",
        "manifest.json",
        "plan.json",
    ]
    assert _entries(tmp_path) == {"block.onnx", "out"}


def test_compile_into_a_foreign_directory_is_refused(block, tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    outcome = cli(capsys, "compile", block, "--devices", 2, "--loss", "mse", "-o", foreign)
    assert outcome.code == 2 and "Traceback" not in outcome.err
    line = outcome.err_lines[-1]
    assert str(foreign) in line and "not a tensoropt output directory" in line
    assert (
        _entries(foreign) == {"thesis.tex"} and (foreign / "thesis.tex").read_text() == "precious"
    )
    assert _entries(tmp_path) == {"block.onnx", "mine"}


def test_compile_onto_a_file_is_refused(block, tmp_path, capsys):
    target = tmp_path / "out"
    target.write_text("a file")
    outcome = cli(capsys, "compile", block, "--devices", 2, "--loss", "mse", "-o", target)
    assert outcome.code == 2 and "not a directory" in outcome.err_lines[-1]
    assert target.read_text() == "a file"


# -- run on a damaged OUTDIR ------------------------------------------------------------


@pytest.fixture
def outdir(block, tmp_path, capsys) -> Path:
    out = tmp_path / "out"
    outcome = cli(capsys, "compile", block, "--devices", 2, "--loss", "mse", "-o", out)
    assert outcome.code == 0, outcome.err
    return out


@pytest.mark.parametrize("backend", ["local", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_run_with_a_missing_device_file(outdir, backend):
    (outdir / "device_1.onnx").unlink()
    outcome = cli_process("run", outdir, "--steps", 1, "--backend", backend)
    assert_bad_input(outcome, "run", "device_1.onnx", "missing", "recompile")


@pytest.mark.parametrize("backend", ["local", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_run_with_a_tampered_device_file(outdir, backend):
    path = outdir / "device_0.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit changed
    path.write_bytes(bytes(data))
    outcome = cli_process("run", outdir, "--steps", 1, "--backend", backend)
    assert_bad_input(outcome, "run", "device_0.onnx", "sha256", "changed after compiling")


def test_run_with_a_tampered_manifest_world_size(outdir, capsys):
    manifest = json.loads((outdir / "manifest.json").read_text())
    manifest["world_size"] = 3
    (outdir / "manifest.json").write_text(json.dumps(manifest))
    outcome = cli(capsys, "run", outdir, "--steps", 1)
    assert_bad_input(outcome, "run", "manifest.json", "recompile")


def test_run_on_a_directory_without_manifest(tmp_path, capsys):
    outcome = cli(capsys, "run", tmp_path, "--steps", 1)
    assert_bad_input(outcome, "run", "manifest.json")
