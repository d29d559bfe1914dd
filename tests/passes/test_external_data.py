"""Compile writes weights as external data, streamed, one data file per rank.

The output format is docs/design/scale.md. Device graphs are read back with
``onnx.load`` (onnx's own external-data reader, not tensoropt's), every shard is
compared with the block of the source weight that the slicing rule gives, and the
partitioned step is verified against the unpartitioned one through the runtime on
an inline copy of the output (tests/helpers/outdir.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import tensoropt.passes.compile as compile_mod
from tensoropt.ir.external import (
    ALIGN,
    INLINE_MAX_BYTES,
    ArraySource,
    DataFileWriter,
    DigestCache,
    FileSource,
    chunks,
    read_block,
)
from tensoropt.models import build_model
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
from tensoropt.passes.training_step import TrainingOptions
from tensoropt.runtime.manifest import load_outdir
from tensoropt.runtime.run import run_steps
from tests.helpers.compile import compile_model
from tests.helpers.outdir import inline_outdir, read_outdir

SGD = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind.SGD, lr=0.01, momentum=0.9))
ADAM = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind.ADAM, lr=1e-3))


# -- reading blocks and writing data files -----------------------------------------


BLOCKS = [
    ((6, 10), (slice(0, 6), slice(5, 10))),  # a column shard
    ((6, 10), (slice(3, 6), slice(0, 10))),  # a row shard
    ((4, 6, 8), (slice(1, 3), slice(2, 4), slice(4, 8))),
    ((4, 6, 8), (slice(0, 4), slice(0, 6), slice(0, 8))),
    ((7,), (slice(2, 5),)),
    ((), ()),
]


@pytest.mark.parametrize(("shape", "block"), BLOCKS)
@pytest.mark.parametrize("limit", [4, 40, 1 << 20])
def test_chunks_cover_the_block_in_c_order(shape, block, limit):
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    pieces = [
        array.reshape(-1)[:1] if not shape else array[(*index, rows, *rest)].reshape(-1)
        for index, rows, rest in chunks(shape, block, 4, limit)
    ]
    assert np.array_equal(np.concatenate(pieces), array[block].reshape(-1))
    if shape and limit == 4:
        assert len(pieces) > 1  # the small limit really splits


@pytest.mark.parametrize(("shape", "block"), BLOCKS)
def test_file_and_array_sources_read_the_same_block(shape, block, tmp_path):
    array = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    path = tmp_path / "w.data"
    path.write_bytes(bytes(100) + array.tobytes())
    source = FileSource(str(path), 100, np.dtype(np.float32), shape)
    expected = array[block].tobytes()
    assert read_block(source, block, False) == expected
    tensor = numpy_helper.from_array(array, "w")
    from onnx_ir.serde import deserialize_tensor

    assert read_block(ArraySource(deserialize_tensor(tensor)), block, False) == expected


def test_holes_of_a_sparse_source_are_read_as_zeros_and_stay_holes(tmp_path):
    rows = 4 * (1 << 20) // 64  # a [rows, 16] float32 tensor of 4 MiB: a hole, then data
    data = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16) + 1
    data[: rows // 2] = 0
    path = tmp_path / "sparse.data"
    with open(path, "wb") as f:
        f.seek(data[: rows // 2].nbytes)  # the zero half is a hole, never written
        f.write(data[rows // 2 :].tobytes())
    source = FileSource(str(path), 0, np.dtype(np.float32), data.shape)
    block = (slice(0, rows), slice(4, 12))  # a column shard across hole and data
    assert read_block(source, block, False) == data[block].tobytes()
    writer = DataFileWriter(str(tmp_path / "out.data"))
    offset, length = writer.append(source, block, False)
    digest = writer.close()
    written = (tmp_path / "out.data").read_bytes()
    assert written[offset : offset + length] == data[block].tobytes()
    assert digest == hashlib.sha256(written).hexdigest()
    allocated = os.stat(tmp_path / "out.data").st_blocks * 512
    assert allocated <= length // 2 + 2 * ALIGN  # the zero half is a hole in the output


def test_writer_aligns_skips_zero_blocks_and_hashes_the_file(tmp_path):
    path = tmp_path / "d.data"
    ones = np.ones((300,), np.float32)
    zeros = np.zeros((1 << 20,), np.float32)  # 4 MiB of zeros: a hole
    negative_zero = np.full((300,), -0.0, np.float32)  # bytes 0x80000000: not a hole
    writer = DataFileWriter(str(path))
    placed = [
        writer.append(ArraySource(_tensor(a)), (slice(0, a.shape[0]),), False)
        for a in (ones, zeros, negative_zero)
    ]
    placed.append(writer.append(ArraySource(_tensor(ones)), (slice(0, 300),), True))
    digest = writer.close()
    data = path.read_bytes()
    assert [offset % ALIGN for offset, _ in placed] == [0, 0, 0, 0]
    assert len(data) == placed[-1][0] + placed[-1][1]  # ends at the last tensor
    for (offset, length), want in zip(
        placed, [ones, zeros, negative_zero, np.zeros(300, np.float32)], strict=True
    ):
        assert length == want.nbytes
        assert data[offset : offset + length] == want.tobytes()
    assert digest == hashlib.sha256(data).hexdigest()
    assert os.stat(path).st_blocks * 512 < len(data) // 2  # the zero block is a hole


def test_digests_of_files_that_share_a_prefix_equal_their_bytes(tmp_path):
    """Later files reuse hash states of earlier ones while their recipes agree."""
    rng = np.random.default_rng(1)
    a, b, c = (_tensor(rng.standard_normal(n).astype(np.float32)) for n in (500, 700, 900))
    full = lambda t: (slice(0, t.shape[0]),)  # noqa: E731
    recipes = {
        "first": [(a, full(a)), (b, full(b)), (c, full(c))],
        "same": [(a, full(a)), (b, full(b)), (c, full(c))],
        "diverges": [(a, full(a)), (c, full(c)), (b, full(b))],
        "prefix": [(a, full(a)), (b, full(b))],
        "half": [(a, full(a)), (b, (slice(0, 350),))],
        "longer": [(a, full(a)), (b, full(b)), (c, full(c)), (a, full(a))],
    }
    cache = DigestCache()
    for name, recipe in recipes.items():
        writer = DataFileWriter(str(tmp_path / name), cache)
        for tensor, block in recipe:
            writer.append(ArraySource(tensor), block, False)
        digest = writer.close()
        assert digest == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest(), name


@pytest.mark.parametrize("placements", ["S(0)S(0)", "S(0)S(1)", "S(1)P", "PS(1)", "RS(0)", "PP"])
def test_shard_block_is_the_slicing_rule(placements):
    from tensoropt.ir.layout import Layout, parse_placements, slice_for
    from tensoropt.ir.mesh import Mesh
    from tensoropt.passes.partition import shard_block

    mesh = Mesh((2, 2), ("dp", "tp"))
    layout = Layout(parse_placements(placements))
    array = np.arange(8 * 12, dtype=np.float32).reshape(8, 12) + 1
    for coords in mesh.all_coords():
        block, zeros = shard_block(array.shape, layout, mesh, coords)
        piece = np.zeros_like(array[block]) if zeros else array[block]
        assert np.array_equal(piece, slice_for(array, layout, mesh, coords)), coords


def test_writer_without_tensors_makes_no_file(tmp_path):
    writer = DataFileWriter(str(tmp_path / "d.data"))
    assert writer.close() is None
    assert not (tmp_path / "d.data").exists()


def _tensor(array: np.ndarray):
    import onnx_ir as ir

    return ir.tensor(array, name="t")


# -- the output directory ----------------------------------------------------------


def _external_model(tmp_path: Path, name: str = "gpt") -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny zoo model with random weights, saved with every tensor as external data."""
    proto = build_model(name, "tiny")
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    path = tmp_path / f"{name}.onnx"
    onnx.save_model(
        proto, str(path), save_as_external_data=True, location=f"{name}.bin", size_threshold=0
    )
    return path, weights


