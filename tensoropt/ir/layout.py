"""Placements and layouts: how one tensor is spread over a device mesh.

A :class:`Layout` holds one placement per mesh axis:

- ``Shard(d)`` (printed ``S(d)``): dim ``d`` is split into equal pieces along that axis;
- ``Replicate()`` (``R``): every device of the axis holds the same value;
- ``Partial()`` (``P``): the devices of the axis hold addends; the value is their sum.

Slicing rule (docs/design/CONTRACTS.md): for the rank at coordinates ``c``, for each mesh
axis ``i`` in order 0..k-1 whose placement is ``S(d)``, split dim ``d`` of the current
(already sliced) array into ``mesh.shape[i]`` equal pieces and keep piece ``c[i]``. Axis 0
is therefore outermost: ``S(0)S(0)`` on a 2x2 mesh gives rank (i, j) quarter ``2*i + j``.
Uneven splits are refused (:class:`ShardingError`), never padded.

Materialising a ``Partial`` placement from a full value (:func:`slice_for`) keeps the value
on group index 0 and zeros elsewhere; the redistribution step ``R -> P`` uses the same rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from tensoropt.errors import PlanError, ShardingError
from tensoropt.ir.mesh import Mesh

# One object per placement: layouts are compared and hashed millions of times while the
# choosers score candidates, and tuples of placements compare identical objects without
# calling their ``__eq__``.
_PLACEMENTS: dict[object, object] = {}


def _only(cls):
    """The one instance of placement class ``cls`` that takes no fields."""
    found = _PLACEMENTS.get(cls)
    if found is None:
        found = _PLACEMENTS[cls] = object.__new__(cls)
    return found


@dataclass(frozen=True, slots=True)
class Shard:
    """Dim ``dim`` is split into equal contiguous pieces along the mesh axis."""

    dim: int

    def __new__(cls, dim: int) -> Shard:
        valid = type(dim) is int and dim >= 0  # (an invalid dim fails in __post_init__)
        found = _PLACEMENTS.get((cls, dim)) if valid else None
        if found is None:
            found = object.__new__(cls)
            if valid:
                object.__setattr__(found, "dim", dim)
                _PLACEMENTS[(cls, dim)] = found
        return found  # type: ignore[return-value]

    def __getnewargs__(self) -> tuple[int]:
        return (self.dim,)

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ShardingError(f"Shard: dim must be an integer >= 0, found {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device of the mesh axis holds the whole value."""

    def __new__(cls) -> Replicate:
        return _only(cls)

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Devices of the mesh axis hold addends; the value is their sum."""

    def __new__(cls) -> Partial:
        return _only(cls)

    def __str__(self) -> str:
        return "P"


Placement: TypeAlias = Shard | Replicate | Partial

_TOKEN = re.compile(r"S\((\d+)\)|R|P")


def parse_placements(text: str, where: str = "layout") -> tuple[Placement, ...]:
    """Parse the concatenated short form, e.g. ``"S(0)R"`` or ``"PS(1)"``."""
    if not isinstance(text, str):
        raise PlanError(f"{where}: expected a placement string like 'S(0)R', found {text!r}")
    compact = text.replace(" ", "")
    out: list[Placement] = []
    pos = 0
    while pos < len(compact):
        m = _TOKEN.match(compact, pos)
        if m is None:
            raise PlanError(
                f"{where}: bad placement string {text!r} at character {pos}: expected "
                "'S(<dim>)', 'R' or 'P' per mesh axis, e.g. 'S(0)R'"
            )
        out.append(Shard(int(m.group(1))) if m.group(1) is not None else _SIMPLE[m.group(0)])
        pos = m.end()
    if not out:
        raise PlanError(f"{where}: empty placement string; give one placement per mesh axis")
    return tuple(out)


_SIMPLE: dict[str, Placement] = {"R": Replicate(), "P": Partial()}


@dataclass(frozen=True, slots=True)
class Layout:
    """One placement per mesh axis. Printed and parsed in the short form ``S(0)R``."""

    placements: tuple[Placement, ...]
    # Layouts key the search's memos millions of times: the hash is computed once.
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not self.placements:
            raise ShardingError("Layout: expected one placement per mesh axis, found none")
        for p in self.placements:
            if not isinstance(p, (Shard, Replicate, Partial)):
                raise ShardingError(f"Layout: {p!r} is not a Shard, Replicate or Partial")
        object.__setattr__(self, "_hash", hash(self.placements))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def parse(cls, text: str, where: str = "layout") -> Layout:
        """Inverse of ``str(layout)``; raises :class:`PlanError` naming ``where``."""
        return cls(parse_placements(text, where))

    @classmethod
    def replicated(cls, ndim: int) -> Layout:
        """All-``R`` layout on a mesh with ``ndim`` axes."""
        return cls((Replicate(),) * ndim)

    def __str__(self) -> str:
        return "".join(str(p) for p in self.placements)

    @property
    def ndim(self) -> int:
        """Number of mesh axes this layout is for."""
        return len(self.placements)

    @property
    def has_partial(self) -> bool:
        """True when some mesh axis holds addends."""
        return any(isinstance(p, Partial) for p in self.placements)

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that shard tensor dim ``dim``, outermost first."""
        return tuple(i for i, p in enumerate(self.placements) if p == Shard(dim))

    def check(self, mesh: Mesh, rank: int, tensor: str = "tensor") -> None:
        """Raise ShardingError unless this layout fits ``mesh`` and a tensor of rank ``rank``."""
        if self.ndim != mesh.ndim:
            raise ShardingError(
                f"{tensor}: layout {self} has {self.ndim} placements but mesh {mesh} has "
                f"{mesh.ndim} axes; give one placement per mesh axis"
            )
        for p in self.placements:
            if isinstance(p, Shard) and p.dim >= rank:
                raise ShardingError(
                    f"{tensor}: layout {self} shards dim {p.dim} but the tensor has rank {rank}"
                )


