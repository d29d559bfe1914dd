"""Bridge between onnx-ir nodes and the sharding-rule registry (plain-data API).

Every pass that needs a node's legal strategies or its local form goes through
here, so the conversion node -> :class:`OpView` lives in one place.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from tensoropt.errors import UnsupportedOpError
from tensoropt.ir.builder import static_shape
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.rules.grad.api import constant_value
from tensoropt.rules.sharding import SHARDING_RULES, LocalOp, MeshSharding, OpView
from tensoropt.rules.sharding import localize_nd as _localize_nd
from tensoropt.rules.sharding import strategies_nd as _strategies_nd
from tensoropt.rules.sharding.memo import Memo


def _attr_value(attr: ir.Attr):
    value = attr.value
    if attr.type == ir.AttributeType.TENSOR:  # (a Protocol isinstance check is slow)
        return value.numpy()
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    return value


_VIEW_META = "tensoropt.op_view"


def op_view(node: ir.Node) -> OpView:
    """The plain-data view of ``node`` that sharding rules take (memoised on the node).

    Passes that change a node's attributes or inputs call :func:`forget_view`.
    """
    cached = node.meta.get(_VIEW_META)
    if cached is not None and cached[0] == tuple(node.inputs):
        return cached[1]
    view = _make_view(node)
    node.meta[_VIEW_META] = (tuple(node.inputs), view, view.key())
    return view


def forget_view(node: ir.Node) -> None:
    node.meta.pop(_VIEW_META, None)


def _make_view(node: ir.Node) -> OpView:
    ins = tuple(node.inputs)
    return OpView(
        op_type=node.op_type,
        attributes={k: _attr_value(a) for k, a in node.attributes.items()},
        input_shapes=tuple(None if v is None else static_shape(v) for v in ins),
        input_dtypes=tuple(None if v is None else int(v.dtype) for v in ins),
        output_shapes=tuple(static_shape(v) for v in node.outputs),
        output_dtypes=tuple(int(v.dtype) for v in node.outputs),
        const_inputs=tuple(None if v is None else _small_const(v) for v in ins),
        reduced_indices=_reduced_indices(node),
    )


def _reduced_indices(node: ir.Node) -> bool:
    """A MaxPool (row-major indices) whose Indices are read only by ``Mod(indices, plane)``
    with ``plane`` the input's spatial size: each reader keeps the position within the
    plane, which a batch or channel split does not change."""
    if node.op_type != "MaxPool" or len(node.outputs) < 2 or node.inputs[0] is None:
        return False
    order = node.attributes.get("storage_order")
    if order is not None and order.value:
        return False
    shape = static_shape(node.inputs[0])
    plane = int(np.prod(shape[2:], dtype=np.int64))
    uses = list(node.outputs[1].uses())
    for use in uses:
        reader = use.node
        if reader.op_type != "Mod" or use.idx != 0 or len(reader.inputs) < 2:
            return False
        divisor = reader.inputs[1]
        const = None if divisor is None else constant_value(divisor)
        if const is None or const.size != 1 or int(const.reshape(-1)[0]) != plane:
            return False
    return bool(uses)


def _small_const(value: ir.Value) -> np.ndarray | None:
    """Constant inputs that rules may read (shape/axes tensors), not big weights."""
    if value.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    if value.const_value is not None and value.const_value.size > 64:
        return None
    return constant_value(value)


def candidates(node: ir.Node, mesh: Mesh) -> list[MeshSharding]:
    """Legal strategies of ``node`` on ``mesh`` (deterministic order)."""
    if node.op_type not in SHARDING_RULES or node.domain not in ("", "ai.onnx"):
        raise UnsupportedOpError(
            f"no sharding rule for {node.op_type} (node {node.name}); it cannot be partitioned"
        )
    view = op_view(node)
    key = (view_key(node), mesh.shape)
    cached = _STRATEGIES.get(key)
    if cached is None:
        cached = _STRATEGIES.put(key, tuple(_strategies_nd(view, mesh.shape)))
    return list(cached)


def localize(node: ir.Node, strategy: MeshSharding, mesh: Mesh) -> LocalOp:
    """The node's local form under ``strategy`` (memoised per distinct op view)."""
    key = (view_key(node), strategy, mesh.shape)
    local = _LOCALS.get(key)
    if local is None:
        local = _LOCALS.put(key, _localize_nd(op_view(node), strategy, mesh.shape))
    return local


