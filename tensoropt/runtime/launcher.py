"""The parent side of the ``mpi`` backend: spawn, watch, collect, clean up.

``mpiexec -n N [-f HOSTFILE] python -m tensoropt.runtime.worker RUNDIR/config.json``
runs in a new session. A watchdog polls every 0.1 s:

* a worker on this host whose process is gone (or a zombie) before writing its
  ``done`` marker is a fault: the parent stops everything and raises
  :class:`~tensoropt.errors.WorkerFault` naming the rank and the step;
* ``mpiexec`` ending with a non-zero status is a fault too; the failing rank is
  taken from a worker's ``error_rank_<k>.json`` (a Python error, re-raised here
  with its class), else from the watchdog, else from ``-print-all-exitcodes``;
* ``stall_timeout`` seconds without a finished step is a fault (a hang).

Cleanup: SIGTERM to mpiexec (hydra then kills its ranks), and after a grace
period SIGKILL to mpiexec's session and to every worker pid on this host. MPICH
puts each rank in its own session, so killing mpiexec's group alone would not be
enough. Nothing started by a run survives it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tensoropt import errors
from tensoropt.errors import TensorOptError, WorkerFault
from tensoropt.runtime.driver import RunOptions, RunResult
from tensoropt.runtime.malloc import child_env
from tensoropt.runtime.profiling import ProfileReport
from tensoropt.runtime.tensorfile import read_tensors
from tensoropt.runtime.verify import VerifyReport, VerifyStep
from tensoropt.runtime.worker import PROGRESS

log = logging.getLogger(__name__)

POLL_S = 0.1
GRACE_S = 3.0


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the MPICH wheel puts it in the venv's bin)."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise TensorOptError(
            "--backend mpi: no mpiexec next to the Python interpreter or on PATH; "
            "install the MPICH wheel (pip install mpich mpi4py)"
        )
    return found


@dataclass(slots=True)
class _Watch:
    """What the parent has learned about the job so far."""

    rundir: Path
    world_size: int
    last_step: int = -1
    last_progress: float = field(default_factory=time.monotonic)
    pids: dict[int, int] = field(default_factory=dict)
    dead: int | None = None

    def poll_pids(self) -> None:
        host = socket.gethostname()
        for r in range(self.world_size):
            if r in self.pids:
                continue
            path = self.rundir / f"rank_{r}.pid"
            try:
                who, pid = path.read_text().split()
            except (OSError, ValueError):
                continue
            if who == host:
                self.pids[r] = int(pid)
        for r, pid in sorted(self.pids.items()):
            if self.dead is None and not _alive(pid) and not self._finished(r):
                self.dead = r

    def _finished(self, rank: int) -> bool:
        return (self.rundir / f"rank_{rank}.done").exists() or (
            self.rundir / f"error_rank_{rank}.json"
        ).exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def launch(
    outdir: Path,
    world_size: int,
    opts: RunOptions,
    hostfile: str | None = None,
    on_step: Callable[[int, float, VerifyStep | None], None] | None = None,
    stall_timeout: float | None = None,
) -> RunResult:
    """Run the MPI job and return rank 0's result; raise WorkerFault on any fault."""
    rundir = Path(tempfile.mkdtemp(prefix="tensoropt-run-"))
    try:
        config = rundir / "config.json"
        config.write_text(json.dumps({"outdir": str(outdir), "options": opts.to_json()}))
        cmd = [mpiexec_path(), "-print-all-exitcodes", "-n", str(world_size)]
        if hostfile:
            cmd += ["-f", str(hostfile)]
        cmd += [sys.executable, "-m", "tensoropt.runtime.worker", str(config)]
        log.info("starting %s", " ".join(cmd))
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env=child_env(),
        )  # fmt: skip
        watch = _Watch(rundir, world_size)
        try:
            output = _supervise(proc, watch, on_step, stall_timeout)
        finally:
            _cleanup(proc, watch)
        _raise_on_failure(proc.returncode, watch, output)
        return _read_result(rundir, world_size, opts)
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


def _pump(stream, sink: queue.Queue, tag: str) -> None:
    for line in stream:
        sink.put((tag, line))
    sink.put((tag, None))


