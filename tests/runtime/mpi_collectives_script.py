"""Run every collective through MpiCommunicator; started by test_mpi.py under mpiexec.

Usage: mpiexec -n 4 python mpi_collectives_script.py OUT_DIR
Writes OUT_DIR/rank_<k>.npz with one array per (collective, group set).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tensoropt.runtime.mpi_comm import MpiCommunicator

# Group sets: each rank picks the group it belongs to; (3, 1) puts rank 3 first.
GROUP_SETS = {
    "world": [(0, 1, 2, 3)],
    "pairs": [(0, 1), (2, 3)],
    "strided": [(0, 2), (3, 1)],
    "self": [(0,), (1,), (2,), (3,)],
}


def data(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal((8, 12)).astype(np.float32)


def main() -> None:
    out = Path(sys.argv[1])
    comm = MpiCommunicator()
    comm.prepare(g for groups in GROUP_SETS.values() for g in groups)
    x = data(comm.rank)
    results = {}
    for name, groups in GROUP_SETS.items():
        group = next(g for g in groups if comm.rank in g)
        results[f"allreduce/{name}"] = comm.allreduce(x, group)
        results[f"allgather/{name}"] = comm.allgather(x, group, 1)
        results[f"reduce_scatter/{name}"] = comm.reduce_scatter(x, group, 0)
        results[f"alltoall/{name}"] = comm.alltoall(x, group, 1, 0)
        # the leading-axis forms (views, no copies) and a transposed (strided) input
        results[f"allgather0/{name}"] = comm.allgather(x, group, -2)
        results[f"reduce_scatter1/{name}"] = comm.reduce_scatter(x, group, 1)
        results[f"reduce_scatter_t/{name}"] = comm.reduce_scatter(x.T, group, 0)
        results[f"alltoall01/{name}"] = comm.alltoall(x, group, 0, 1)
        results[f"alltoall00/{name}"] = comm.alltoall(x, group, 0, -2)
        results[f"allreduce_t/{name}"] = comm.allreduce(x.T, group)
    results["allreduce_int/world"] = comm.allreduce(np.arange(5, dtype=np.int64) * comm.rank,
                                                    (0, 1, 2, 3))  # fmt: skip
    comm.barrier()
    np.savez(out / f"rank_{comm.rank}.npz", **results)


if __name__ == "__main__":
    main()
