"""Finite-difference property tests of the data-movement gradient rules."""

from __future__ import annotations

import numpy as np
from grad_harness import (
    Const,
    broadcastable_to,
    check_gradients,
    node_case,
    normal,
    rng_of,
    shapes,
)
from hypothesis import strategies as st

INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)


def _ints(values):
    return Const(np.asarray(list(values), dtype=np.int64))


@st.composite
def _reshape(draw):
    rng = rng_of(draw)
    shape = draw(shapes(0, 4))
    total = int(np.prod(shape, dtype=np.int64))
    target = draw(
        st.sampled_from(
            [list(shape[::-1]), [total], [1, total, 1], [-1], [*shape[:1], -1], [0, *shape[1:]]]
        )
    )
    if not shape and 0 in target:
        target = [total]
    return node_case("Reshape", [normal(rng, shape), _ints(target)])


@st.composite
def _flatten(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 4))
    axis = draw(st.integers(-len(shape), len(shape)))
    return node_case("Flatten", [normal(rng, shape)], {"axis": axis})


@st.composite
def _squeeze(draw):
    rng = rng_of(draw)
    shape = draw(st.lists(st.sampled_from([1, 1, 2, 3]), min_size=1, max_size=4))
    ones = [i for i, d in enumerate(shape) if d == 1]
    args = [normal(rng, shape)]
    if ones and draw(st.booleans()):
        axes = draw(st.lists(st.sampled_from(ones), unique=True, min_size=1))
        args.append(_ints(a - len(shape) if draw(st.booleans()) else a for a in axes))
    return node_case("Squeeze", args)


@st.composite
def _unsqueeze(draw):
    rng = rng_of(draw)
    shape = draw(shapes(0, 3))
    out_rank = len(shape) + draw(st.integers(1, 2))
    axes = draw(
        st.lists(
            st.integers(-out_rank, out_rank - 1),
            unique_by=lambda a: a % out_rank,
            min_size=out_rank - len(shape),
            max_size=out_rank - len(shape),
        )
    )
    return node_case("Unsqueeze", [normal(rng, shape), _ints(axes)])


@st.composite
def _transpose(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 4))
    attrs = {}
    if draw(st.booleans()):
        attrs["perm"] = list(draw(st.permutations(range(len(shape)))))
    return node_case("Transpose", [normal(rng, shape)], attrs)


@st.composite
def _expand(draw):
    rng = rng_of(draw)
    out = draw(shapes(0, 4))
    x_shape = draw(broadcastable_to(out))
    # The shape input may itself hold 1s where x is wider (Expand broadcasts both ways).
    target = [
        1 if (i >= len(out) - len(x_shape) and draw(st.booleans())) else d
        for i, d in enumerate(out)
    ]
    return node_case("Expand", [normal(rng, x_shape), _ints(target)])


@st.composite
def _tile(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 3))
    repeats = [draw(st.integers(1, 3)) for _ in shape]
    return node_case("Tile", [normal(rng, shape), _ints(repeats)])


@st.composite
def _concat(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 3))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        part = list(shape)
        part[axis] = draw(st.integers(1, 3))
        parts.append(normal(rng, part))
    return node_case("Concat", parts, {"axis": axis})


@st.composite
def _split(draw):
    """split sizes as an input, or num_outputs (uneven last chunk); some outputs unused."""
    rng = rng_of(draw)
    shape = list(draw(shapes(1, 3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    if draw(st.booleans()):
        sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        shape[axis] = sum(sizes)
        n, args, attrs = len(sizes), [normal(rng, shape), _ints(sizes)], {"axis": axis}
    else:
        n = draw(st.integers(1, 3))
        shape[axis] = n * draw(st.integers(1, 2)) + draw(st.integers(0, 1)) * (n > 1)
        args, attrs = [normal(rng, shape)], {"axis": axis, "num_outputs": n}
    used = draw(st.lists(st.integers(0, n - 1), unique=True, min_size=1, max_size=n))
    return node_case("Split", args, attrs, num_outputs=n, loss_outputs=sorted(used))


@st.composite
def _slice(draw):
    """starts/ends/axes/steps incl. negative values, out-of-range ends, steps != 1."""
    rng = rng_of(draw)
    shape = draw(shapes(1, 3, 1, 6))
    rank = len(shape)
    axes = draw(st.lists(st.integers(0, rank - 1), unique=True, min_size=1, max_size=rank))
    starts, ends, steps = [], [], []
    for a in axes:
        d = shape[a]
        step = draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
        start = draw(st.integers(-d - 1, d + 1))
        # (onnx shape inference mis-sizes INT64_MAX ends with negative steps: not drawn)
        end = draw(
            st.sampled_from(
                [draw(st.integers(-d - 1, d + 1)), INT64_MAX if step > 0 else INT64_MIN]
            )
        )
        starts.append(start)
        ends.append(end)
        steps.append(step)
    signed = [a - rank if draw(st.booleans()) else a for a in axes]
    args = [normal(rng, shape), _ints(starts), _ints(ends), _ints(signed)]
    if any(s != 1 for s in steps) or draw(st.booleans()):
        args.append(_ints(steps))
    return node_case("Slice", args)


@st.composite
def _pad(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 3, 2, 4))
    rank = len(shape)
    pads = [draw(st.integers(-1, 2)) for _ in range(2 * rank)]
    args = [normal(rng, shape), _ints(pads)]
    if draw(st.booleans()):
        args.append(Const(np.asarray(draw(st.sampled_from([0.0, 1.5])))))
    return node_case("Pad", args)


CASES = {
    "Reshape": _reshape(),
    "Flatten": _flatten(),
    "Squeeze": _squeeze(),
    "Unsqueeze": _unsqueeze(),
    "Transpose": _transpose(),
    "Expand": _expand(),
    "Tile": _tile(),
    "Concat": _concat(),
    "Split": _split(),
    "Slice": _slice(),
    "Pad": _pad(),
}


def test_slice_with_negative_strided_steps_on_two_axes():
    x = normal(np.random.default_rng(0), (5, 7))
    case = node_case(
        "Slice", [x, _ints([4, 1]), _ints([INT64_MIN, 7]), _ints([0, 1]), _ints([-2, 3])]
    )
    check_gradients(case)


def test_empty_slice_gives_zero_gradient():
    x = normal(np.random.default_rng(0), (3, 4))
    grads = check_gradients(node_case("Slice", [x, _ints([2]), _ints([2]), _ints([1])]))
    np.testing.assert_array_equal(grads["x0"], np.zeros_like(x))
