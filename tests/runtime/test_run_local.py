"""The local backend end to end: per-device run == unpartitioned run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tensoropt.runtime.data import make_batch, specs_from_manifest
from tensoropt.runtime.manifest import load_outdir
from tensoropt.runtime.run import run_steps
from tensoropt.runtime.verify import rel_error
from tests.helpers.handbuilt import mlp_case, write_outdir
from tests.runtime.conftest import reference_run

CASES = ["megatron_tp2", "dp2", "dp4", "dp2_tp2", "a2a2", "a2a4", "single"]


@pytest.mark.parametrize("case", CASES)
def test_local_run_equals_unpartitioned_after_3_steps(outdirs, case):
    outdir = outdirs(case)
    result = run_steps(outdir, 3, seed=5)
    specs = specs_from_manifest(load_outdir(outdir))
    ref_losses, ref_state = reference_run(outdir, [make_batch(specs, k, 5) for k in range(3)])
    assert len(result.losses) == 3
    for got, want in zip(result.losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    for name, value in result.params.items():
        assert value.shape == ref_state[name].shape
        assert rel_error(value, ref_state[name]) <= 1e-5, name
    for name, value in result.states.items():
        assert rel_error(value, ref_state[name]) <= 1e-5, name
    # the run trained something: parameters moved away from their initial values
    initial = run_steps(outdir, 1, seed=5).params
    assert any(not np.array_equal(initial[n], result.params[n]) for n in result.params)


def test_verify_reports_every_step_and_passes(outdirs):
    result = run_steps(outdirs("dp2_tp2"), 3, verify=True)
    report = result.verify
    assert report is not None and report.ok
    assert [s.step for s in report.per_step] == [0, 1, 2]
    assert set(report.per_step[0].rel_error_params) == {"W0", "W1", "b1", "W2"}
    assert [s.loss for s in report.per_step] == result.losses
    assert report.to_json()["tolerance"] == 1e-4


def test_verify_catches_a_wrong_partition(tmp_path):
    # Reference with another learning rate: the per-device graphs no longer match it.
    case = mlp_case(dp=2, tp=1)
    other = mlp_case(dp=1, tp=1, lr=0.2)
    outdir = write_outdir(dataclasses.replace(case, annotated=other.annotated), tmp_path)
    report = run_steps(outdir, 2, verify=True).verify
    assert report is not None and not report.ok
    assert report.per_step[0].rel_error_loss < 1e-6  # step 0's loss precedes any update
    assert report.max_rel_error_params > 1e-3


def test_runs_are_deterministic_and_seeded(outdirs):
    a = run_steps(outdirs("dp4"), 2, seed=3)
    b = run_steps(outdirs("dp4"), 2, seed=3)
    c = run_steps(outdirs("dp4"), 2, seed=4)
    assert a.losses == b.losses
    assert a.losses != c.losses


def test_save_params_writes_full_named_arrays(outdirs, tmp_path):
    out = tmp_path / "p.npz"
    result = run_steps(outdirs("megatron_tp2"), 2, save_params=out)
    with np.load(out) as saved:
        assert set(saved.files) == {"W0", "W1", "b1", "W2"}
        assert saved["W1"].shape == (6, 8)  # global shape, reassembled from 2 column shards
        for name in saved.files:
            np.testing.assert_array_equal(saved[name], result.params[name])


def test_data_file_gives_the_same_run_as_the_same_batches(outdirs, tmp_path):
    outdir = outdirs("dp2")
    specs = specs_from_manifest(load_outdir(outdir))
    batches = [make_batch(specs, k, 9) for k in range(3)]
    per_step = {s.name: np.stack([b[s.name] for b in batches]) for s in specs}
    np.savez(tmp_path / "steps.npz", **per_step)
    np.savez(tmp_path / "one.npz", **batches[0])
    synthetic = run_steps(outdir, 3, seed=9)
    from_file = run_steps(outdir, 3, data=tmp_path / "steps.npz")
    assert from_file.losses == synthetic.losses
    same = run_steps(outdir, 3, data=tmp_path / "one.npz").losses
    ref, _ = reference_run(outdir, [batches[0]] * 3)
    np.testing.assert_allclose(same, ref, rtol=1e-5)
