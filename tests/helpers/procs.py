"""What a child process is doing, read from /proc: whether it has installed its signal
handlers, and whether it has children of its own. Tests wait on these instead of a
fixed sleep, which a loaded machine outlasts."""

from __future__ import annotations

import glob
import signal
import time
from collections.abc import Callable


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (/proc/PID/status SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def has_children(pid: int) -> bool:
    """Whether process ``pid`` has started a process that is still alive."""
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                if f.read().split():
                    return True
        except FileNotFoundError:  # a thread that ended
            continue
    return False


def wait_for(ready: Callable[[], bool], alive: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``ready`` until it holds; fail when ``alive`` stops holding or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert alive(), "the process ended before it was ready"
        assert time.monotonic() < deadline, f"not ready within {timeout_s} s"
        time.sleep(0.05)
