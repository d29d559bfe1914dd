"""The runtime on output directories in the external-data format (``device_<r>.data``).

* a compiled directory trains exactly like its inline copy (tests/helpers/outdir.py:
  every tensor inside the ONNX files, states as zero initializers): the same losses
  and parameters bit for bit, optimizer states starting from zeros that are stored
  nowhere, ``--verify`` against an ``annotated.onnx`` without parameter values, on
  the local and the mpi backend;
* no compute segment embeds weight bytes, and a constant read by several segments
  is one array per rank;
* checkpoints are tensor files with aligned raw data, and resuming from them equals
  an uninterrupted run;
* names that point outside OUTDIR (manifest entries, external-data locations) are
  refused with one line and exit code 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from tensoropt.cli import main
from tensoropt.errors import OutputDirError
from tensoropt.models import build_model
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
from tensoropt.passes.training_step import TrainingOptions
from tensoropt.runtime import checkpoint as ckpt
from tensoropt.runtime.engine import load_device, split_all
from tensoropt.runtime.external import INLINE_LIMIT, tensor_nbytes
from tensoropt.runtime.manifest import load_outdir
from tensoropt.runtime.program import RankProgram
from tensoropt.runtime.run import run_steps
from tensoropt.runtime.tensorfile import ALIGN, read_header
from tests.helpers.compile import compile_model
from tests.helpers.outdir import inline_outdir

# SGD with momentum: its states start at zero. (Adam is not used here: it scales the
# float32 noise of an exactly-zero gradient, such as a key bias's, up to the learning
# rate, so no plan verifies at 1e-4 under it, inline or external.)
MOMENTUM = OptimizerOptions(OptimizerKind.SGD, lr=0.01, momentum=0.9)
# A frozen weight of a sharded MLP: a constant that the forward and the backward read.
FROZEN = TrainingOptions(optimizer=MOMENTUM, freeze=r"h0\.mlp\.fc_out\.weight")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(inline, external) output directories of tiny GPT, megatron on 2 ranks."""
    root = tmp_path_factory.mktemp("external")
    compile_model(build_model("gpt", "tiny"), "megatron", "2", root / "external", FROZEN)
    return inline_outdir(root / "external", root / "inline"), root / "external"


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Weight bytes embedded in a model proto (inline initializer data)."""
    return sum(
        len(t.raw_data) + 4 * (len(t.float_data) + len(t.int32_data))
        + 8 * (len(t.int64_data) + len(t.double_data))
        for t in model.graph.initializer
    )  # fmt: skip


def _same(a, b):
    assert a.losses == b.losses
    assert a.params.keys() == b.params.keys() and a.states.keys() == b.states.keys()
    for name, value in {**a.params, **a.states}.items():
        other = b.params.get(name, b.states.get(name))
        np.testing.assert_array_equal(other, value, err_msg=name)


def test_external_format_trains_exactly_like_inline(dirs):
    inline, ext = dirs
    a = run_steps(inline, 3, verify=True, threads=1)
    b = run_steps(ext, 3, verify=True, threads=1)
    assert a.verify.ok and b.verify.ok, (a.verify.to_json(), b.verify.to_json())
    _same(a, b)
    # the momenta started from zeros (stored nowhere); after the steps they are not
    assert b.states and all(np.any(v) for v in b.states.values())


@pytest.mark.mpi
def test_external_format_on_the_mpi_backend(dirs):
    inline, ext = dirs
    local = run_steps(inline, 2, threads=1)
    mpi = run_steps(ext, 2, backend="mpi", verify=True, threads=1)
    assert mpi.verify is not None and mpi.verify.ok, mpi.verify.to_json()
    _same(local, mpi)


def test_segments_embed_no_weight_bytes_and_share_one_copy(dirs):
    _, ext = dirs
    manifest = load_outdir(ext)
    models = {r: load_device(manifest, r) for r in range(manifest.world_size)}
    plans = split_all(manifest, models)
    frozen = "h0.mlp.fc_out.weight"
    for plan in plans.values():
        segments = [s.segment for s in plan.stages if s.segment is not None]
        assert len(segments) > 1
        for seg in segments:
            assert initializer_bytes(seg.model) < 64 * INLINE_LIMIT
            for t in seg.model.graph.initializer:
                assert t.name in seg.shared or tensor_nbytes(t) <= INLINE_LIMIT, t.name
        readers = [seg for seg in segments if frozen in seg.shared]
        assert len(readers) >= 2, "the frozen weight should be read by forward and backward"
        assert all(frozen in seg.inputs for seg in readers)
        assert list(plan.weights) == [frozen]  # the rank's one copy, fed to both
    program = RankProgram(plans[0])
    feeds = {n: np.zeros(1) for n in plans[0].feeds}
    assert program.begin(feeds)[frozen] is plans[0].weights[frozen]  # no copy per step


def test_checkpoints_are_aligned_tensor_files_and_resume_exactly(dirs, tmp_path):
    _, ext = dirs
    full = run_steps(ext, 4, threads=1)
    run_steps(ext, 2, checkpoint=tmp_path, threads=1)
    meta, entries = read_header(ckpt.shard_path(tmp_path, 1, 2))
    assert meta["step"] == 2 and len(meta["losses"]) == 2
    assert entries and all(e["offset"] % ALIGN == 0 for e in entries)
    state, _ = ckpt.load_shard(tmp_path, 1, 2)
    assert set(state) == {e["name"] for e in entries}
    resumed = run_steps(ext, 4, checkpoint=tmp_path, resume=True, verify=True, threads=1)
    assert resumed.start_step == 2 and resumed.verify.ok
    _same(full, resumed)


def test_a_truncated_checkpoint_is_refused(dirs, tmp_path):
    _, ext = dirs
    run_steps(ext, 1, checkpoint=tmp_path, threads=1)
    path = ckpt.shard_path(tmp_path, 0, 1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ckpt.TensorOptError, match="unreadable tensor file"):
        run_steps(ext, 2, checkpoint=tmp_path, resume=True)


def _copy(ext: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(ext, out)
    return out


def _rewrite_manifest(out: Path, edit) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("bad", ["../device_1.data", "/etc/passwd", "sub/device_1.data"])
def test_manifest_names_outside_outdir_are_refused(dirs, tmp_path, capsys, bad):
    out = _copy(dirs[1], tmp_path)

    def edit(manifest):
        manifest["ranks"][1]["data"] = bad

    _rewrite_manifest(out, edit)
    assert main(["run", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(bad) in err and "plain file name" in err, err


@pytest.mark.parametrize("where", ["files", "file"])
def test_manifest_file_entries_outside_outdir_are_refused(dirs, tmp_path, where):
    out = _copy(dirs[1], tmp_path)

    def edit(manifest):
        if where == "files":
            manifest["files"]["../plan.json"] = manifest["files"].pop("plan.json")
        else:
            manifest["ranks"][0]["file"] = str(out / "device_0.onnx")

    _rewrite_manifest(out, edit)
    with pytest.raises(OutputDirError, match="not a plain file name"):
        load_outdir(out)


@pytest.mark.parametrize("bad", ["../device_0.data", "/tmp/device_0.data"])
def test_external_data_locations_outside_outdir_are_refused(dirs, tmp_path, capsys, bad):
    out = _copy(dirs[1], tmp_path)
    path = out / "device_0.onnx"
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.external_data)
    next(e for e in tensor.external_data if e.key == "location").value = bad
    onnx.save(model, str(path))
    from tensoropt.runtime.manifest import sha256_file

    def edit(manifest):
        manifest["ranks"][0]["sha256"] = manifest["files"]["device_0.onnx"] = sha256_file(path)

    _rewrite_manifest(out, edit)
    assert main(["run", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(bad) in err and tensor.name in err, err


def test_a_truncated_data_file_is_refused_by_its_hash(dirs, tmp_path, capsys):
    out = _copy(dirs[1], tmp_path)
    data = out / "device_1.data"
    data.write_bytes(data.read_bytes()[:100])
    assert main(["run", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "device_1.data" in err and "sha256" in err, err


def test_inspect_reads_graphs_only(dirs, capsys):
    inline, ext = dirs
    reports = []
    for out in (inline, ext):
        assert main(["inspect", str(out), "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out)["devices"])
    assert reports[0] == reports[1]  # the same counts, whether the weights are inline or not
    assert all(d["param_and_state_bytes"] > 0 for d in reports[1])
