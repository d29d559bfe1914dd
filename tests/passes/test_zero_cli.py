"""``compile --plan fsdp`` and ``--zero N``: hand plans with ZeRO, recorded in plan.json,
shown by inspect, and bad input refused with exit 2 and one line naming the thing."""

from __future__ import annotations

import json

import pytest

from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tests.cli.cli_run import assert_bad_input, cli


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero_cli")
    paths = {}
    for name in ("gpt", "inception_v3"):
        paths[name] = folder / f"{name}.onnx"
        save_model(build_model(name, "tiny"), str(paths[name]))
    return paths


def _zero(outdir) -> dict[str, int]:
    units = json.loads((outdir / "plan.json").read_text())["units"]
    return {name: u.get("zero", 0) for name, u in units.items()}


def test_fsdp_is_data_parallel_with_zero_three(models, tmp_path, capsys):
    out = tmp_path / "fsdp"
    result = cli(capsys, "compile", models["gpt"], "--devices", 4, "--plan", "fsdp", "-o", out)
    assert result.code == 0, result.err
    assert "fsdp: ZeRO stage 3 on 32 units" in result.err
    zero = _zero(out)
    assert sorted(set(zero.values())) == [0, 3] and list(zero.values()).count(3) == 32
    plan = json.loads((out / "plan.json").read_text())
    assert plan["source"] == "fsdp"
    assert plan["recompute"] == [f"block_{i}" for i in range(len(plan["recompute"]))]
    assert plan["recompute"]  # every block of the tiny gpt
    assert f"fsdp: all {len(plan['recompute'])} blocks recomputed" in result.err
    # --recompute replaces fsdp's blocks, and says so
    kept = cli(capsys, "compile", models["gpt"], "--devices", 4, "--plan", "fsdp",
               "--recompute", "none", "-o", tmp_path / "kept")  # fmt: skip
    assert kept.code == 0, kept.err
    assert f"--recompute none: 0 of {len(plan['recompute'])} blocks recomputed" in kept.err
    assert not json.loads((tmp_path / "kept" / "plan.json").read_text()).get("recompute")
    # --zero 0 takes fsdp's ZeRO off, and says so
    unsharded = cli(capsys, "compile", models["gpt"], "--devices", 4, "--plan", "fsdp",
                    "--zero", 0, "-o", tmp_path / "unsharded")  # fmt: skip
    assert unsharded.code == 0, unsharded.err
    assert "--zero 0: ZeRO off on the 32 units that had it" in unsharded.err
    assert not any(_zero(tmp_path / "unsharded").values())
    shown = cli(capsys, "inspect", out)
    assert shown.out.count("  zero: stage 3 on 32 units") == 1  # the plan's: said once
    run = cli(capsys, "run", out, "--steps", 3, "--verify")
    assert run.code == 0 and "verify: ok" in run.out + run.err


@pytest.mark.parametrize(("plan", "mesh", "stage"), [("megatron", "2x2", 2),
                                                     ("data-parallel", "4", 1)])  # fmt: skip
def test_zero_flag_sets_every_unit_with_a_zero_axis(models, plan, mesh, stage, tmp_path, capsys):
    out = tmp_path / "z"
    result = cli(
        capsys, "compile", models["gpt"], "--devices", 4, "--mesh", mesh, "--plan", plan,
        "--zero", stage, "-o", out,
    )  # fmt: skip
    assert result.code == 0, result.err
    assert f"--zero {stage}: ZeRO stage {stage} on" in result.err
    assert stage in _zero(out).values()
    if plan == "megatron":
        return  # a megatron plan.json names the stacked projections of megatron's rewrite
    # the recorded plan compiles to the same ZeRO stages
    again = tmp_path / "again"
    result = cli(capsys, "compile", models["gpt"], "--devices", 4, "--plan", out / "plan.json",
                 "-o", again)  # fmt: skip
    assert result.code == 0, result.err
    assert _zero(again) == _zero(out)


def test_zero_flag_overrides_a_plan_files_stages(models, tmp_path, capsys):
    first = tmp_path / "first"
    assert cli(capsys, "compile", models["gpt"], "--devices", 2, "--plan", "fsdp", "-o",
               first).code == 0  # fmt: skip
    second = tmp_path / "second"
    result = cli(capsys, "compile", models["gpt"], "--devices", 2, "--plan",
                 first / "plan.json", "--zero", 1, "-o", second)  # fmt: skip
    assert result.code == 0, result.err
    assert {z for z in _zero(second).values()} == {0, 1}
    assert [n for n, z in _zero(first).items() if z] == [n for n, z in _zero(second).items() if z]
    off = tmp_path / "off"
    result = cli(capsys, "compile", models["gpt"], "--devices", 2, "--plan",
                 first / "plan.json", "--zero", 0, "-o", off)  # fmt: skip
    assert result.code == 0, result.err
    assert set(_zero(off).values()) == {0}


