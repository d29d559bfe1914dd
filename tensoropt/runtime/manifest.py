"""Read and check a compiled output directory; slice and reassemble by placements.

See docs/design/CONTRACTS.md, "Output directory". :func:`load_outdir` checks the
sha256 of every file the manifest lists before anything runs, so a stale or
edited graph is refused with a message that names the file.

Slicing rule (CONTRACTS.md): for a value of global shape G and the rank at mesh
coordinates c, for each mesh axis i in order whose placement is ``S(d)``, split
dim d of the already-sliced array into mesh.shape[i] equal pieces and keep piece
c[i]. Each rank's piece is therefore one contiguous block; :func:`block_of`
computes it, and :func:`shard` / :func:`assemble` use the same block both ways.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tensoropt.errors import OutputDirError
from tensoropt.passes.micro import MicroCut

MANIFEST_SCHEMA = "tensoropt.manifest/1"
_RECOMPILE = "recompile it with `tensoropt compile`"


class InputKind(enum.Enum):
    DATA = "data"
    LABELS = "labels"
    PARAM = "param"
    STATE = "state"


class InputInit(enum.Enum):
    """How an input without an initializer starts (manifest input ``"init"``)."""

    ZEROS = "zeros"  # zeros of the rank's local shape (optimizer states)


@dataclass(frozen=True, slots=True)
class InputInfo:
    """One entry of manifest["inputs"]: a graph input of every device graph."""

    name: str
    kind: InputKind
    global_shape: tuple[int, ...]
    dtype: str
    placements: tuple[str, ...]
    high: int | None = None  # exclusive upper bound for synthetic integer data
    init: InputInit | None = None  # set: no initializer in the device graphs
    micro_dim: int | None = None  # the dim of the rank's piece split into micro-batches


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    coords: tuple[int, ...]
    file: str
    sha256: str
    data: str | None = None  # the external data file of ``file`` (None: all inline)
    stage: int = 0  # pipelined steps: the rank's pipeline stage
    # pipelined steps: the inputs and outputs of the rank's graph (None: every input and
    # output the manifest describes)
    inputs: tuple[str, ...] | None = None
    outputs: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Manifest:
    """The parsed manifest of an output directory."""

    outdir: Path
    world_size: int
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    ranks: tuple[RankInfo, ...]
    step: Mapping[str, Any]
    inputs: Mapping[str, InputInfo]
    sha256: str  # of manifest.json itself (ties checkpoints to this compile)
    micro: MicroCut | None = None  # micro-batched steps: the phase cut (passes.micro)
    # pipelined steps: stages, schedule, micro_batches, ranks_per_stage, starts
    pipeline: Mapping[str, Any] | None = None

    def inputs_of(self, *kinds: InputKind) -> list[InputInfo]:
        return [info for info in self.inputs.values() if info.kind in kinds]

    def holds(self, rank: int, name: str) -> bool:
        """True when ``rank``'s graph has the input ``name`` (pipeline stages hold their
        own parameters; every other rank holds every input)."""
        names = self.ranks[rank].inputs
        return names is None or name in names

    @property
    def carry(self) -> dict[str, str]:
        return dict(self.step.get("carry", {}))

    def carry_of(self, rank: int) -> dict[str, str]:
        """The outputs of ``rank``'s graph that become its next step's inputs."""
        outputs = self.ranks[rank].outputs
        return {o: i for o, i in self.carry.items() if outputs is None or o in outputs}

    @property
    def loss_rank(self) -> int:
        """The first rank whose graph computes the loss (of the last pipeline stage)."""
        if self.pipeline is None:
            return 0
        return (int(self.pipeline["stages"]) - 1) * int(self.pipeline["ranks_per_stage"])

    @property
    def loss_name(self) -> str:
        return str(self.step.get("loss", "loss"))

    def device_path(self, rank: int) -> Path:
        return self.outdir / self.ranks[rank].file


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_outdir(outdir: str | Path, check_files: bool = True) -> Manifest:
    """Parse ``OUTDIR/manifest.json`` and (by default) check every listed file's sha256."""
    outdir = Path(outdir)
    path = outdir / "manifest.json"
    if not outdir.is_dir():
        what = "is not a directory" if outdir.exists() else "does not exist"
        raise OutputDirError(f"{outdir}: {what}; give an output directory of `tensoropt compile`")
    if not path.is_file():
        raise OutputDirError(f"{path}: no manifest.json in the output directory; {_RECOMPILE}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OutputDirError(f"{path}: not valid JSON ({exc}); {_RECOMPILE}") from exc
    try:
        manifest = _parse(outdir, raw, sha256_file(path))
    except _Malformed as exc:
        raise OutputDirError(f"{path}: {exc}; {_RECOMPILE}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise OutputDirError(f"{path}: malformed manifest ({exc!r}); {_RECOMPILE}") from exc
    files = raw.get("files", {})
    for rank in manifest.ranks:
        if rank.data is not None and rank.data not in files:
            raise OutputDirError(
                f"{path}: data file {rank.data!r} of rank {rank.rank} has no sha256 in "
                f'"files"; {_RECOMPILE}'
            )
    if check_files:
        expected = {r.file: r.sha256 for r in manifest.ranks}
        expected.update(files)
        for name, digest in expected.items():
            check_file(outdir / plain_name(name, path), digest)
    return manifest


def plain_name(name: object, manifest: Path) -> str:
    """``name`` if it is a plain file name inside the output directory; refuses others."""
    text = str(name)
    bad = (
        not isinstance(name, str)
        or text in ("", ".", "..")
        or "/" in text
        or "\\" in text
        or "\0" in text
        or ":" in text
    )
    if bad:
        raise OutputDirError(
            f"{manifest}: names {text!r}, which is not a plain file name inside the output "
            f"directory; {_RECOMPILE}"
        )
    return text


def check_file(path: Path, digest: str) -> None:
    if not path.is_file():
        raise OutputDirError(f"{path}: listed in manifest.json but missing; {_RECOMPILE}")
    found = sha256_file(path)
    if found != digest:
        raise OutputDirError(
            f"{path}: sha256 {found[:12]}... does not match manifest.json ({digest[:12]}...); "
            f"the file was changed after compiling; {_RECOMPILE}"
        )


class _Malformed(ValueError):
    """A manifest that parses but lacks what the runtime reads (the message says what)."""


def _require(raw: Any, key: str, kind: type, where: str) -> Any:
    """``raw[key]``, refused with a message naming the key when absent or of another type."""
    if not isinstance(raw, Mapping) or key not in raw:
        raise _Malformed(f"no {key!r} key{where}")
    value = raw[key]
    if not isinstance(value, kind):
        raise _Malformed(f"{key!r}{where} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _check_step(step: Mapping[str, Any], inputs: Mapping[str, InputInfo]) -> None:
    """The step JSON holds what the runtime reads, and every value it names is an input."""
    where = ' in "step"'
    names = [*_require(step, "params", list, where), *_require(step, "states", list, where)]
    _require(step, "carry", Mapping, where)
    names += list(step.get("data_inputs") or [])
    if step.get("labels"):
        names.append(step["labels"])
    missing = [n for n in names if n not in inputs]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise _Malformed(
            f'"inputs" does not describe {", ".join(map(repr, missing[:3]))}{more} of the '
            "step's inputs"
        )


def _check_mesh(mesh_shape: tuple[int, ...], ranks, world: int, pipeline) -> None:
    """The mesh holds exactly the ranks (device files): one per mesh position and stage."""
    stages = 1 if pipeline is None else int(pipeline["stages"])
    size = int(np.prod(mesh_shape)) if mesh_shape else 1
    if size * stages != world:
        per = "" if stages == 1 else f" x {stages} pipeline stages"
        raise _Malformed(
            f"mesh shape {list(mesh_shape)}{per} holds {size * stages} devices, but the "
            f"manifest lists {world} device files"
        )
    for r in ranks:
        inside = len(r.coords) == len(mesh_shape) and all(
            isinstance(c, int) and 0 <= c < n for c, n in zip(r.coords, mesh_shape, strict=True)
        )
        if not inside:
            raise _Malformed(
                f"rank {r.rank} has coords {list(r.coords)}, outside mesh shape {list(mesh_shape)}"
            )


def _parse(outdir: Path, raw: Mapping[str, Any], digest: str) -> Manifest:
    if raw.get("schema") != MANIFEST_SCHEMA:
        raise ValueError(f"schema {raw.get('schema')!r}, expected {MANIFEST_SCHEMA!r}")
    for key, kind in (("world_size", int), ("ranks", list), ("step", Mapping)):
        _require(raw, key, kind, "")
    _require(raw, "inputs", Mapping, "")
    world = int(raw["world_size"])
    mesh = raw.get("mesh", {"shape": [world], "axis_names": ["d"]})
    where = outdir / "manifest.json"
    ranks = tuple(
        RankInfo(
            int(r["rank"]),
            tuple(r["coords"]),
            plain_name(r["file"], where),
            str(r["sha256"]),
            None if r.get("data") is None else plain_name(r["data"], where),
            int(r.get("stage", 0)),
            None if r.get("inputs") is None else tuple(str(n) for n in r["inputs"]),
            None if r.get("outputs") is None else tuple(str(n) for n in r["outputs"]),
        )
        for r in sorted(raw["ranks"], key=lambda r: int(r["rank"]))
    )
    for name in raw.get("files", {}):
        plain_name(name, where)
    if [r.rank for r in ranks] != list(range(world)):
        raise ValueError(f"ranks {[r.rank for r in ranks]} should be 0..{world - 1}")
    inputs = {}
    for name, e in raw["inputs"].items():
        high = e.get("high")
        inputs[name] = InputInfo(
            name=name,
            kind=InputKind(e["kind"]),
            global_shape=tuple(int(d) for d in e["global_shape"]),
            dtype=str(e.get("dtype", "float32")),
            placements=tuple(e.get("placements", ["R"] * len(mesh["shape"]))),
            high=None if high is None else int(high),
            init=None if e.get("init") is None else InputInit(e["init"]),
            micro_dim=None if e.get("micro_dim") is None else int(e["micro_dim"]),
        )
    _check_step(raw["step"], inputs)
    mesh_shape = tuple(int(s) for s in mesh["shape"])
    _check_mesh(mesh_shape, ranks, world, raw.get("pipeline"))
    return Manifest(
        outdir=outdir,
        world_size=world,
        mesh_shape=mesh_shape,
        axis_names=tuple(mesh.get("axis_names", [])),
        ranks=ranks,
        step=raw["step"],
        inputs=inputs,
        sha256=digest,
        micro=None if raw.get("micro") is None else MicroCut.from_json(raw["micro"]),
        pipeline=raw.get("pipeline"),
    )


# ------------------------------------------------------------------ placements

_SHARD = re.compile(r"^S\((-?\d+)\)$")


def shard_dim(placement: str) -> int | None:
    """The tensor dim of ``S(d)``; ``None`` for ``R``. ``P`` is refused (never an input)."""
    m = _SHARD.match(placement.strip())
    if m:
        return int(m.group(1))
    if placement.strip() == "R":
        return None
    raise OutputDirError(
        f"placement {placement!r}: inputs and outputs of device graphs must be 'R' or "
        f"'S(d)'; {_RECOMPILE}"
    )


def block_of(
    global_shape: Sequence[int],
    placements: Sequence[str],
    mesh_shape: Sequence[int],
    coords: Sequence[int],
) -> tuple[slice, ...]:
    """The global index block held by the rank at ``coords`` (the slicing rule)."""
    lo = [0] * len(global_shape)
    hi = list(global_shape)
    for axis, placement in enumerate(placements):
        d = shard_dim(placement)
        if d is None:
            continue
        n = mesh_shape[axis]
        length = hi[d] - lo[d]
        if length % n:
            raise OutputDirError(
                f"dim {d} of size {length} does not split into {n} equal pieces "
                f"(placements {list(placements)}, shape {list(global_shape)}); {_RECOMPILE}"
            )
        piece = length // n
        lo[d] += coords[axis] * piece
        hi[d] = lo[d] + piece
    return tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))


def shard(array: np.ndarray, info: InputInfo, manifest: Manifest, rank: int) -> np.ndarray:
    """This rank's piece of a global array (a contiguous copy).

    An input split into micro-batches (``micro_dim``): dim ``micro_dim`` of the global
    array splits into one chunk per micro-batch, and the rank's piece is its piece of
    each chunk, in micro-batch order (``runtime.micro`` splits it back)."""
    coords = manifest.ranks[rank].coords
    if info.micro_dim is None or manifest.micro is None:
        block = block_of(info.global_shape, info.placements, manifest.mesh_shape, coords)
        return np.ascontiguousarray(array[block])
    chunks = np.split(array, manifest.micro.batches, axis=info.micro_dim)
    block = block_of(chunks[0].shape, info.placements, manifest.mesh_shape, coords)
    return np.concatenate([c[block] for c in chunks], axis=info.micro_dim)


def assemble(pieces: Mapping[int, np.ndarray], info: InputInfo, manifest: Manifest) -> np.ndarray:
    """The global array from rank pieces (the lowest rank holding each block wins)."""
    first = next(iter(pieces.values()))
    full = np.empty(info.global_shape, dtype=first.dtype)
    for rank in sorted(pieces, reverse=True):
        coords = manifest.ranks[rank].coords
        block = block_of(info.global_shape, info.placements, manifest.mesh_shape, coords)
        full[block] = pieces[rank]
    return full