_STRATEGIES = Memo(50_000)  # (view key, mesh shape) -> strategies
_LOCALS = Memo(200_000)  # (view key, strategy, mesh shape) -> local form


def view_key(node: ir.Node) -> tuple:
    """A hashable key of the node's plain-data view: equal for identical ops."""
    op_view(node)
    return node.meta[_VIEW_META][2]


def input_layout(strategy: MeshSharding, i: int) -> Layout | None:
    ins = strategy.inputs
    return ins[i] if i < len(ins) else None


def output_layout(strategy: MeshSharding, j: int) -> Layout:
    return strategy.outputs[j]


def matches(strategy: MeshSharding, inputs, outputs) -> bool:
    return tuple(strategy.inputs) == tuple(inputs) and tuple(strategy.outputs) == tuple(outputs)


def has_partial(strategy: MeshSharding) -> bool:
    layouts = [*(x for x in strategy.inputs if x is not None), *strategy.outputs]
    return any(isinstance(p, Partial) for lay in layouts for p in lay.placements)


def conversion_bytes(have: Layout, need: Layout, value: ir.Value, mesh: Mesh) -> float:
    """Bytes a device sends to turn ``have`` into ``need`` (alpha-beta volume terms).

    Per mesh axis of size n and local size B: P->R 2(n-1)/n B, P->S and S->R (n-1)/n B,
    S->S (n-1)/n B, R->S nothing; R->P is charged like P->R (see below).
    """
    return shaped_conversion_bytes(have, need, static_shape(value), value.dtype, mesh)


def shaped_conversion_bytes(
    have: Layout, need: Layout, shape: tuple[int, ...], dtype: ir.DataType, mesh: Mesh
) -> float:
    """:func:`conversion_bytes` of a value of ``shape`` and ``dtype``."""
    return conversion_volume(have, need, shape, dtype, mesh.shape, mesh.sequential_axis)


# Every candidate's scoring asks for these: functools' LRU (in C) is bounded like the
# Memo above and cheaper per hit (the scoring calls it about 20 times per candidate
# choice; with the memo and a per-chooser tie-breaker table, program building took 7%
# more CPU on GPT-2-medium).
@functools.lru_cache(maxsize=200_000)
def conversion_volume(
    have: Layout,
    need: Layout,
    shape: tuple[int, ...],
    dtype: ir.DataType,
    mesh_shape,
    sequential: int | None = None,
) -> float:
    itemsize = max(1, int(np.ceil(dtype.itemsize)))
    size = float(math.prod(shape)) * itemsize
    for axis, p in enumerate(have.placements):
        if isinstance(p, Shard):
            size /= mesh_shape[axis]
    total = 0.0
    for axis, (a, b) in enumerate(zip(have.placements, need.placements, strict=True)):
        n = mesh_shape[axis]
        frac = (n - 1) / n
        if a == b or (isinstance(a, Replicate) and not isinstance(b, Partial)):
            continue
        if axis == sequential and (isinstance(a, Shard) or isinstance(b, Shard)):
            return math.inf  # the pieces of a sequential axis never coexist: no exchange
        if isinstance(a, Replicate):
            # R->P is free locally, but it only defers an all-reduce; charge one so that
            # propagation reduces where the partial sums meet replicated values.
            total += 2 * frac * size
            continue
        if isinstance(a, Partial):
            total += (2 * frac if isinstance(b, Replicate) else frac) * size
        elif isinstance(b, Replicate):
            total += frac * size * n
        else:
            total += frac * size  # all-to-all: each rank sends (n-1)/n of its piece
    return total
