"""Graphs whose weights live in external data: load the graph, read tensors in place.

A compiled output directory keeps every initializer of more than 1 KiB of a graph
in one data file next to it (ONNX external data: ``location``, ``offset``,
``length``; see docs/design/scale-runtime.md). The runtime never parses weight
bytes through protobuf: :func:`load_graph` reads the graph without them, and
:func:`read_initializer` reads one tensor straight from its data file into one
numpy array (the only copy the process makes). Locations must be plain file names
inside the graph's directory, like every name in the manifest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tensoropt.errors import OutputDirError
from tensoropt.runtime.manifest import plain_name

# Tensors above this size are shared by the segments of a rank rather than copied into
# each segment proto (the output-directory format puts the same ones in external data).
INLINE_LIMIT = 1024


@dataclass(frozen=True, slots=True)
class ExternalRef:
    """Where an initializer's bytes are: ``length`` bytes at ``offset`` of ``location``."""

    location: str
    offset: int
    length: int | None


def external_ref(tensor: TensorProto) -> ExternalRef | None:
    """The external-data entry of ``tensor``; None when its bytes are inline."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    entries = {e.key: e.value for e in tensor.external_data}
    length = entries.get("length")
    return ExternalRef(
        entries.get("location", ""),
        int(entries.get("offset", 0)),
        None if length is None else int(length),
    )


def tensor_nbytes(tensor: TensorProto) -> int:
    """Bytes of ``tensor``'s values, from its type and shape alone."""
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return int(np.prod(tensor.dims, dtype=np.int64)) * dtype.itemsize


def load_graph(path: Path) -> onnx.ModelProto:
    """The ONNX model at ``path`` without its external weight bytes; locations checked."""
    try:
        model = onnx.load(os.fspath(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ...
        raise OutputDirError(f"{path}: cannot load ({exc}); recompile the model") from exc
    for tensor in model.graph.initializer:
        ref = external_ref(tensor)
        if ref is not None:
            plain_name(ref.location, f"{path}: initializer {tensor.name!r}")
    return model


def read_initializer(tensor: TensorProto, base: Path) -> np.ndarray:
    """``tensor``'s value: inline, or read from its data file in ``base`` (one copy)."""
    ref = external_ref(tensor)
    if ref is None:
        return numpy_helper.to_array(tensor)
    plain_name(ref.location, f"initializer {tensor.name!r}")
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    shape = tuple(int(d) for d in tensor.dims)
    nbytes = tensor_nbytes(tensor)
    path = base / ref.location
    if ref.length is not None and ref.length != nbytes:
        raise OutputDirError(
            f"{path}: initializer {tensor.name!r} says {ref.length} bytes, its shape "
            f"{list(shape)} {dtype.name} needs {nbytes}; recompile the model"
        )
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise OutputDirError(
            f"{path}: cannot read the data of initializer {tensor.name!r} ({exc.strerror}); "
            "recompile the model"
        ) from None
    if ref.offset + nbytes > size:
        raise OutputDirError(
            f"{path}: initializer {tensor.name!r} needs bytes {ref.offset}..{ref.offset + nbytes} "
            f"but the file has {size}; recompile the model"
        )
    array = np.empty(shape, dtype=dtype)
    read_into(path, ref.offset, memoryview(array.reshape(-1).view(np.uint8)))
    return array


def read_into(path: Path, offset: int, buffer: memoryview, chunk: int = 1 << 28) -> None:
    """Fill ``buffer`` with the bytes of ``path`` from ``offset`` (in chunks: one read
    call moves at most about 2 GiB on Linux)."""
    with path.open("rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(buffer):
            got = f.readinto(buffer[done : done + chunk])
            if not got:
                raise OutputDirError(f"{path}: ends early at byte {offset + done}")
            done += got


def initializers(model: onnx.ModelProto) -> dict[str, TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def is_shared(tensor: TensorProto) -> bool:
    """Is ``tensor`` kept once per rank and shared by segments (external or > 1 KiB)?"""
    return external_ref(tensor) is not None or tensor_nbytes(tensor) > INLINE_LIMIT
