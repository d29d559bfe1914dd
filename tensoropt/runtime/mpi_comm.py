"""The ``mpi`` communicator backend (mpi4py over the MPICH wheel).

Every MPI call here only moves bytes (``Alltoall`` / ``Allgather`` on uint8 views
of contiguous numpy buffers); all arithmetic is done in numpy with
:func:`~tensoropt.runtime.collectives.ordered_sum`. Why: MPI's own reductions pick
their summation tree by message size and rank count, so their float results may
differ from the ``local`` backend (and, for some algorithms, between ranks). Here
an AllReduce is a reduce-scatter (AllToAll of chunks, then a group-order sum of
the chunk this rank owns) followed by an AllGather: bandwidth is the same as a
ring allreduce's, and every element is summed as ``((x0 + x1) + x2) + ...`` in
group order, bit-identical to the ``local`` backend on every rank and every run.
Sends are views of the input where the split axis is the first one, and results
reuse the receive buffer, so a call holds its input plus about one input-sized
buffer (docs/design/runtime.md, "Buffers").

Sub-communicators are made once per group with ``Comm.Create_group`` (collective
over the group's members only) and cached; :meth:`MpiCommunicator.prepare`
creates them up front, in one global order, so that no creation happens mid-step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from tensoropt.runtime.collectives import ordered_sum, split_even
from tensoropt.runtime.comm import Group


def _bytes(a: np.ndarray) -> list[Any]:
    from mpi4py import MPI

    return [np.ascontiguousarray(a).reshape(-1).view(np.uint8), MPI.BYTE]


class MpiCommunicator:
    """One MPI process = one rank; groups map to cached sub-communicators."""

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI

        self._world = comm if comm is not None else MPI.COMM_WORLD
        self._comms: dict[Group, Any] = {}

    @property
    def rank(self) -> int:
        return int(self._world.Get_rank())

    @property
    def size(self) -> int:
        return int(self._world.Get_size())

    @property
    def world(self) -> Any:
        """The underlying ``mpi4py`` world communicator."""
        return self._world

    def prepare(self, all_groups: Iterable[Group]) -> None:
        """Create the sub-communicators of this rank's groups.

        ``all_groups`` must be the same collection on every rank (e.g. the union of
        every rank's groups): creation then happens in one global sorted order,
        which cannot deadlock although each creation involves only its members.
        """
        for group in sorted(set(all_groups)):
            if self.rank in group:
                self._sub(group)

    def _sub(self, group: Group) -> Any:
        sub = self._comms.get(group)
        if sub is None:
            mpi_group = self._world.Get_group().Incl(list(group))
            sub = self._world.Create_group(mpi_group)
            mpi_group.Free()
            self._comms[group] = sub
        return sub

    def _alltoall_rows(self, sub: Any, send: np.ndarray) -> np.ndarray:
        """``send[j]`` goes to member j; row j of the result came from member j."""
        send = np.ascontiguousarray(send)
        recv = np.empty_like(send)
        sub.Alltoall(_bytes(send), _bytes(recv))
        return recv

    def _allgather_rows(self, sub: Any, x: np.ndarray, n: int) -> np.ndarray:
        x = np.ascontiguousarray(x)
        recv = np.empty((n, *x.shape), dtype=x.dtype)
        sub.Allgather(_bytes(x), _bytes(recv))
        return recv

    def allreduce(self, x: np.ndarray, group: Group) -> np.ndarray:
        n = len(group)
        if n == 1:
            return np.array(x, copy=True)
        sub = self._sub(group)
        flat = np.ascontiguousarray(x).reshape(-1)
        chunk = -(-flat.size // n)
        if flat.size == n * chunk:
            send = flat.reshape(n, chunk)  # a view: no copy of the input
        else:
            send = np.zeros((n, chunk), dtype=flat.dtype)
            send.reshape(-1)[: flat.size] = flat
        recv = self._alltoall_rows(sub, send)
        del send
        mine = ordered_sum(list(recv))
        # The gathered sums overwrite the received chunks (no longer needed): the
        # call holds the input, one input-sized buffer and one chunk, as a device's
        # out-of-place allreduce does.
        sub.Allgather(_bytes(mine), _bytes(recv))
        return recv.reshape(-1)[: flat.size].reshape(x.shape)

    def allgather(self, x: np.ndarray, group: Group, axis: int) -> np.ndarray:
        n = len(group)
        if n == 1:
            return np.array(x, copy=True)
        rows = self._allgather_rows(self._sub(group), x, n)
        if _leading(axis, x.ndim):  # the rows already lie in the result's order
            return rows.reshape(n * x.shape[0], *x.shape[1:])
        return np.concatenate(list(rows), axis=axis)

    def reduce_scatter(self, x: np.ndarray, group: Group, axis: int) -> np.ndarray:
        n = len(group)
        if n == 1:
            return np.array(x, copy=True)
        recv = self._alltoall_rows(self._sub(group), _pieces(x, n, axis, "ReduceScatter"))
        return ordered_sum(list(recv))

    def alltoall(
        self, x: np.ndarray, group: Group, split_axis: int, concat_axis: int
    ) -> np.ndarray:
        n = len(group)
        if n == 1:
            return np.array(x, copy=True)
        recv = self._alltoall_rows(self._sub(group), _pieces(x, n, split_axis, "AllToAll"))
        if _leading(concat_axis, x.ndim):
            return recv.reshape(n * recv.shape[1], *recv.shape[2:])
        return np.concatenate(list(recv), axis=concat_axis)

    def barrier(self) -> None:
        self._world.Barrier()


def _leading(axis: int, ndim: int) -> bool:
    """True when ``axis`` is the first dimension of a rank-``ndim`` array."""
    return ndim > 0 and axis % ndim == 0


def _pieces(x: np.ndarray, n: int, axis: int, what: str) -> np.ndarray:
    """``x`` split into ``n`` equal pieces along ``axis``, stacked on a new first axis:
    a view of a contiguous ``x`` when ``axis`` is its first, a copy otherwise."""
    if _leading(axis, x.ndim) and x.flags.c_contiguous:
        split_even(x, n, axis, what)  # the same refusal of an uneven split
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])
    return np.stack(split_even(x, n, axis, what))
