"""Under umask 022 every file and directory a command writes is readable by others
(issue 15, item 4): compiled directories go to a launcher that may run as another
user. Outputs are written to private temporaries and renamed into place; the modes
must still be what the umask says. (``calibrate`` is checked where its other test
calibrates: tests/calibrate/test_compare.py.)"""

from __future__ import annotations

import os
import stat

import pytest

from tensoropt.cli import main
from tests.helpers.modes import umask
from tests.helpers.modes import unreadable as _unreadable

pytest.importorskip("matplotlib")


@pytest.fixture
def umask_022():
    with umask(0o022):
        yield


def test_every_command_writes_files_others_can_read(tmp_path, umask_022):
    root = tmp_path / "outputs"
    root.mkdir()
    model = root / "mlp.onnx"
    outdir = root / "compiled"
    runs = [
        ["model", "mlp", "-o", model],
        ["train", model, "--steps", "1", "--save-params", root / "p.npz",
         "--export-step", root / "step.onnx"],
        ["search", model, "--devices", "1,2", "--plot", root / "frontier.png",
         "--dump-costs", root / "costs.json"],
        ["compile", model, "--devices", "2", "--pick", "min-memory", "-o", outdir],
        ["run", outdir, "--steps", "2", "--checkpoint", root / "ckpt",
         "--save-params", root / "trained.npz"],
        ["report", model, "--devices", "1,2", "-o", root / "report"],
    ]  # fmt: skip
    for argv in runs:
        assert main([str(a) for a in argv]) == 0, argv
    written = {p.name for p in root.iterdir()}
    assert {"compiled", "ckpt", "report", "frontier.png", "trained.npz"} <= written
    assert any((root / "ckpt").iterdir()) and any((root / "report").iterdir())
    assert _unreadable(root) == []


def test_a_private_umask_keeps_outputs_private(tmp_path):
    """The umask is honoured, not overridden: 077 gives 0600 files and 0700 directories."""
    previous = os.umask(0o077)
    try:
        model = tmp_path / "mlp.onnx"
        assert main(["model", "mlp", "-o", str(model)]) == 0
        out = tmp_path / "c"
        assert main(["compile", str(model), "--devices", "2", "-o", str(out)]) == 0
    finally:
        os.umask(previous)
    for path in [out, *out.iterdir()]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, (path, oct(mode))
