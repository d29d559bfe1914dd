"""Finite-difference property tests of Gather, GatherND and GatherElements gradients:
any axis, negative and repeated indices, constant or runtime indices."""

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


CASES = {"Gather": _gather(), "GatherND": _gather_nd(), "GatherElements": _gather_elements()}


def test_embedding_with_repeated_ids_accumulates():
    """Token ids as a runtime input, one id repeated: its row gets the summed gradient."""
    rng = np.random.default_rng(0)
    table = normal(rng, (6, 3))
    ids = np.array([[1, 4, 1], [-5, 0, 1]], dtype=np.int64)  # -5 is row 1 as well
    grads = check_gradients(node_case("Gather", [table, ids]))
    assert np.all(grads["x0"][[2, 3, 5]] == 0.0)
    assert np.all(grads["x0"][1] != 0.0)
