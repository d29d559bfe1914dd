"""Micro-batched steps on both backends, with checkpoints and the CLI.

The MPI backend runs the same k micro-steps per step as the local one (real mpirun
processes) and gives bit-identical losses and parameters; a checkpoint is taken between
steps, so resuming equals an uninterrupted run; ``compile --micro-batches`` applies to
built-in plans and plan files and refuses what it cannot compile in one line, exit 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tensoropt.calibrate.validate import graph_facts
from tensoropt.cost.cluster import builtin
from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.runtime.run import run_steps
from tests.cli.cli_run import cli
from tests.helpers.runs import assert_resume_equals_uninterrupted, assert_same_run, compiled


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


@pytest.mark.mpi
@pytest.mark.numerics_only  # an MPI run against the local one of a plan verified there
@pytest.mark.parametrize(
    ("mesh", "plan", "k"),
    [("2", "megatron", 2), pytest.param("2x2", "data-parallel", 2, marks=pytest.mark.slow)],
)
def test_mpi_runs_the_micro_steps_like_local(gpt, mesh, plan, k, tmp_path, capsys):
    devices = 4 if "x" in mesh else 2
    out = compiled(
        capsys, gpt, tmp_path / "out", "--devices", devices, "--mesh", mesh, "--plan", plan,
        "--micro-batches", k,
    )  # fmt: skip
    mpi = run_steps(out, 3, backend="mpi", verify=True)
    local = run_steps(out, 3, backend="local")
    assert mpi.verify is not None and mpi.verify.ok, mpi.verify.to_json()
    assert_same_run(local, mpi)


def test_resume_equals_uninterrupted(gpt, tmp_path, capsys):
    out = compiled(capsys, gpt, tmp_path / "out", "--devices", 2, "--micro-batches", 2)
    assert_resume_equals_uninterrupted(out, tmp_path / "ck", 2)


def test_save_params_are_full_and_keyed_as_without_micro_batches(gpt, tmp_path, capsys):
    plain = compiled(capsys, gpt, tmp_path / "plain", "--devices", 2, "--plan", "megatron")
    micro = compiled(
        capsys, gpt, tmp_path / "micro", "--devices", 2, "--plan", "megatron",
        "--micro-batches", 4,
    )  # fmt: skip
    for out, npz in ((plain, "plain.npz"), (micro, "micro.npz")):
        result = cli(capsys, "run", out, "--steps", 2, "--save-params", tmp_path / npz)
        assert result.code == 0, result.err
    a, b = np.load(tmp_path / "plain.npz"), np.load(tmp_path / "micro.npz")
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        assert a[key].shape == b[key].shape
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_plan_file_value_is_overridden_and_recorded(gpt, tmp_path, capsys):
    first = compiled(capsys, gpt, tmp_path / "a", "--devices", 2, "--micro-batches", 2)
    plan = json.loads((first / "plan.json").read_text())
    assert plan["micro_batches"] == 2
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    again = compiled(capsys, gpt, tmp_path / "b", "--devices", 2, "--plan", tmp_path / "plan.json")
    assert json.loads((again / "manifest.json").read_text())["micro"]["batches"] == 2
    over = compiled(
        capsys, gpt, tmp_path / "c", "--devices", 2, "--plan", tmp_path / "plan.json",
        "--micro-batches", 4,
    )  # fmt: skip
    assert json.loads((over / "plan.json").read_text())["micro_batches"] == 4
    one = compiled(
        capsys, gpt, tmp_path / "d", "--devices", 2, "--plan", tmp_path / "plan.json",
        "--micro-batches", 1,
    )  # fmt: skip
    assert "micro" not in json.loads((one / "manifest.json").read_text())
    assert "micro_batches" not in json.loads((one / "plan.json").read_text())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--micro-batches", 3), "--micro-batches 3 does not divide the batch: input "),
        (("--micro-batches", 0), "--micro-batches '0': expected an integer >= 1"),
        (("--micro-batches", "two"), "--micro-batches 'two': expected an integer >= 1"),
    ],
)
def test_bad_micro_batches_exit_2_with_one_line(gpt, tmp_path, capsys, args, message):
    result = cli(capsys, "compile", gpt, "--devices", 2, "-o", tmp_path / "out", *args)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.err
    assert not (tmp_path / "out").exists()


def test_op_that_needs_the_whole_batch_exits_2_naming_it(tmp_path, capsys):
    # a softmax over the batch axis: no micro-batch holds what it normalises over
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
            helper.make_node("Softmax", ["h"], ["y"], name="batch_softmax", axis=0),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = tmp_path / "softmax.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), model)
    result = cli(
        capsys, "compile", model, "--devices", 2, "--micro-batches", 2, "-o", tmp_path / "out"
    )
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "'batch_softmax' (Softmax) needs the whole batch" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["vgg16", "resnet50"])
def test_max_pool_networks_run_micro_batches_like_one_device(name, tmp_path, capsys):
    # MaxPool's backward reads its indices modulo the plane, so the pool splits the batch
    model = tmp_path / f"{name}.onnx"
    save_model(build_model(name, "tiny"), str(model))
    out = compiled(capsys, model, tmp_path / "out", "--devices", 2, "--micro-batches", 2)
    result = run_steps(out, 3, verify=True)
    assert result.verify is not None and result.verify.ok, result.verify.to_json()


def test_inspect_shows_micro_batches_and_per_step_collectives(gpt, tmp_path, capsys):
    out = compiled(
        capsys, gpt, tmp_path / "out", "--devices", 2, "--plan", "megatron",
        "--micro-batches", 2,
    )  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    result = cli(capsys, "inspect", out)
    assert result.code == 0, result.err
    # the two tensor-parallel ranks are alike: one section names both
    assert result.out.count("micro-batches: 2 per step") == 1
    assert "device_0.onnx, device_1.onnx (2 devices alike): " in result.out
    result = cli(capsys, "inspect", out, "--json")
    devices = json.loads(result.out)["devices"]
    per_step = manifest["estimate"]["collectives_per_device"]
    for device in devices:
        assert device["micro_batches"] == 2
        assert sum(c["count"] for c in device["collectives"]) == per_step


@pytest.mark.parametrize(
    ("devices", "extra", "none"),
    [
        (2, ("--mesh", "2", "--plan", "megatron", "--micro-batches", 4), False),
        (4, ("--mesh", "2", "--plan", "megatron", "--stages", 2, "--micro-batches", 2), False),
        (4, ("--mesh", "1", "--plan", "data-parallel", "--stages", 4, "--micro-batches", 2), True),
    ],
    ids=["micro", "pp2-tp2", "pp4"],
)
def test_collectives_per_device_is_one_figure(gpt, tmp_path, capsys, devices, extra, none):
    """Compile's line and JSON, the plan's estimate and inspect name the same count: the
    collectives the busiest device issues per step (micro-phase ones once per
    micro-batch; a pipeline's Send/Recv are not collectives)."""
    out = tmp_path / "out"
    done = cli(capsys, "compile", gpt, "--devices", devices, *extra, "-o", out, "--json")
    assert done.code == 0, done.err
    doc = json.loads(done.out)
    result = cli(capsys, "inspect", out, "--json")
    assert result.code == 0, result.err
    counts = [
        sum(c["count"] for c in device["collectives"] if c["kind"] not in ("Send", "Recv"))
        for device in json.loads(result.out)["devices"]
    ]
    assert doc["collectives_per_device"] == doc["estimate"]["collectives_per_device"]
    assert doc["collectives_per_device"] == max(counts)
    # validate's graph_collectives counts them alike
    assert graph_facts(str(out), builtin("h100").intra).collectives == max(counts)
    assert (max(counts) == 0) is none
    # every plan here splits the step (a pipeline of one device per stage with no
    # collective at all included): none is the plan that replicates each device's work
    assert doc["replicates_all_work"] is False
