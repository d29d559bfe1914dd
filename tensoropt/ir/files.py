"""Files and directories created the way ``open`` and ``mkdir`` would create them.

``tempfile.mkstemp`` and ``mkdtemp`` make private entries (0600, 0700) whatever the
umask says; every output of tensoropt is written to one of those and renamed into
place (written completely or not at all). These helpers give the entry the mode a
plain ``open(path, "w")`` or ``os.mkdir`` would have given it, so that compiled
directories, figures and checkpoints are readable by whoever the umask lets read
them (a launcher running as another user, a shared file system).
"""

from __future__ import annotations

import os
import tempfile

FILE_MODE = 0o666  # what open() asks for; the umask takes bits away
DIR_MODE = 0o777  # what mkdir asks for


def current_umask() -> int:
    """This process's umask, read without changing it where Linux says it (a umask
    swap would briefly leave files that another thread creates unprotected)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def mkstemp_public(directory: str | os.PathLike, prefix: str, suffix: str = "") -> tuple[int, str]:
    """``tempfile.mkstemp`` whose file has the mode ``open`` would give it."""
    fd, path = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        os.fchmod(fd, FILE_MODE & ~current_umask())
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, path


def mkdtemp_public(directory: str | os.PathLike, prefix: str) -> str:
    """``tempfile.mkdtemp`` whose directory has the mode ``mkdir`` would give it."""
    path = tempfile.mkdtemp(dir=directory, prefix=prefix)
    try:
        os.chmod(path, DIR_MODE & ~current_umask())
    except BaseException:
        os.rmdir(path)
        raise
    return path
