"""Data-movement ops: Reshape, Flatten, Squeeze, Unsqueeze, Expand, Transpose, Concat,
Split, Slice, Tile, Pad. All are linear, so all offer Partial-in -> Partial-out.

Reshape-like ops (Reshape, Flatten, Squeeze, Unsqueeze) split input and output dims into
groups with equal element counts (``[B, S, H] -> [B, S, nh, hd]``: ``{B}->{B}``,
``{S}->{S}``, ``{H}->{nh, hd}``). Only a group's leading dim may be sharded, and only
when both its input and its output leading dims divide: then both sides hold the same
contiguous block of the group. So ``H`` is sharded via ``nh`` only. Reshape's local target
shape is rewritten (``-1`` stays ``-1``; a ``0`` stays ``0`` when it still copies the right
local size).

Concat / Split never shard their axis; Slice, Tile and Pad shard only dims that they leave
untouched (a Slice over the full range counts as untouched; its local bounds are rewritten).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensoropt.errors import ShardingError
from tensoropt.ir.layout import Shard
from tensoropt.rules.sharding.base import (
    FactorRule,
    FactorSpec,
    Labels,
    LocalOp,
    OpSharding,
    OpView,
    ShardingRule,
    elementwise_labels,
    norm_axis,
    partial_strategy,
    replace_const,
)

Consts = tuple[np.ndarray | None, ...]


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Groups of (input dims, output dims) with equal products; size-1 dims stand alone."""
    if 0 in src or 0 in dst:
        return []
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            raise ShardingError(f"reshape {src} -> {dst}: element counts differ")
        si, sj = i, j
        pi, pj = src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if (pi < pj and i >= len(src)) or (pi > pj and j >= len(dst)):
                raise ShardingError(f"reshape {src} -> {dst}: element counts differ")
            if pi < pj:
                pi, i = pi * src[i], i + 1
            else:
                pj, j = pj * dst[j], j + 1
        groups.append((list(range(si, i)), list(range(sj, j))))
    return groups


def _others(op: OpView) -> tuple[Labels | None, ...]:
    """Labels for inputs 1.. (shape / axes / constants): never sharded."""
    return tuple(() if op.has_input(i) else None for i in range(1, len(op.input_shapes)))


def _reshape_like_spec(op: OpView) -> FactorSpec:
    src, dst = op.input_shapes[0] or (), op.output_shapes[0]
    lin: list[str | None] = [None] * len(src)
    lout: list[str | None] = [None] * len(dst)
    fixed = op.op_type != "Reshape" or op.const_ints(1) is not None
    for k, (gi, go) in enumerate(reshape_groups(src, dst) if fixed else []):
        if gi and go:
            lin[gi[0]] = lout[go[0]] = f"g{k}"
    partial = (partial_strategy(op, (0,)),)
    return FactorSpec((tuple(lin), *_others(op)), (tuple(lout),), partial=partial)


def _squeeze_valid(op: OpView, s: OpSharding, n: int) -> bool:
    """Squeeze without ``axes`` drops every size-1 dim: a dim must not shrink to 1 locally."""
    p = s.inputs[0]
    if op.has_input(1) or not isinstance(p, Shard):
        return True
    return (op.input_shapes[0] or ())[p.dim] // n != 1


def _reshape_rewrite(op: OpView, s: OpSharding, n: int, local: LocalOp) -> tuple[Any, Consts]:
    target = op.const_ints(1)
    if target is None or not any(isinstance(p, Shard) for p in s.inputs + s.outputs):
        return dict(op.attributes), local.const_inputs
    local_in, local_out = local.input_shapes[0] or (), local.output_shapes[0]
    zero_copies = not op.attr("allowzero", 0)
    new = []
    for j, t in enumerate(target):
        if t == -1:
            new.append(-1)
        elif t == 0 and zero_copies and j < len(local_in) and local_in[j] == local_out[j]:
            new.append(0)
        else:
            new.append(local_out[j])
    value = np.asarray(new, dtype=np.asarray(op.const_inputs[1]).dtype)
    return dict(op.attributes), replace_const(op, 1, value)


def _expand_spec(op: OpView) -> FactorSpec:
    ins, out = elementwise_labels(op)
    if op.const_ints(1) is None:
        out = tuple(lab if lab in (ins[0] or ()) else None for lab in out)
    return FactorSpec((ins[0], ()), (out,), generated=True, partial=(partial_strategy(op, (0,)),))


def _expand_rewrite(op: OpView, s: OpSharding, n: int, local: LocalOp) -> tuple[Any, Consts]:
    if op.const_ints(1) is None:
        return dict(op.attributes), local.const_inputs
    shape = np.asarray(local.output_shapes[0], dtype=np.int64)
    return dict(op.attributes), replace_const(op, 1, shape)


def _transpose_spec(op: OpView) -> FactorSpec:
    rank = len(op.input_shapes[0] or ())
    perm = op.attr("perm", list(reversed(range(rank))))
    lin = tuple(f"d{d}" for d in range(rank))
    return FactorSpec((lin,), (tuple(lin[p] for p in perm),), partial=(partial_strategy(op, (0,)),))


