"""External tensor data: checking a model's data files, reading slices, writing shards.

The ONNX external-data convention: a ``TensorProto`` with ``data_location =
EXTERNAL`` names a file (``location``, relative to the model's directory) and the
byte range (``offset``, ``length``) that holds its raw little-endian C-order data.

Compile never holds a model's weights in memory. A :class:`TensorSource` says where
one initializer's bytes are (a range of a data file, or a small in-memory tensor);
a :class:`DataFileWriter` copies one block of it (a rank's shard) into a rank's data
file in chunks of at most :data:`CHUNK_BYTES` of source span, each read through its
own ``np.memmap`` that is dropped after the copy. Peak memory is therefore a few
chunks, whatever the size of the model. Blocks that are all zero bytes (the zoo's
planning-size weights, Partial shards off coordinate 0) are skipped with a seek, so
the data file stays sparse.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from tensoropt.errors import ModelLoadError

ALIGN = 4096
"""Every tensor in a data file starts at a multiple of this (a page: mmap-friendly)."""

INLINE_MAX_BYTES = 1024
"""Initializers up to this size stay inside the ONNX file; larger ones are external."""

CHUNK_BYTES = 32 << 20
"""Largest source byte span read (mapped) at once while copying a shard."""

HOLE_BYTES = 1 << 20
"""Granularity of zero detection: an all-zero run of this many bytes is not written."""

_ZEROS = bytes(HOLE_BYTES)

Block = tuple[slice, ...]
Reader = Callable[[tuple[int, ...], slice, Block], np.ndarray | None]
"""Reads one piece (see :func:`chunks`) of a source; None for a piece of zero bytes."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ------------------------------------------------------------------ locations


def resolve_location(location: str, base_dir: str, tensor: str) -> str:
    """The absolute path of an external-data ``location``; refuses one outside ``base_dir``.

    A location must be a relative path inside the model's directory: absolute
    paths, ``..`` components and symlinks that lead out of the directory are refused
    (a model file must not make tensoropt read arbitrary files).
    """
    where = f"tensor {tensor!r}: external data location {location!r}"
    fix = "move the data file next to the model and give its plain file name"
    if not location:
        raise ModelLoadError(f"{where} is empty; {fix}")
    parts = location.replace("\\", "/").split("/")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in parts[0]:
        raise ModelLoadError(f"{where} is an absolute path; {fix}")
    if ".." in parts:
        raise ModelLoadError(f"{where} leaves the model's directory ('..'); {fix}")
    base = os.path.realpath(base_dir)
    path = os.path.join(base, *parts)
    real = os.path.realpath(path)
    if real != base and not real.startswith(base + os.sep):
        raise ModelLoadError(f"{where} is a link that leads outside the model's directory; {fix}")
    return path


