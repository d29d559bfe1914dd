"""A real interruption: ``tensoropt run --backend mpi --checkpoint`` SIGKILLed once every
rank has checkpointed a step, for the resume tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tensoropt.runtime.checkpoint import latest_common_step


def kill_after_checkpoint(out: Path, ck: Path, ranks: int = 2, step: int = 2) -> int:
    """Run ``out`` over MPI with checkpoints in ``ck``, SIGKILL the launcher's process
    group once every rank has checkpointed ``step``, wait for the files to settle, and
    return the last step every rank finished (at least ``step``)."""
    argv = [sys.executable, "-m", "tensoropt", "run", str(out), "--steps", "100000",
            "--backend", "mpi", "--checkpoint", str(ck)]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while (latest_common_step(ck, ranks) or 0) < step and proc.poll() is None:
            assert time.monotonic() < deadline, f"no checkpoint of step {step} within 120 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # the ranks die with their launcher, a moment after it: wait for the files to settle
    seen = None
    while seen != (seen := sorted(os.listdir(ck))):
        time.sleep(1.0)
    done = latest_common_step(ck, ranks)
    assert done is not None and done >= step
    return done
