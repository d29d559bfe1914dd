"""The collective benchmark's rounds: every point once per round, in an order of its own."""

from __future__ import annotations

import numpy as np

from tensoropt.calibrate.collectives import CommSpec, measure_comm, samples_per_point


class Recorder:
    """A one-rank communicator that records (kind, bytes) of every call."""

    size = 1
    rank = 0

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def _record(self, kind: str, x: np.ndarray) -> np.ndarray:
        self.calls.append((kind, x.nbytes))
        return x

    def allreduce(self, x, group):
        return self._record("AllReduce", x)

    def allgather(self, x, group, axis):
        return self._record("AllGather", x)

    def reduce_scatter(self, x, group, axis):
        return self._record("ReduceScatter", x)

    def alltoall(self, x, group, split_axis, concat_axis):
        return self._record("AllToAll", x)

    def barrier(self) -> None:
        pass


def _sequence(spec: CommSpec) -> list[list[tuple[str, int]]]:
    comm = Recorder()
    measure_comm(comm, spec, lambda t: t)
    points = 4 * len(spec.sizes)
    timed = comm.calls[2 * points :]  # after two warm-up calls of every point
    return [timed[i : i + points] for i in range(0, len(timed), points)]


def test_each_round_times_every_point_once_in_an_order_every_rank_repeats():
    spec = CommSpec((64, 1024, 16384), repeats=1)
    rounds = _sequence(spec)
    assert len(rounds) == samples_per_point(spec)
    assert all(sorted(r) == sorted(rounds[0]) and len(set(r)) == len(r) for r in rounds)
    # no fixed order: a point does not always follow the same one
    assert len({tuple(r) for r in rounds}) > 1
    assert len({r[0] for r in rounds}) > 1
    # the same sequence on every rank: their collective calls must match
    assert _sequence(spec) == rounds
