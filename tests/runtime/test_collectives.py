"""Collective semantics on the local backend, against plain numpy expressions."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensoropt.ir.vocab import COMMUNICATING_KINDS, CollectiveKind
from tensoropt.runtime.collectives import CollectiveCall
from tensoropt.runtime.comm import Communicator, LocalWorld


def _data(n: int, shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def expected(kind: str, xs: list[np.ndarray], axis: int = 0, split: int = 0, concat: int = 0):
    """Member i's result when member i contributed xs[i] (group order = list order)."""
    n = len(xs)
    if kind == "allreduce":
        total = xs[0].copy()
        for x in xs[1:]:
            total = total + x
        return [total] * n
    if kind == "allgather":
        return [np.concatenate(xs, axis=axis)] * n
    if kind == "reduce_scatter":
        total = xs[0].copy()
        for x in xs[1:]:
            total = total + x
        return np.split(total, n, axis=axis)
    # alltoall: member j gets piece j of everyone's split, concatenated in group order
    return [np.concatenate([np.split(x, n, axis=split)[j] for x in xs], axis=concat)
            for j in range(n)]  # fmt: skip


def _call(comm: Communicator, kind: str, x, group, axis=0, split=0, concat=0):
    if kind == "allreduce":
        return comm.allreduce(x, group)
    if kind == "allgather":
        return comm.allgather(x, group, axis)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(x, group, axis)
    return comm.alltoall(x, group, split, concat)


def run_threads(world: LocalWorld, group, fn):
    """Run fn(comm) for every member of ``group`` in its own thread."""
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(world.communicator(rank))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in group]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    return results


KINDS = ["allreduce", "allgather", "reduce_scatter", "alltoall"]


@given(
    n=st.integers(1, 4),
    perm_seed=st.integers(0, 1000),
    kind=st.sampled_from(KINDS),
    axes=st.tuples(st.integers(0, 1), st.integers(0, 1)),
)
def test_threaded_local_communicator_matches_numpy(n, perm_seed, kind, axes):
    group = tuple(int(r) for r in np.random.default_rng(perm_seed).permutation(6)[:n])
    world = LocalWorld(6)
    shape = (2 * n, 3 * n)
    xs = _data(n, shape, perm_seed)
    by_rank = dict(zip(group, xs, strict=True))
    got = run_threads(
        world, group, lambda c: _call(c, kind, by_rank[c.rank], group, axes[0], *axes)
    )
    want = expected(kind, xs, axes[0], axes[0], axes[1])
    for i, rank in enumerate(group):
        np.testing.assert_array_equal(got[rank], want[i])


@pytest.mark.parametrize("kind", COMMUNICATING_KINDS)
def test_batched_local_serves_several_groups_at_once(kind):
    world = LocalWorld(4)
    groups = {0: (0, 2), 2: (0, 2), 1: (3, 1), 3: (3, 1)}  # (3, 1): rank 3 comes first
    xs = {r: _data(1, (4, 4), r)[0] for r in range(4)}
    calls = {r: CollectiveCall("n", kind, "x", "y", g, axis=1, split_axis=0, concat_axis=1)
             for r, g in groups.items()}  # fmt: skip
    got = world.run_batched(calls, xs)
    name = {"AllReduce": "allreduce", "AllGather": "allgather",
            "ReduceScatter": "reduce_scatter", "AllToAll": "alltoall"}[kind.value]  # fmt: skip
    for group in [(0, 2), (3, 1)]:
        want = expected(name, [xs[r] for r in group], axis=1, split=0, concat=1)
        for i, r in enumerate(group):
            np.testing.assert_array_equal(got[r], want[i])


def test_sum_follows_group_order():
    # In float32, (1e8 + 1) - 1e8 == 0 but (1e8 - 1e8) + 1 == 1: the order is visible.
    vals = {0: np.float32(1e8), 1: np.float32(1.0), 2: np.float32(-1e8)}
    world = LocalWorld(3)
    for group, want in [((0, 1, 2), 0.0), ((0, 2, 1), 1.0)]:
        got = run_threads(world, group, lambda c, g=group: c.allreduce(np.array([vals[c.rank]]), g))
        assert all(float(v[0]) == want for v in got.values())


def test_uneven_split_is_refused():
    from tensoropt.errors import TensorOptError

    world = LocalWorld(2)
    call = CollectiveCall("rs", CollectiveKind.REDUCE_SCATTER, "x", "y", (0, 1), axis=0)
    with pytest.raises(TensorOptError, match="does not split into 2"):
        world.run_batched({0: call, 1: call}, {0: np.ones(3), 1: np.ones(3)})


def test_barrier_waits_for_everyone():
    world = LocalWorld(3)
    order: list[str] = []

    def fn(comm):
        order.append(f"before{comm.rank}")
        comm.barrier()
        order.append(f"after{comm.rank}")

    run_threads(world, (0, 1, 2), fn)
    assert all(e.startswith("before") for e in order[:3])
    assert all(e.startswith("after") for e in order[3:])
