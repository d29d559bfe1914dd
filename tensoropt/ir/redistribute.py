"""Redistribution planning: the steps that turn one layout of a value into another.

Per mesh axis ``i`` (group = the ranks that differ only in coordinate ``i``):

=============  =====================  ==========================================
source         target                 step
=============  =====================  ==========================================
``P``          ``R``                  ALL_REDUCE
``P``          ``S(d)``               REDUCE_SCATTER(dim=d)
``S(d)``       ``R``                  ALL_GATHER(dim=d)
``R``          ``S(d)``               LOCAL_SLICE(dim=d) (no communication)
``S(d)``       ``S(e)``               ALL_TO_ALL(src_dim=d, dst_dim=e), or gather+slice
``R``          ``P``                  LOCAL_ZERO: group index 0 keeps the value, the
                                      others hold zeros (exact, unlike scaling by 1/n)
``S(d)``       ``P``                  ALL_GATHER then LOCAL_ZERO
=============  =====================  ==========================================

Ordering across axes matters when several axes shard the same tensor dim: by the slicing
rule (axis 0 outermost) the piece an inner axis holds depends on the outer axes. An axis
is *stable* when its placement does not change and no outer axis that shards the same dim
changes. Unstable axes are first gathered / reduced from the innermost axis outwards, then
sliced / scattered from the outermost axis inwards. A direct ALL_TO_ALL is used only when
neither dim is sharded by any other mesh axis (then its order does not matter).

``ALL_TO_ALL(src_dim=d, dst_dim=e)`` is the CONTRACTS ``AllToAll`` with
``split_axis = e`` and ``concat_axis = d``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tensoropt.errors import ShardingError
from tensoropt.ir.layout import Layout, Partial, Placement, Replicate, Shard, local_shape, numel
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.vocab import CollectiveKind


@dataclass(frozen=True, slots=True)
class Step:
    """One step on one mesh axis. ``dim`` for gather/scatter/slice; src/dst dims for A2A."""

    kind: CollectiveKind
    mesh_axis: int
    dim: int | None = None
    src_dim: int | None = None
    dst_dim: int | None = None

    def __str__(self) -> str:
        if self.kind is CollectiveKind.ALL_TO_ALL:
            return f"{self.kind.value}[axis {self.mesh_axis}](S({self.src_dim})->S({self.dst_dim}))"
        dim = "" if self.dim is None else f"(dim {self.dim})"
        return f"{self.kind.value}[axis {self.mesh_axis}]{dim}"


_R = Replicate()
_P = Partial()


def _stable_axes(src: Layout, dst: Layout) -> list[bool]:
    stable: list[bool] = []
    for i, (s, t) in enumerate(zip(src.placements, dst.placements, strict=True)):
        ok = s == t
        if ok and isinstance(s, Shard):
            outer = [j for j in range(i) if s in (src.placements[j], dst.placements[j])]
            ok = all(stable[j] for j in outer)
        stable.append(ok)
    return stable


def _sharded_elsewhere(layout: Layout, dim: int, axis: int) -> bool:
    return any(p == Shard(dim) for j, p in enumerate(layout.placements) if j != axis)


def _direct_all_to_all(src: Layout, dst: Layout, axis: int) -> bool:
    s, t = src.placements[axis], dst.placements[axis]
    if not (isinstance(s, Shard) and isinstance(t, Shard)) or s.dim == t.dim:
        return False
    return not any(_sharded_elsewhere(lay, d, axis) for lay in (src, dst) for d in (s.dim, t.dim))


def plan_redistribution(
    src: Layout, dst: Layout, global_shape: Sequence[int], mesh: Mesh, tensor: str = "tensor"
) -> tuple[Step, ...]:
    """Steps that turn a value of ``global_shape`` from layout ``src`` into ``dst``.

    Raises ShardingError when either layout does not fit the shape or the mesh.
    """
    local_shape(global_shape, src, mesh, tensor)
    local_shape(global_shape, dst, mesh, tensor)
    stable = _stable_axes(src, dst)
    cur: list[Placement] = list(src.placements)
    steps: list[Step] = []
    for i in reversed(range(mesh.ndim)):  # phase 1: undo, innermost axis first
        if stable[i]:
            continue
        s, t = cur[i], dst.placements[i]
        if isinstance(s, Shard) and _direct_all_to_all(src, dst, i):
            steps.append(Step(CollectiveKind.ALL_TO_ALL, i, src_dim=s.dim, dst_dim=t.dim))  # type: ignore[union-attr]
            cur[i] = t
        elif isinstance(s, Shard):
            steps.append(Step(CollectiveKind.ALL_GATHER, i, dim=s.dim))
            cur[i] = _R
        elif isinstance(s, Partial) and isinstance(t, Replicate):
            steps.append(Step(CollectiveKind.ALL_REDUCE, i))
            cur[i] = _R
    for i in range(mesh.ndim):  # phase 2: redo, outermost axis first
        s, t = cur[i], dst.placements[i]
        if s == t:
            continue
        if isinstance(s, Partial) and isinstance(t, Shard):
            steps.append(Step(CollectiveKind.REDUCE_SCATTER, i, dim=t.dim))
        elif isinstance(s, Shard | Partial):
            raise ShardingError(f"{tensor}: internal: axis {i} left at {s} before {t}")
        elif isinstance(t, Shard):
            steps.append(Step(CollectiveKind.LOCAL_SLICE, i, dim=t.dim))
        elif isinstance(t, Partial):
            steps.append(Step(CollectiveKind.LOCAL_ZERO, i))
        cur[i] = t
    return tuple(steps)


def step_output_shape(step: Step, shape: Sequence[int], n: int) -> tuple[int, ...]:
    """Local shape after ``step`` on an axis of size ``n``, given the local shape before."""
    out = list(shape)
    kind = step.kind
    if kind is CollectiveKind.ALL_GATHER and step.dim is not None:
        out[step.dim] *= n
    elif (
        kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.LOCAL_SLICE) and step.dim is not None
    ):
        out[step.dim] //= n
    elif (
        kind is CollectiveKind.ALL_TO_ALL and step.src_dim is not None and step.dst_dim is not None
    ):
        out[step.src_dim] *= n
        out[step.dst_dim] //= n
    return tuple(out)


_LATENCY_TERMS = {
    CollectiveKind.ALL_REDUCE: 2,
    CollectiveKind.REDUCE_SCATTER: 1,
    CollectiveKind.ALL_GATHER: 1,
    CollectiveKind.ALL_TO_ALL: 1,
}


def latency_terms(kind: CollectiveKind) -> int:
    """How many alpha (latency) terms a step costs: AllReduce 2, other collectives 1."""
    return _LATENCY_TERMS.get(kind, 0)


def itemsize(dtype: int | np.dtype | type) -> int:
    """Bytes per element of an ONNX dtype code or a numpy dtype."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        from onnx import helper

        return int(np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize)
    return int(np.dtype(dtype).itemsize)


