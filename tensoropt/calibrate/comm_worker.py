"""One MPI rank of the collective benchmark (``tensoropt calibrate --backend mpi``).

``mpiexec -n N python -m tensoropt.calibrate.comm_worker CONFIG.json``: every rank
times the collectives through :class:`~tensoropt.runtime.mpi_comm.MpiCommunicator`;
rank 0 prints ``POINT`` after each round of samples (the parent's progress bar) and
writes the points to the path in the config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    from tensoropt.calibrate.collectives import CommSpec, measure_comm
    from tensoropt.runtime.checkpoint import write_atomic
    from tensoropt.runtime.mpi_comm import MpiCommunicator

    argv = sys.argv[1:] if argv is None else argv
    config = json.loads(Path(argv[0]).read_text())
    spec = CommSpec.from_json(config["spec"])
    world = MPI.COMM_WORLD
    comm = MpiCommunicator(world)
    comm.prepare([tuple(range(comm.size))])
    root = comm.rank == 0

    def slowest(t: float) -> float:
        return float(world.allreduce(t, op=MPI.MAX))

    def on_point() -> None:
        if root:
            print("POINT", flush=True)

    points = measure_comm(comm, spec, slowest, on_point)
    if root:
        write_atomic(config["out"], json.dumps(points).encode())
    world.Barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
