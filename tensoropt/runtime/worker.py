"""One MPI rank of ``tensoropt run --backend mpi``.

Started by :mod:`tensoropt.runtime.launcher` as
``mpiexec -n N python -m tensoropt.runtime.worker RUNDIR/config.json``. Talks to
the parent only through files in RUNDIR and JSON lines on stdout:

* ``rank_<k>.pid``   -- "<host> <pid>", written first (the parent's watchdog);
* stdout lines ``TENSOROPT_PROGRESS {...}`` from rank 0 after every step;
* ``error_rank_<k>.json`` -- the error of a failing rank (then MPI Abort);
* ``result.json`` + ``result.tensors`` (a tensor file) -- rank 0's result;
  ``rank_<k>.done`` at the end.

``TENSOROPT_FAULT_INJECT=RANK:STEP[:hang]`` makes rank RANK die (``os._exit``),
or hang, just before global step STEP: the fault-handling tests use it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

PROGRESS = "TENSOROPT_PROGRESS "
FAULT_ENV = "TENSOROPT_FAULT_INJECT"


def _fault_from_env() -> tuple[int, int, str] | None:
    raw = os.environ.get(FAULT_ENV, "").strip()
    if not raw:
        return None
    rank, step, *mode = raw.split(":")
    return int(rank), int(step), (mode[0] if mode else "exit")


def _threads(world) -> int:
    """Share this host's cores among the ranks it holds (at least one thread each)."""
    from mpi4py import MPI

    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    per_host = local.Get_size()
    local.Free()
    return max(1, (os.cpu_count() or 1) // per_host)


def _write_json(path: Path, data: object) -> None:
    from tensoropt.runtime.checkpoint import write_atomic

    write_atomic(path, json.dumps(data).encode())


def _run(rundir: Path, config: dict, rank: int, world) -> None:
    from tensoropt.runtime.driver import RunOptions, drive
    from tensoropt.runtime.engine import MpiEngine, load_device, split_rank
    from tensoropt.runtime.manifest import check_file, load_outdir
    from tensoropt.runtime.program import SessionConfig
    from tensoropt.runtime.tensorfile import write_tensors

    opts = RunOptions.from_json(config["options"])
    opts = RunOptions.from_json({**opts.to_json(), "fault": _fault_from_env()})
    manifest = load_outdir(config["outdir"], check_files=False)
    info = manifest.ranks[rank]
    check_file(manifest.outdir / info.file, info.sha256)
    if info.data is not None:  # this rank's weights: checked here, read in place below
        files = json.loads((manifest.outdir / "manifest.json").read_text()).get("files", {})
        check_file(manifest.outdir / info.data, files.get(info.data, ""))
    model = load_device(manifest, rank)
    plan = split_rank(manifest, model, rank)
    threads = opts.threads or _threads(world)
    config = SessionConfig(intra_op_threads=threads, arena=opts.arena)
    if manifest.pipeline is not None:
        from tensoropt.runtime.pipeline import PipelineMpiEngine

        engine = PipelineMpiEngine(
            plan,
            manifest.loss_name,
            manifest.loss_rank,
            world,
            config,  # type: ignore[arg-type]
        )
    else:
        engine = MpiEngine(plan, world, config)

    def on_step(k: int, loss: float, vstep) -> None:
        line = {"step": k, "loss": loss, "verify": vstep.to_json() if vstep else None}
        print(PROGRESS + json.dumps(line), flush=True)

    result = drive(engine, manifest, {rank: model}, opts, on_step)
    if result is not None:
        arrays = {f"param/{k}": v for k, v in result.params.items()}
        arrays.update({f"state/{k}": v for k, v in result.states.items()})
        write_tensors(rundir / "result.tensors", arrays, {})
        meta = {
            "losses": result.losses,
            "start_step": result.start_step,
            "seconds": result.seconds,
            "verify": None if result.verify is None else result.verify.to_json(),
            "profile": None if result.profile is None else result.profile.to_json(),
        }
        _write_json(rundir / "result.json", meta)
    world.Barrier()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config_path = Path(argv[0])
    rundir = config_path.parent
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    (rundir / f"rank_{rank}.pid").write_text(f"{socket.gethostname()} {os.getpid()}")
    try:
        _run(rundir, json.loads(config_path.read_text()), rank, world)
    except BaseException as exc:  # report any failure of this rank, then stop every rank
        from tensoropt.errors import TensorOptError

        known = isinstance(exc, TensorOptError)
        _write_json(
            rundir / f"error_rank_{rank}.json",
            {
                "type": type(exc).__name__ if known else "WorkerFault",
                "message": str(exc) if known else traceback.format_exc(),
                "exit_code": exc.exit_code if known else 1,
            },
        )
        sys.stdout.flush()
        world.Abort(exc.exit_code if known else 1)
    (rundir / f"rank_{rank}.done").write_text("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
