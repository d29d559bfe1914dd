"""Redistribution: every (src, dst) pair on 1-D and 2-D meshes, simulated with numpy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tensoropt.errors import ShardingError
from tensoropt.ir.layout import Layout, Partial, Replicate, Shard, assemble, local_shape, slice_for
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.redistribute import (
    Step,
    comm_bytes,
    latency_terms,
    plan_redistribution,
    simulate,
    step_output_shape,
)
from tensoropt.ir.vocab import CollectiveKind

K = CollectiveKind
PLACEMENTS = (Replicate(), Partial(), Shard(0), Shard(1))
SHAPE = (12, 12)


def _distribute(x: np.ndarray, layout: Layout, mesh: Mesh, rng) -> dict:
    """S slices and R copies; a P axis gets random addends (same on replicated copies)."""
    pieces = {(): x}
    for axis, p in enumerate(layout.placements):
        n, nxt, cache = mesh.shape[axis], {}, {}
        for prefix, a in pieces.items():
            if isinstance(p, Shard):
                parts = np.split(a, n, axis=p.dim)
            elif isinstance(p, Partial):
                key = tuple(
                    0 if isinstance(layout.placements[k], Replicate) else c
                    for k, c in enumerate(prefix)
                )
                if key not in cache:
                    rand = [rng.standard_normal(a.shape) for _ in range(n - 1)]
                    cache[key] = [*rand, a - sum(rand)]
                parts = cache[key]
            else:
                parts = [a] * n
            nxt.update({prefix + (k,): part for k, part in enumerate(parts)})
        pieces = nxt
    return pieces


def _check_pair(src: Layout, dst: Layout, mesh: Mesh, seed: int) -> tuple[Step, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE)
    steps = plan_redistribution(src, dst, SHAPE, mesh)
    out = simulate(steps, _distribute(x, src, mesh, rng), mesh)
    want_shape = local_shape(SHAPE, dst, mesh)
    for c, piece in out.items():
        assert piece.shape == want_shape, f"{src}->{dst} {steps}: rank {c} shape {piece.shape}"
        if not dst.has_partial:
            np.testing.assert_allclose(piece, slice_for(x, dst, mesh, c), rtol=0, atol=1e-12)
    np.testing.assert_allclose(assemble(out, dst, mesh, check_replicas=False), x, atol=1e-12)
    return steps


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("src", PLACEMENTS, ids=str)
@pytest.mark.parametrize("dst", PLACEMENTS, ids=str)
def test_every_pair_on_1d_mesh(src, dst, n: int) -> None:
    steps = _check_pair(Layout((src,)), Layout((dst,)), Mesh.of(n), seed=n)
    assert (src == dst) == (steps == ())


LAYOUTS_2D = [Layout(p) for p in itertools.product(PLACEMENTS, repeat=2)]


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3), (3, 2)], ids=str)
def test_every_pair_on_2d_mesh(mesh_shape) -> None:
    mesh = Mesh.of(*mesh_shape)
    for k, (src, dst) in enumerate(itertools.product(LAYOUTS_2D, repeat=2)):
        steps = _check_pair(src, dst, mesh, seed=k)
        assert (src == dst) == (steps == ()), f"{src}->{dst}: {steps}"


@pytest.mark.slow
def test_every_pair_on_3d_mesh() -> None:
    mesh = Mesh.of(2, 2, 3)
    layouts = [Layout(p) for p in itertools.product(PLACEMENTS, repeat=3)]
    for k, (src, dst) in enumerate(itertools.product(layouts, repeat=2)):
        _check_pair(src, dst, mesh, seed=k)


@pytest.mark.parametrize(
    ("src", "dst", "want"),
    [
        ("P", "R", [Step(K.ALL_REDUCE, 0)]),
        ("P", "S(1)", [Step(K.REDUCE_SCATTER, 0, dim=1)]),
        ("S(0)", "R", [Step(K.ALL_GATHER, 0, dim=0)]),
        ("R", "S(0)", [Step(K.LOCAL_SLICE, 0, dim=0)]),
        ("S(0)", "S(1)", [Step(K.ALL_TO_ALL, 0, src_dim=0, dst_dim=1)]),
        ("R", "P", [Step(K.LOCAL_ZERO, 0)]),
        ("S(1)", "P", [Step(K.ALL_GATHER, 0, dim=1), Step(K.LOCAL_ZERO, 0)]),
        # gather the inner axis before the outer one of the same dim, then slice again
        (
            "S(0)S(0)",
            "RS(0)",
            [
                Step(K.ALL_GATHER, 1, dim=0),
                Step(K.ALL_GATHER, 0, dim=0),
                Step(K.LOCAL_SLICE, 1, dim=0),
            ],
        ),
        ("S(0)S(1)", "S(0)R", [Step(K.ALL_GATHER, 1, dim=1)]),
        ("PS(0)", "S(1)S(0)", [Step(K.REDUCE_SCATTER, 0, dim=1)]),
        (
            "S(0)S(1)",
            "S(1)S(0)",
            [
                Step(K.ALL_GATHER, 1, dim=1),
                Step(K.ALL_GATHER, 0, dim=0),
                Step(K.LOCAL_SLICE, 0, dim=1),
                Step(K.LOCAL_SLICE, 1, dim=0),
            ],
        ),
    ],
)
def test_canonical_step_sequences(src: str, dst: str, want: list[Step]) -> None:
    mesh = Mesh.of(*([2] * len(Layout.parse(src).placements)))
    assert list(plan_redistribution(Layout.parse(src), Layout.parse(dst), SHAPE, mesh)) == want


def test_refuses_uneven_target() -> None:
    with pytest.raises(ShardingError, match=r"v: dim 1 \(size 6; .* 4 pieces"):
        plan_redistribution(Layout.parse("R"), Layout.parse("S(1)"), (12, 6), Mesh.of(4), "v")


def test_comm_bytes_follow_the_alpha_beta_volumes() -> None:
    n, shape = 4, (8, 16)  # 128 float32 elements = 512 bytes held per rank before the step
    b = 512.0
    assert comm_bytes(Step(K.ALL_REDUCE, 0), shape, 1, n) == pytest.approx(2 * 3 / 4 * b)
    assert comm_bytes(Step(K.REDUCE_SCATTER, 0, dim=0), shape, 1, n) == pytest.approx(3 / 4 * b)
    assert comm_bytes(Step(K.ALL_GATHER, 0, dim=0), shape, 1, n) == pytest.approx(3 / 4 * b * n)
    a2a = Step(K.ALL_TO_ALL, 0, src_dim=0, dst_dim=1)
    assert comm_bytes(a2a, shape, np.float64, n) == pytest.approx(3 / 4 * 2 * b)
    assert comm_bytes(Step(K.LOCAL_SLICE, 0, dim=0), shape, 1, n) == 0.0
    assert [latency_terms(k) for k in K] == [2, 1, 1, 1, 0, 0]


def test_step_output_shape_tracks_local_shapes() -> None:
    mesh = Mesh.of(2, 3)
    src, dst = Layout.parse("S(0)S(1)"), Layout.parse("S(1)S(0)")
    shape = local_shape(SHAPE, src, mesh)
    for step in plan_redistribution(src, dst, SHAPE, mesh):
        shape = step_output_shape(step, shape, mesh.shape[step.mesh_axis])
    assert shape == local_shape(SHAPE, dst, mesh)
