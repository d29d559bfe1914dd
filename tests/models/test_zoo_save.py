"""save_model: atomic files, sparse zero sidecars for paper presets, real sidecars otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

import tensoropt.models.io as zoo_io
from tensoropt.models import ZooError, build_model, save_model, sidecar_path, zoo_info


def _external_entries(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


@pytest.mark.parametrize(
    ("name", "output_shape"),
    [("gpt", (8, 1024, 50304)), ("resnet50", (64, 1000))],
)
def test_paper_preset_saves_sparse_zero_sidecar(
    tmp_path: Path, name: str, output_shape: tuple[int, ...]
) -> None:
    path = tmp_path / f"{name}.onnx"
    model = build_model(name, "paper")
    save_model(model, path)

    data = sidecar_path(path)
    assert data.name == f"{name}.onnx.data"
    info = zoo_info(model)
    assert info is not None and info.weights.value == "external-zeros"
    st = os.stat(data)
    assert st.st_size >= info.weight_bytes > 64 * 2**20
    assert st.st_blocks * 512 < st.st_size // 100, "sidecar must be sparse"
    assert path.stat().st_size < 8 * 2**20

    loaded = onnx.load(str(path), load_external_data=False)
    out_dims = tuple(d.dim_value for d in loaded.graph.output[0].type.tensor_type.shape.dim)
    assert out_dims == output_shape
    ends = []
    for t in loaded.graph.initializer:
        assert t.data_location == TensorProto.EXTERNAL, t.name
        entries = _external_entries(t)
        assert entries["location"] == data.name
        assert int(entries["length"]) == 4 * int(np.prod(t.dims))
        ends.append(int(entries["offset"]) + int(entries["length"]))
    assert max(ends) == st.st_size
    onnx.checker.check_model(str(path), full_check=True)


def test_saving_does_not_change_callers_model(tmp_path: Path) -> None:
    model = build_model("resnet50", "paper")
    before = model.SerializeToString()
    save_model(model, tmp_path / "r.onnx")
    assert model.SerializeToString() == before


def test_small_model_is_one_file_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "gpt.onnx"
    model = build_model("gpt", "tiny")
    save_model(model, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt.onnx"], "no temp files left"
    assert onnx.load(str(path)).SerializeToString() == model.SerializeToString()


def test_large_embedded_weights_go_to_a_real_sidecar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zoo_io, "EXTERNAL_THRESHOLD_BYTES", 1024)
    model = build_model("mlp", "tiny")
    path = tmp_path / "mlp.onnx"
    save_model(model, path)
    assert sidecar_path(path).exists()
    reloaded = onnx.load(str(path))
    for a, b in zip(model.graph.initializer, reloaded.graph.initializer, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    onnx.checker.check_model(str(path), full_check=True)


def test_overwrite_replaces_file(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    save_model(build_model("mlp", "tiny"), path)
    save_model(build_model("gpt", "tiny"), path)
    info = zoo_info(onnx.load(str(path)))
    assert info is not None and info.name == "gpt"


def test_missing_directory_is_a_zoo_error(tmp_path: Path) -> None:
    with pytest.raises(ZooError, match="does not exist"):
        save_model(build_model("mlp", "tiny"), tmp_path / "nope" / "m.onnx")
    with pytest.raises(ZooError, match="is a directory"):
        save_model(build_model("mlp", "tiny"), tmp_path)


def test_foreign_unloaded_external_model_is_refused(tmp_path: Path) -> None:
    """Writing zeros is only safe for zoo planning models, never for someone's real weights."""
    model = build_model("mlp", "tiny")
    del model.metadata_props[:]
    t = model.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "4")):
        t.external_data.add(key=key, value=value)
    with pytest.raises(ZooError, match="not a zoo planning model"):
        save_model(model, tmp_path / "m.onnx")
    assert not any(tmp_path.iterdir())
