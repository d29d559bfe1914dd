"""The sharding-rule registry and the n-D mesh composition.

``SHARDING_RULES`` maps op type -> rule, built from the per-family ``RULES`` tables. A
multi-axis mesh is handled axis by axis: pick a strategy for axis 0 on the global op,
localize it, then pick a strategy for axis 1 on the localized op, and so on
(:func:`strategies_nd`, :func:`localize_nd`). Dims keep their numbering through
localization, so the per-axis placements stack into one :class:`Layout` per tensor, whose
slicing order (axis 0 outermost) matches the order of composition.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from tensoropt.errors import PlanError, ShardingError, UnsupportedOpError
from tensoropt.ir.layout import Layout
from tensoropt.rules.sharding import elementwise, gather, matmul, misc, nn, reduce, shape
from tensoropt.rules.sharding.base import (
    LocalOp,
    OpSharding,
    OpView,
    ShardingRule,
    remember_legal,
    replicated,
)
from tensoropt.rules.sharding.memo import Memo


class ShardingRegistry:
    """Op type -> :class:`ShardingRule`; an explicit object, built once from tables."""

    __slots__ = ("_rules",)

    def __init__(self, tables: Iterable[Mapping[str, ShardingRule]]) -> None:
        rules: dict[str, ShardingRule] = {}
        for table in tables:
            for op_type, rule in table.items():
                if op_type in rules:
                    raise ValueError(f"sharding rule for {op_type} registered twice")
                rules[op_type] = rule
        self._rules = MappingProxyType(rules)

    def __contains__(self, op_type: object) -> bool:
        return op_type in self._rules

    @property
    def op_types(self) -> tuple[str, ...]:
        """Every op type with a rule, sorted."""
        return tuple(sorted(self._rules))

    def rule(self, op_type: str) -> ShardingRule:
        if op_type not in self._rules:
            raise UnsupportedOpError(
                f"no sharding rule for op type {op_type!r}; supported: {', '.join(self.op_types)}"
            )
        return self._rules[op_type]

    def strategies(self, op: OpView, n: int) -> list[OpSharding]:
        """Legal strategies along one mesh axis of size ``n`` (``n == 1``: only all-R)."""
        if n < 1:
            raise ShardingError(f"{op.op_type}: mesh axis size must be >= 1, found {n}")
        if n == 1:
            return [replicated(op)]
        return self.rule(op.op_type).strategies(op, n)

    def localize(self, op: OpView, s: OpSharding, n: int) -> LocalOp:
        """The per-device op for strategy ``s`` along one mesh axis of size ``n``."""
        return self.rule(op.op_type).localize(op, s, n)


SHARDING_RULES = ShardingRegistry(
    (
        elementwise.RULES,
        matmul.RULES,
        reduce.RULES,
        shape.RULES,
        gather.RULES,
        nn.RULES,
        misc.RULES,
    )
)


@dataclass(frozen=True, slots=True)
class MeshSharding:
    """A strategy on a whole mesh: one :class:`OpSharding` per mesh axis.

    ``inputs``/``outputs`` (the per-tensor layouts) are computed once at construction:
    the cost model and the partitioner read them millions of times.
    """

    axes: tuple[OpSharding, ...]
    inputs: tuple[Layout | None, ...] = field(init=False, compare=False, repr=False)
    outputs: tuple[Layout, ...] = field(init=False, compare=False, repr=False)
    _hash: int = field(init=False, compare=False, repr=False, default=0)
    _str: str | None = field(init=False, compare=False, repr=False, default=None)

    def __post_init__(self) -> None:
        first = self.axes[0].inputs
        inputs = tuple(
            None if first[i] is None else Layout(tuple(a.inputs[i] for a in self.axes))  # type: ignore[misc]
            for i in range(len(first))
        )
        outputs = tuple(
            Layout(tuple(a.outputs[j] for a in self.axes)) for j in range(len(self.axes[0].outputs))
        )
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "outputs", outputs)
        object.__setattr__(self, "_hash", hash(self.axes))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        # memoised: every cost problem labels its strategies with it
        if self._str is None:
            ins = ", ".join("-" if lay is None else str(lay) for lay in self.inputs)
            text = f"({ins}) -> ({', '.join(str(lay) for lay in self.outputs)})"
            object.__setattr__(self, "_str", text)
        return self._str


def local_view(op: OpView, local: LocalOp) -> OpView:
    """The OpView of the localized op (input of the next mesh axis)."""
    consts = tuple(
        new if new is not None else old
        for new, old in zip(local.const_inputs, op.const_inputs, strict=True)
    )
    return OpView(
        op.op_type,
        local.attributes,
        local.input_shapes,
        op.input_dtypes,
        local.output_shapes,
        op.output_dtypes,
        consts,
        op.reduced_indices,
    )


def strategies_nd(
    op: OpView, mesh_shape: Sequence[int], registry: ShardingRegistry = SHARDING_RULES
) -> list[MeshSharding]:
    """Every legal strategy on a mesh of ``mesh_shape``, in a deterministic order.

    The order is lexicographic over axes (axis 0 slowest); indices into this list are what
    a plan's ``index`` refers to.
    """
    return [_interned(c) for c in _compose(op, tuple(mesh_shape), registry)]


# per-axis strategies -> their MeshSharding: ops of the same arity and ranks share most
# strategies, and building one computes every layout it holds
_INTERNED: dict[tuple[OpSharding, ...], MeshSharding] = {}
_INTERNED_MAX = 200_000


def _interned(axes: tuple[OpSharding, ...]) -> MeshSharding:
    found = _INTERNED.get(axes)
    if found is None:
        if len(_INTERNED) >= _INTERNED_MAX:
            _INTERNED.clear()
        found = _INTERNED[axes] = MeshSharding(axes)
    return found


def strategies_2d(
    op: OpView, n0: int, n1: int, registry: ShardingRegistry = SHARDING_RULES
) -> list[MeshSharding]:
    """:func:`strategies_nd` on a 2-D mesh ``n0 x n1``."""
    return strategies_nd(op, (n0, n1), registry)


# (registry, op view key, mesh shape) -> the per-axis strategy tuples of _compose, most
# recent last. The local views of different strategies and meshes coincide often: the
# replicated strategy of a micro mesh's sequential axis leaves the op as it was, and one
# layer's ops recur in every layer; the bound keeps a long-lived process from growing.
_COMPOSED = Memo(20_000)


# (registry, op view key, axis size) -> the op's legal strategies along one axis and the
# local view of each: meshes with the same first axis (2x32, 2x128) share them.
_AXIS = Memo(20_000)


def _legal(op: OpView, n: int, registry: ShardingRegistry) -> list[OpSharding]:
    """The rule's strategies along one axis, remembered for the legality check of
    localizing them (they came from the rule itself)."""
    legal = registry.strategies(op, n)
    if n > 1:
        remember_legal(registry.rule(op.op_type), op, n, legal)
    return legal


def axis_step(op: OpView, n: int) -> tuple[list[OpSharding], list[OpView]]:
    """The op's legal strategies along one mesh axis of size ``n`` and the local view
    of each (memoised with the enumerations of whole meshes)."""
    return _axis_step(op, n, SHARDING_RULES)


def _axis_step(
    op: OpView, n: int, registry: ShardingRegistry
) -> tuple[list[OpSharding], list[OpView]]:
    key = (registry, op.key(), n)
    found = _AXIS.get(key)
    if found is not None:
        return found
    legal = _legal(op, n, registry)
    # Every strategy is localized before any recursion: the recursion remembers the legal
    # strategies of the local ops, and a check against this op would enumerate them again.
    views = [local_view(op, registry.localize(op, s, n)) for s in legal]
    return _AXIS.put(key, (legal, views))


# (registry, op view key, axis size) -> the op's legal strategies along one axis, for a
# last mesh axis: nothing composes after it, so its strategies need no local views
# (most localizations of an enumeration were of the last axis)
_LAST = Memo(20_000)


def _last_axis(op: OpView, n: int, registry: ShardingRegistry) -> list[OpSharding]:
    key = (registry, op.key(), n)
    stepped = _AXIS.get(key)
    if stepped is not None:
        return stepped[0]
    found = _LAST.get(key)
    if found is not None:
        return found
    return _LAST.put(key, _legal(op, n, registry))


def _compose(
    op: OpView, shape: tuple[int, ...], registry: ShardingRegistry
) -> tuple[tuple[OpSharding, ...], ...]:
    if not shape:
        return ((),)
    key = (registry, op.key(), shape)
    found = _COMPOSED.get(key)
    if found is not None:
        return found
    out: list[tuple[OpSharding, ...]] = []
    if len(shape) == 1:
        out = [(s,) for s in _last_axis(op, shape[0], registry)]
    else:
        legal, views = _axis_step(op, shape[0], registry)
        for s, view in zip(legal, views, strict=True):
            out += [(s, *rest) for rest in _compose(view, shape[1:], registry)]
    return _COMPOSED.put(key, tuple(out))


def localize_nd(
    op: OpView,
    strategy: MeshSharding,
    mesh_shape: Sequence[int],
    registry: ShardingRegistry = SHARDING_RULES,
) -> LocalOp:
    """The per-device op of a mesh strategy; output scales of the axes multiply."""
    if len(strategy.axes) != len(mesh_shape):
        raise ShardingError(
            f"{op.op_type}: strategy has {len(strategy.axes)} axes, mesh has {len(mesh_shape)}"
        )
    view = op
    scales: list[float | None] = [None] * len(op.output_shapes)
    local: LocalOp | None = None
    for s, n in zip(strategy.axes, mesh_shape, strict=True):
        local = registry.localize(view, s, n)
        scales = [_mul(a, b) for a, b in zip(scales, local.output_scale, strict=True)]
        view = local_view(view, local)
    if local is None:
        raise ShardingError(f"{op.op_type}: empty mesh")
    consts = tuple(
        None if _same(new, old) else new
        for new, old in zip(view.const_inputs, op.const_inputs, strict=True)
    )
    return LocalOp(view.attributes, consts, tuple(scales), view.input_shapes, view.output_shapes)


def _mul(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else a * b


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b))


def resolve_unit(
    op: OpView,
    mesh_shape: Sequence[int],
    inputs: Sequence[Layout | None] | None = None,
    outputs: Sequence[Layout] | None = None,
    index: int | None = None,
    unit: str = "unit",
    registry: ShardingRegistry = SHARDING_RULES,
) -> tuple[int, MeshSharding]:
    """Find a plan unit's strategy among :func:`strategies_nd` by layouts and/or index.

    Raises PlanError naming the unit when the layouts are not legal, the index is out of
    range, or both are given and disagree.
    """
    legal = strategies_nd(op, mesh_shape, registry)
    if index is not None and not 0 <= index < len(legal):
        raise PlanError(f"{unit}: index {index} out of range; {op.op_type} has {len(legal)}")
    if inputs is None or outputs is None:
        if index is None:
            raise PlanError(f"{unit}: give layouts or an index")
        return index, legal[index]
    want = (tuple(inputs), tuple(outputs))
    found = [i for i, m in enumerate(legal) if (m.inputs, m.outputs) == want]
    if not found:
        options = "; ".join(str(m) for m in itertools.islice(legal, 12))
        shown = f"({', '.join(map(str, inputs))}) -> ({', '.join(map(str, outputs))})"
        raise PlanError(
            f"{unit}: {shown} is not a legal strategy for {op.op_type} with input shapes "
            f"{op.input_shapes} on mesh {tuple(mesh_shape)}; legal ones include: {options}"
        )
    if index is not None and index not in found:
        raise PlanError(f"{unit}: index {index} does not match the layouts given ({found[0]})")
    return found[0], legal[found[0]]
