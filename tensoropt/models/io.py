"""Writing zoo models to disk: atomic files, sparse zero sidecars for planning-size weights.

A ``paper`` preset has gigabytes of weights that exist only so the planner sees the
right shapes. Its initializers are external-data stubs; :func:`save_model` gives them
one sidecar ``<file>.data`` made with ``truncate``, a sparse file of zeros that takes
(almost) no disk blocks and no memory. Every file is written to a temporary name in
the target directory and renamed into place, so a crash never leaves half a model.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import TensorProto, external_data_helper

from tensoropt.models._builder import (
    EXTERNAL_THRESHOLD_BYTES,
    ZOO_METADATA_KEY,
    WeightStorage,
)
from tensoropt.models.config import ZooError
from tensoropt.streams import is_stream, open_stream


@dataclass(frozen=True, slots=True)
class ZooInfo:
    """What a zoo model says about itself (model.metadata_props ``tensoropt.zoo``)."""

    name: str
    preset: str
    task: str
    params: int
    weight_bytes: int
    weights: WeightStorage
    raw: str
    """The full JSON text (inputs, labels, outputs, config, frozen initializers)."""


def zoo_info(model: onnx.ModelProto) -> ZooInfo | None:
    """The zoo metadata of `model`, or None when it was not built by the zoo."""
    props = {p.key: p.value for p in model.metadata_props}
    raw = props.get(ZOO_METADATA_KEY)
    if raw is None:
        return None
    meta = json.loads(raw)
    return ZooInfo(
        name=meta["name"],
        preset=meta["preset"],
        task=meta["task"],
        params=int(meta["params"]),
        weight_bytes=int(meta["weight_bytes"]),
        weights=WeightStorage(meta["weights"]),
        raw=raw,
    )


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """Where :func:`save_model` puts external weights for the model file `path`."""
    p = Path(path)
    return p.with_name(p.name + ".data")


def save_model(model: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    """Write `model` to `path` atomically; large weights go to one sidecar ``<path>.data``.

    - Zoo models built with zero external stubs get a *sparse* sidecar of zeros.
    - Other models with more than 64 MiB of embedded weights get a real sidecar.
    - Everything else is written as one self-contained file.
    The caller's proto is not modified.
    """
    target = Path(path)
    if target.is_symlink() and not is_stream(target):
        # the file the link points to is replaced and the link stays; the sidecar goes
        # beside that file, where the model's relative reference to it looks
        target = Path(os.path.realpath(target))
    _check_directory(target)
    external = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    if external:
        _save_sparse(model, target)
        return
    embedded = sum(len(t.raw_data) for t in model.graph.initializer)
    if embedded > EXTERNAL_THRESHOLD_BYTES:
        _save_real_sidecar(model, target)
        return
    data = model.SerializeToString()
    _atomic_write(target, lambda f: f.write(data))


def _check_directory(target: Path) -> None:
    parent = target.parent if str(target.parent) else Path(".")
    if target.name in ("", ".", ".."):
        raise ZooError(f"cannot write model to {str(target)!r}: give a file name such as gpt.onnx")
    if not parent.is_dir():
        raise ZooError(
            f"cannot write model to {target}: directory {parent} does not exist; "
            "create it first or choose another -o path"
        )
    if target.is_dir():
        raise ZooError(f"cannot write model to {target}: it is a directory; give a file name")


def _save_sparse(model: onnx.ModelProto, target: Path) -> None:
    info = zoo_info(model)
    if info is None or info.weights is not WeightStorage.EXTERNAL_ZEROS:
        raise ZooError(
            f"cannot save to {target}: the model has external-data initializers that were not "
            "loaded and it is not a zoo planning model, so writing zeros would lose weights; "
            "load it with load_external_data=True first"
        )
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    sidecar = sidecar_path(target)
    end = 0
    for tensor in copy.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        entries = {e.key: e for e in tensor.external_data}
        entries["location"].value = sidecar.name
        end = max(end, int(entries["offset"].value) + int(entries["length"].value))
    _atomic_write(sidecar, lambda f: f.truncate(end))
    data = copy.SerializeToString()
    _atomic_write(target, lambda f: f.write(data))


def _save_real_sidecar(model: onnx.ModelProto, target: Path) -> None:
    """Embedded weights too large for one file: move them into ``<path>.data``, bytes kept."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    sidecar = sidecar_path(target)
    offset = 0

    def write_weights(f: BinaryIO) -> None:
        nonlocal offset
        for tensor in copy.graph.initializer:
            if not tensor.HasField("raw_data"):
                continue
            raw = tensor.raw_data
            external_data_helper.set_external_data(
                tensor, sidecar.name, offset=offset, length=len(raw)
            )
            f.write(raw)
            offset += len(raw)
            tensor.ClearField("raw_data")

    _atomic_write(sidecar, write_weights)
    data = copy.SerializeToString()
    _atomic_write(target, lambda f: f.write(data))


def _atomic_write(target: Path, fill: Callable[[BinaryIO], object]) -> None:
    """Create a temp file beside `target`, let `fill` write it, then rename it into place.

    A stream (:func:`tensoropt.streams.is_stream`: a FIFO, a device, ``/dev/stdout``) is
    written through instead (``tensoropt/streams.py`` says why)."""
    if is_stream(target):
        try:
            with open_stream(target) as f:
                fill(f)
        except OSError as exc:
            raise ZooError(f"cannot write {target}: {exc.strerror}") from None
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise ZooError(f"cannot write {target}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ZooError(f"cannot write {target}: {exc.strerror}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