def test_zero_on_a_mesh_with_no_data_parallel_axis_is_refused(models, tmp_path, capsys):
    result = cli(capsys, "compile", models["gpt"], "--devices", 2, "--plan", "megatron",
                 "--zero", 1, "-o", tmp_path / "o")  # fmt: skip
    assert_bad_input(result, "compile", "--zero 1", "data-parallel axis")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("unit", ["h0/attn/scores/MatMul", "h0/attn/q_proj/MatMul"])
def test_a_plan_file_asking_zero_where_there_is_no_zero_axis_is_refused(
    models, unit, tmp_path, capsys
):
    """A unit that places no parameter, or whose parameter is split where its op splits
    the batch (no axis left to shard it over), has no ZeRO axis."""
    out = tmp_path / "dp"
    assert cli(capsys, "compile", models["gpt"], "--devices", 2, "-o", out).code == 0
    plan = json.loads((out / "plan.json").read_text())
    assert unit in plan["units"]
    if unit.endswith("q_proj/MatMul"):  # its weight split on the batch axis: S(1)
        plan["units"][unit] = {"inputs": ["R", "S(1)"], "outputs": ["S(2)"], "zero": 3}
    else:
        plan["units"][unit]["zero"] = 3
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))
    result = cli(capsys, "compile", models["gpt"], "--devices", 2, "--plan", path,
                 "-o", tmp_path / "o")  # fmt: skip
    assert_bad_input(result, "compile", repr(unit), "ZeRO stage 3", "data-parallel mesh axis")
    assert not (tmp_path / "o").exists()


def test_zero_on_a_node_that_is_not_a_unit_is_refused(models, tmp_path, capsys):
    out = tmp_path / "dp"
    assert cli(capsys, "compile", models["gpt"], "--devices", 2, "-o", out).code == 0
    plan = json.loads((out / "plan.json").read_text())
    plan["units"]["h0/attn/q/Reshape"] = {"index": 0, "zero": 1}  # a follower
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))
    result = cli(capsys, "compile", models["gpt"], "--devices", 2, "--plan", path,
                 "-o", tmp_path / "o")  # fmt: skip
    assert_bad_input(result, "compile", "'h0/attn/q/Reshape'")


@pytest.mark.slow
def test_a_parameter_no_dimension_of_which_divides(models, tmp_path, capsys):
    """--zero leaves such units at stage 0 and says so; a plan file that asks it on one
    is refused naming the unit and the parameter."""
    out = tmp_path / "z"
    result = cli(capsys, "compile", models["inception_v3"], "--devices", 4, "--zero", 1,
                 "-o", out)  # fmt: skip
    assert result.code == 0, result.err
    assert "units keep ZeRO 0, a parameter of theirs has no dimension" in result.err
    note = next(line for line in result.err_lines if "keep ZeRO 0" in line)
    unit = note.split("(first: ")[1].rstrip(")")
    assert _zero(out)[unit] == 0
    plan = json.loads((out / "plan.json").read_text())
    plan["units"][unit]["zero"] = 1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))
    result = cli(capsys, "compile", models["inception_v3"], "--devices", 4, "--plan", path,
                 "-o", tmp_path / "o")  # fmt: skip
    assert_bad_input(result, "compile", repr(unit), "no dimension divides")


def test_zero_with_pick_is_refused(models, tmp_path, capsys):
    result = cli(capsys, "compile", models["gpt"], "--devices", 2, "--pick", "fastest",
                 "--zero", 1, "-o", tmp_path / "o")  # fmt: skip
    assert_bad_input(result, "compile", "--zero 1", "--pick")


def test_compile_reports_the_zero_estimate(models, tmp_path, capsys):
    """The estimate compile prints and keeps in manifest.json prices the plan's ZeRO
    stages: less memory than data-parallel, and as many collectives as it emits."""
    import onnx

    estimates = {}
    for plan in ("data-parallel", "fsdp"):
        out = tmp_path / plan
        result = cli(capsys, "compile", models["gpt"], "--devices", 2, "--plan", plan,
                     "--json", "-o", out)  # fmt: skip
        assert result.code == 0, result.err
        estimates[plan] = json.loads(result.out)["estimate"]
        assert json.loads((out / "manifest.json").read_text())["estimate"] == estimates[plan]
        device = onnx.load(str(out / "device_0.onnx"), load_external_data=False)
        kinds = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")
        emitted = sum(n.op_type in kinds for n in device.graph.node)
        assert estimates[plan]["collectives_per_device"] == emitted
    assert estimates["fsdp"]["memory_bytes"] < estimates["data-parallel"]["memory_bytes"]
