"""Per-rank checkpoint shards, written atomically, and resumption.

Layout of a checkpoint directory: one file per rank and saved step,
``rank_<rank>.step_<step>.tensors`` (``step`` = number of completed steps), a
:mod:`tensoropt.runtime.tensorfile`: that rank's local parameter and
optimizer-state shards as raw aligned bytes, after a JSON header that names each
tensor's dtype, shape and offset and holds the metadata (step, loss history, seed,
world size, sha256 of the manifest it was written for). A shard is streamed to a
temp name in the same directory and then ``os.replace``d, so a crash never leaves a
half-written shard under a real name, and no second copy of the state is built in
memory to write it.

Saving is a coordinated point: every rank writes its shard of step s
(:func:`save_shard`), the ranks meet at a barrier, and only then does each drop its
own shards that are not among the newest two steps saved (:func:`prune`). So the
kept shards are always steps every rank completed, even when ranks of a plan
without collectives run apart between checkpoints; a crash can leave rank 0 at step
5 and rank 1 at step 4, and :func:`latest_common_step` resumes from step 4, which
no rank dropped. Resuming needs every rank's shards in one directory reachable from
rank 0's host (a shared filesystem when running over several hosts).
:func:`check_directory` refuses, before a run starts, a directory that a run could
not use without losing or misreading shards.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from tensoropt.errors import TensorOptError
from tensoropt.ir.files import mkstemp_public
from tensoropt.runtime.tensorfile import read_header, read_tensors, write_tensors
from tensoropt.streams import is_stream, open_stream

_NAME = re.compile(r"^rank_(\d+)\.step_(\d+)\.tensors$")
KEEP = 2


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    step: int  # completed steps
    losses: tuple[float, ...]
    seed: int
    world_size: int
    manifest_sha256: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "losses": list(self.losses),
                "seed": self.seed,
                "world_size": self.world_size,
                "manifest_sha256": self.manifest_sha256,
            }
        )

    @staticmethod
    def from_json(text: str) -> CheckpointMeta:
        d = json.loads(text)
        return CheckpointMeta(
            int(d["step"]),
            tuple(float(x) for x in d["losses"]),
            int(d["seed"]),
            int(d["world_size"]),
            str(d["manifest_sha256"]),
        )


def _replace_atomically(path: str | os.PathLike, fill: Callable[[BinaryIO], object]) -> None:
    """Let ``fill`` write ``path`` completely or not at all: a temp file beside it, then
    renamed into place.

    A symlink is followed: the file it points to is replaced (the temp file made beside
    that file) and the link stays. A stream (:func:`tensoropt.streams.is_stream`: a FIFO,
    ``/dev/null``, ``/dev/stdout``) is written through (``tensoropt/streams.py`` says
    why); ``fill`` writes a buffer first, since it may seek."""
    if is_stream(path):
        buffer = io.BytesIO()
        fill(buffer)
        with open_stream(path) as f:
            f.write(buffer.getbuffer())
        return
    target = Path(os.path.realpath(path))
    fd, tmp = mkstemp_public(target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` completely or not at all (:func:`_replace_atomically`)."""
    _replace_atomically(path, lambda f: f.write(data))


