"""Output paths that are streams: written through, never replaced by a renamed file.

Every command writes its files atomically (a temp file renamed into place), except where
the path is a stream: a FIFO, a character device (``/dev/null``), a socket, or one of this
process's own open descriptors (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``,
``/proc/self/fd/N``). Renaming over a stream would replace the pipe or device by a
regular file; and when the descriptor is stdout redirected to a regular file, replacing
that file would drop what the command printed before. A stream cannot be written
atomically, so its reader may see a partial document if the write fails midway.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

_STANDARD = {"stdin": 0, "stdout": 1, "stderr": 2}
_DESCRIPTOR = re.compile(r"/dev/(stdin|stdout|stderr)|/dev/fd/(\d+)|/proc/([^/]+)/fd/(\d+)")


def own_descriptor(path: str | os.PathLike) -> int | None:
    """The open descriptor of this process that ``path`` names, or None.

    The path is matched as written (made absolute, its symlinks not followed), since
    ``/dev/stdout`` resolves to whatever stdout is: a terminal, a pipe or a regular file."""
    match = _DESCRIPTOR.fullmatch(os.path.abspath(os.fspath(path)))
    if match is None:
        return None
    standard, dev_fd, pid, proc_fd = match.groups()
    if standard is not None:
        fd = _STANDARD[standard]
    elif dev_fd is not None:
        fd = int(dev_fd)
    elif pid in ("self", "thread-self", str(os.getpid())):
        fd = int(proc_fd)
    else:
        return None
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd


def is_stream(path: str | os.PathLike) -> bool:
    """Whether ``path`` is written through: one of this process's descriptors
    (:func:`own_descriptor`), or a path that exists (its symlinks followed) and is
    neither a regular file nor a directory."""
    if own_descriptor(path) is not None:
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@contextmanager
def open_stream(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """``path`` opened to write through (:func:`is_stream`).

    One of this process's descriptors is written at its own offset, after what Python's
    stdout and stderr hold is flushed, so that output redirected to a file keeps what
    the command printed before; opening ``/dev/stdout`` anew would truncate that file."""
    fd = own_descriptor(path)
    if fd is None:
        with open(path, "wb") as f:
            yield f
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    with os.fdopen(os.dup(fd), "wb") as f:
        yield f
