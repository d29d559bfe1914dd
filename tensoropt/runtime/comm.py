"""The communicator interface and the in-process (``local``) backend.

A :class:`Communicator` is one rank's handle on the world. A group is a tuple of
global ranks; the position of a rank in the tuple is its position in the group
(AllGather concatenates, and sums are taken, in that order).

The ``local`` backend keeps every rank in one process. :class:`LocalWorld` offers
two ways in:

* :meth:`LocalWorld.run_batched` takes the contributions of all members at once.
  The local executor uses it: it runs the ranks in lockstep (segment i on every
  rank, then collective i over its groups), so no threads are needed.
* :meth:`LocalWorld.communicator` returns a per-rank :class:`LocalCommunicator`
  that satisfies the same :class:`Communicator` protocol as the MPI backend by a
  thread rendezvous. It exists so that code written against the protocol, and the
  collective tests, run unchanged on both backends.

Both paths use the group-order arithmetic of :mod:`tensoropt.runtime.collectives`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from tensoropt.ir.vocab import CollectiveKind
from tensoropt.runtime import collectives as C
from tensoropt.runtime.collectives import CollectiveCall

Group = tuple[int, ...]


@runtime_checkable
class Communicator(Protocol):
    """One rank's view of the collectives. Every member of ``group`` must call."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allreduce(self, x: np.ndarray, group: Group) -> np.ndarray: ...

    def allgather(self, x: np.ndarray, group: Group, axis: int) -> np.ndarray: ...

    def reduce_scatter(self, x: np.ndarray, group: Group, axis: int) -> np.ndarray: ...

    def alltoall(
        self, x: np.ndarray, group: Group, split_axis: int, concat_axis: int
    ) -> np.ndarray: ...

    def barrier(self) -> None: ...


def dispatch(comm: Communicator, call: CollectiveCall, x: np.ndarray) -> np.ndarray:
    """Execute one decoded collective node through ``comm``."""
    if call.kind is CollectiveKind.ALL_REDUCE:
        return comm.allreduce(x, call.group)
    if call.kind is CollectiveKind.ALL_GATHER:
        return comm.allgather(x, call.group, call.axis)
    if call.kind is CollectiveKind.REDUCE_SCATTER:
        return comm.reduce_scatter(x, call.group, call.axis)
    return comm.alltoall(x, call.group, call.split_axis, call.concat_axis)


class LocalWorld:
    """All ranks of a world inside one process; deterministic (group-order sums)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._seq: dict[tuple[Group, int], int] = {}
        self._slots: dict[tuple[Group, int], dict[int, np.ndarray]] = {}
        self._results: dict[tuple[Group, int], dict[int, np.ndarray]] = {}

    def run_batched(
        self, call_by_rank: Mapping[int, CollectiveCall], inputs: Mapping[int, np.ndarray]
    ) -> dict[int, np.ndarray]:
        """Run one collective index on every rank given; each rank names its own group.

        Ranks whose groups coincide are served together; every group must be
        complete (all its members present), which the pre-check guarantees.
        """
        out: dict[int, np.ndarray] = {}
        for rank in sorted(call_by_rank):
            if rank in out:
                continue
            call = call_by_rank[rank]
            parts = [inputs[m] for m in call.group]
            for member, value in zip(call.group, C.apply_parts(call, parts), strict=True):
                out[member] = value
        return out

    def communicator(self, rank: int) -> LocalCommunicator:
        """A per-rank handle for code that runs each rank in its own thread."""
        return LocalCommunicator(self, rank)

    def _rendezvous(
        self,
        rank: int,
        group: Group,
        x: np.ndarray,
        combine: Callable[[Sequence[np.ndarray]], list[np.ndarray]],
    ) -> np.ndarray:
        """Post ``x``; when the whole group has posted, every member gets its result."""
        with self._cond:
            seq = self._seq.get((group, rank), 0)
            self._seq[(group, rank)] = seq + 1
            key = (group, seq)
            slot = self._slots.setdefault(key, {})
            slot[rank] = np.array(x, copy=True)
            if len(slot) == len(group):
                results = combine([slot[m] for m in group])
                self._results[key] = dict(zip(group, results, strict=True))
                del self._slots[key]
                self._cond.notify_all()
            while key not in self._results or rank not in self._results[key]:
                self._cond.wait()
            mine = self._results[key].pop(rank)
            if not self._results[key]:
                del self._results[key]
            return mine


class LocalCommunicator:
    """One rank of a :class:`LocalWorld`; blocks until its whole group has called."""

    def __init__(self, world: LocalWorld, rank: int) -> None:
        self._world = world
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.size

    def allreduce(self, x: np.ndarray, group: Group) -> np.ndarray:
        return self._world._rendezvous(self._rank, group, x, C.allreduce_parts)

    def allgather(self, x: np.ndarray, group: Group, axis: int) -> np.ndarray:
        return self._world._rendezvous(self._rank, group, x, lambda p: C.allgather_parts(p, axis))

    def reduce_scatter(self, x: np.ndarray, group: Group, axis: int) -> np.ndarray:
        return self._world._rendezvous(
            self._rank, group, x, lambda p: C.reduce_scatter_parts(p, axis)
        )

    def alltoall(
        self, x: np.ndarray, group: Group, split_axis: int, concat_axis: int
    ) -> np.ndarray:
        return self._world._rendezvous(
            self._rank, group, x, lambda p: C.alltoall_parts(p, split_axis, concat_axis)
        )

    def barrier(self) -> None:
        everyone = tuple(range(self._world.size))
        self._world._rendezvous(self._rank, everyone, np.zeros(0), C.allreduce_parts)
