"""Does each rank have a memory link of its own right now? A probe of the host.

On this project's VM the host sometimes runs the two vCPUs on cores that share one
memory link (docs/design/measured.md, "Calibration determinism"): two processes
streaming memory at once then get half the bandwidth each, at other times each gets
what one alone gets, and the host switches between the two every few seconds to
minutes. A rank's memory-bound ops follow it. Calibration times compute alone
(docs/design.md, "Compute is timed alone") and records probes of this state;
``validate`` probes it before every plan it runs, so a measurement taken while the
ranks shared a link is marked as such.

:meth:`Prober.probe` streams a buffer twice the size of the last-level cache in one process
alone, then in ``processes`` processes at once, and returns the per-process bandwidth
both ways. Their ratio is ~1 when each process has its own link and ~1/processes when
they share one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass

from tensoropt.errors import TensorOptError

STREAM_BYTES = 64 << 20  # twice the 32 MiB L3 of this project's machines
PROBE_SECONDS = 0.25  # streaming time of each half of a probe
SHARED_BELOW = 0.75  # together / alone below this: the processes share a link
REPLY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class LinkProbe:
    """Per-process streaming bandwidth (B/s) alone and with ``processes`` at once."""

    alone: float
    together: float
    processes: int

    @property
    def ratio(self) -> float:
        return self.together / self.alone

    @property
    def shared(self) -> bool:
        return self.ratio < SHARED_BELOW

    def to_json(self) -> dict:
        return {
            "alone_Bps": round(self.alone),
            "together_Bps": round(self.together),
            "processes": self.processes,
            "ratio": round(self.ratio, 3),
            "shared": self.shared,
        }


def _stream(src, dst, seconds: float) -> float:
    """Bytes per second of ``dst = src + 1`` in a loop of ``seconds``."""
    import time

    import numpy as np

    calls, start = 0, time.perf_counter()
    while True:
        np.add(src, 1.0, out=dst)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls * 2 * src.nbytes / elapsed


def _worker(conn) -> None:
    # the parent gone (a calibration interrupted while this process started or
    # streamed) ends the process quietly: the parent reports the interrupt
    with contextlib.suppress(EOFError, OSError, KeyboardInterrupt):
        _serve(conn)


def _serve(conn) -> None:
    import numpy as np

    src = np.ones(STREAM_BYTES // 8, dtype=np.float32)  # two buffers: STREAM_BYTES in all
    dst = np.empty_like(src)
    np.add(src, 1.0, out=dst)  # both faulted in before the first probe
    conn.send("ready")
    while True:
        what, seconds = conn.recv()
        if what == "stop":
            return
        conn.send(_stream(src, dst, seconds))


class Prober:
    """``processes`` streaming processes, started once and probed as often as wanted."""

    def __init__(self, processes: int = 2) -> None:
        self.processes = processes
        self._procs: list = []
        self._conns: list = []

    def __enter__(self) -> Prober:
        from tensoropt.calibrate.neighbours import start_child

        ctx = multiprocessing.get_context("spawn")
        try:
            for _ in range(self.processes):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(theirs,), daemon=True)
                start_child(proc)
                theirs.close()
                self._procs.append(proc)
                self._conns.append(mine)
            for conn in self._conns:
                self._reply(conn)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @staticmethod
    def _stopped() -> TensorOptError:
        return TensorOptError("memory-link probe: a streaming process stopped; rerun")

    def _reply(self, conn) -> object:
        try:
            if conn.poll(REPLY_TIMEOUT_S):
                return conn.recv()
        except (EOFError, OSError):
            pass
        raise self._stopped()

    def _send(self, conn, what: str, seconds: float) -> None:
        try:
            conn.send((what, seconds))
        except OSError:  # the process is gone (a broken pipe)
            raise self._stopped() from None

    def probe(self, seconds: float = PROBE_SECONDS) -> LinkProbe:
        first = self._conns[0]
        self._send(first, "alone", seconds)
        alone = float(self._reply(first))
        # no barrier: the messages leave microseconds apart, the streams last 0.25 s
        # (a multiprocessing.Barrier kept across other process sets was found broken
        # after a busy_neighbours block had ended)
        for conn in self._conns:
            self._send(conn, "together", seconds)
        together = [float(self._reply(conn)) for conn in self._conns]
        return LinkProbe(alone, sum(together) / len(together), self.processes)

    def __exit__(self, *exc) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop", 0.0))
            conn.close()
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        self._procs, self._conns = [], []


def probe_processes(ranks: int) -> int:
    """Processes a probe streams with: the ranks, at most one per core; 0 (no probe)
    below two."""
    count = min(ranks, os.cpu_count() or 1)
    return count if count >= 2 else 0


@contextlib.contextmanager
def prober(ranks: int) -> Iterator[Prober | None]:
    """A :class:`Prober` for ``ranks`` ranks, or None where a probe means nothing (one
    rank, one core)."""
    count = probe_processes(ranks)
    if not count:
        yield None
        return
    with Prober(count) as p:
        yield p
