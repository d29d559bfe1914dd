"""Compile through the CLI and compare two runs' results, for the runtime tests."""

from __future__ import annotations

import numpy as np

from tests.cli.cli_run import cli


def compiled(capsys, model, out, *extra):
    """``tensoropt compile MODEL -o OUT EXTRA...``, which must succeed; returns ``out``."""
    result = cli(capsys, "compile", model, "-o", out, *extra)
    assert result.code == 0, result.err
    return out


def assert_same_run(a, b) -> None:
    """Two RunResults with bit-identical losses, parameters and optimizer states."""
    assert a.losses == b.losses
    assert a.params.keys() == b.params.keys()
    for name, value in a.params.items():
        np.testing.assert_array_equal(b.params[name], value, err_msg=name)
    assert a.states.keys() == b.states.keys()
    for name, value in a.states.items():
        np.testing.assert_array_equal(b.states[name], value, err_msg=name)


def assert_resume_equals_uninterrupted(out, checkpoint, world: int) -> None:
    """4 steps in one go equal 2 steps, a checkpoint, and 2 more after ``--resume``."""
    from tensoropt.runtime import checkpoint as ckpt
    from tensoropt.runtime.run import run_steps

    full = run_steps(out, 4)
    run_steps(out, 2, checkpoint=checkpoint)
    assert ckpt.latest_common_step(checkpoint, world) == 2
    resumed = run_steps(out, 4, checkpoint=checkpoint, resume=True)
    assert resumed.start_step == 2
    assert_same_run(full, resumed)
