"""Progress of long work on stderr, whatever stderr is.

On a terminal, a bar (tqdm). Otherwise (a log file, a pipe, CI) one line every
:data:`RECORD_EVERY_S` seconds, from a timer thread so a long item still reports:

    calibrate: 45/318 (14%), 62 s elapsed, pass 1/3: Conv 8x32x4x4 x 32x32x3x3
    search: 212/548 (39%), 40 s elapsed, last finished: 16 devices, mesh 4x4

(done and total count finished items: a calibration's measured cases, a search's
problems (each variant of each mesh, counted in the worker processes as they go),
validate's plans, train's steps, compile's model files; the label says what finished
last, or for the loops of :class:`Steps` what is under way).
``calibrate`` also records once at its start (``announce``); the other commands
record nothing for work shorter than one period, so quick runs leave stderr alone.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

RECORD_EVERY_S = 10.0
FOLLOW_EVERY_S = 0.5  # how often a bar reads a ``count`` kept elsewhere


class Progress:
    """Counts finished items; shows them as a bar on a terminal, as records otherwise."""

    def __init__(
        self,
        total: int,
        *,
        desc: str = "calibrate",
        done: int = 0,
        stream: TextIO | None = None,
        every_s: float = RECORD_EVERY_S,
        announce: bool = True,
        count: Callable[[], int] | None = None,
    ) -> None:
        """``count``: where the finished items are counted instead of :meth:`tick` (work
        in other processes, e.g. a shared counter); the bar follows it every
        :data:`FOLLOW_EVERY_S` seconds."""
        self._stream = stream if stream is not None else sys.stderr
        self._desc = desc
        self._total = total
        self._done = done
        self._label = "starting"
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar = None
        self._thread = None
        self._count = count
        if is_terminal(self._stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, desc=desc, file=self._stream, leave=False)
            if count is not None:
                self._thread = threading.Thread(
                    target=self._follow, name=f"{desc}-progress", daemon=True
                )
                self._thread.start()
        else:
            if announce:
                self._record()
            self._thread = threading.Thread(
                target=self._every, args=(every_s,), name=f"{desc}-progress", daemon=True
            )
            self._thread.start()

    def tick(self, label: str) -> None:
        """One more item finished; ``label`` says what (and in which phase)."""
        with self._lock:
            self._done += 1
            self._label = label
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(label[:40])

    def describe(self, label: str) -> None:
        """Say what is under way, without counting an item."""
        with self._lock:
            self._label = label
        if self._bar is not None:
            self._bar.set_postfix_str(label[:40])

    def line(self) -> str:
        with self._lock:
            done, label = self._done, self._label
        if self._count is not None:
            done = self._count()
        share = done / self._total if self._total else 1.0
        elapsed = time.monotonic() - self._t0
        return f"{self._desc}: {done}/{self._total} ({share:.0%}), {elapsed:.0f} s elapsed, {label}"

    def _record(self) -> None:
        # stderr closed or gone: progress is not worth a crash
        with contextlib.suppress(OSError, ValueError):
            print(self.line(), file=self._stream, flush=True)

    def _every(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            self._record()

    def _follow(self) -> None:
        while not self._stop.wait(FOLLOW_EVERY_S):
            self._catch_up()

    def _catch_up(self) -> None:
        if self._bar is not None and self._count is not None:
            self._bar.update(self._count() - self._bar.n)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._catch_up()
            self._bar.close()


class Steps:
    """An iterable that counts its items on a :class:`Progress` as they finish (an item
    is finished when the next is asked for, as tqdm counts). The progress starts with
    the iteration and stops when it ends, however it ends. ``label(item)`` names the
    item under way in the records."""

    def __init__(self, iterable: Iterable, make: Callable[[], Progress], label=None) -> None:
        self._iterable = iterable
        self._make = make
        self._label = label

    def __iter__(self) -> Iterator:
        progress = self._make()
        under_way = None
        try:
            for item in self._iterable:
                if under_way is not None:
                    progress.tick(under_way)
                under_way = self._label(item) if self._label else "running"
                progress.describe(under_way)
                yield item
            if under_way is not None:
                progress.tick("done")
        finally:
            progress.close()


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
