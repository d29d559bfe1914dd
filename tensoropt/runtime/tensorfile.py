"""A file of named raw tensors with a small JSON header, written and read by streaming.

Checkpoint shards and the MPI job's result use it. Layout:

* 8 bytes: the magic ``b"TOTENS1\\n"``;
* 8 bytes: the header length H (little-endian unsigned);
* H bytes: JSON ``{"meta": {...}, "tensors": [{"name", "dtype", "shape", "offset",
  "nbytes"}, ...]}``;
* each tensor's raw C-order bytes at its ``offset`` from the start of the file,
  offsets aligned to 4 KiB (the layout of the output directory's data files).

Writing goes tensor by tensor from the caller's arrays into a temporary file in the
same directory, which is renamed into place at the end (complete or absent); no
serialized copy of the whole state is ever built in memory. Reading fills one fresh
array per tensor straight from the file. npz would do neither: ``np.savez`` to bytes
copies everything once more, and zip members are not aligned.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tensoropt.errors import TensorOptError
from tensoropt.ir.files import mkstemp_public

MAGIC = b"TOTENS1\n"
ALIGN = 4096
_PREFIX = len(MAGIC) + 8


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> tuple[bytes, list]:
    """The header bytes and each tensor's (offset, array), offsets after the header."""
    entries = []
    for name, array in arrays.items():
        entries.append(
            {
                "name": name,
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "offset": 0,
                "nbytes": int(array.nbytes),
            }
        )
    # Offsets depend on the header's length, which depends on the offsets' digits: lay
    # out against a generous bound of the header instead of iterating.
    draft = json.dumps({"meta": meta, "tensors": entries}).encode()
    start = _aligned(_PREFIX + len(draft) + 32 * len(entries) + 64)
    pos = start
    placed = []
    for entry, array in zip(entries, arrays.values(), strict=True):
        entry["offset"] = pos
        placed.append((pos, array))
        pos = _aligned(pos + entry["nbytes"])
    header = json.dumps({"meta": meta, "tensors": entries}).encode()
    assert _PREFIX + len(header) <= start
    return header, placed


def write_tensors(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], meta: Mapping) -> None:
    """Write ``arrays`` and ``meta`` to ``path`` atomically, one tensor at a time."""
    path = Path(path)
    header, placed = _layout(arrays, dict(meta))
    fd, tmp = mkstemp_public(path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for offset, array in placed:
                f.seek(offset)
                f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
            f.truncate()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_header(path: Path) -> tuple[dict, list[dict]]:
    """The ``meta`` and tensor entries of a tensor file; TensorOptError if malformed."""
    try:
        with path.open("rb") as f:
            prefix = f.read(_PREFIX)
            if len(prefix) != _PREFIX or prefix[: len(MAGIC)] != MAGIC:
                raise ValueError("not a tensoropt tensor file")
            (length,) = struct.unpack("<Q", prefix[len(MAGIC) :])
            doc = json.loads(f.read(length))
        size = path.stat().st_size
        for e in doc["tensors"]:
            if e["offset"] + e["nbytes"] > size:
                raise ValueError(f"tensor {e['name']!r} runs past the end of the file")
            count = int(np.prod(e["shape"], dtype=np.int64))
            if count * np.dtype(e["dtype"]).itemsize != e["nbytes"]:
                raise ValueError(f"tensor {e['name']!r}: shape and dtype disagree with nbytes")
        return dict(doc["meta"]), list(doc["tensors"])
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise TensorOptError(f"{path}: unreadable tensor file ({exc})") from exc


def read_tensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """Every tensor of a tensor file (one fresh array each) and its ``meta``."""
    from tensoropt.runtime.external import read_into

    path = Path(path)
    meta, entries = read_header(path)
    arrays: dict[str, np.ndarray] = {}
    for e in entries:
        array = np.empty(e["shape"], dtype=np.dtype(e["dtype"]))
        if e["nbytes"]:
            read_into(path, e["offset"], memoryview(array.reshape(-1).view(np.uint8)))
        arrays[e["name"]] = array
    return arrays, meta
