"""Pipelined steps (``compile --stages P``) train like the single-device step.

Each case compiles through the CLI, runs 3 steps (SGD with momentum; Adam on the MLP,
whose step counter every stage keeps a copy of) with ``--verify`` (the reference is
the single-device full-batch step; parameters within 1e-4) on the local backend, and, for
the MPI cases, the same with real ``mpirun`` processes, bit-identical to local. Stages
hold their own parameters; the gathered parameters are every parameter of the model.
"""

from __future__ import annotations

import json

import onnx
import pytest

from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.runtime.pipeline import BACKWARD, FORWARD, schedule
from tensoropt.runtime.run import run_steps
from tests.cli.cli_run import assert_bad_input, cli
from tests.helpers.runs import assert_resume_equals_uninterrupted, assert_same_run, compiled


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(path))
    return path


def _verified(out, backend="local"):
    result = run_steps(out, 3, backend=backend, verify=True)
    assert result.verify is not None and result.verify.ok, result.verify.to_json()
    return result


CASES = [
    # (devices, stages, micro-batches, plan, mesh, schedule)
    (2, 2, 2, "data-parallel", None, "1f1b"),
    (4, 4, 4, "data-parallel", None, "1f1b"),
    (2, 2, 4, "data-parallel", None, "gpipe"),
    (4, 2, 2, "megatron", None, "1f1b"),
    (4, 2, 4, "data-parallel", None, "1f1b"),
    (4, 4, 2, "data-parallel", None, "gpipe"),
    (8, 2, 2, "data-parallel", "2x2", "1f1b"),
]


@pytest.mark.parametrize(
    ("devices", "stages", "k", "plan", "mesh", "kind"),
    [
        pytest.param(*c, id="-".join(str(x) for x in c if x is not None), marks=marks)
        for c, marks in zip(
            CASES, [(), (), (), (), (pytest.mark.slow,)] + [(pytest.mark.slow,)] * 2, strict=False
        )
    ],
)
def test_pipelined_gpt_trains_like_one_device(
    gpt, tmp_path, capsys, devices, stages, k, plan, mesh, kind
):
    extra = ["--mesh", mesh] if mesh else []
    out = compiled(
        capsys, gpt, tmp_path / "out", "--devices", devices, "--plan", plan, "--stages", stages,
        "--micro-batches", k, "--schedule", kind, *extra,
    )  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == devices
    assert manifest["pipeline"]["stages"] == stages
    assert [r["stage"] for r in manifest["ranks"]] == [
        g * stages // devices for g in range(devices)
    ]
    result = _verified(out)
    plain = onnx.load(str(gpt), load_external_data=False)
    assert set(result.params) == {i.name for i in plain.graph.initializer if i.dims}


@pytest.mark.parametrize(("devices", "stages", "k"), [(2, 2, 2), (4, 2, 4), (4, 4, 4)])
def test_pipelined_resnet_trains_like_one_device(tmp_path, capsys, devices, stages, k):
    model = tmp_path / "resnet.onnx"
    save_model(build_model("resnet50", "tiny"), str(model))
    out = compiled(
        capsys, model, tmp_path / "out", "--devices", devices, "--stages", stages,
        "--micro-batches", k,
    )  # fmt: skip
    _verified(out)


@pytest.mark.parametrize("extra", [["--plan", "fsdp"], ["--zero", "1"]], ids=["fsdp", "zero-1"])
def test_memory_axes_inside_stages_train_like_one_device(gpt, tmp_path, capsys, extra):
    # ZeRO (and with fsdp every block recomputed) on each stage's 2 data-parallel devices
    out = compiled(
        capsys, gpt, tmp_path / "out", "--devices", 4, "--stages", 2, "--micro-batches", 2,
        *extra,
    )  # fmt: skip
    _verified(out)


