"""Busy neighbours: processes computing on other cores while one rank's kernels are timed
(``calibrate --neighbours N``; none by default).

"A device" is one rank (``calibrate --ranks N`` gives each ``cores // N`` threads), and a
run puts N ranks on the host at once. Two 1-rank runs side by side ran 5-19% slower
than one alone. On this project's VM that comes from the host (docs/design/measured.md,
"Calibration determinism"): it sometimes runs the two vCPUs on cores that share one
memory link, and then two processes streaming memory get half the bandwidth each; at
other times each gets the full rate, as one process alone always does. Beside a
neighbour, a memory-bound case's rate therefore depends on the host's placement that
minute (the 1M Relu 0.67-1.1e11 B/s, alone 1.04-1.18e11), and two calibrations
disagreed by 25-45%. So compute is timed alone by default (docs/design.md, "Compute is
timed alone"), and ``--neighbours`` measures beside busy processes for a user who wants
the rates of a loaded host.

Each neighbour runs the training step of the case being measured, without pause, for
as long as it is measured.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from multiprocessing import resource_tracker

from tensoropt.calibrate import kernels
from tensoropt.errors import TensorOptError
from tensoropt.runtime.malloc import spawn_environment

SYNC_TIMEOUT_S = 300.0  # longer than any one case takes
NEIGHBOUR_COPIES = 4  # copies of the case in the training step a neighbour runs


def _loop(opts: kernels.KernelOptions, schedule: Sequence[kernels.KernelCase], barrier, done):
    """Run each calibration case's training step without pause while the parent
    measures that case (until ``done`` passes its index), then go on to the next."""
    import numpy as np

    from tensoropt.calibrate.steps import step_runner

    parent = os.getppid()
    rng = np.random.default_rng(3)
    for index, case in enumerate(schedule):
        run = step_runner(case, NEIGHBOUR_COPIES, opts.threads, rng)
        try:
            barrier.wait(SYNC_TIMEOUT_S)
        except threading.BrokenBarrierError:  # the parent is gone or gave up
            return
        while done.value <= index:
            if os.getppid() != parent:  # the parent was killed (no SIGTERM came)
                return
            run()
        del run


def start_child(proc: multiprocessing.process.BaseProcess) -> None:
    """Start a spawned child as the runtime starts its ranks, with SIGINT ignored.

    The child's environment has the runtime's malloc settings
    (:func:`tensoropt.runtime.malloc.spawn_environment`: its huge-page tunable is read
    only when a process starts), so kernels are measured on the memory a rank runs on.

    SIGINT blocked in the child: a terminal's Ctrl-C reaches the whole process group;
    the parent alone turns it into one line and stops its children (SIGTERM), where
    each child would otherwise print a KeyboardInterrupt traceback of its own. The
    calling thread blocks SIGINT while it spawns, and the child inherits that mask
    across the exec (multiprocessing does not restore signals), so SIGINT stays
    pending in the child and is never delivered.

    A Ctrl-C that reaches the parent during the start is neither lost nor raised
    half-way through it: other threads (the BLAS pool's) may take a process-wide
    SIGINT even while this thread blocks it, so the main thread's handler only notes
    it until the child is started, and the signal is raised again after. Ignoring
    SIGINT during the start instead discarded such a Ctrl-C, and the calibration went
    on measuring. SIGTERM is noted and raised again the same way (the command's handler
    raising it half-way through the start cut the child's start data short, and the
    child printed an ``EOFError`` traceback), but never blocked: the child inherits the
    mask, and the parent stops its children with SIGTERM."""
    # multiprocessing starts its resource tracker with the first spawned child, and
    # unblocks SIGINT when it has: start it first, so that the block holds for the
    # whole start
    resource_tracker.ensure_running()
    in_main = threading.current_thread() is threading.main_thread()
    noted: list[int] = []
    noted_signals = (signal.SIGINT, signal.SIGTERM)
    with spawn_environment():
        if in_main:
            previous = {
                sig: signal.signal(sig, lambda signum, _frame: noted.append(signum))
                for sig in noted_signals
            }
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if in_main:
                for sig, handler in previous.items():
                    # None: a handler installed outside Python; Python's is the default
                    if handler is None:
                        handler = (
                            signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
                        )
                    signal.signal(sig, handler)
    for sig in dict.fromkeys(noted):  # each once, in the order they came
        signal.raise_signal(sig)


class Pacer:
    """Keeps the neighbours on the case being measured (picklable: a spawned measuring
    process gets it). Measure the schedule's cases in order, each inside ``with
    pacer.busy():``."""

    def __init__(self, barrier=None, done=None) -> None:
        self._barrier, self._done = barrier, done

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        if self._barrier is None:  # no neighbours
            yield
            return
        try:
            self._barrier.wait(SYNC_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise TensorOptError(
                "calibrate: a neighbour process stopped; rerun calibrate, "
                "or use --backend local to measure without neighbours"
            ) from None
        try:
            yield
        finally:
            with self._done.get_lock():
                self._done.value += 1


@contextlib.contextmanager
def busy_neighbours(
    count: int, opts: kernels.KernelOptions, schedule: Sequence[kernels.KernelCase]
) -> Iterator[Pacer]:
    """Run ``count`` neighbour processes for the duration of the block.

    Yields a :class:`Pacer`: the caller (or a process it hands the pacer to) measures
    each case of ``schedule``, in order, inside ``with pacer.busy():``. Every
    neighbour has that case's training step built when the block starts and runs it
    back to back until the block ends, so each timed call of the measured process has
    busy neighbours, as a rank's ops have in a step of N ranks. (Neighbours that
    repeated the whole measurement, cache eviction included, in step only at each
    case's start ran out of phase: either side finished a case first and waited, so a
    varying share of a case's timed calls ran beside an idle core; two calibrations
    were 25-50% apart on the small BatchNorms.) Processes are spawned (a fresh
    interpreter: no handlers or onnxruntime state of the caller) and stopped with
    SIGTERM when the block ends, however it ends.
    """
    if count <= 0:
        yield Pacer()
        return
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(count + 1)
    done = ctx.Value("q", 0)
    procs = [
        ctx.Process(
            target=_loop, args=(opts, tuple(schedule), barrier, done), daemon=True, name="neighbour"
        )
        for _ in range(count)
    ]
    try:
        for proc in procs:
            start_child(proc)
        yield Pacer(barrier, done)
    finally:
        barrier.abort()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            if proc.pid is not None:
                proc.join()
