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
    for name, value in a.states.items():
        np.testing.assert_array_equal(b.states[name], value, err_msg=name)