def test_pipelined_mlp_trains_with_adam_like_one_device(mlp, tmp_path, capsys):
    out = compiled(
        capsys, mlp, tmp_path / "out", "--devices", 2, "--stages", 2, "--micro-batches", 2,
        "--optimizer", "adam",
    )  # fmt: skip
    _verified(out)
    manifest = json.loads((out / "manifest.json").read_text())
    states = [
        {n for n in r["inputs"] if manifest["inputs"].get(n, {}).get("kind") == "state"}
        for r in manifest["ranks"]
    ]
    assert "__step" in states[0] & states[1]  # each stage counts the steps itself
    assert states[0] & states[1] == {"__step"}  # and holds only its own moments


def test_each_stage_sends_its_boundary_and_holds_its_own_parameters(gpt, tmp_path, capsys):
    out = compiled(
        capsys, gpt, tmp_path / "out", "--devices", 2, "--stages", 2, "--micro-batches", 2
    )
    shown = cli(capsys, "inspect", out, "--json")
    assert shown.code == 0, shown.err
    devices = json.loads(shown.out)["devices"]
    assert not json.loads(shown.out)["replicates_all_work"]
    sends = [[(c["kind"], c["group"], c["count"]) for c in d["collectives"]] for d in devices]
    # per micro-batch: the residual stream forward, its gradient (one sum) back
    assert sends == [[("Send", [1], 2)], [("Send", [0], 2)]]
    bytes_sent = [d["bytes_sent_per_step"] for d in devices]
    assert bytes_sent[0] == bytes_sent[1] == devices[1]["pipeline"]["bytes_received_per_step"]
    assert [d["pipeline"]["stage"] for d in devices] == [0, 1]
    params = [set(d["param_shapes"]) for d in devices]
    assert params[0] and params[1] and not params[0] & params[1]
    assert "wte.weight" in params[0] and "lm_head.weight" in params[1]


def test_resume_equals_uninterrupted(gpt, tmp_path, capsys):
    out = compiled(
        capsys, gpt, tmp_path / "out", "--devices", 2, "--stages", 2, "--micro-batches", 2
    )
    assert_resume_equals_uninterrupted(out, tmp_path / "ck", 2)


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("devices", "plan"), [(2, "data-parallel"), pytest.param(4, "megatron", marks=pytest.mark.slow)]
)
def test_mpi_runs_the_schedule_like_local(gpt, tmp_path, capsys, devices, plan):
    out = compiled(
        capsys, gpt, tmp_path / "out", "--devices", devices, "--plan", plan, "--stages", 2,
        "--micro-batches", 2,
    )  # fmt: skip
    mpi = _verified(out, "mpi")
    assert_same_run(run_steps(out, 3), mpi)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "m"), [(1, 3), (2, 1), (2, 4), (4, 2), (4, 4), (4, 8)])
def test_schedule_runs_each_micro_batch_once_and_bounds_the_stash(kind, stages, m):
    for s in range(stages):
        actions = schedule(s, stages, m, kind)
        assert sorted(actions) == sorted(
            [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
        )
        live, peak = set(), 0
        for what, i in actions:
            if what == FORWARD:
                live.add(i)
            else:
                assert i in live  # its forward ran first
                live.remove(i)
            peak = max(peak, len(live))
        assert peak == (min(stages - s, m) if kind == "1f1b" else m)


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--devices", 2, "--stages", 2], ["--micro-batches 2 or more"]),
        (["--devices", 3, "--stages", 2, "--micro-batches", 2], ["--stages 2", "multiple of 2"]),
        (["--devices", 64, "--stages", 64, "--micro-batches", 2], ["--stages 64", "blocks"]),
        (["--devices", 2, "--stages", "two", "--micro-batches", 2], ["--stages 'two'"]),
        (["--devices", 2, "--stages", 2, "--micro-batches", 3], ["--micro-batches 3", "divide"]),
        (["--devices", 1, "--stages", 2, "--micro-batches", 2], ["--stages 2", "multiple of 2"]),
    ],
)
def test_bad_stage_requests_are_refused_in_one_line(gpt, tmp_path, capsys, extra, fragments):
    outcome = cli(capsys, "compile", gpt, "-o", tmp_path / "out", *extra)
    assert_bad_input(outcome, "compile", *fragments)
    assert not (tmp_path / "out").exists()


