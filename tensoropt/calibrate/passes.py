"""One compute pass over the calibration's cases, measured in a fresh process.

A process's history moves some of its rates: on this project's VM, the 1M-element
Relu ran at 1.0-1.2e11 B/s in every fresh process (20 tries) but at 0.73e11 in four of
six full calibrations, after ninety other cases had run in the same process; two
passes in one process agreed with each other and disagreed with the next
calibration (with fresh processes: 2 of the next 8, slow in both passes, a state of
the host). So every pass runs in its own spawned process (a fresh interpreter, heap
and onnxruntime), and :func:`tensoropt.calibrate.profile.middle_pass` keeps each case's
median pass. Results and progress come back over a pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Mapping, Sequence

from tensoropt.calibrate import kernels
from tensoropt.calibrate.neighbours import Pacer, start_child
from tensoropt.errors import TensorOptError

POLL_S = 1.0  # how often the parent checks that the measuring process is alive


def _worker(opts: kernels.KernelOptions, cases: Sequence[kernels.KernelCase], pacer, copies, conn):
    # started by neighbours.start_child: the runtime's malloc settings are in its
    # environment already (glibc reads them at start)
    from tensoropt.calibrate.steps import measure_training_case

    try:
        for case in cases:
            conn.send(("tick", case.label()))
            with pacer.busy():
                fixed = None if copies is None else copies[case.label()]
                result, sample = measure_training_case(case, opts, fixed)
            conn.send(("result", result, sample.median))
    except (OSError, KeyboardInterrupt):  # the parent is gone or interrupted: it reports
        return
    except TensorOptError as exc:
        _send_quietly(conn, ("error", str(exc)))
    except Exception as exc:  # noqa: BLE001 -- one line to the parent, not a traceback
        _send_quietly(conn, ("error", f"calibrate: measuring failed: {type(exc).__name__}: {exc}"))
    conn.close()


def _send_quietly(conn, message) -> None:
    with contextlib.suppress(OSError):
        conn.send(message)


def measure_pass(
    opts: kernels.KernelOptions,
    cases: Sequence[kernels.KernelCase],
    pacer: Pacer,
    tick: Callable[[str], None],
    copies: Mapping[str, int] | None = None,
) -> list[tuple[kernels.KernelResult, float]]:
    """(result, session-run overhead) of every case, measured in a fresh process.

    With ``copies`` (per case label, the first pass's R), the training steps are
    measured at those copy counts, so every pass's step slope has the same R.

    The process is stopped however this returns (an interrupt included); one that
    dies part-way is one clear error.
    """
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_worker,
        args=(opts, tuple(cases), pacer, copies and dict(copies), writer),
        daemon=True,
        name="measure",
    )
    out: list[tuple[kernels.KernelResult, float]] = []

    def stopped() -> TensorOptError:
        proc.join(POLL_S)
        return TensorOptError(
            f"calibrate: the measuring process stopped (exit code {proc.exitcode}) "
            f"after {len(out)} of {len(cases)} cases; rerun calibrate"
        )

    try:
        start_child(proc)
        writer.close()
        while len(out) < len(cases):
            if not reader.poll(POLL_S):
                if not proc.is_alive():
                    raise stopped()
                continue
            try:
                msg = reader.recv()
            except EOFError:
                raise stopped() from None
            if msg[0] == "tick":
                tick(msg[1])
            elif msg[0] == "result":
                out.append((msg[1], msg[2]))
            else:
                raise TensorOptError(msg[1])
        proc.join()
        return out
    finally:
        if proc.is_alive():
            proc.terminate()
        if proc.pid is not None:
            proc.join()
        reader.close()
