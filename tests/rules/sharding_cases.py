"""Small random instances of every op with a sharding rule (several per op).

Dims are drawn from sizes like 6 and 12 so that meshes of 2 and 3 both exercise sharding,
plus 1s (broadcast), 4s (2 divides, 3 does not) and odd sizes (nothing divides).
Cases are float64 where onnxruntime's CPU kernels support double; the few float32 cases
name the reason next to them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from sharding_harness import Case

Gen = Callable[[np.random.Generator], list[Case]]
I64 = np.int64


def _f(rng: np.random.Generator, *shape: int, dtype=np.float64) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape), dtype=dtype)


def _pos(rng: np.random.Generator, *shape: int, dtype=np.float64) -> np.ndarray:
    return np.asarray(rng.uniform(0.5, 2.0, shape), dtype=dtype)


def _i(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=I64)


def _unary(op: str, pos: bool = False, dtype=np.float64, **attrs) -> Gen:
    def gen(rng):
        make = _pos if pos else _f
        return [
            Case(op, [make(rng, 6, 4, dtype=dtype)], dict(attrs)),
            Case(op, [make(rng, 2, 6, 3, dtype=dtype)], dict(attrs)),
        ]

    return gen


BROADCAST_PAIRS = [((6, 4), (6, 4)), ((2, 6, 4), (4,)), ((6, 1), (1, 12)), ((), (6, 3))]


def _binary(op: str, pos: bool = False) -> Gen:
    def gen(rng):
        make = _pos if pos else _f
        return [Case(op, [make(rng, *a), make(rng, *b)]) for a, b in BROADCAST_PAIRS]

    return gen


def _variadic(op: str) -> Gen:
    def gen(rng):
        return [
            Case(op, [_f(rng, 6, 4), _f(rng, 4), _f(rng, 2, 6, 1)]),
            Case(op, [_f(rng, 6, 4)]),
        ]

    return gen


def _compare(op: str) -> Gen:
    def gen(rng):
        ints = rng.integers(0, 3, (6, 4)).astype(I64)
        return [
            Case(op, [_f(rng, 6, 4), _f(rng, 4)]),
            Case(op, [ints, rng.integers(0, 3, (1, 4)).astype(I64)]),
        ]

    return gen


def _logic(op: str) -> Gen:
    def gen(rng):
        a, b = rng.random((6, 4)) > 0.5, rng.random((4,)) > 0.5
        return [Case(op, [a] if op == "Not" else [a, b])]

    return gen


def _clip(rng):
    x = _f(rng, 6, 4)
    return [
        Case("Clip", [x, np.array(-0.5), np.array(0.7)], consts=frozenset({1, 2})),
        Case("Clip", [x, None, np.array(0.1)], consts=frozenset({2})),
    ]


def _mod(rng):
    a = rng.integers(-9, 9, (6, 4)).astype(I64)
    b = rng.integers(1, 5, (4,)).astype(I64)
    return [
        Case("Mod", [a, b]),
        Case("Mod", [_f(rng, 6, 4), _pos(rng, 6, 4)], {"fmod": 1}),
    ]


def _isnan(rng):
    x = _f(rng, 6, 4)
    x[rng.random((6, 4)) > 0.7] = np.nan
    return [Case("IsNaN", [x])]


def _isinf(rng):
    x = _f(rng, 6, 4)
    x[rng.random((6, 4)) > 0.7] = np.inf
    return [Case("IsInf", [x])]


def _variadic_f32(op: str) -> Gen:
    """``_variadic`` in float32 (no double kernel in onnxruntime's CPU provider)."""

    def gen(rng):
        return [
            Case(op, [x.astype(np.float32) for x in case.inputs]) for case in _variadic(op)(rng)
        ]

    return gen


def _where(rng):
    return [
        Case("Where", [rng.random((6, 4)) > 0.5, _f(rng, 6, 4), _f(rng, 6, 4)]),
        Case("Where", [rng.random((1, 4)) > 0.5, _f(rng, 2, 6, 4), _f(rng, 4)]),
    ]


def _cast(rng):
    return [
        Case("Cast", [_f(rng, 6, 4)], {"to": 11}),
        Case("Cast", [_f(rng, 6, 4) * 5], {"to": 7}),
        Case("Cast", [rng.integers(-5, 5, (2, 6)).astype(I64)], {"to": 11}),
        # float32 input: exercises a float -> float cast that changes the precision
        Case("Cast", [_f(rng, 6, 2, dtype=np.float32)], {"to": 11}),
    ]


def _identity(rng):
    return [Case("Identity", [_f(rng, 6, 4)])]


def _matmul(rng):
    shapes = [
        ((6, 4), (4, 12)),
        ((2, 6, 4), (4, 6)),
        ((2, 1, 6, 4), (3, 4, 2)),
        ((4,), (4, 6)),
        ((6, 4), (4,)),
        ((6, 12), (12, 6)),
    ]
    return [Case("MatMul", [_f(rng, *a), _f(rng, *b)]) for a, b in shapes]


def _gemm(rng):
    return [
        Case("Gemm", [_f(rng, 6, 4), _f(rng, 4, 12), _f(rng, 12)], {"alpha": 0.5, "beta": 2.0}),
        Case("Gemm", [_f(rng, 4, 6), _f(rng, 12, 4)], {"transA": 1, "transB": 1}),
        Case("Gemm", [_f(rng, 6, 6), _f(rng, 6, 6), _f(rng, 6, 1)], {"transB": 1}),
    ]


def _einsum(rng):
    eqs = [
        ("bij,bjk->bik", [(2, 6, 4), (2, 4, 6)]),
        ("ij->ji", [(6, 4)]),
        ("...ij,jk->...ik", [(2, 6, 4), (4, 6)]),
        ("ii->i", [(6, 6)]),
        ("ij,ij->", [(6, 4), (6, 4)]),
        ("bhqd,bhkd->bhqk", [(2, 3, 6, 4), (2, 3, 6, 4)]),
        ("ij,jk", [(6, 4), (4, 6)]),
    ]
    return [Case("Einsum", [_f(rng, *s) for s in shapes], {"equation": eq}) for eq, shapes in eqs]


def _reduce(op: str) -> Gen:
    def gen(rng):
        x = _f(rng, 6, 4, 12)
        c = frozenset({1})
        return [
            Case(op, [x, _i(1)], {"keepdims": 0}, c),
            Case(op, [x, _i(1)], {"keepdims": 1}, c),
            Case(op, [x, _i(0, -1)], {"keepdims": 0}, c),
            Case(op, [x]),
            Case(op, [x], {"noop_with_empty_axes": 1}),
        ]

    return gen


def _softmax(op: str) -> Gen:
    def gen(rng):
        x = _f(rng, 2, 6, 4)
        return [Case(op, [x]), Case(op, [x], {"axis": 1})]

    return gen


def _layer_norm(rng):
    x = _f(rng, 2, 6, 4)
    return [
        Case("LayerNormalization", [x, _f(rng, 4), _f(rng, 4)], {"epsilon": 1e-5}, n_outputs=3),
        Case("LayerNormalization", [x, _f(rng, 6, 4)], {"axis": 1}),
    ]


# Conv / ConvTranspose / AveragePool / GlobalAveragePool: onnxruntime's CPU kernels are
# float32 only. A conv output sums at most 4*3*3 = 36 products of N(0,1) values (|sum of
# |terms|| ~ 30); reordering that sum across shards (and P addends of size ~1) changes it by
# about sqrt(36) * 6e-8 * 30 ~ 1e-5 in the worst realistic case, so 2e-5 rtol/atol is tight.
# Pools average at most 9 values of size ~1: 1e-6.
F32 = np.float32


def _conv_case(op: str, rng, shapes, attrs=None) -> Case:
    """A float32 Conv/ConvTranspose case: x, w (and bias) of ``shapes``."""
    return Case(op, [_f(rng, *shape, dtype=F32) for shape in shapes], attrs or {}, tol=2e-5)


def _conv(rng):
    return [
        _conv_case("Conv", rng, [(2, 4, 5, 5), (6, 4, 3, 3), (6,)], {"pads": [1, 1, 1, 1]}),
        _conv_case("Conv", rng, [(6, 6, 4, 4), (12, 6, 2, 2)], {"strides": [2, 2]}),
        _conv_case("Conv", rng, [(2, 4, 4, 4), (6, 2, 3, 3)], {"group": 2}),
        # depthwise, whole groups split: 6 groups over 2 and 3, not over 4 (2x2)
        _conv_case(
            "Conv", rng, [(2, 6, 5, 5), (12, 1, 3, 3), (12,)], {"group": 6, "pads": [1, 1, 1, 1]}
        ),
        # 2 groups of 4 channels: a split of 4 divides the channels, not the groups
        _conv_case("Conv", rng, [(2, 8, 4, 4), (8, 4, 3, 3)], {"group": 2}),
    ]


def _conv_transpose(rng):
    op = "ConvTranspose"
    return [
        _conv_case(op, rng, [(2, 4, 3, 3), (4, 6, 2, 2), (6,)], {"strides": [2, 2]}),
        _conv_case(op, rng, [(6, 6, 3, 3), (6, 4, 3, 3)]),
        _conv_case(op, rng, [(2, 4, 3, 3), (4, 3, 2, 2), (6,)], {"group": 2, "strides": [2, 2]}),
    ]


def _max_pool(rng):
    x = _f(rng, 2, 6, 6, 6)  # MaxPool has a double kernel
    return [
        Case("MaxPool", [x], {"kernel_shape": [2, 2], "strides": [2, 2]}, tol=0),
        Case("MaxPool", [x], {"kernel_shape": [3, 3]}, n_outputs=2, tol=0),
    ]


def _avg_pool(rng):
    x = _f(rng, 2, 6, 6, 6, dtype=F32)
    return [
        Case("AveragePool", [x], {"kernel_shape": [2, 2], "strides": [2, 2]}, tol=1e-6),
        Case(
            "AveragePool",
            [x],
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
            tol=1e-6,
        ),
    ]


def _global_avg_pool(rng):
    return [Case("GlobalAveragePool", [_f(rng, 2, 6, 3, 3, dtype=F32)], tol=1e-6)]


def _batch_norm(rng):
    c = 6
    params = [_f(rng, c), _f(rng, c), _f(rng, c), _pos(rng, c)]
    return [
        Case("BatchNormalization", [_f(rng, 2, c, 3, 3), *params], {"epsilon": 1e-5}),
        Case(
            "BatchNormalization",
            [_f(rng, 4, c, 2, 2), *params],
            {"training_mode": 1, "momentum": 0.9},
            n_outputs=3,
        ),
    ]


def _dropout(rng):
    x = _f(rng, 6, 4)
    return [
        Case("Dropout", [x], n_outputs=2),
        Case("Dropout", [x, np.array(0.0), np.array(True)], consts=frozenset({1, 2}), n_outputs=2),
        Case("Dropout", [x, np.array(0.5), np.array(False)], consts=frozenset({1, 2})),
    ]


def _reshape(rng):
    c = frozenset({1})
    return [
        Case("Reshape", [_f(rng, 2, 6, 12), _i(0, 0, 6, -1)], consts=c),
        Case("Reshape", [_f(rng, 6, 4), _i(24)], consts=c),
        Case("Reshape", [_f(rng, 2, 3, 4), _i(6, 4)], consts=c),
        Case("Reshape", [_f(rng, 12, 6), _i(2, 6, -1)], consts=c),
        Case("Reshape", [_f(rng, 6, 1, 4), _i(6, 4, 1)], consts=c),
        Case("Reshape", [_f(rng, 6, 4, 3), _i(3, 2, 12)], consts=c),
    ]


def _flatten(rng):
    x = _f(rng, 2, 6, 2, 3)
    return [Case("Flatten", [x], {"axis": a}) for a in (0, 1, 2)]


def _squeeze(rng):
    return [
        Case("Squeeze", [_f(rng, 6, 1, 4), _i(1)], consts=frozenset({1})),
        Case("Squeeze", [_f(rng, 1, 6, 1)]),
    ]


def _unsqueeze(rng):
    return [Case("Unsqueeze", [_f(rng, 6, 4), _i(0, 2)], consts=frozenset({1}))]


def _expand(rng):
    c = frozenset({1})
    return [
        Case("Expand", [_f(rng, 6, 1), _i(6, 4)], consts=c),
        Case("Expand", [_f(rng, 4), _i(2, 6, 4)], consts=c),
        Case("Expand", [_f(rng, 1, 12), _i(6, 1, 1)], consts=c),
    ]


def _transpose(rng):
    x = _f(rng, 2, 6, 4)
    return [Case("Transpose", [x], {"perm": [2, 0, 1]}), Case("Transpose", [x])]


def _concat(rng):
    return [
        Case("Concat", [_f(rng, 6, 4), _f(rng, 6, 2)], {"axis": 1}),
        Case("Concat", [_f(rng, 2, 4), _f(rng, 4, 4), _f(rng, 6, 4)], {"axis": -2}),
    ]


def _split(rng):
    return [
        Case("Split", [_f(rng, 6, 12), _i(2, 4)], {"axis": 0}, frozenset({1}), n_outputs=2),
        Case("Split", [_f(rng, 6, 4)], {"axis": 1, "num_outputs": 2}, n_outputs=2),
    ]


def _slice(rng):
    x = _f(rng, 6, 4, 12)
    big = np.iinfo(np.int64).max
    return [
        Case("Slice", [x, _i(1), _i(5), _i(0)], consts=frozenset({1, 2, 3})),
        Case("Slice", [x, _i(0, 1), _i(big, 3), _i(0, 1)], consts=frozenset({1, 2, 3})),
        Case("Slice", [x, _i(-6, 0), _i(12, 6), _i(2, 0)], consts=frozenset({1, 2, 3})),
        Case("Slice", [x, _i(5), _i(-big), _i(0), _i(-1)], consts=frozenset({1, 2, 3, 4})),
    ]


def _tile(rng):
    return [Case("Tile", [_f(rng, 6, 4), _i(1, 2)], consts=frozenset({1}))]


def _pad(rng):
    x = _f(rng, 6, 4)
    c = frozenset({1, 2})
    return [
        Case("Pad", [x, _i(0, 1, 0, 2)], consts=frozenset({1})),
        Case("Pad", [x, _i(0, 1, 0, 2), np.array(1.5)], consts=c),
        Case("Pad", [x, _i(0, 1, 0, 1)], {"mode": "reflect"}, consts=frozenset({1})),
        Case("Pad", [x, _i(1, 1), None, _i(1)], consts=frozenset({1, 3})),
    ]


def _gather(rng):
    return [
        Case("Gather", [_f(rng, 12, 4), rng.integers(0, 12, (2, 6)).astype(I64)]),
        Case("Gather", [_f(rng, 6, 4), rng.integers(-4, 4, (3,)).astype(I64)], {"axis": 1}),
        Case("Gather", [_f(rng, 6, 4), np.array(2, dtype=I64)]),
    ]


def _top_k(rng):
    k = np.array([2], dtype=I64)
    return [
        Case("TopK", [_f(rng, 4, 6, 3), k], {"axis": 1}, n_outputs=2, tol=0, consts=frozenset({1})),
        Case("TopK", [_f(rng, 6, 4), k], {"largest": 0}, n_outputs=2, tol=0, consts=frozenset({1})),
    ]


def _arg(op: str):
    def cases(rng):
        return [
            Case(op, [_f(rng, 4, 6, 3)], {"axis": 1}, tol=0),
            Case(op, [_f(rng, 6, 4)], {"axis": -1, "keepdims": 0}, tol=0),
            Case(op, [_f(rng, 4, 2, 6)], {"select_last_index": 1}, tol=0),
        ]

    return cases


def _gather_elements(rng):
    return [
        Case(
            "GatherElements", [_f(rng, 6, 4), rng.integers(0, 4, (6, 4)).astype(I64)], {"axis": 1}
        ),
        Case("GatherElements", [_f(rng, 6, 4), rng.integers(0, 6, (6, 2)).astype(I64)]),
    ]


def _gather_nd(rng):
    return [
        Case("GatherND", [_f(rng, 6, 4), rng.integers(0, 6, (2, 1)).astype(I64)]),
        Case(
            "GatherND",
            [_f(rng, 2, 6, 4), rng.integers(0, 6, (2, 3, 1)).astype(I64)],
            {"batch_dims": 1},
        ),
        Case("GatherND", [_f(rng, 6, 4, 2), rng.integers(0, 4, (6, 2)).astype(I64)]),
    ]


def _scatter_nd(rng):
    return [
        Case("ScatterND", [_f(rng, 6, 4), np.array([[4], [1]], dtype=I64), _f(rng, 2, 4)]),
        Case(
            "ScatterND",
            [_f(rng, 6, 4), np.array([[2], [2], [0]], dtype=I64), _f(rng, 3, 4)],
            {"reduction": "add"},
        ),
        Case(
            "ScatterND",
            [_f(rng, 6, 4), np.array([[1, 2]], dtype=I64), _f(rng, 1)],
            {"reduction": "mul"},
        ),
    ]


def _scatter_elements(rng):
    idx = np.stack([rng.permutation(4)[:2] for _ in range(6)]).astype(I64)
    return [
        Case("ScatterElements", [_f(rng, 6, 4), idx, _f(rng, 6, 2)], {"axis": 1}),
        Case(
            "ScatterElements", [_f(rng, 6, 4), idx, _f(rng, 6, 2)], {"axis": 1, "reduction": "max"}
        ),
    ]


def _onehot(rng):
    idx = rng.integers(0, 4, (2, 6)).astype(I64)
    vals = np.array([0.0, 1.0], dtype=np.float32)  # ORT OneHot kernels: float32 values
    c = frozenset({1, 2})
    return [
        Case("OneHot", [idx, np.array(4, dtype=I64), vals], consts=c),
        Case("OneHot", [idx, np.array(4, dtype=I64), vals], {"axis": 0}, consts=c),
    ]


def _shape(rng):
    x = _f(rng, 6, 4, 2)
    return [Case("Shape", [x]), Case("Shape", [x], {"start": 1}), Case("Shape", [x], {"end": 1})]


def _size(rng):
    return [Case("Size", [_f(rng, 6, 4)])]


def _constant(rng):
    return [Case("Constant", [], {"value": _f(rng, 6, 4)})]


def _constant_of_shape(rng):
    return [
        Case("ConstantOfShape", [_i(6, 4)], {"value": np.array([2.5])}, frozenset({0})),
        Case("ConstantOfShape", [_i(12)], consts=frozenset({0})),
    ]


def _range(rng):
    return [
        Case(
            "Range",
            [np.array(0, I64), np.array(12, I64), np.array(2, I64)],
            consts=frozenset({0, 1, 2}),
        )
    ]


def _trilu(rng):
    return [
        Case("Trilu", [_f(rng, 2, 6, 6)]),
        Case("Trilu", [_f(rng, 6, 6, 4), np.array(1, I64)], {"upper": 0}, frozenset({1})),
    ]


def _cumsum(rng):
    x = _f(rng, 6, 4)
    return [
        Case("CumSum", [x, np.array(1, I64)], consts=frozenset({1})),
        Case("CumSum", [x, np.array(0, I64)], {"exclusive": 1, "reverse": 1}, frozenset({1})),
    ]


CASES: dict[str, Gen] = {
    **{
        op: _unary(op)
        for op in ("Neg", "Tanh", "Sigmoid", "Relu", "Exp", "Abs", "Sign", "Floor", "Ceil")
    },
    **{op: _unary(op, pos=True) for op in ("Sqrt", "Reciprocal", "Log")},
    # Erf and Gelu: onnxruntime's CPU kernels are float32 only; no P strategies, so the
    # per-shard results are the same float32 computations (default tolerance 1e-5).
    "Erf": _unary("Erf", dtype=np.float32),
    "Gelu": _unary("Gelu", dtype=np.float32, approximate="tanh"),
    # the same for these activations: float32 only in onnxruntime's CPU kernels
    **{
        op: _unary(op, dtype=np.float32)
        for op in ("Elu", "LeakyRelu", "HardSigmoid", "HardSwish", "Softplus")
    },
    **{op: _unary(op) for op in ("Cos", "Sin", "Round")},
    **{op: _binary(op) for op in ("Add", "Sub", "Mul", "Max", "Min")},
    "Div": _binary("Div", pos=True),
    "Pow": _binary("Pow", pos=True),
    "Sum": _variadic("Sum"),
    "Mean": _variadic_f32("Mean"),
    "Clip": _clip,
    "Mod": _mod,
    **{op: _compare(op) for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")},
    **{op: _logic(op) for op in ("And", "Or", "Xor", "Not")},
    "IsNaN": _isnan,
    "IsInf": _isinf,
    "Where": _where,
    "Cast": _cast,
    "Identity": _identity,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Einsum": _einsum,
    **{
        op: _reduce(op)
        for op in (
            *("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"),
            *("ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp"),
        )
    },
    "Softmax": _softmax("Softmax"),
    "LogSoftmax": _softmax("LogSoftmax"),
    "LayerNormalization": _layer_norm,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "MaxPool": _max_pool,
    "AveragePool": _avg_pool,
    "GlobalAveragePool": _global_avg_pool,
    "BatchNormalization": _batch_norm,
    "Dropout": _dropout,
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Expand": _expand,
    "Transpose": _transpose,
    "Concat": _concat,
    "Split": _split,
    "Slice": _slice,
    "Tile": _tile,
    "Pad": _pad,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "GatherND": _gather_nd,
    "ScatterND": _scatter_nd,
    "ScatterElements": _scatter_elements,
    "TopK": _top_k,
    "ArgMax": _arg("ArgMax"),
    "ArgMin": _arg("ArgMin"),
    "OneHot": _onehot,
    "Shape": _shape,
    "Size": _size,
    "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
    "Range": _range,
    "Trilu": _trilu,
    "CumSum": _cumsum,
}
