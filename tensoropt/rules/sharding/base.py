"""Sharding-rule data types and the declarative factor engine.

A rule answers two questions for one op along ONE mesh axis of size ``n``:

- ``strategies(op, n)``: every legal :class:`OpSharding` (the all-``R`` one first), in a
  deterministic order;
- ``localize(op, s, n)``: how the per-device op differs (:class:`LocalOp`): local shapes,
  rewritten attributes and constant inputs, and a scale to apply to outputs.

Most ops are described by a :class:`FactorSpec` (einsum-like factor labels per tensor dim)
and served by :class:`FactorRule`. Sharding factor ``f`` on the axis shards every dim that
carries ``f``; a factor carried by inputs but no output is contracting and, when the spec
maps it to a :class:`Reduction`, turns the outputs into ``Partial``. Partial-in ->
Partial-out strategies of linear ops are listed explicitly by the spec (``partial``).
Partial values are always floating point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from tensoropt.errors import ShardingError
from tensoropt.ir.layout import Partial, Placement, Replicate, Shard
from tensoropt.rules.sharding.memo import Memo

Shape = tuple[int, ...]
FLOAT_DTYPES = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16
R = Replicate()
P = Partial()


def _hashable(value):
    if isinstance(value, np.ndarray):
        return ("nd", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class OpView:
    """What a rule sees of one node: plain data, no onnx-ir objects.

    ``input_shapes[i] is None`` marks an absent optional input. ``const_inputs[i]`` holds the
    value of a constant input (shape tensors, axes, split sizes), else None. Attributes hold
    plain Python values (ints, floats, strings, lists, numpy arrays for tensors), and only
    the attributes set on the node (rules apply ONNX defaults themselves).
    """

    op_type: str
    attributes: Mapping[str, Any]
    input_shapes: tuple[Shape | None, ...]
    input_dtypes: tuple[int | None, ...]
    output_shapes: tuple[Shape, ...]
    output_dtypes: tuple[int, ...]
    const_inputs: tuple[np.ndarray | None, ...] = ()
    # A MaxPool whose Indices output is read only modulo its input's spatial plane (what
    # the gradient rule reads): the offsets a batch or channel split changes cancel there.
    reduced_indices: bool = False
    # the key, made on first use: the rules' memos ask for it on every lookup
    _key: tuple | None = field(default=None, init=False, compare=False, repr=False)

    def key(self) -> tuple:
        """A hashable key of this view: equal for identical ops (memo keys)."""
        found = self._key
        if found is None:
            found = (
                self.op_type,
                tuple(sorted((k, _hashable(v)) for k, v in self.attributes.items())),
                self.input_shapes,
                self.input_dtypes,
                self.output_shapes,
                self.output_dtypes,
                tuple(_hashable(c) for c in self.const_inputs),
                self.reduced_indices,
            )
            object.__setattr__(self, "_key", found)
        return found

    def __post_init__(self) -> None:
        object.__setattr__(self, "attributes", MappingProxyType(dict(self.attributes)))
        if not self.const_inputs:
            object.__setattr__(self, "const_inputs", (None,) * len(self.input_shapes))
        lengths = (len(self.input_shapes), len(self.input_dtypes), len(self.const_inputs))
        if len(set(lengths)) != 1 or len(self.output_shapes) != len(self.output_dtypes):
            raise ShardingError(
                f"{self.op_type}: OpView has {lengths} input shapes/dtypes/consts and "
                f"{len(self.output_shapes)}/{len(self.output_dtypes)} output shapes/dtypes"
            )

    def attr(self, name: str, default: Any = None) -> Any:
        """Attribute value, or ``default`` (the ONNX default) when not set."""
        return self.attributes.get(name, default)

    def has_input(self, i: int) -> bool:
        """True when input ``i`` is present."""
        return i < len(self.input_shapes) and self.input_shapes[i] is not None

    def const_ints(self, i: int) -> list[int] | None:
        """Constant input ``i`` as a list of Python ints, or None when absent / not constant."""
        if not self.has_input(i) or self.const_inputs[i] is None:
            return None
        return [int(v) for v in np.asarray(self.const_inputs[i]).reshape(-1)]

    def is_float_input(self, i: int) -> bool:
        return self.has_input(i) and self.input_dtypes[i] in FLOAT_DTYPES

    def is_float_output(self, i: int) -> bool:
        return self.output_dtypes[i] in FLOAT_DTYPES


@dataclass(frozen=True, slots=True)
class OpSharding:
    """One legal way to run an op along one mesh axis (None: absent optional input)."""

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement, ...]

    def __str__(self) -> str:
        ins = ", ".join("-" if p is None else str(p) for p in self.inputs)
        return f"({ins}) -> ({', '.join(str(p) for p in self.outputs)})"


@dataclass(frozen=True, slots=True)
class LocalOp:
    """How the per-device op differs from the global op.

    ``attributes`` is the full attribute set of the local node. ``const_inputs[i]`` replaces
    constant input ``i`` (None: unchanged). ``output_scale[j]`` multiplies local output ``j``
    (None: no scaling), e.g. ReduceMean over a sharded dim gives ``Partial`` scaled by 1/n.
    """

    attributes: Mapping[str, Any]
    const_inputs: tuple[np.ndarray | None, ...]
    output_scale: tuple[float | None, ...]
    input_shapes: tuple[Shape | None, ...]
    output_shapes: tuple[Shape, ...]


class ShardingRule(Protocol):
    """Per-op sharding behaviour along one mesh axis of size ``n``."""

    def strategies(self, op: OpView, n: int) -> list[OpSharding]: ...

    def localize(self, op: OpView, s: OpSharding, n: int) -> LocalOp: ...


class Reduction(Enum):
    """What a sharded contracting factor does to the outputs."""

    SUM = "sum"  # outputs become Partial
    MEAN = "mean"  # outputs become Partial, scaled by 1/n


Labels = tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class FactorSpec:
    """Factor labels per dim of every input (None: absent input) and output.

    A ``None`` label means the dim is never sharded. ``reduce`` names the contracting
    factors that may be sharded. ``additive`` inputs (biases) must be ``Partial`` when a
    contracting factor is sharded. ``generated`` allows sharding factors carried only by
    outputs (the rule's rewrite must then fix the shape constants). ``partial`` lists the
    extra Partial-in -> Partial-out strategies of linear ops.
    """

    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels, ...]
    reduce: Mapping[str, Reduction] = field(default_factory=dict)
    additive: frozenset[int] = frozenset()
    generated: bool = False
    partial: tuple[OpSharding, ...] = ()


Rewrite = Callable[
    [OpView, OpSharding, int, LocalOp], tuple[Mapping[str, Any], tuple[np.ndarray | None, ...]]
]


def replicated(op: OpView) -> OpSharding:
    """The all-``R`` strategy (absent inputs: None)."""
    ins = tuple(R if shape is not None else None for shape in op.input_shapes)
    return OpSharding(ins, (R,) * len(op.output_shapes))


def partial_strategy(
    op: OpView, partial_inputs: Sequence[int], outputs: Sequence[Placement] | None = None
) -> OpSharding:
    """Inputs in ``partial_inputs`` are P, other present inputs R; outputs all P by default."""
    ins = tuple(
        None if shape is None else (P if i in partial_inputs else R)
        for i, shape in enumerate(op.input_shapes)
    )
    outs = tuple(outputs) if outputs is not None else (P,) * len(op.output_shapes)
    return OpSharding(ins, outs)


def partial_ok(op: OpView, s: OpSharding) -> bool:
    """Partial placements only on floating-point tensors."""
    ins = all(p != P or op.is_float_input(i) for i, p in enumerate(s.inputs))
    outs = all(p != P or op.is_float_output(j) for j, p in enumerate(s.outputs))
    return ins and outs


def elementwise_labels(op: OpView, prefix: str = "d") -> tuple[tuple[Labels | None, ...], Labels]:
    """Broadcast-aligned labels: an input dim of size 1 or missing gets no factor (R)."""
    out = op.output_shapes[0]
    out_labels = tuple(f"{prefix}{j}" if size != 1 else None for j, size in enumerate(out))
    ins: list[Labels | None] = []
    for shape in op.input_shapes:
        if shape is None:
            ins.append(None)
            continue
        offset = len(out) - len(shape)
        ins.append(
            tuple(
                out_labels[j + offset] if size == out[j + offset] else None
                for j, size in enumerate(shape)
            )
        )
    return tuple(ins), out_labels


def norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    """Normalise a possibly negative axis; raise ShardingError when out of range."""
    if not -rank <= axis < max(rank, 1):
        raise ShardingError(f"{what} {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def _factor_order(spec: FactorSpec) -> list[str]:
    seen: dict[str, None] = {}
    for labels in (*spec.inputs, *spec.outputs):
        for f in labels or ():
            if f is not None:
                seen.setdefault(f, None)
    return list(seen)


def _carriers(op: OpView, spec: FactorSpec, f: str) -> list[int]:
    sizes = []
    for labels, shape in zip(
        (*spec.inputs, *spec.outputs), (*op.input_shapes, *op.output_shapes), strict=True
    ):
        if labels is None or shape is None:
            continue
        sizes += [shape[d] for d, lab in enumerate(labels) if lab == f]
    return sizes


def _placement(labels: Labels | None, f: str, otherwise: Placement) -> Placement | None:
    if labels is None:
        return None
    if f in labels:
        return Shard(labels.index(f))
    return otherwise


def _factor_strategy(op: OpView, spec: FactorSpec, f: str) -> OpSharding | None:
    in_outputs = any(f in labels for labels in spec.outputs)
    in_inputs = any(labels is not None and f in labels for labels in spec.inputs)
    if not in_outputs and f not in spec.reduce:
        return None
    if not in_inputs and not spec.generated:
        return None
    ins = tuple(
        _placement(labels, f, P if (i in spec.additive and not in_outputs) else R)
        for i, labels in enumerate(spec.inputs)
    )
    outs = tuple(_placement(labels, f, P) for labels in spec.outputs)
    if in_outputs and P in outs:
        return None  # a free factor missing from one output: that output cannot be placed
    s = OpSharding(ins, outs)  # type: ignore[arg-type]
    return s if partial_ok(op, s) else None


def factor_strategies(op: OpView, spec: FactorSpec, n: int) -> list[OpSharding]:
    """All-R, then one strategy per shardable factor (in label order), then ``partial``."""
    if len(spec.inputs) != len(op.input_shapes) or len(spec.outputs) != len(op.output_shapes):
        raise ShardingError(f"{op.op_type}: factor spec does not match the node's arity")
    out = [replicated(op)]
    for f in _factor_order(spec):
        sizes = _carriers(op, spec, f)
        if n < 2 or any(size % n or size < n for size in sizes):
            continue
        s = _factor_strategy(op, spec, f)
        if s is not None and s not in out:
            out.append(s)
    if n >= 2:
        out += [s for s in spec.partial if partial_ok(op, s) and s not in out]
    return out


def local_shapes(
    op: OpView, s: OpSharding, n: int
) -> tuple[tuple[Shape | None, ...], tuple[Shape, ...]]:
    """Divide every sharded dim by ``n`` (the strategy is assumed legal)."""

    def shrink(shape: Shape | None, p: Placement | None) -> Shape | None:
        if shape is None or not isinstance(p, Shard):
            return shape
        return tuple(size // n if d == p.dim else size for d, size in enumerate(shape))

    ins = tuple(shrink(sh, p) for sh, p in zip(op.input_shapes, s.inputs, strict=True))
    outs = tuple(shrink(sh, p) for sh, p in zip(op.output_shapes, s.outputs, strict=True))
    return ins, outs  # type: ignore[return-value]


# The legal strategies of the last (rule, op, n) checked. Composing n-D strategies
# localizes every strategy of one op in turn, and each check would enumerate them all
# again; the entry holds the rule and the (frozen) view themselves, compared by identity.
_LAST_LEGAL: list = [None, None, 0, ()]


# (rule, op view key, n) -> its legal strategies, for the checks of ops localized one
# strategy at a time (the chosen strategies of a plan, the micro axis's): the same views
# recur on every mesh and in every layer; bounded, least recently used out first
_CHECKED = Memo(20_000)


def remember_legal(rule: ShardingRule, op: OpView, n: int, legal: list[OpSharding]) -> None:
    """Tell :func:`check_member` the legal strategies of ``(rule, op, n)``, just computed."""
    _LAST_LEGAL[:] = [rule, op, n, legal]


def check_member(rule: ShardingRule, op: OpView, s: OpSharding, n: int) -> None:
    """Raise ShardingError unless ``s`` is one of the rule's strategies for ``op``."""
    last = _LAST_LEGAL
    if last[0] is rule and last[1] is op and last[2] == n:
        legal = last[3]
    else:
        key = (rule, op.key(), n)
        legal = _CHECKED.get(key)
        if legal is None:
            legal = _CHECKED.put(key, rule.strategies(op, n))
        _LAST_LEGAL[:] = [rule, op, n, legal]
    if s not in legal:
        options = "; ".join(str(x) for x in legal)
        raise ShardingError(
            f"{op.op_type}: strategy {s} is not legal on a mesh axis of size {n} for input "
            f"shapes {op.input_shapes}; legal: {options}"
        )


def plain_local(op: OpView, s: OpSharding, n: int, scale: float | None = None) -> LocalOp:
    """LocalOp with unchanged attributes and constants; ``scale`` on Partial outputs."""
    ins, outs = local_shapes(op, s, n)
    scales = tuple(scale if p == P else None for p in s.outputs)
    return LocalOp(op.attributes, (None,) * len(ins), scales, ins, outs)


@dataclass(frozen=True, slots=True)
class FactorRule:
    """A rule served by a :class:`FactorSpec`; ``rewrite`` fixes attributes / constants."""

    spec: Callable[[OpView], FactorSpec]
    rewrite: Rewrite | None = None
    valid: Callable[[OpView, OpSharding, int], bool] | None = None

    def strategies(self, op: OpView, n: int) -> list[OpSharding]:
        found = factor_strategies(op, self.spec(op), n)
        return found if self.valid is None else [s for s in found if self.valid(op, s, n)]

    def localize(self, op: OpView, s: OpSharding, n: int) -> LocalOp:
        check_member(self, op, s, n)
        spec = self.spec(op)
        scale = 1.0 / n if _mean_sharded(spec, s) else None
        local = plain_local(op, s, n, scale)
        if self.rewrite is None:
            return local
        attrs, consts = self.rewrite(op, s, n, local)
        return LocalOp(attrs, consts, local.output_scale, local.input_shapes, local.output_shapes)


def _mean_sharded(spec: FactorSpec, s: OpSharding) -> bool:
    for labels, p in zip(spec.inputs, s.inputs, strict=True):
        if labels is not None and isinstance(p, Shard):
            f = labels[p.dim]
            return f is not None and spec.reduce.get(f) is Reduction.MEAN
    return False


def replace_const(op: OpView, index: int, value: np.ndarray) -> tuple[np.ndarray | None, ...]:
    """const_inputs tuple that replaces input ``index`` only."""
    consts: list[np.ndarray | None] = [None] * len(op.input_shapes)
    consts[index] = value
    return tuple(consts)