def numel(shape: Sequence[int]) -> float:
    """The element count of ``shape`` as a float: its sizes multiplied in order in float64,
    as ``float(np.prod(shape, dtype=np.float64))`` gives them, without numpy's per-call
    cost (the cost model asks for millions of short shapes)."""
    out = 1.0
    for d in shape:
        out *= d
    return float(out)


def local_shape(
    global_shape: Sequence[int], layout: Layout, mesh: Mesh, tensor: str = "tensor"
) -> tuple[int, ...]:
    """Shape of one device's piece; raises ShardingError on an uneven split."""
    layout.check(mesh, len(global_shape), tensor)
    shape = list(global_shape)
    for axis, p in enumerate(layout.placements):
        if not isinstance(p, Shard):
            continue
        n = mesh.shape[axis]
        if shape[p.dim] % n:
            size = f"size {global_shape[p.dim]}"
            if shape[p.dim] != global_shape[p.dim]:
                size += f", {shape[p.dim]} after the outer mesh axes"
            raise ShardingError(
                f"{tensor}: dim {p.dim} ({size}; global shape {tuple(global_shape)}) does "
                f"not split evenly into {n} pieces on mesh axis {axis} "
                f"({mesh.axis_names[axis]}) of layout {layout}; pick another layout"
            )
        shape[p.dim] //= n
    return tuple(shape)


def slice_for(
    array: np.ndarray, layout: Layout, mesh: Mesh, coords: Sequence[int], tensor: str = "tensor"
) -> np.ndarray:
    """The piece of ``array`` that the rank at ``coords`` holds (the CONTRACTS slicing rule).

    ``Partial`` axes keep the value on coordinate 0 and zeros elsewhere.
    """
    local_shape(array.shape, layout, mesh, tensor)
    out = array
    for axis, p in enumerate(layout.placements):
        c = coords[axis]
        if isinstance(p, Shard):
            out = np.split(out, mesh.shape[axis], axis=p.dim)[c]
        elif isinstance(p, Partial) and c != 0:
            out = np.zeros_like(out)
    return np.array(out, copy=True, order="C")


def assemble(
    shards_by_coords: Mapping[tuple[int, ...], np.ndarray],
    layout: Layout,
    mesh: Mesh,
    tensor: str = "tensor",
    check_replicas: bool = True,
) -> np.ndarray:
    """Inverse of :func:`slice_for`: S concatenates, P sums, R takes one copy.

    With ``check_replicas`` the copies of a replicated axis must be exactly equal.
    """
    missing = [c for c in mesh.all_coords() if c not in shards_by_coords]
    if missing:
        raise ShardingError(f"{tensor}: no piece for mesh coordinates {missing[0]}")
    pieces: dict[tuple[int, ...], np.ndarray] = {
        c: np.asarray(shards_by_coords[c]) for c in mesh.all_coords()
    }
    for axis in reversed(range(mesh.ndim)):
        merged: dict[tuple[int, ...], np.ndarray] = {}
        for prefix in {c[:axis] for c in pieces}:
            group = [pieces[prefix + (i,)] for i in range(mesh.shape[axis])]
            merged[prefix] = _merge(group, layout.placements[axis], tensor, axis, check_replicas)
        pieces = merged
    return pieces[()]


def _merge(
    group: list[np.ndarray], p: Placement, tensor: str, axis: int, check: bool
) -> np.ndarray:
    if isinstance(p, Shard):
        return np.concatenate(group, axis=p.dim)
    if isinstance(p, Partial):
        return np.sum(np.stack(group), axis=0).astype(group[0].dtype)
    if check:
        for i, g in enumerate(group[1:], start=1):
            if g.shape != group[0].shape or not np.array_equal(g, group[0], equal_nan=True):
                raise ShardingError(
                    f"{tensor}: replicated on mesh axis {axis}, but the piece at position {i} "
                    "differs from the piece at position 0"
                )
    return group[0]
