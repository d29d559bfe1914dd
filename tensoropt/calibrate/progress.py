"""Progress of a calibration on stderr, whatever stderr is.

On a terminal, a bar (tqdm). Otherwise (a log file, a pipe, CI) one line every
:data:`RECORD_EVERY_S` seconds, from a timer thread so a long case still reports:

    calibrate: 45/318 (14%), 62 s elapsed, pass 1/3: Conv 8x32x4x4 x 32x32x3x3

(done and total count measured cases, collective rounds and the floor; the label is
the phase and what was measured last).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import TextIO

RECORD_EVERY_S = 10.0


class Progress:
    """Counts finished items; shows them as a bar on a terminal, as records otherwise."""

    def __init__(
        self,
        total: int,
        *,
        done: int = 0,
        stream: TextIO | None = None,
        every_s: float = RECORD_EVERY_S,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._total = total
        self._done = done
        self._label = "starting"
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar = None
        self._thread = None
        if _is_terminal(self._stream):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=done, desc="calibrate", file=self._stream, leave=False
            )
        else:
            self._record()
            self._thread = threading.Thread(
                target=self._every, args=(every_s,), name="calibrate-progress", daemon=True
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

    def line(self) -> str:
        with self._lock:
            done, label = self._done, self._label
        share = done / self._total if self._total else 1.0
        elapsed = time.monotonic() - self._t0
        return f"calibrate: {done}/{self._total} ({share:.0%}), {elapsed:.0f} s elapsed, {label}"

    def _record(self) -> None:
        # stderr closed or gone: progress is not worth a crash
        with contextlib.suppress(OSError, ValueError):
            print(self.line(), file=self._stream, flush=True)

    def _every(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            self._record()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
