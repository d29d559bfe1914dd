"""Sharding-rule behaviour: coverage, linearity policy, hand-written rules, properties."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sharding_cases import CASES
from sharding_harness import Case, op_view, run, validate

from tensoropt.errors import PlanError, ShardingError, UnsupportedOpError
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard
from tensoropt.rules.sharding import (
    SHARDING_RULES,
    FactorRule,
    FactorSpec,
    OpSharding,
    OpView,
    ShardingRegistry,
    localize_nd,
    resolve_unit,
    strategies_nd,
)
from tensoropt.rules.sharding.base import elementwise_labels

R, P = Replicate(), Partial()

BRIEF_OPS = [
    "MatMul",
    "Gemm",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Sqrt",
    "Reciprocal",
    "Neg",
    "Tanh",
    "Erf",
    "Gelu",
    "Sigmoid",
    "Relu",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",
    "Reshape",
    "Transpose",
    "Split",
    "Slice",
    "Concat",
    "Unsqueeze",
    "Squeeze",
    "Expand",
    "Gather",
    "GatherND",
    "GatherElements",
    "Where",
    "Cast",
    "IsNaN",
    "And",
    "Or",
    "Not",
    "Equal",
    "Less",
    "Greater",
    "Conv",
    "ConvTranspose",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "BatchNormalization",
    "Flatten",
    "Constant",
    "ConstantOfShape",
    "Identity",
    "Dropout",
    "Exp",
    "Log",
    "Abs",
    "Sign",
    "Max",
    "Min",
    "Clip",
    "ScatterND",
    "ScatterElements",
    "Shape",
    "Size",
    "Range",
    "Tile",
    "Pad",
    "Sum",
    "Einsum",
    "Mod",
    "Floor",
    "Ceil",
    "Trilu",
    "CumSum",
    "OneHot",
]

# Ops that must offer Partial-in -> Partial-out (gradient accumulation relies on it).
LINEAR_OPS = [
    "Add",
    "Sub",
    "Neg",
    "Identity",
    "Reshape",
    "Transpose",
    "ReduceSum",
    "ReduceMean",
    "Concat",
    "Slice",
    "Split",
    "MatMul",
    "Gemm",
    "Mul",
    "Div",
    "Cast",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Expand",
    "Sum",
    "Einsum",
    "Gather",
    "Where",
    "Tile",
    "Pad",
    "Trilu",
    "CumSum",
    "AveragePool",
    "GlobalAveragePool",
    "Conv",
    "ConvTranspose",
    "GatherElements",
    "GatherND",
    "ScatterND",
    "ScatterElements",
    "Dropout",
]
# Ops that read only the shape of their input: a P input is fine, the output is R.
SHAPE_ONLY = {"Shape", "Size"}


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _views(op_type: str) -> list[OpView]:
    return [op_view(c, run(c, c.inputs, c.attrs)) for c in CASES[op_type](_rng(op_type))]


def test_registry_covers_every_op_of_the_brief() -> None:
    missing = [op for op in BRIEF_OPS if op not in SHARDING_RULES]
    assert not missing


def test_unknown_op_names_the_op() -> None:
    with pytest.raises(UnsupportedOpError, match="'Foo'"):
        SHARDING_RULES.rule("Foo")


def test_duplicate_registration_is_refused() -> None:
    with pytest.raises(ValueError, match="Add"):
        ShardingRegistry(({"Add": SHARDING_RULES.rule("Add")}, {"Add": SHARDING_RULES.rule("Add")}))


@pytest.mark.parametrize("op_type", LINEAR_OPS)
def test_linear_ops_offer_partial_in_partial_out(op_type: str) -> None:
    offered = [
        s
        for view in _views(op_type)
        for s in SHARDING_RULES.strategies(view, 2)
        if P in s.inputs and all(p in (P, R) for p in s.outputs) and P in s.outputs
    ]
    assert offered, f"{op_type}: no Partial-in -> Partial-out strategy"


@pytest.mark.parametrize("op_type", sorted(CASES))
def test_partial_policy(op_type: str) -> None:
    """Non-linear ops never take P; integer / bool tensors are never P."""
    for view in _views(op_type):
        for s in SHARDING_RULES.strategies(view, 2):
            for i, p in enumerate(s.inputs):
                if p == P:
                    assert op_type in LINEAR_OPS or op_type in SHAPE_ONLY, f"{op_type}: {s}"
                    assert view.is_float_input(i), f"{op_type}: P on non-float input {i}: {s}"
            for j, p in enumerate(s.outputs):
                if p == P:
                    assert view.is_float_output(j), f"{op_type}: P on non-float output {j}: {s}"


def test_size_one_axis_gives_only_replicated() -> None:
    view = _views("MatMul")[0]
    assert SHARDING_RULES.strategies(view, 1) == [OpSharding((R, R), (R,))]


def test_localize_refuses_an_illegal_strategy() -> None:
    view = _views("Softmax")[0]  # (2, 6, 4), axis -1
    with pytest.raises(ShardingError, match="not legal"):
        SHARDING_RULES.localize(view, OpSharding((Shard(2),), (Shard(2),)), 2)


def _reshape_view(src: tuple[int, ...], target: list[int]) -> OpView:
    case = Case("Reshape", [np.zeros(src), np.asarray(target, np.int64)], consts=frozenset({1}))
    return op_view(case, run(case, case.inputs, case.attrs))


def test_reshape_shards_hidden_only_through_heads() -> None:
    # [B, S, H] -> [B, S, nh, hd] with nh = 3, hd = 4: H = 12 divides by 2, nh does not.
    view = _reshape_view((2, 6, 12), [0, 0, 3, 4])
    assert OpSharding((Shard(2), R), (Shard(2),)) not in SHARDING_RULES.strategies(view, 2)
    assert OpSharding((Shard(2), R), (Shard(2),)) in SHARDING_RULES.strategies(view, 3)


def test_reshape_rewrites_target_shape_keeping_minus_one_and_zero() -> None:
    view = _reshape_view((2, 6, 12), [0, 0, 6, -1])
    local = SHARDING_RULES.localize(view, OpSharding((Shard(2), R), (Shard(2),)), 2)
    np.testing.assert_array_equal(local.const_inputs[1], [0, 0, 3, -1])
    local = SHARDING_RULES.localize(view, OpSharding((Shard(1), R), (Shard(1),)), 2)
    np.testing.assert_array_equal(local.const_inputs[1], [0, 0, 6, -1])
    assert local.output_shapes == ((2, 3, 6, 2),)


def test_reduce_mean_over_sharded_dim_is_partial_scaled() -> None:
    case = Case("ReduceMean", [np.zeros((6, 4)), np.asarray([0], np.int64)], consts=frozenset({1}))
    view = op_view(case, run(case, case.inputs, case.attrs))
    s = OpSharding((Shard(0), R), (P,))
    assert s in SHARDING_RULES.strategies(view, 3)
    assert SHARDING_RULES.localize(view, s, 3).output_scale == (pytest.approx(1 / 3),)


def test_gather_never_shards_the_vocab_dim() -> None:
    for view in _views("Gather"):
        axis = view.attr("axis", 0)
        for s in SHARDING_RULES.strategies(view, 2):
            assert s.inputs[0] != Shard(axis), s


def test_conv_never_shards_spatial_dims_and_batchnorm_training_keeps_batch() -> None:
    for view in _views("Conv") + _views("ConvTranspose"):
        for s in SHARDING_RULES.strategies(view, 2):
            assert all(p not in (Shard(2), Shard(3)) for p in s.inputs[:1] + s.outputs), s
    training = [v for v in _views("BatchNormalization") if v.attr("training_mode", 0)]
    assert training
    for s in SHARDING_RULES.strategies(training[0], 2):
        assert s.inputs[0] in (R, Shard(1)), s


def test_grouped_conv_splits_whole_groups_and_runs_fewer_locally() -> None:
    grouped = [v for v in _views("Conv") + _views("ConvTranspose") if v.attr("group", 1) > 1]
    assert len(grouped) == 4
    for view in grouped:
        group = view.attr("group")
        for n in (2, 3, 4):
            found = [s for s in SHARDING_RULES.strategies(view, n) if s.outputs[0] == Shard(1)]
            channels = view.input_shapes[0][1]
            assert bool(found) == (group % n == 0 and channels % n == 0), (view.op_type, n)
            for s in found:
                assert SHARDING_RULES.localize(view, s, n).attributes["group"] == group // n


def test_resolve_unit_by_layouts_and_by_index() -> None:
    view = _views("MatMul")[0]  # (6, 4) @ (4, 12)
    layouts = (Layout.parse("S(0)R"), Layout.parse("RS(1)")), (Layout.parse("S(0)S(1)"),)
    index, strategy = resolve_unit(view, (2, 2), *layouts, unit="mm")
    assert (strategy.inputs, strategy.outputs) == layouts
    assert resolve_unit(view, (2, 2), index=index)[1] == strategy
    with pytest.raises(PlanError, match="index 0 does not match"):
        resolve_unit(view, (2, 2), *layouts, index=0, unit="mm")
    bad = (Layout.parse("S(1)R"), Layout.parse("RR")), (Layout.parse("S(0)R"),)
    with pytest.raises(PlanError, match="mm: .* is not a legal strategy for MatMul"):
        resolve_unit(view, (2, 2), *bad, unit="mm")
    with pytest.raises(PlanError, match="out of range"):
        resolve_unit(view, (2, 2), index=10_000, unit="mm")


def test_localize_nd_multiplies_scales_across_axes() -> None:
    case = Case(
        "ReduceMean", [np.zeros((4, 4)), np.asarray([0, 1], np.int64)], consts=frozenset({1})
    )
    view = op_view(case, run(case, case.inputs, case.attrs))
    both = [m for m in strategies_nd(view, (2, 2)) if m.inputs[0] == Layout.parse("S(0)S(1)")]
    assert len(both) == 1
    assert localize_nd(view, both[0], (2, 2)).output_scale == (pytest.approx(0.25),)


def _wrong_registry(op_type: str, spec) -> ShardingRegistry:
    return ShardingRegistry(({op_type: FactorRule(spec)},))


def test_validator_catches_wrong_rules() -> None:
    """Deliberately wrong rules must fail the validator (the harness can fail)."""

    def softmax_all_dims(op: OpView) -> FactorSpec:
        ins, out = elementwise_labels(op)
        return FactorSpec(ins, (out,))

    def relu_linear(op: OpView) -> FactorSpec:
        ins, out = elementwise_labels(op)
        return FactorSpec(ins, (out,), partial=(OpSharding((P,), (P,)),))

    x = _rng("wrong").standard_normal((6, 4))
    with pytest.raises(AssertionError):
        validate(Case("Softmax", [x]), (2,), registry=_wrong_registry("Softmax", softmax_all_dims))
    with pytest.raises(AssertionError):
        validate(Case("Relu", [x]), (2,), registry=_wrong_registry("Relu", relu_linear))


# ---- property tests: random shapes / attributes, every strategy validated -----------------

DIMS = st.sampled_from([1, 2, 3, 4, 6, 12])


@settings(max_examples=25)
@given(
    out=st.lists(DIMS, min_size=0, max_size=3),
    mask=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    op=st.sampled_from(["Add", "Mul", "Sub", "Div", "Max"]),
)
def test_elementwise_broadcast_property(out: list[int], mask: list[int], op: str) -> None:
    rng = _rng(tuple(out), tuple(mask), op)
    # mask: 0 keep the dim, 1 make it 1 (broadcast), 2 drop it (only leading dims)
    b = [1 if m == 1 else d for d, m in zip(out, mask, strict=False)]
    lead = 0
    while lead < len(b) and mask[lead] == 2:
        lead += 1
    a_shape, b_shape = tuple(out), tuple(b[lead:])
    a = rng.uniform(0.5, 2.0, a_shape)
    bb = rng.uniform(0.5, 2.0, b_shape)
    for mesh in [(2,), (3,), (2, 2)]:
        validate(Case(op, [a, bb]), mesh)
        validate(Case(op, [bb, a]), mesh)


@settings(max_examples=25)
@given(
    batch=st.lists(DIMS, min_size=0, max_size=2),
    m=DIMS,
    k=DIMS,
    n=DIMS,
    a_vec=st.booleans(),
    b_vec=st.booleans(),
)
def test_matmul_property(
    batch: list[int], m: int, k: int, n: int, a_vec: bool, b_vec: bool
) -> None:
    rng = _rng(tuple(batch), m, k, n, a_vec, b_vec)
    a = rng.standard_normal((k,) if a_vec else (*batch, m, k))
    b = rng.standard_normal((k,) if b_vec else (*batch[1:], k, n))
    for mesh in [(2,), (3,), (2, 2)]:
        validate(Case("MatMul", [a, b]), mesh)


@st.composite
def _reshapes(draw):
    factors = draw(st.lists(st.sampled_from([1, 2, 3, 2, 3]), min_size=1, max_size=5))
    cut_src = sorted(draw(st.sets(st.integers(1, len(factors) - 1))) if len(factors) > 1 else [])
    cut_dst = sorted(draw(st.sets(st.integers(1, len(factors) - 1))) if len(factors) > 1 else [])

    def group(cuts: list[int]) -> tuple[int, ...]:
        bounds = [0, *cuts, len(factors)]
        return tuple(int(np.prod(factors[a:b])) for a, b in itertools.pairwise(bounds))

    return group(cut_src), group(cut_dst), draw(st.booleans())


@settings(max_examples=30)
@given(_reshapes())
def test_reshape_property(shapes) -> None:
    src, dst, use_minus_one = shapes
    target = list(dst)
    if use_minus_one:
        target[len(target) // 2] = -1
    x = _rng(src, dst).standard_normal(src)
    case = Case("Reshape", [x, np.asarray(target, np.int64)], consts=frozenset({1}))
    for mesh in [(2,), (3,), (2, 2), (2, 3)]:
        validate(case, mesh)


@settings(max_examples=20)
@given(
    shape=st.lists(DIMS, min_size=1, max_size=3),
    data=st.data(),
    op=st.sampled_from(["ReduceSum", "ReduceMean", "ReduceMax"]),
    keepdims=st.integers(0, 1),
)
def test_reduce_property(shape: list[int], data, op: str, keepdims: int) -> None:
    axes = data.draw(st.sets(st.integers(-len(shape), len(shape) - 1), min_size=1))
    if len({a % len(shape) for a in axes}) != len(axes):
        return  # duplicate axes are invalid ONNX
    x = _rng(tuple(shape), tuple(sorted(axes)), op).standard_normal(shape)
    case = Case(op, [x, np.asarray(sorted(axes), np.int64)], {"keepdims": keepdims}, frozenset({1}))
    for mesh in [(2,), (3,), (2, 2)]:
        validate(case, mesh)


@settings(max_examples=20)
@given(shape=st.lists(DIMS, min_size=1, max_size=4), data=st.data())
def test_transpose_softmax_property(shape: list[int], data) -> None:
    perm = data.draw(st.permutations(range(len(shape))))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = _rng(tuple(shape), tuple(perm), axis).standard_normal(shape)
    for mesh in [(2,), (2, 2)]:
        validate(Case("Transpose", [x], {"perm": list(perm)}), mesh)
        validate(Case("Softmax", [x], {"axis": axis}), mesh)
        validate(Case("LayerNormalization", [x, np.ones(shape[axis:])], {"axis": axis}), mesh)


def test_every_op_the_importer_takes_has_a_sharding_rule_or_is_named() -> None:
    """An op with a gradient rule (train takes it) and no sharding rule would import,
    train, then fail to partition; the ops left without one are named here."""
    from tensoropt.rules.grad import GRAD_RULES

    unpartitioned = {"GlobalMaxPool", "EyeLike", "NonZero"}
    unpartitioned |= {"Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike"}
    unpartitioned |= {"RandomUniform", "RandomUniformLike"}
    assert GRAD_RULES.supported() - set(SHARDING_RULES.op_types) == unpartitioned
