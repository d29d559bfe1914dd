"""Files that the xdist workers of one test run make once and share.

``pytest -n 2`` gives every worker its own session fixtures: a calibration or a torch
export behind one would run once per worker. :func:`made_once` makes the file in a
folder of this run that the workers share, under a file lock, so the first worker to
ask makes it and the others wait for it and read it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest


def shared_dir(factory: pytest.TempPathFactory) -> Path:
    """A folder of this run that every worker sees (without xdist: the run's own)."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's root, which holds every worker's basetemp
    path = base / "shared"
    path.mkdir(exist_ok=True)
    return path


def made_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The path ``shared_dir/name/name``, made by ``make(path)`` in the first worker that
    asks (the others block until it is done). A failed ``make`` leaves no marker, so the
    next worker tries again and fails on its own."""
    folder = shared_dir(factory) / name
    path, done = folder / name, folder / ".done"
    with open(shared_dir(factory) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                folder.mkdir(exist_ok=True)
                make(path)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path
