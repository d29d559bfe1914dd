"""Output-directory checks and the slicing rule."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensoropt.errors import OutputDirError
from tensoropt.runtime.manifest import InputInfo, InputKind, Manifest, assemble, load_outdir, shard
from tests.helpers.handbuilt import mlp_case, write_outdir


@pytest.fixture
def outdir(tmp_path):
    return write_outdir(mlp_case(dp=2, tp=1), tmp_path / "out")


@pytest.mark.parametrize("victim", ["device_1.onnx", "annotated.onnx", "plan.json"])
def test_tampered_file_is_named(outdir, victim):
    with (outdir / victim).open("ab") as f:
        f.write(b"\0")
    with pytest.raises(OutputDirError, match=rf"{victim}: sha256 .* recompile"):
        load_outdir(outdir)


def test_missing_file_is_named(outdir):
    (outdir / "device_0.onnx").unlink()
    with pytest.raises(OutputDirError, match=r"device_0.onnx: listed in manifest.json but missing"):
        load_outdir(outdir)


def test_missing_or_bad_manifest(tmp_path, outdir):
    with pytest.raises(OutputDirError, match="no manifest.json"):
        load_outdir(tmp_path)
    raw = json.loads((outdir / "manifest.json").read_text())
    raw["schema"] = "something/9"
    (outdir / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(OutputDirError, match="malformed manifest"):
        load_outdir(outdir)


def _manifest(mesh: tuple[int, ...]) -> Manifest:
    coords = list(np.ndindex(*mesh))
    from tensoropt.runtime.manifest import RankInfo

    ranks = tuple(RankInfo(i, tuple(c), f"d{i}", "") for i, c in enumerate(coords))
    return Manifest(None, len(coords), mesh, (), ranks, {}, {}, "")  # type: ignore[arg-type]


@st.composite
def layouts(draw):
    mesh = tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3)))
    rank = draw(st.integers(1, 3))
    placements = []
    shape = [draw(st.sampled_from([1, 2, 5])) for _ in range(rank)]
    for m in mesh:
        p = draw(st.sampled_from(["R", *[f"S({d})" for d in range(rank)]]))
        if p != "R":
            shape[int(p[2])] *= m
        placements.append(p)
    return mesh, tuple(shape), tuple(placements)


@given(layouts())
def test_shard_then_assemble_is_identity(layout):
    mesh, shape, placements = layout
    manifest = _manifest(mesh)
    info = InputInfo("w", InputKind.PARAM, shape, "float32", placements)
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    pieces = {r: shard(full, info, manifest, r) for r in range(manifest.world_size)}
    np.testing.assert_array_equal(assemble(pieces, info, manifest), full)
    # each piece is 1/k of the array, k = product of the mesh sizes that shard it
    k = int(np.prod([m for m, p in zip(mesh, placements, strict=True) if p != "R"]))
    assert all(p.size * k == full.size for p in pieces.values())


def test_nested_split_follows_mesh_axis_order():
    # S(0) on both axes of a (2, 2) mesh: axis 0 halves dim 0, axis 1 halves that half.
    manifest = _manifest((2, 2))
    info = InputInfo("w", InputKind.PARAM, (8,), "float32", ("S(0)", "S(0)"))
    full = np.arange(8)
    assert [shard(full, info, manifest, r).tolist() for r in range(4)] == [
        [0, 1], [2, 3], [4, 5], [6, 7]
    ]  # fmt: skip