def _supervise(proc, watch: _Watch, on_step, stall_timeout: float | None) -> list[str]:
    """Forward progress and watch for faults until the job ends; returns output lines."""
    lines: queue.Queue = queue.Queue()
    for stream, tag in ((proc.stdout, "out"), (proc.stderr, "err")):
        threading.Thread(target=_pump, args=(stream, lines, tag), daemon=True).start()
    output: list[str] = []
    open_streams = 2
    deadline: float | None = None
    while True:
        try:
            while True:
                tag, line = lines.get_nowait()
                if line is None:
                    open_streams -= 1
                else:
                    rest = _on_progress(line, watch, on_step) if tag == "out" else line
                    if rest is line or rest.strip():  # mpiexec prints exit codes on stdout
                        output.append(rest.rstrip("\n"))
        except queue.Empty:
            pass
        if proc.poll() is not None and open_streams == 0:
            return output
        watch.poll_pids()
        if watch.dead is not None:
            # mpiexec normally notices too and stops the rest within milliseconds, then
            # prints every rank's exit status (which names the culprit reliably); give
            # it a moment before the parent takes over the cleanup.
            deadline = deadline or time.monotonic() + GRACE_S
            if time.monotonic() > deadline:
                return output
        if stall_timeout and time.monotonic() - watch.last_progress > stall_timeout:
            raise WorkerFault(
                f"no step finished for {stall_timeout:g} s after step {watch.last_step}; "
                "the MPI job looks hung and was stopped"
            )
        time.sleep(POLL_S)


def _on_progress(line: str, watch: _Watch, on_step) -> str:
    """Handle a rank-0 progress line; return what of ``line`` is other output (all of it
    for any other line). mpiexec merges the ranks' stdout, so a rank that dies mid-line
    leaves its text on the same line as the next progress record, or cuts it."""
    if not line.startswith(PROGRESS):
        return line
    try:
        data, end = json.JSONDecoder().raw_decode(line, len(PROGRESS))
    except json.JSONDecodeError:
        return line
    watch.last_step = int(data["step"])
    watch.last_progress = time.monotonic()
    if on_step is not None:
        v = data.get("verify")
        on_step(data["step"], data["loss"], _verify_step(v) if v else None)
    return line[end:]


def _verify_step(d: dict) -> VerifyStep:
    return VerifyStep.from_json(d)


def _cleanup(proc: subprocess.Popen, watch: _Watch) -> None:
    """Stop mpiexec and every worker of this host; returns when nothing is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
    watch.poll_pids()
    for pid in watch.pids.values():
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _raise_on_failure(returncode: int, watch: _Watch, output: list[str]) -> None:
    errs = sorted(watch.rundir.glob("error_rank_*.json"), key=lambda p: _rank_of(p.name))
    if errs:
        data = json.loads(errs[0].read_text())
        cls = getattr(errors, data.get("type", ""), None)
        if not (isinstance(cls, type) and issubclass(cls, TensorOptError)):
            cls = WorkerFault
        raise cls(f"rank {_rank_of(errs[0].name)}: {data['message']}")
    step = watch.last_step + 1
    if watch.dead is None and returncode == 0:
        return
    culprit = _culprit_from_exitcodes(output)
    if culprit is None:
        culprit = watch.dead
    who = f"rank {culprit}" if culprit is not None else "a rank"
    for line in output:
        log.info("mpiexec: %s", line)
    raise WorkerFault(
        f"{who} died during step {step} (mpiexec exit status {returncode}); all ranks "
        "were stopped; rerun with -v to see the workers' output"
    )


def _rank_of(name: str) -> int:
    return int(re.findall(r"\d+", name)[0])


def _culprit_from_exitcodes(output: list[str]) -> int | None:
    """First rank whose exit status is neither 0 nor a cleanup kill (SIGKILL/SIGTERM)."""
    for line in output:
        if "Exit codes:" not in line:
            continue
        codes = [int(c) for c in re.findall(r"-?\d+", re.sub(r"\[[^\]]*\]", " ", line))]
        for rank, code in enumerate(codes):
            if code not in (0, 9, 15):
                return rank
    return None


def _read_result(rundir: Path, world_size: int, opts: RunOptions) -> RunResult:
    meta_path = rundir / "result.json"
    if not meta_path.exists():
        raise WorkerFault("the MPI job ended without a result from rank 0")
    meta = json.loads(meta_path.read_text())
    arrays, _ = read_tensors(rundir / "result.tensors")
    report = None
    if meta["verify"] is not None:
        steps = tuple(_verify_step(s) for s in meta["verify"]["per_step"])
        report = VerifyReport(steps, meta["verify"]["tolerance"])
    return RunResult(
        losses=[float(x) for x in meta["losses"]],
        params={k[6:]: v for k, v in arrays.items() if k.startswith("param/")},
        states={k[6:]: v for k, v in arrays.items() if k.startswith("state/")},
        verify=report,
        start_step=int(meta["start_step"]),
        world_size=world_size,
        backend="mpi",
        seconds=float(meta["seconds"]),
        profile=ProfileReport.from_json(meta["profile"]) if meta.get("profile") else None,
    )
