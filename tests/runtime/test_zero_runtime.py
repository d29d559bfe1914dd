"""ZeRO on the runtime: parameters and optimizer states stored as shards.

- the mpi backend gives the local backend's losses and parameters bit for bit, and
  verifies against the single-device step;
- a checkpointed run stopped and resumed gives the losses and parameters of an
  uninterrupted one (Adam: two sharded states per parameter);
- ``run --save-params`` writes full parameters, keyed as a data-parallel run's, equal
  to them;
- a ZeRO-3 parameter's all-gathers run just before their readers' segment, and their
  buffers are freed after their last reader.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tensoropt.cli import main
from tensoropt.models import build_model
from tensoropt.runtime.engine import load_device, split_rank
from tensoropt.runtime.manifest import load_outdir
from tensoropt.runtime.run import run_steps
from tensoropt.runtime.split import zero_gather
from tensoropt.runtime.verify import param_floor, rel_error
from tests.helpers.killed import kill_after_checkpoint
from tests.helpers.runs import assert_same_run
from tests.passes.test_zero_equivalence import ADAM, compile_zero


@pytest.mark.mpi
@pytest.mark.numerics_only  # an MPI run against the local one of a plan verified there
@pytest.mark.parametrize(
    ("name", "plan_name", "spec", "stage"),
    [
        ("mlp", "data-parallel", "2", 3),
        ("gpt", "megatron", "2x2", 3),
        pytest.param("gpt", "data-parallel", "4", 1, marks=pytest.mark.slow),
        pytest.param("resnet50", "data-parallel", "2x2", 3, marks=pytest.mark.slow),
    ],
)
def test_zero_mpi_equals_local_and_verifies(name, plan_name, spec, stage, tmp_path):
    compile_zero(build_model(name, "tiny"), plan_name, spec, stage, tmp_path / "out")
    mpi = run_steps(tmp_path / "out", 3, backend="mpi", verify=True)
    local = run_steps(tmp_path / "out", 3, backend="local")
    assert mpi.verify is not None and mpi.verify.ok, mpi.verify.to_json()
    assert mpi.losses == local.losses
    assert mpi.params.keys() == local.params.keys()
    for key, value in local.params.items():
        np.testing.assert_array_equal(mpi.params[key], value, err_msg=key)


@pytest.mark.parametrize(
    "backend", ["local", pytest.param("mpi", marks=[pytest.mark.mpi, pytest.mark.slow])]
)
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_resume_equals_uninterrupted(stage, backend, tmp_path):
    out = tmp_path / "out"
    compile_zero(build_model("mlp", "tiny"), "data-parallel", "2", stage, out, ADAM)
    full = run_steps(out, 5, backend)
    run_steps(out, 3, backend, checkpoint=tmp_path / "ck")  # stops after step 2
    resumed = run_steps(out, 5, backend, checkpoint=tmp_path / "ck", resume=True)
    assert resumed.start_step == 3
    assert_same_run(full, resumed)
    # the states come back whole, under their names: Adam's two per parameter
    for name, value in full.params.items():
        assert full.states[f"{name}__m"].shape == full.states[f"{name}__v"].shape == value.shape


def _cli(*argv) -> None:
    assert main([str(a) for a in argv]) == 0


@pytest.mark.parametrize(("plan", "zero"), [("fsdp", None), ("data-parallel", "1")])
def test_zero_save_params_are_full_and_keyed_as_data_parallel(plan, zero, tmp_path, capsys):
    model = tmp_path / "gpt.onnx"
    _cli("model", "gpt", "-o", model)
    _cli("compile", model, "--devices", 2, "--plan", "data-parallel", "-o", tmp_path / "dp")
    flags = ["--plan", plan] + (["--zero", zero] if zero else [])
    _cli("compile", model, "--devices", 2, *flags, "-o", tmp_path / "z")
    for name in ("dp", "z"):
        _cli("run", tmp_path / name, "--steps", 3, "--save-params", tmp_path / f"{name}.npz")
    capsys.readouterr()
    a, b = np.load(tmp_path / "dp.npz"), np.load(tmp_path / "z.npz")
    assert sorted(a.files) == sorted(b.files)
    floor = param_floor({k: a[k] for k in a.files})
    for key in a.files:
        assert b[key].shape == a[key].shape, key
        assert rel_error(b[key], a[key], floor) <= 1e-6, key


def test_zero3_gathers_run_just_before_their_readers(tmp_path):
    """Each gather of a stored shard runs in the batch right before the first segment
    that reads it, and its buffer is freed after the last; so they spread over the step
    instead of all running (and living) from its start."""
    out = tmp_path / "out"
    compile_zero(build_model("gpt", "tiny"), "data-parallel", "2", 3, out)
    manifest = load_outdir(out)
    model = load_device(manifest, 0)
    plan = split_rank(manifest, model, 0)
    tagged = {n.name for n in onnx.load(str(out / "device_0.onnx")).graph.node if zero_gather(n)}
    assert tagged
    batches = set()
    for i, stage in enumerate(plan.stages):
        for call in stage.collectives:
            if call.node_name not in tagged:
                continue
            batches.add(i)
            readers = [
                j
                for j, later in enumerate(plan.stages)
                if later.segment is not None and call.output in later.segment.inputs
            ]
            assert readers and min(readers) == i + 1, call.node_name
            freed = [j for j, s in enumerate(plan.stages) if call.output in s.release]
            assert freed == [max(readers)], call.node_name
    assert len(batches) > len(tagged) // 4  # spread over the step, not in one batch


@pytest.mark.mpi
@pytest.mark.slow
def test_zero3_killed_run_resumes_to_the_uninterrupted_losses(tmp_path):
    """A real kill: mpirun with ZeRO-3 shards is SIGKILLed once every rank has
    checkpointed step 2; ``--resume`` then ends three steps later with the losses and
    parameters of a run that was never interrupted."""
    out = tmp_path / "out"
    compile_zero(build_model("mlp", "tiny"), "data-parallel", "2", 3, out, ADAM)
    ck = tmp_path / "ck"
    done = kill_after_checkpoint(out, ck)
    full = run_steps(out, done + 3, "mpi")
    resumed = run_steps(out, done + 3, "mpi", checkpoint=ck, resume=True)
    assert resumed.start_step == done
    assert_same_run(full, resumed)
