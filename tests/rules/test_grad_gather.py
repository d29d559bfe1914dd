"""Finite-difference property tests of Gather, GatherND and GatherElements gradients:
any axis, negative and repeated indices, constant or runtime indices; of ScatterElements
and ScatterND (reduction none with distinct positions, add with repeats) and TopK."""

from __future__ import annotations

import numpy as np
from grad_harness import Const, check_gradients, node_case, normal, rng_of, shapes
from hypothesis import strategies as st


def _indices(rng, dim, shape, negative: bool):
    """Indices into a dim of size ``dim`` with repeats (few distinct values), some negative."""
    idx = rng.integers(0, dim, size=shape)
    if negative:
        idx = np.where(rng.random(shape) < 0.5, idx - dim, idx)
    return np.asarray(idx, dtype=np.int64)


def _wrap(draw, idx):
    """Constant indices, or a runtime int64 input (normalised in the graph)."""
    return Const(idx) if draw(st.booleans()) else idx


@st.composite
def _gather(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 3))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    idx_shape = draw(shapes(0, 2, 1, 5))
    idx = _indices(rng, shape[axis], idx_shape, draw(st.booleans()))
    return node_case("Gather", [normal(rng, shape), _wrap(draw, idx)], {"axis": axis})


@st.composite
def _gather_nd(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 3))
    depth = draw(st.integers(1, len(shape)))
    batch = draw(shapes(0, 2, 1, 4))
    columns = [_indices(rng, shape[j], batch, draw(st.booleans())) for j in range(depth)]
    idx = np.stack(columns, axis=-1) if batch else np.asarray(columns, dtype=np.int64)
    return node_case("GatherND", [normal(rng, shape), _wrap(draw, idx)])


@st.composite
def _gather_elements(draw):
    rng = rng_of(draw)
    shape = draw(shapes(1, 3))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    idx_shape = list(shape)
    idx_shape[axis] = draw(st.integers(1, 5))
    idx = _indices(rng, shape[axis], idx_shape, draw(st.booleans()))
    return node_case("GatherElements", [normal(rng, shape), _wrap(draw, idx)], {"axis": axis})


@st.composite
def _scatter_elements(draw):
    """Distinct positions per slice for reduction none (overwrites of one position race);
    any positions, repeats included, for add."""
    rng = rng_of(draw)
    shape = draw(shapes(1, 3, 2, 5))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    reduction = draw(st.sampled_from(["none", "add"]))
    upd_shape = list(shape)
    upd_shape[axis] = draw(st.integers(1, shape[axis]))
    if reduction == "none":
        moved = np.moveaxis(np.zeros(upd_shape), axis, -1).shape
        rows = [rng.permutation(shape[axis])[: moved[-1]] for _ in range(int(np.prod(moved[:-1])))]
        idx = np.moveaxis(np.reshape(rows, moved), -1, axis).astype(np.int64)
    else:
        idx = _indices(rng, shape[axis], upd_shape, draw(st.booleans()))
    args = [normal(rng, shape), _wrap(draw, idx), normal(rng, upd_shape)]
    return node_case("ScatterElements", args, {"axis": axis, "reduction": reduction})


@st.composite
def _scatter_nd(draw):
    """Rows of a [N, ...] tensor: distinct rows for none, repeats for add."""
    rng = rng_of(draw)
    shape = draw(shapes(1, 3, 2, 5))
    reduction = draw(st.sampled_from(["none", "add"]))
    count = draw(st.integers(1, shape[0]))
    if reduction == "none":
        rows = rng.permutation(shape[0])[:count]
    else:
        rows = _indices(rng, shape[0], (count,), draw(st.booleans()))
    idx = np.asarray(rows, dtype=np.int64).reshape(count, 1)
    args = [normal(rng, shape), _wrap(draw, idx), normal(rng, (count, *shape[1:]))]
    return node_case("ScatterND", args, {"reduction": reduction})


@st.composite
def _top_k(draw):
    """Values and indices of the k largest (or smallest) along an axis; the values reach
    the loss (distinct inputs: no tie moves under the finite-difference step)."""
    rng = rng_of(draw)
    shape = draw(shapes(1, 3, 2, 5))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    k = draw(st.integers(1, shape[axis]))
    x = rng.permutation(int(np.prod(shape))).reshape(shape).astype(np.float64) / 3.0
    attrs = {"axis": axis, "largest": int(draw(st.booleans()))}
    args = [x, Const(np.array([k], dtype=np.int64))]
    return node_case("TopK", args, attrs, num_outputs=2, loss_outputs=[0])


CASES = {
    "Gather": _gather(),
    "GatherND": _gather_nd(),
    "GatherElements": _gather_elements(),
    "ScatterElements": _scatter_elements(),
    "ScatterND": _scatter_nd(),
    "TopK": _top_k(),
}


def test_embedding_with_repeated_ids_accumulates():
    """Token ids as a runtime input, one id repeated: its row gets the summed gradient."""
    rng = np.random.default_rng(0)
    table = normal(rng, (6, 3))
    ids = np.array([[1, 4, 1], [-5, 0, 1]], dtype=np.int64)  # -5 is row 1 as well
    grads = check_gradients(node_case("Gather", [table, ids]))
    assert np.all(grads["x0"][[2, 3, 5]] == 0.0)
    assert np.all(grads["x0"][1] != 0.0)