def test_pipelined_torch_export_trains_like_one_device(exported, tmp_path, capsys):
    pytest.importorskip("torch")
    out = compiled(
        capsys, exported("gpt2"), tmp_path / "out", "--devices", 2, "--stages", 2,
        "--micro-batches", 2,
    )  # fmt: skip
    report = run_steps(out, 3, verify=True, threads=1).verify
    assert report is not None and report.ok, report.to_json()
    assert report.max_rel_error_params <= 1e-4, report.to_json()


@pytest.mark.slow
@pytest.mark.mpi
def test_a_dead_stage_rank_is_named_and_nothing_is_left_running(gpt, tmp_path, capsys):
    import os
    import subprocess
    import sys
    import time
    import uuid

    from tests.runtime.test_mpi import _processes_with

    out = compiled(
        capsys, gpt, tmp_path / "out", "--devices", 2, "--stages", 2, "--micro-batches", 2
    )
    marker = f"TENSOROPT_TEST_MARKER={uuid.uuid4().hex}"
    env = {**os.environ, "TENSOROPT_FAULT_INJECT": "1:2", marker.split("=")[0]: marker[22:]}
    cmd = [sys.executable, "-m", "tensoropt", "run", str(out), "--steps", "5",
           "--backend", "mpi"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode not in (0, 2)
    assert time.monotonic() - t0 < 30
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "rank 1" in lines[0] and "step 2" in lines[0], proc.stderr
    assert _processes_with(marker) == []


@pytest.mark.parametrize(
    ("pipeline", "fragments"),
    [
        ({"starts": ["block_99"]}, ["block_99", "not blocks of this model"]),
        ({"starts": ["block_2"], "schedule": "zb"}, ["pipeline.schedule", "1f1b, gpipe"]),
        ({"starts": ["block_2", "block_2"]}, ["listed twice"]),
    ],
)
def test_bad_plan_file_stages_are_refused_in_one_line(gpt, tmp_path, capsys, pipeline, fragments):
    plan = {
        "schema": "tensoropt.plan/1",
        "mesh": {"shape": [1], "axis_names": ["dp"]},
        "micro_batches": 2,
        "pipeline": pipeline,
        "units": {},
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    devices = len(pipeline["starts"]) + 1
    outcome = cli(
        capsys, "compile", gpt, "-o", tmp_path / "out", "--devices", devices, "--plan", path
    )
    assert_bad_input(outcome, "compile", *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("counts", ["x", "0", ""])
def test_bad_search_stage_counts_are_refused_in_one_line(gpt, capsys, counts):
    outcome = cli(
        capsys, "search", gpt, "--devices", 2, "--axes", "split,stages", "--stages", counts
    )
    assert_bad_input(outcome, "search", "--stages")


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--micro-batches", "3"], ["--micro-batches 3", "does not divide the batch of 8"]),
        (["--micro-batches", "2,3"], ["3 does not divide", "e.g. 2,4,8"]),
        (["--micro-batches", "3,5"], ["3, 5 do not divide the batch of 8"]),
        (["--stages", "16"], ["--stages 16", "5 blocks", "at most 5"]),
        (["--stages", "3"], ["--stages 3", "divides none of the device counts 4"]),
    ],
)
def test_search_counts_no_problem_can_use_are_refused(gpt, capsys, extra, fragments):
    """Counts given on the command line that no pipelined problem could use: exit 2,
    one line, before any search (the default lists are filtered silently)."""
    outcome = cli(capsys, "search", gpt, "--devices", 4, "--axes", "split,stages", *extra)
    assert_bad_input(outcome, "search", *fragments)