def comm_bytes(
    step: Step, local_shape: Sequence[int], dtype: int | np.dtype | type, n: int
) -> float:
    """Beta-term volume of a step (DESIGN.md section 4), in bytes.

    ``local_shape`` is the shape each rank holds before the step. ``B`` is the size of the
    full buffer the collective works on: the gathered output for AllGather, the unscattered
    input for ReduceScatter, the buffer for AllReduce and AllToAll. Volumes are
    AllGather / ReduceScatter (n-1)/n*B, AllReduce 2(n-1)/n*B, AllToAll (n-1)/n*B_local, local
    steps 0. Multiply by the axis' inverse bandwidth and add ``latency_terms`` alphas.
    """
    if not step.kind.communicates or n <= 1:
        return 0.0
    nbytes = numel(local_shape) * itemsize(dtype)
    if step.kind is CollectiveKind.ALL_GATHER:
        nbytes *= n
    factor = {
        CollectiveKind.ALL_REDUCE: 2 * (n - 1) / n,
        CollectiveKind.REDUCE_SCATTER: (n - 1) / n,
        CollectiveKind.ALL_GATHER: (n - 1) / n,
        # Each rank keeps 1/n of its local buffer and sends the rest (what the runtime
        # moves); DESIGN's (n-1)/n^2 B is the same volume with B the global tensor.
        CollectiveKind.ALL_TO_ALL: (n - 1) / n,
    }[step.kind]
    return factor * nbytes


def simulate(
    steps: Sequence[Step], shards: Mapping[tuple[int, ...], np.ndarray], mesh: Mesh
) -> dict[tuple[int, ...], np.ndarray]:
    """Reference semantics: run ``steps`` on per-rank numpy pieces keyed by mesh coordinates."""
    cur = {c: np.asarray(a) for c, a in shards.items()}
    for step in steps:
        cur = {c: _apply(step, cur, mesh, c) for c in cur}
    return cur


def _apply(
    step: Step, cur: Mapping[tuple[int, ...], np.ndarray], mesh: Mesh, c: tuple[int, ...]
) -> np.ndarray:
    i, n = step.mesh_axis, mesh.shape[step.mesh_axis]
    group = [cur[c[:i] + (k,) + c[i + 1 :]] for k in range(n)]
    kind = step.kind
    if kind is CollectiveKind.ALL_REDUCE:
        return np.sum(np.stack(group), axis=0).astype(group[0].dtype)
    if kind is CollectiveKind.REDUCE_SCATTER:
        total = np.sum(np.stack(group), axis=0).astype(group[0].dtype)
        return np.split(total, n, axis=step.dim)[c[i]]
    if kind is CollectiveKind.ALL_GATHER:
        return np.concatenate(group, axis=step.dim)
    if kind is CollectiveKind.LOCAL_SLICE:
        return np.split(cur[c], n, axis=step.dim)[c[i]]
    if kind is CollectiveKind.LOCAL_ZERO:
        return cur[c] if c[i] == 0 else np.zeros_like(cur[c])
    if kind is CollectiveKind.ALL_TO_ALL:
        pieces = [np.split(g, n, axis=step.dst_dim)[c[i]] for g in group]
        return np.concatenate(pieces, axis=step.src_dim)
    raise ShardingError(f"unknown redistribution step {step}")