def save_npz(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """An .npz of ``arrays``, streamed to a temp file renamed into place (no bytes copy)."""
    _replace_atomically(path, lambda f: np.savez(f, **arrays))


def shard_path(directory: Path, rank: int, step: int) -> Path:
    return directory / f"rank_{rank}.step_{step}.tensors"


def save_shard(
    directory: str | os.PathLike, rank: int, state: Mapping[str, np.ndarray], meta: CheckpointMeta
) -> Path:
    """Write one rank's shard for ``meta.step`` (older shards stay: see :func:`prune`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = shard_path(directory, rank, meta.step)
    write_tensors(path, state, json.loads(meta.to_json()))
    return path


def has_shards(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds any rank's shard."""
    return bool(_steps_of(Path(directory)))


def prune(directory: str | os.PathLike, rank: int, keep: Sequence[int]) -> None:
    """Drop ``rank``'s shards of any step not in ``keep`` (the newest steps every rank
    saved; call it only after every rank has written the newest of them)."""
    directory = Path(directory)
    for old in _steps_of(directory).get(rank, set()) - set(keep):
        shard_path(directory, rank, old).unlink(missing_ok=True)


def _steps_of(directory: Path) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    if not directory.is_dir():
        return found
    for entry in directory.iterdir():
        m = _NAME.match(entry.name)
        if m:
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return found


def latest_common_step(directory: str | os.PathLike, world_size: int) -> int | None:
    """The newest step for which every rank 0..world_size-1 has a shard, or None."""
    found = _steps_of(Path(directory))
    common = set.intersection(*(found.get(r, set()) for r in range(world_size)))
    return max(common) if common else None


def load_shard(
    directory: str | os.PathLike, rank: int, step: int
) -> tuple[dict[str, np.ndarray], CheckpointMeta]:
    """One rank's state and the checkpoint metadata stored with it."""
    path = shard_path(Path(directory), rank, step)
    arrays, meta = read_tensors(path)
    try:
        return arrays, CheckpointMeta.from_json(json.dumps(meta))
    except (KeyError, TypeError, ValueError) as exc:
        raise TensorOptError(f"{path}: checkpoint shard without valid metadata ({exc!r})") from exc


def check_meta(meta: CheckpointMeta, seed: int, world_size: int, manifest_sha: str, where: Path):
    """Refuse to resume from a checkpoint written for another compile, world or seed."""
    if meta.manifest_sha256 != manifest_sha or meta.world_size != world_size:
        raise TensorOptError(
            f"{where}: checkpoint was written for another compiled output (manifest sha256 "
            f"{meta.manifest_sha256[:12]}..., {meta.world_size} ranks); use a fresh "
            "--checkpoint directory or the output directory it came from"
        )
    if meta.seed != seed:
        raise TensorOptError(
            f"{where}: checkpoint was written with --seed {meta.seed}, this run uses "
            f"--seed {seed}; resume with --seed {meta.seed}"
        )


def check_directory(
    directory: str | os.PathLike, world_size: int, manifest_sha: str, resume: bool
) -> int | None:
    """Refuse a checkpoint directory a run could not use safely; the step to resume from.

    Any shard of another compiled output (or world size) is refused: its steps would
    be taken for this run's. Without ``resume``, shards of this output are refused too
    (the run would write over and drop them); with it, shards there must make a step
    every rank saved. A missing or empty directory with ``resume`` starts at step 0 (a
    job that always passes --resume, requeued or not, loses nothing there). Nothing is
    read beyond the shards' headers, nothing is written."""
    directory = Path(directory)
    found = _steps_of(directory)
    for rank in sorted(found):
        for step in sorted(found[rank]):
            path = shard_path(directory, rank, step)
            meta, _ = read_header(path)
            sha, world = meta.get("manifest_sha256"), meta.get("world_size")
            if sha != manifest_sha or world != world_size:
                raise TensorOptError(
                    f"{directory}: holds checkpoints of another compiled output ({path.name}: "
                    f"manifest sha256 {str(sha)[:12]}..., {world} ranks); use a fresh "
                    "--checkpoint directory or the output directory it came from"
                )
    common = latest_common_step(directory, world_size)
    held = "; ".join(
        f"rank {r}: steps {', '.join(map(str, sorted(found[r])))}" for r in sorted(found)
    )
    if not resume and found:
        newest = "" if common is None else f" up to step {common}"
        raise TensorOptError(
            f"{directory}: already holds checkpoints of this output{newest} ({held}); add "
            "--resume to continue from them, or give an empty --checkpoint directory"
        )
    if resume and common is None and found:
        raise TensorOptError(
            f"--resume: {directory} holds no step every one of the {world_size} ranks saved "
            f"({held}); nothing to resume from: to start from step 0, run without --resume "
            "with an empty --checkpoint directory"
        )
    return common
