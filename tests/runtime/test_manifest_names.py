"""The manifest reader's side of external data: ``data`` and ``init`` fields, and every
name in the manifest must be a plain file name inside the output directory."""

from __future__ import annotations

import json

import pytest

from tensoropt.errors import OutputDirError
from tensoropt.runtime.manifest import InputInit, load_outdir
from tests.cli.cli_run import assert_bad_input, cli
from tests.helpers.handbuilt import mlp_case, write_outdir


@pytest.fixture
def outdir(tmp_path):
    return write_outdir(mlp_case(dp=2, tp=1), tmp_path / "out")


def _edit(outdir, change) -> None:
    path = outdir / "manifest.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_data_and_init_fields_are_read(outdir):
    (outdir / "device_0.data").write_bytes(b"\1" * 8)
    import hashlib

    digest = hashlib.sha256(b"\1" * 8).hexdigest()
    state = next(n for n, e in json.loads((outdir / "manifest.json").read_text())["inputs"].items()
                 if e["kind"] == "state")  # fmt: skip

    def change(raw):
        raw["ranks"][0]["data"] = "device_0.data"
        raw["ranks"][1]["data"] = None
        raw["files"]["device_0.data"] = digest
        raw["inputs"][state]["init"] = "zeros"

    _edit(outdir, change)
    manifest = load_outdir(outdir)
    assert [r.data for r in manifest.ranks] == ["device_0.data", None]
    assert manifest.inputs[state].init is InputInit.ZEROS
    assert {i.name for i in manifest.inputs.values() if i.init is not None} == {state}


@pytest.mark.parametrize(
    "name", ["../device_0.onnx", "/etc/passwd", "sub/device_0.onnx", "..", "", "C:device_0"]
)
@pytest.mark.parametrize("where", ["file", "data", "files"])
def test_a_name_that_is_not_a_plain_file_name_is_refused(outdir, name, where):
    def change(raw):
        if where == "files":
            raw["files"][name] = "0" * 64
        else:
            raw["ranks"][0][where] = name
            raw["files"][name] = "0" * 64

    _edit(outdir, change)
    with pytest.raises(OutputDirError, match="not a plain file name inside the output directory"):
        load_outdir(outdir, check_files=False)


def test_a_rank_data_file_without_a_hash_is_refused(outdir):
    (outdir / "device_1.data").write_bytes(b"\1")
    _edit(outdir, lambda raw: raw["ranks"][1].update(data="device_1.data"))
    with pytest.raises(OutputDirError, match=r"'device_1.data' of rank 1 has no sha256"):
        load_outdir(outdir, check_files=False)


def test_run_refuses_a_manifest_that_points_outside_in_one_line(outdir, capsys):
    _edit(outdir, lambda raw: raw["ranks"][0].update(file="../device_0.onnx"))
    outcome = cli(capsys, "run", outdir, "--steps", 1)
    assert_bad_input(outcome, "run", "'../device_0.onnx'", "plain file name")
