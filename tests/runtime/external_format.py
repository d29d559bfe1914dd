"""Rewrite a compiled OUTDIR into the external-data output format (a test stand-in).

What compile writes at scale (docs/design/scale-runtime.md): every initializer over
1 KiB of ``device_<r>.onnx`` in ``device_<r>.data`` (offsets 4 KiB aligned), optimizer
states without initializers and ``"init": "zeros"`` in the manifest,
``annotated.onnx`` without parameter or state values and its other large
initializers in ``annotated.data``, and every file hashed in ``manifest["files"]``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import onnx
from onnx import TensorProto, numpy_helper

LIMIT = 1024
ALIGN = 4096


def _externalize(model: onnx.ModelProto, drop: set[str], data: Path) -> bool:
    """Drop initializers named in ``drop``; move the others over LIMIT into ``data``."""
    kept = [t for t in model.graph.initializer if t.name not in drop]
    offset = 0
    with data.open("wb") as f:
        for t in kept:
            raw = numpy_helper.to_array(t).tobytes()
            if len(raw) <= LIMIT:
                continue
            f.seek(offset)
            f.write(raw)
            t.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data"):
                t.ClearField(field)
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", offset), ("length", len(raw))):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            offset = -(-(offset + len(raw)) // ALIGN) * ALIGN
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    if offset == 0:
        data.unlink()
    return offset > 0


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def to_external_format(outdir: Path) -> Path:
    """Rewrite ``outdir`` (written by ``tensoropt compile``) in place; returns it."""
    outdir = Path(outdir)
    manifest = json.loads((outdir / "manifest.json").read_text())
    params = set(manifest["step"]["params"])
    states = set(manifest["step"]["states"])
    files: dict[str, str] = {}
    for entry in manifest["ranks"]:
        path = outdir / entry["file"]
        model = onnx.load(str(path))
        data = outdir / f"{path.stem}.data"
        entry["data"] = data.name if _externalize(model, states, data) else None
        onnx.save(model, str(path))
        entry["sha256"] = files[path.name] = _sha(path)
        if entry["data"]:
            files[data.name] = _sha(data)
    for name in states:
        manifest["inputs"][name]["init"] = "zeros"
    annotated = outdir / "annotated.onnx"
    model = onnx.load(str(annotated))
    if _externalize(model, params | states, outdir / "annotated.data"):
        files["annotated.data"] = _sha(outdir / "annotated.data")
    onnx.save(model, str(annotated))
    files["annotated.onnx"] = _sha(annotated)
    files["plan.json"] = _sha(outdir / "plan.json")
    manifest["files"] = files
    (outdir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return outdir


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Weight bytes embedded in a model proto (inline initializer data)."""
    return sum(
        len(t.raw_data) + 4 * (len(t.float_data) + len(t.int32_data))
        + 8 * (len(t.int64_data) + len(t.double_data))
        for t in model.graph.initializer
    )  # fmt: skip