def _compile_file(path: Path, plan: str, mesh: str, outdir: Path, options=SGD):
    from tensoropt.cli.common import supported_ops
    from tensoropt.ir.importer import ImportOptions, import_model
    from tensoropt.passes.plans import builtin_plan
    from tensoropt.passes.training_step import build_training_step
    from tensoropt.rules.grad import GRAD_RULES
    from tests.helpers.compile import make_mesh

    model = import_model(
        path, ImportOptions(load_weights=False, supported_ops=supported_ops(GRAD_RULES))
    )
    step = build_training_step(model, options)
    built = builtin_plan(plan, step.model.graph, step.signature, make_mesh(mesh, plan))
    return compile_mod.compile_step(step, built.plan, built.data_axes, str(outdir)), step


@pytest.mark.parametrize(("plan", "mesh"), [("megatron", "2x2"), ("data-parallel", "4")])
def test_each_rank_holds_exactly_its_shards_as_external_data(plan, mesh, tmp_path):
    path, weights = _external_model(tmp_path)
    _, step = _compile_file(path, plan, mesh, tmp_path / "out", ADAM)
    out = read_outdir(tmp_path / "out")
    manifest = out.manifest
    states = set(manifest["step"]["states"])
    assert states and all(manifest["inputs"][s]["init"] == "zeros" for s in states)
    for rank, entry in enumerate(manifest["ranks"]):
        assert entry["data"] == f"device_{rank}.data"
        raw = onnx.load(str(tmp_path / "out" / entry["file"]), load_external_data=False)
        inits = {t.name: t for t in raw.graph.initializer}
        assert not states & inits.keys()  # states: graph inputs with no initializer
        assert states <= {i.name for i in raw.graph.input}
        shard_bytes = 0
        for t in raw.graph.initializer:
            size = int(np.prod(t.dims)) * 4
            external = t.data_location == onnx.TensorProto.EXTERNAL
            assert external == (size > INLINE_MAX_BYTES), t.name
            if external:
                e = {x.key: x.value for x in t.external_data}
                assert e["location"] == entry["data"] and int(e["offset"]) % ALIGN == 0
                assert int(e["length"]) == size
                shard_bytes += size
        values = out.initializers(rank)
        for name in manifest["step"]["params"]:
            assert np.array_equal(values[name], weights[name][out.block(name, rank)]), name
        data = tmp_path / "out" / entry["data"]
        assert shard_bytes <= data.stat().st_size < shard_bytes + ALIGN * len(inits)


