"""ZeRO stages with micro-batches on the runtime: shards accumulated and stored.

- the MPI backend (real mpiexec ranks) gives the local backend's losses and parameters
  bit for bit and verifies against the single-device full-batch step;
- a checkpointed ZeRO-3 + micro-batch run stopped (and, slow, SIGKILLed under mpiexec)
  and resumed gives the losses, parameters and states of an uninterrupted one;
- ``run --save-params`` writes full parameters, keyed and valued as a data-parallel run
  with the same micro-batches.
"""

from __future__ import annotations

import numpy as np
import pytest

from tensoropt.cli import main
from tensoropt.runtime.run import run_steps
from tensoropt.runtime.verify import param_floor, rel_error
from tests.helpers.killed import kill_after_checkpoint
from tests.helpers.runs import assert_same_run
from tests.passes.test_zero_equivalence import ADAM
from tests.passes.test_zero_micro import compile_zero_micro, zoo


@pytest.mark.mpi
@pytest.mark.numerics_only  # an MPI run against the local one of a plan verified there
@pytest.mark.parametrize(
    ("name", "plan_name", "spec", "stage", "k"),
    [
        ("gpt", "data-parallel", "2", 2, 2),
        ("mlp", "data-parallel", "2x2", 3, 2),
        pytest.param("gpt", "megatron", "2x2", 1, 2, marks=pytest.mark.slow),
        pytest.param("bert", "data-parallel", "4", 3, 4, marks=pytest.mark.slow),
    ],
)
def test_zero_micro_mpi_equals_local_and_verifies(name, plan_name, spec, stage, k, tmp_path):
    out = tmp_path / "out"
    compile_zero_micro(zoo(name), plan_name, spec, stage, k, out)
    mpi = run_steps(out, 3, backend="mpi", verify=True)
    local = run_steps(out, 3, backend="local")
    assert mpi.verify is not None and mpi.verify.ok, mpi.verify.to_json()
    assert mpi.losses == local.losses
    assert mpi.params.keys() == local.params.keys()
    for key, value in local.params.items():
        np.testing.assert_array_equal(mpi.params[key], value, err_msg=key)


@pytest.mark.parametrize(
    "backend", ["local", pytest.param("mpi", marks=[pytest.mark.mpi, pytest.mark.slow])]
)
def test_zero3_micro_resume_equals_uninterrupted(backend, tmp_path):
    out = tmp_path / "out"
    compile_zero_micro(zoo("mlp"), "data-parallel", "2", 3, 2, out, ADAM)
    full = run_steps(out, 5, backend)
    run_steps(out, 3, backend, checkpoint=tmp_path / "ck")  # stops after step 2
    resumed = run_steps(out, 5, backend, checkpoint=tmp_path / "ck", resume=True)
    assert resumed.start_step == 3
    assert_same_run(full, resumed)
    for name, value in full.params.items():  # the states come back whole
        assert full.states[f"{name}__m"].shape == full.states[f"{name}__v"].shape == value.shape


def _cli(*argv) -> None:
    assert main([str(a) for a in argv]) == 0


@pytest.mark.parametrize("zero", ["1", "3"])
def test_zero_micro_save_params_are_full_and_keyed_as_data_parallel(zero, tmp_path, capsys):
    model = tmp_path / "gpt.onnx"
    _cli("model", "gpt", "-o", model)
    micro = ("--micro-batches", 2)
    _cli("compile", model, "--devices", 2, "--plan", "data-parallel", *micro, "-o", tmp_path / "dp")
    _cli("compile", model, "--devices", 2, "--plan", "data-parallel", "--zero", zero, *micro,
         "-o", tmp_path / "z")  # fmt: skip
    for name in ("dp", "z"):
        _cli("run", tmp_path / name, "--steps", 3, "--save-params", tmp_path / f"{name}.npz")
    capsys.readouterr()
    a, b = np.load(tmp_path / "dp.npz"), np.load(tmp_path / "z.npz")
    assert sorted(a.files) == sorted(b.files)
    floor = param_floor({k: a[k] for k in a.files})
    for key in a.files:
        assert b[key].shape == a[key].shape, key
        assert rel_error(b[key], a[key], floor) <= 1e-6, key


@pytest.mark.mpi
@pytest.mark.slow
def test_zero3_micro_killed_run_resumes_to_the_uninterrupted_losses(tmp_path):
    """A real kill: mpiexec running a ZeRO-3 plan with 2 micro-batches is SIGKILLed once
    every rank has checkpointed step 2; ``--resume`` then ends three steps later with
    the losses, parameters and states of a run that was never interrupted."""
    out = tmp_path / "out"
    compile_zero_micro(zoo("mlp"), "data-parallel", "2", 3, 2, out, ADAM)
    ck = tmp_path / "ck"
    done = kill_after_checkpoint(out, ck)
    full = run_steps(out, done + 3, "mpi")
    resumed = run_steps(out, done + 3, "mpi", checkpoint=ck, resume=True)
    assert resumed.start_step == done
    assert_same_run(full, resumed)
