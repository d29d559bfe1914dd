"""Logical device mesh.

A :class:`Mesh` is an n-dimensional grid of logical devices. Global ranks are numbered
row-major over the mesh coordinates (the last axis varies fastest), so a ``2x4`` mesh puts
ranks 0..3 on row 0 and 4..7 on row 1. Mapping ranks to hosts belongs to the runtime.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tensoropt.errors import PlanError

_DEFAULT_NAMES: dict[int, tuple[str, ...]] = {1: ("dp",), 2: ("dp", "tp")}
_MESH_TEXT = re.compile(r"^\s*\d+(\s*x\s*\d+)*\s*$")
_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


SEQUENTIAL_AXIS = "__micro__"
"""The name of a mesh axis whose coordinates run one after another on each device (the
micro-batches of a step, ``passes.micro``), never side by side: no data moves along it."""


def mesh_dims(text: str) -> tuple[int, ...]:
    """``--mesh 8`` or ``--mesh 2x4`` as its sizes (1 or 2 positive ones); one line
    naming the flag otherwise (PlanError, exit 2)."""
    try:
        dims = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise PlanError(f"--mesh {text!r} is not like 8 or 2x4") from None
    if any(d < 1 for d in dims) or len(dims) > 2:
        raise PlanError(f"--mesh {text!r}: give 1 or 2 positive sizes, e.g. 8 or 2x4")
    return dims


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """Axis names used when none are given: ``dp`` / ``dp, tp`` / ``m0, m1, ...``."""
    return _DEFAULT_NAMES.get(ndim, tuple(f"m{i}" for i in range(ndim)))


@dataclass(frozen=True, slots=True)
class Mesh:
    """An n-D grid of logical devices; ranks are row-major over the coordinates."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.shape:
            raise PlanError("mesh: expected at least one axis, found shape ()")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.shape):
            raise PlanError(f"mesh: every axis size must be an integer >= 1, found {self.shape}")
        if len(self.axis_names) != len(self.shape):
            raise PlanError(
                f"mesh: {len(self.shape)} axes {self.shape} but {len(self.axis_names)} names "
                f"{self.axis_names}; give one name per axis"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise PlanError(f"mesh: axis names must be distinct, found {self.axis_names}")
        for name in self.axis_names:
            if not isinstance(name, str) or not _AXIS_NAME.match(name):
                raise PlanError(f"mesh: axis name {name!r} is not an identifier")

    @classmethod
    def parse(cls, text: str, axis_names: Sequence[str] | None = None) -> Mesh:
        """Parse ``"8"`` or ``"2x4"``; names default to :func:`default_axis_names`."""
        if not isinstance(text, str) or not _MESH_TEXT.match(text):
            raise PlanError(f"mesh: expected a shape like '8' or '2x4', found {text!r}")
        shape = tuple(int(part) for part in text.replace(" ", "").split("x"))
        names = tuple(axis_names) if axis_names is not None else default_axis_names(len(shape))
        return cls(shape, names)

    @classmethod
    def of(cls, *shape: int) -> Mesh:
        """Mesh with default axis names, e.g. ``Mesh.of(2, 4)``."""
        return cls(tuple(shape), default_axis_names(len(shape)))

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.shape)

    @property
    def sequential_axis(self) -> int | None:
        """0 when the first axis is the :data:`SEQUENTIAL_AXIS` (the only place
        ``passes.micro`` puts it), else None."""
        return 0 if self.axis_names[0] == SEQUENTIAL_AXIS else None

    @property
    def size(self) -> int:
        """Number of devices (product of the axis sizes)."""
        return math.prod(self.shape)

    def axis(self, axis: int | str) -> int:
        """Index of a mesh axis given by index or name."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise PlanError(f"mesh {self}: no axis named {axis!r}; axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise PlanError(f"mesh {self}: axis {axis} out of range 0..{self.ndim - 1}")
        return axis

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of a global rank (row-major: the last axis varies fastest)."""
        if not 0 <= rank < self.size:
            raise PlanError(f"mesh {self}: rank {rank} out of range 0..{self.size - 1}")
        out: list[int] = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank(self, coords: Sequence[int]) -> int:
        """Global rank of mesh coordinates (inverse of :meth:`coords`)."""
        if len(coords) != self.ndim:
            raise PlanError(f"mesh {self}: expected {self.ndim} coordinates, found {tuple(coords)}")
        rank = 0
        for c, size in zip(coords, self.shape, strict=True):
            if not 0 <= c < size:
                raise PlanError(f"mesh {self}: coordinates {tuple(coords)} out of range")
            rank = rank * size + c
        return rank

    def group(self, rank: int, axis: int | str) -> tuple[int, ...]:
        """Global ranks that share every coordinate of ``rank`` except ``axis``.

        Ordered along that axis, so position i of the group is the rank with coordinate i.
        This is the ``group`` attribute of collectives over one mesh axis.
        """
        a = self.axis(axis)
        base = list(self.coords(rank))
        members = []
        for i in range(self.shape[a]):
            base[a] = i
            members.append(self.rank(base))
        return tuple(members)

    def all_coords(self) -> tuple[tuple[int, ...], ...]:
        """Coordinates of every rank, in rank order."""
        return tuple(self.coords(r) for r in range(self.size))

    def to_json(self) -> dict[str, list[int] | list[str]]:
        """The ``{"shape": [...], "axis_names": [...]}`` form used in plan and manifest files."""
        return {"shape": list(self.shape), "axis_names": list(self.axis_names)}

    @classmethod
    def from_json(cls, obj: object, where: str = "mesh") -> Mesh:
        """Inverse of :meth:`to_json`; errors name the JSON path ``where``."""
        if not isinstance(obj, dict):
            raise PlanError(f"{where}: expected an object with 'shape', found {type(obj).__name__}")
        shape = obj.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in shape
        ):
            raise PlanError(f"{where}.shape: expected a list of integers, found {shape!r}")
        names = obj.get("axis_names")
        if names is None:
            names = list(default_axis_names(len(shape)))
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise PlanError(f"{where}.axis_names: expected a list of strings, found {names!r}")
        try:
            return cls(tuple(shape), tuple(names))
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
