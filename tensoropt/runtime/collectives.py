"""Collective nodes of per-device graphs, and their group-order semantics.

A per-device graph marks communication with nodes in the ``ai.tensoropt`` domain
(see docs/design/CONTRACTS.md, "Collectives in per-device graphs"). This module
turns such a node into a typed :class:`CollectiveCall` and holds the reference
arithmetic of every collective over the contributions of a whole group, listed in
group order. Both communicator backends reduce with :func:`ordered_sum`, so a sum
is always ``((x0 + x1) + x2) + ...`` in group order: results are bit-identical run
to run, across backends, and on every rank of the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, helper

from tensoropt.errors import TensorOptError
from tensoropt.ir.vocab import COLLECTIVE_DOMAIN as DOMAIN
from tensoropt.ir.vocab import COMMUNICATING_KINDS, CollectiveKind

# Device graphs hold only the communicating kinds: the local ones are lowered per rank.
_KINDS = {k.value: k for k in COMMUNICATING_KINDS}


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One collective node of one rank's graph, with its attributes decoded."""

    node_name: str
    kind: CollectiveKind
    input: str
    output: str
    group: tuple[int, ...]
    axis: int = 0
    split_axis: int = 0
    concat_axis: int = 0

    def describe(self) -> str:
        """A short human-readable form used in error messages."""
        return f"{self.kind.value} node {self.node_name!r} over group {list(self.group)}"


def is_collective(node: NodeProto) -> bool:
    """True for a node that the runtime must execute itself."""
    return node.domain == DOMAIN


def parse_collective(node: NodeProto, rank: int, world_size: int) -> CollectiveCall:
    """Decode an ``ai.tensoropt`` node; raise if it is malformed for this rank."""
    where = f"rank {rank}: node {node.name!r} ({node.domain}::{node.op_type})"
    kind = _KINDS.get(node.op_type)
    if kind is None:
        raise TensorOptError(
            f"{where}: unknown collective; expected one of {sorted(_KINDS)}; recompile the model"
        )
    if len(node.input) != 1 or len(node.output) != 1:
        raise TensorOptError(
            f"{where}: expected 1 input and 1 output, found {len(node.input)} and "
            f"{len(node.output)}; recompile the model"
        )
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    group = tuple(int(g) for g in attrs.get("group", ()))
    _check_group(where, group, rank, world_size)
    return CollectiveCall(
        node_name=node.name,
        kind=kind,
        input=node.input[0],
        output=node.output[0],
        group=group,
        axis=int(attrs.get("axis", 0)),
        split_axis=int(attrs.get("split_axis", 0)),
        concat_axis=int(attrs.get("concat_axis", 0)),
    )


def _check_group(where: str, group: tuple[int, ...], rank: int, world_size: int) -> None:
    if not group:
        raise TensorOptError(f"{where}: attribute 'group' is missing or empty")
    if len(set(group)) != len(group) or not all(0 <= g < world_size for g in group):
        raise TensorOptError(
            f"{where}: group {list(group)} must hold distinct ranks in [0, {world_size})"
        )
    if rank not in group:
        raise TensorOptError(f"{where}: group {list(group)} does not contain rank {rank}")


# ---------------------------------------------------------------- group-order arithmetic


def ordered_sum(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Elementwise sum in the order given: ``((p0 + p1) + p2) + ...`` (a new array)."""
    acc = np.array(parts[0], copy=True)
    for p in parts[1:]:
        acc += p
    return acc


def split_even(x: np.ndarray, n: int, axis: int, what: str) -> list[np.ndarray]:
    if x.shape[axis] % n:
        raise TensorOptError(
            f"{what}: dimension {axis} of size {x.shape[axis]} does not split into {n} "
            "equal pieces; recompile the model"
        )
    return np.split(x, n, axis=axis)


def allreduce_parts(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Every member gets the group-order sum."""
    total = ordered_sum(parts)
    return [total.copy() for _ in parts]


def allgather_parts(parts: Sequence[np.ndarray], axis: int) -> list[np.ndarray]:
    """Every member gets the parts concatenated along ``axis`` in group order."""
    full = np.concatenate(parts, axis=axis)
    return [full.copy() for _ in parts]


def reduce_scatter_parts(parts: Sequence[np.ndarray], axis: int) -> list[np.ndarray]:
    """Sum in group order, then member i keeps piece i of the sum along ``axis``."""
    n = len(parts)
    pieces = [split_even(p, n, axis, "ReduceScatter") for p in parts]
    return [ordered_sum([pieces[src][dst] for src in range(n)]) for dst in range(n)]


def alltoall_parts(
    parts: Sequence[np.ndarray], split_axis: int, concat_axis: int
) -> list[np.ndarray]:
    """Member i sends piece j of its split to member j; received pieces are concatenated."""
    n = len(parts)
    pieces = [split_even(p, n, split_axis, "AllToAll") for p in parts]
    return [
        np.concatenate([pieces[src][dst] for src in range(n)], axis=concat_axis) for dst in range(n)
    ]


def apply_parts(call: CollectiveCall, parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run ``call`` over the whole group's contributions (listed in group order)."""
    if call.kind is CollectiveKind.ALL_REDUCE:
        return allreduce_parts(parts)
    if call.kind is CollectiveKind.ALL_GATHER:
        return allgather_parts(parts, call.axis)
    if call.kind is CollectiveKind.REDUCE_SCATTER:
        return reduce_scatter_parts(parts, call.axis)
    return alltoall_parts(parts, call.split_axis, call.concat_axis)


def output_dims(call: CollectiveCall, dims: list[int | None]) -> list[int | None]:
    """Local output shape of ``call`` for a local input shape (``None`` = unknown dim)."""
    n = len(call.group)
    out = list(dims)

    def scale(axis: int, mul: bool) -> None:
        if not -len(out) <= axis < len(out):
            raise TensorOptError(
                f"{call.describe()}: axis {axis} is out of range for a rank-{len(out)} "
                "input; recompile the model"
            )
        d = out[axis]
        if d is not None:
            out[axis] = d * n if mul else d // n

    if call.kind is CollectiveKind.ALL_GATHER:
        scale(call.axis, True)
    elif call.kind is CollectiveKind.REDUCE_SCATTER:
        scale(call.axis, False)
    elif call.kind is CollectiveKind.ALL_TO_ALL:
        scale(call.split_axis, False)
        scale(call.concat_axis, True)
    return out