def _axis_blocked(rank: int, axis: int) -> Labels:
    return tuple(None if d == axis else f"d{d}" for d in range(rank))


def _concat_spec(op: OpView) -> FactorSpec:
    rank = len(op.output_shapes[0])
    labels = _axis_blocked(rank, norm_axis(op.attr("axis", 0), rank, "Concat axis"))
    ins = tuple(labels if sh is not None else None for sh in op.input_shapes)
    every = tuple(i for i, sh in enumerate(op.input_shapes) if sh is not None)
    return FactorSpec(ins, (labels,), partial=(partial_strategy(op, every),))


def _split_spec(op: OpView) -> FactorSpec:
    rank = len(op.input_shapes[0] or ())
    labels = _axis_blocked(rank, norm_axis(op.attr("axis", 0), rank, "Split axis"))
    outs = tuple(labels for _ in op.output_shapes)
    return FactorSpec((labels, *_others(op)), outs, partial=(partial_strategy(op, (0,)),))


def _slice_params(op: OpView) -> list[tuple[int, int, int, int]] | None:
    """(axis, start, end, step) per sliced axis, or None when not constant."""
    starts, ends = op.const_ints(1), op.const_ints(2)
    if starts is None or ends is None:
        return None
    rank = len(op.input_shapes[0] or ())
    axes = op.const_ints(3) if op.has_input(3) else list(range(len(starts)))
    steps = op.const_ints(4) if op.has_input(4) else [1] * len(starts)
    if axes is None or steps is None:
        return None
    return [
        (norm_axis(a, rank, "Slice axes"), s, e, st)
        for a, s, e, st in zip(axes, starts, ends, steps, strict=True)
    ]


def _full_range(start: int, end: int, step: int, size: int) -> bool:
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    return step == 1 and min(max(start, 0), size) == 0 and end >= size


def _slice_spec(op: OpView) -> FactorSpec:
    shape = op.input_shapes[0] or ()
    params = _slice_params(op)
    labels: list[str | None] = [f"d{d}" for d in range(len(shape))]
    for axis, start, end, step in params if params is not None else []:
        if not _full_range(start, end, step, shape[axis]):
            labels[axis] = None
    if params is None:
        labels = [None] * len(shape)
    lab = tuple(labels)
    return FactorSpec((lab, *_others(op)), (lab,), partial=(partial_strategy(op, (0,)),))


def _slice_rewrite(op: OpView, s: OpSharding, n: int, local: LocalOp) -> tuple[Any, Consts]:
    p = s.inputs[0]
    params = _slice_params(op)
    if not isinstance(p, Shard) or params is None:
        return dict(op.attributes), local.const_inputs
    starts = np.array(op.const_inputs[1], copy=True).reshape(-1)
    ends = np.array(op.const_inputs[2], copy=True).reshape(-1)
    for k, (axis, *_rest) in enumerate(params):
        if axis == p.dim:
            starts[k], ends[k] = 0, (local.input_shapes[0] or ())[axis]
    consts = list(replace_const(op, 1, starts))
    consts[2] = ends
    return dict(op.attributes), tuple(consts)


def _tile_spec(op: OpView) -> FactorSpec:
    rank = len(op.input_shapes[0] or ())
    repeats = op.const_ints(1)
    lab = tuple(f"d{d}" if repeats is not None and repeats[d] == 1 else None for d in range(rank))
    return FactorSpec((lab, ()), (lab,), partial=(partial_strategy(op, (0,)),))


def _pad_spec(op: OpView) -> FactorSpec:
    rank = len(op.input_shapes[0] or ())
    pads = op.const_ints(1)
    axes = op.const_ints(3) if op.has_input(3) else list(range(rank))
    labels: list[str | None] = [f"d{d}" for d in range(rank)]
    if pads is None or axes is None:
        labels = [None] * rank
    else:
        k = len(axes)
        for i, a in enumerate(axes):
            if pads[i] != 0 or pads[i + k] != 0:
                labels[norm_axis(a, rank, "Pad axes")] = None
    value = op.const_inputs[2] if op.has_input(2) else np.zeros(1)
    zero_fill = value is not None and not np.any(np.asarray(value))
    linear = op.attr("mode", "constant") == "constant" and zero_fill
    partial = (partial_strategy(op, (0,)),) if linear else ()
    lab = tuple(labels)
    return FactorSpec((lab, *_others(op)), (lab,), partial=partial)


RULES: dict[str, ShardingRule] = {
    "Reshape": FactorRule(_reshape_like_spec, _reshape_rewrite),
    "Flatten": FactorRule(_reshape_like_spec),
    "Squeeze": FactorRule(_reshape_like_spec, valid=_squeeze_valid),
    "Unsqueeze": FactorRule(_reshape_like_spec),
    "Expand": FactorRule(_expand_spec, _expand_rewrite),
    "Transpose": FactorRule(_transpose_spec),
    "Concat": FactorRule(_concat_spec),
    "Split": FactorRule(_split_spec),
    "Slice": FactorRule(_slice_spec, _slice_rewrite),
    "Tile": FactorRule(_tile_spec),
    "Pad": FactorRule(_pad_spec),
}