def external_entries(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the main graph that keeps its data in an external file."""
    graph = model.graph
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and (
                attr.t.data_location == onnx.TensorProto.EXTERNAL
            ):
                yield attr.t


def check_locations(model: onnx.ModelProto, base_dir: str) -> None:
    """Refuse external-data locations outside ``base_dir`` (see :func:`resolve_location`)."""
    for tensor in external_tensors(model):
        resolve_location(external_entries(tensor).get("location", ""), base_dir, tensor.name)


def check_extent(
    path: str, tensor: str, offset: int, length: int | None, nbytes: int, per_tensor: bool
) -> None:
    """Refuse a missing data file, a truncated one, or a size that disagrees with the tensor.

    ``per_tensor``: the entry names no offset and no length, so the whole file is
    the tensor and its size must equal the tensor's size exactly.
    """
    where = f"{path}: external data of tensor {tensor!r}"
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"{where}: no such file; keep the model's data file next to it (or re-save "
            "the model with its weights)"
        )
    if length is not None and length != nbytes:
        raise ModelLoadError(
            f"{where}: the model says {length} bytes but the tensor's shape and dtype need "
            f"{nbytes}; the model and its data file do not match: re-export the model"
        )
    size = os.path.getsize(path)
    if per_tensor and size != nbytes:
        raise ModelLoadError(
            f"{where}: the file has {size} bytes but the tensor needs {nbytes}; the model and "
            "its data file do not match: re-export the model"
        )
    if size < offset + nbytes:
        raise ModelLoadError(
            f"{where}: the file has {size} bytes but the tensor needs bytes {offset}.."
            f"{offset + nbytes}; the data file is truncated: copy or export it again"
        )


def check_extents(model: onnx.ModelProto, base_dir: str) -> None:
    """:func:`check_extent` for every external tensor of ``model`` (before onnx reads them)."""
    for tensor in external_tensors(model):
        entries = external_entries(tensor)
        path = resolve_location(entries.get("location", ""), base_dir, tensor.name)
        dtype = ir.DataType(tensor.data_type)
        nbytes = math.ceil(math.prod(tensor.dims) * dtype.bitwidth / 8)
        length = entries.get("length")
        check_extent(
            path,
            tensor.name,
            int(entries.get("offset", 0)),
            None if length is None else int(length),
            nbytes,
            "offset" not in entries and length is None,
        )


# ------------------------------------------------------------------ sources


@dataclass(frozen=True, slots=True)
class FileSource:
    """A tensor stored in a byte range of a data file (read by memmap, never whole)."""

    path: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def piece(self, index: tuple[int, ...], rows: slice, rest: Block) -> np.ndarray | None:
        """``tensor[index + (rows,) + rest]`` read through a mapping of its span only.

        None when the span is a hole of a sparse file (all zeros, nothing read)."""
        d = len(index)
        row = self.dtype.itemsize * math.prod(self.shape[d + 1 :])
        start = self.offset + _flat(index, self.shape) * self.dtype.itemsize + rows.start * row
        count = rows.stop - rows.start
        if _is_hole(self.path, start, start + count * row):
            return None
        # A mapping of this piece's span only; it is unmapped (its pages leave the
        # resident set) as soon as the caller drops the returned array.
        mapped = np.memmap(
            self.path, self.dtype, "r", offset=start, shape=(count, *self.shape[d + 1 :])
        )
        return np.ascontiguousarray(mapped[(slice(None), *rest)])

    def reader(self) -> Reader:
        return self.piece


@dataclass(frozen=True, slots=True)
class ArraySource:
    """A tensor held in memory (inline in the model, or made by a pass)."""

    tensor: ir.TensorProtocol

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape.numpy())

    @property
    def dtype(self) -> np.dtype:
        return self.tensor.dtype.numpy()

    def reader(self) -> Reader:
        array = self.tensor.numpy()  # once per block: a proto tensor decodes on each call

        def piece(index: tuple[int, ...], rows: slice, rest: Block) -> np.ndarray:
            if array.ndim == 0:
                return array.reshape(1)
            return np.ascontiguousarray(array[(*index, rows, *rest)])

        return piece


TensorSource = FileSource | ArraySource


def source_of(tensor: ir.TensorProtocol) -> TensorSource:
    """Where ``tensor``'s bytes are; external data is checked (exists, size) here."""
    name = tensor.name or "?"
    dtype = tensor.dtype
    if dtype.bitwidth % 8:
        raise ModelLoadError(
            f"tensor {name!r}: {dtype.name} packs several values per byte, which tensoropt "
            "cannot split; convert the model to 8-bit or wider types"
        )
    if not isinstance(tensor, ir.ExternalTensor):
        return ArraySource(tensor)
    if not tensor.base_dir:
        raise ModelLoadError(
            f"tensor {name!r}: external data {tensor.location!r} has no base directory; "
            "import the model from its file"
        )
    location = os.fspath(tensor.location)
    path = resolve_location(location, os.fspath(tensor.base_dir), name)
    offset = tensor.offset or 0
    check_extent(
        path,
        name,
        offset,
        tensor.length,
        tensor.nbytes,
        tensor.offset is None and tensor.length is None,
    )
    return FileSource(path, offset, dtype.numpy(), tuple(tensor.shape.numpy()))


# ------------------------------------------------------------------ blocks and chunks


def _flat(index: tuple[int, ...], shape: Sequence[int]) -> int:
    flat = 0
    for i, k in enumerate(index):
        flat = flat * shape[i] + k
    return flat * math.prod(shape[len(index) :])


def block_nbytes(block: Block, dtype: np.dtype) -> int:
    return dtype.itemsize * math.prod(s.stop - s.start for s in block)


def chunks(
    shape: Sequence[int], block: Block, itemsize: int, limit: int = CHUNK_BYTES
) -> Iterator[tuple[tuple[int, ...], slice, Block]]:
    """Split ``block`` into pieces whose source span is at most ``limit`` bytes.

    Yields ``(index, rows, rest)``: fixed leading indices, a range of the next dim,
    and the block's ranges of the remaining dims. Pieces come in C order of the
    block, so writing them one after the other writes the block in C order.
    """
    if not shape:
        yield (), slice(0, 1), ()  # a scalar: read as one row of a 1-element view
        return
    d = 0
    while itemsize * math.prod(shape[d + 1 :]) > limit:
        d += 1
    row = itemsize * math.prod(shape[d + 1 :])
    step = max(1, limit // max(row, 1))
    lead = [range(s.start, s.stop) for s in block[:d]]
    for index in np.ndindex(*(len(r) for r in lead)) if lead else [()]:
        fixed = tuple(lead[i][k] for i, k in enumerate(index))
        lo, hi = block[d].start, block[d].stop
        for a in range(lo, hi, step):
            yield fixed, slice(a, min(a + step, hi)), block[d + 1 :]


def _is_hole(path: str, start: int, stop: int) -> bool:
    """Whether bytes start..stop of ``path`` are an unallocated hole (read as zeros)."""
    if stop <= start:
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        data = os.lseek(fd, start, os.SEEK_DATA)
    except OSError as exc:
        return exc.errno == errno.ENXIO  # no data at or after start
    finally:
        os.close(fd)
    return data >= stop


# ------------------------------------------------------------------ writing


def source_key(source: TensorSource) -> tuple:
    """Equal for two sources whose bytes are the same object (file range or tensor)."""
    if isinstance(source, FileSource):
        return ("file", source.path, source.offset, source.dtype.str, source.shape)
    return ("array", id(source.tensor))


@dataclass(frozen=True, slots=True)
class _Written:
    """A finished data file: what was appended, and the sha256 state after each append."""

    recipe: tuple[tuple, ...]
    states: tuple[object, ...]


class DigestCache:
    """The data files of one output directory, so that identical bytes are hashed once.

    A data file's bytes follow from its recipe, the (source, block, zeros) of each
    append in order (offsets follow from the sizes). Replicated weights make many
    ranks' files identical, or identical up to some tensor; a writer whose recipe
    so far is a prefix of an earlier file's recipe takes that file's saved hash
    state instead of hashing the same bytes again.
    """

    def __init__(self) -> None:
        self.files: list[_Written] = []


class DataFileWriter:
    """One external data file, written front to back; sha256 computed while writing.

    Tensors start at :data:`ALIGN`-aligned offsets; the gaps and all-zero chunks are
    holes (never written). The file is created on the first tensor, so a rank without
    external tensors has none.
    """

    def __init__(self, path: str, cache: DigestCache | None = None) -> None:
        self.path = path
        self.location = os.path.basename(path)
        self._fd: int | None = None
        self._end = 0
        self._cache = cache
        self._recipe: list[tuple] = []
        self._states: list[object] = []
        # Earlier files whose recipe starts like this one's; while any is left the
        # bytes so far equal theirs and hashing is deferred to their saved states.
        self._same: list[_Written] = list(cache.files) if cache is not None else []
        self._hash: hashlib._Hash | None = None if self._same else hashlib.sha256()

    def append(self, source: TensorSource, block: Block, zeros: bool) -> tuple[int, int]:
        """Write ``source[block]`` (or zeros of its shape); returns (offset, length)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._follow((source_key(source), block, zeros))
        offset = align(self._end)
        self._hash_zeros(offset - self._end)
        position = offset
        dtype = source.dtype
        length = block_nbytes(block, dtype)
        if zeros:
            self._hash_zeros(length)
            position += length
        else:
            read = source.reader()
            for index, rows, rest in chunks(source.shape, block, dtype.itemsize):
                piece = read(index, rows, rest)
                if piece is None:  # a hole of the source: a hole here too
                    size = block_nbytes((rows, *rest), dtype)
                    self._hash_zeros(size)
                    position += size
                    continue
                data = memoryview(piece.reshape(-1).view(np.uint8))
                for start in range(0, len(data), HOLE_BYTES):
                    part = data[start : start + HOLE_BYTES]
                    if any_nonzero(part):
                        _pwrite_all(self._fd, part, position)
                        if self._hash is not None:
                            self._hash.update(part)
                    else:
                        self._hash_zeros(len(part))
                    position += len(part)
        if position != offset + length:
            raise AssertionError(f"{self.path}: wrote {position - offset} of {length} bytes")
        self._end = position
        step = len(self._recipe) - 1
        self._states.append(self._same[0].states[step] if self._hash is None else self._hash.copy())
        return offset, length

    def _follow(self, key: tuple) -> None:
        """Add ``key`` to the recipe; start hashing where it leaves every earlier file's."""
        step = len(self._recipe)
        self._recipe.append(key)
        if self._hash is not None:
            return
        same = [f for f in self._same if len(f.recipe) > step and f.recipe[step] == key]
        if not same:
            self._hash = self._states[-1].copy() if self._states else hashlib.sha256()
        self._same = same

    def _hash_zeros(self, n: int) -> None:
        if self._hash is None:
            return
        zeros = memoryview(_ZEROS)
        while n > 0:
            k = min(n, len(zeros))
            self._hash.update(zeros[:k])
            n -= k

    def close(self) -> str | None:
        """Finish the file (trailing holes included); its sha256, or None if never created."""
        if self._fd is None:
            return None
        try:
            os.ftruncate(self._fd, self._end)
        finally:
            os.close(self._fd)
            self._fd = None
        if self._cache is not None:
            self._cache.files.append(_Written(tuple(self._recipe), tuple(self._states)))
        final = self._states[-1]
        return final.hexdigest()  # type: ignore[attr-defined]

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def any_nonzero(data: memoryview) -> bool:
    """Whether any byte is non-zero (bytes, not values: -0.0 is not a hole)."""
    return bool(np.frombuffer(data, np.uint8).any())


def _pwrite_all(fd: int, data: memoryview, position: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, position)
        data = data[n:]
        position += n


def set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make ``tensor`` an external-data reference (no bytes in the proto)."""
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
        tensor.ClearField(field)
    for field in ("uint64_data", "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key = key
        entry.value = str(value)


def set_inline(tensor: onnx.TensorProto, data: bytes) -> None:
    """Make ``tensor`` hold ``data`` as its raw bytes inside the proto."""
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = data


def read_block(source: TensorSource, block: Block, zeros: bool) -> bytes:
    """The raw C-order bytes of ``source[block]`` (zeros of its size if ``zeros``)."""
    if zeros:
        return bytes(block_nbytes(block, source.dtype))
    read = source.reader()
    parts = []
    for index, rows, rest in chunks(source.shape, block, source.dtype.itemsize):
        piece = read(index, rows, rest)
        if piece is None:
            parts.append(bytes(block_nbytes((rows, *rest), source.dtype)))
        else:
            parts.append(piece.reshape(-1).view(np.uint8).tobytes())
    return b"".join(parts)