def test_annotated_holds_no_params_or_states_and_its_other_weights_external(tmp_path):
    path, weights = _external_model(tmp_path)
    options = TrainingOptions(optimizer=ADAM.optimizer, freeze=r"^wte\.")
    _compile_file(path, "megatron", "2", tmp_path / "out", options)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    raw = onnx.load(str(tmp_path / "out" / "annotated.onnx"), load_external_data=False)
    names = {t.name for t in raw.graph.initializer}
    assert not names & {*manifest["step"]["params"], *manifest["step"]["states"]}
    inputs = {i.name for i in raw.graph.input}
    assert {*manifest["step"]["params"], *manifest["step"]["states"]} <= inputs
    frozen = [n for n in weights if n not in manifest["step"]["params"]]
    assert "wte.weight" in frozen and weights["wte.weight"].nbytes > INLINE_MAX_BYTES
    loaded = read_outdir(tmp_path / "out").annotated
    values = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    for name in frozen:
        assert np.array_equal(values[name], weights[name]), name
    for t in raw.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            assert {x.key: x.value for x in t.external_data}["location"] == "annotated.data"
    assert "annotated.data" in manifest["files"]


def test_manifest_hashes_every_file_and_the_reader_checks_them(tmp_path):
    path, _ = _external_model(tmp_path)
    _compile_file(path, "megatron", "2x2", tmp_path / "out")  # ranks 0 and 2 alike
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    listed = set(manifest["files"])
    assert listed == set(os.listdir(out)) - {"manifest.json"}
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    loaded = load_outdir(out)
    assert [r.data for r in loaded.ranks] == [f"device_{r}.data" for r in range(4)]
    assert manifest["files"]["device_0.data"] == manifest["files"]["device_2.data"]
    assert manifest["files"]["device_0.data"] != manifest["files"]["device_1.data"]
    assert {i.name for i in loaded.inputs.values() if i.init is not None} == set(
        manifest["step"]["states"]
    )
    # one flipped byte of a data file is caught
    data = out / "device_1.data"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="device_1.data"):
        load_outdir(out)


def test_the_template_copied_per_rank_holds_no_weight_bytes(tmp_path, monkeypatch):
    path, weights = _external_model(tmp_path)
    largest = max(w.nbytes for w in weights.values())
    seen = []
    real = compile_mod.lower_for_rank

    def spy(template, rank, sink):
        seen.append(max(t.ByteSize() for t in template.proto.graph.initializer))
        return real(template, rank, sink)

    monkeypatch.setattr(compile_mod, "lower_for_rank", spy)
    _compile_file(path, "megatron", "2", tmp_path / "out", ADAM)
    assert len(seen) == 2
    assert max(seen) < INLINE_MAX_BYTES + 256 < largest  # stand-ins and small inline ones


@pytest.mark.parametrize(
    ("name", "plan", "mesh", "options"),
    [
        ("gpt", "megatron", "2x2", SGD),
        ("gpt", "data-parallel", "2", SGD),
        ("mlp", "megatron", "2x2", ADAM),
    ],
)
def test_streamed_output_trains_like_the_single_device_step(name, plan, mesh, options, tmp_path):
    path, _ = _external_model(tmp_path, name)
    _compile_file(path, plan, mesh, tmp_path / "out", options)
    inline = inline_outdir(tmp_path / "out", tmp_path / "inline")
    report = run_steps(inline, 3, "local", verify=True, threads=1).verify
    assert report is not None and len(report.per_step) == 3
    assert report.max_rel_error_loss <= 1e-4, report.to_json()
    assert report.max_rel_error_params <= 1e-4, report.to_json()


def test_in_memory_weights_compile_to_the_same_files_as_external_ones(tmp_path):
    path, _ = _external_model(tmp_path, "mlp")
    _compile_file(path, "megatron", "2", tmp_path / "a")
    compile_model(build_model("mlp", "tiny"), "megatron", "2", tmp_path / "b", SGD)
    data = sorted(f for f in os.listdir(tmp_path / "a") if f.endswith(".data"))
    assert data == sorted(f for f in os.listdir(tmp_path / "b") if f.endswith(".data"))
    assert data == ["device_0.data", "device_1.data"]  # mlp trains every weight
    for name in data:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
