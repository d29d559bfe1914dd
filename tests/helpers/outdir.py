"""Read a compiled output directory with plain onnx, independently of tensoropt's runtime.

:func:`read_outdir` loads every device graph with ``onnx.load`` (onnx's own external
data reader). :func:`inline_outdir` writes a copy in which every tensor is inside
its ONNX file, optimizer states have zero initializers and the reference step has
its parameters (assembled from the ranks' shards), so that a runtime that reads
initial values from initializers can run and verify it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from tensoropt.runtime.manifest import block_of


@dataclass(frozen=True, slots=True)
class Outdir:
    manifest: dict
    devices: list[onnx.ModelProto]  # external data loaded
    annotated: onnx.ModelProto  # external data loaded

    def initializers(self, rank: int) -> dict[str, np.ndarray]:
        return {t.name: numpy_helper.to_array(t) for t in self.devices[rank].graph.initializer}

    def block(self, name: str, rank: int) -> tuple[slice, ...]:
        entry = self.manifest["inputs"][name]
        mesh = self.manifest["mesh"]["shape"]
        coords = self.manifest["ranks"][rank]["coords"]
        return block_of(entry["global_shape"], entry["placements"], mesh, coords)

    def assembled(self, name: str) -> np.ndarray:
        """The global value of parameter ``name`` from the ranks' initial shards."""
        entry = self.manifest["inputs"][name]
        full = np.empty(entry["global_shape"], dtype=entry["dtype"])
        for rank in range(self.manifest["world_size"]):
            full[self.block(name, rank)] = self.initializers(rank)[name]
        return full


def read_outdir(outdir: Path) -> Outdir:
    manifest = json.loads((outdir / "manifest.json").read_text())
    devices = [onnx.load(str(outdir / r["file"])) for r in manifest["ranks"]]
    return Outdir(manifest, devices, onnx.load(str(outdir / "annotated.onnx")))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _zeros(graph: onnx.GraphProto, name: str) -> onnx.TensorProto:
    value = next(v for v in graph.input if v.name == name)
    ttype = value.type.tensor_type
    shape = [d.dim_value for d in ttype.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type)
    return numpy_helper.from_array(np.zeros(shape, dtype), name)


def inline_outdir(outdir: Path, target: Path) -> Path:
    """Write the inline form of ``outdir`` to ``target`` (see module doc)."""
    read = read_outdir(outdir)
    manifest = json.loads(json.dumps(read.manifest))
    states = [n for n, e in manifest["inputs"].items() if e.get("init") == "zeros"]
    params = list(manifest["step"]["params"])
    target.mkdir()
    files = {}
    for entry, proto in zip(manifest["ranks"], read.devices, strict=True):
        proto.graph.initializer.extend(_zeros(proto.graph, n) for n in states)
        onnx.save(proto, str(target / entry["file"]))
        entry.pop("data", None)
        entry["sha256"] = files[entry["file"]] = _sha256(target / entry["file"])
    annotated = read.annotated
    annotated.graph.initializer.extend(
        numpy_helper.from_array(read.assembled(n), n) for n in params
    )
    annotated.graph.initializer.extend(_zeros(annotated.graph, n) for n in states)
    onnx.save(annotated, str(target / "annotated.onnx"))
    files["annotated.onnx"] = _sha256(target / "annotated.onnx")
    (target / "plan.json").write_bytes((outdir / "plan.json").read_bytes())
    files["plan.json"] = _sha256(target / "plan.json")
    for entry in manifest["inputs"].values():
        entry.pop("init", None)
    manifest["files"] = files
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return target
