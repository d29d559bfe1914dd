"""Busy neighbours: the host's other ranks, computing while one rank's kernels are timed.

"A device" is one rank (``calibrate --ranks N`` gives each ``cores // N`` threads), and a
run puts N ranks on the host at once. They share the last-level cache and the memory
bus, so a rank computes slower beside busy neighbours than alone. Measured on this
project's 2-core machine, two 1-rank runs side by side against one alone: mlp-small
+8..+19% step time, gpt-small +0..+9%, resnet50-tiny +5..+17%; and 2-rank plans were
the ones whose compute the model under-estimated. So the compute calibration runs with
N - 1 neighbour processes doing the same measurements (same cases, same thread
count, same cache eviction) on the other cores, each case started by all at once, and
its rates are those of a device whose neighbours are busy, as in a step of N ranks.
Their own timings are discarded.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from collections.abc import Callable, Iterator

from tensoropt.calibrate import kernels
from tensoropt.errors import TensorOptError

SYNC_TIMEOUT_S = 300.0  # longer than any one case takes


def _loop(opts: kernels.KernelOptions, quick: bool, barrier) -> None:
    """Measure the calibration's cases in step with the parent, until it stops us."""
    from tensoropt.calibrate.steps import measure_training_case
    from tensoropt.runtime.malloc import tune_process

    tune_process()
    while True:
        for case in kernels.cases(quick):
            try:
                barrier.wait(SYNC_TIMEOUT_S)
            except threading.BrokenBarrierError:  # the parent is gone or gave up
                return
            measure_training_case(case, opts)


@contextlib.contextmanager
def busy_neighbours(
    count: int, opts: kernels.KernelOptions, quick: bool
) -> Iterator[Callable[[], None]]:
    """Run ``count`` neighbour processes for the duration of the block.

    Yields ``sync``: the caller calls it before each case of ``kernels.cases(quick)``,
    in order, and every neighbour then starts the same case at the same moment, as
    the ranks of a step run the same op at once (unsynchronised neighbours made two
    calibrations 30-50% apart on small BatchNorms). Processes are spawned (a fresh
    interpreter: no handlers or onnxruntime state of the caller) and stopped with
    SIGTERM when the block ends, however it ends.
    """
    if count <= 0:
        yield lambda: None
        return
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(count + 1)
    procs = [
        ctx.Process(target=_loop, args=(opts, quick, barrier), daemon=True, name="neighbour")
        for _ in range(count)
    ]

    def sync() -> None:
        try:
            barrier.wait(SYNC_TIMEOUT_S)
        except threading.BrokenBarrierError:
            dead = [p.exitcode for p in procs if not p.is_alive()]
            raise TensorOptError(
                f"calibrate: a neighbour process stopped (exit codes {dead}); "
                "rerun calibrate, or use --backend local to measure without neighbours"
            ) from None

    try:
        for proc in procs:
            proc.start()
        yield sync
    finally:
        barrier.abort()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            if proc.pid is not None:
                proc.join()
