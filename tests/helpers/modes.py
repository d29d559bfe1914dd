"""File modes under a umask: what others may read of what a command wrote."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def unreadable(root: Path) -> list[str]:
    """Entries under ``root`` that others cannot read (or, for directories, enter)
    under umask 022: directories must be 0755 and files 0644."""
    bad = []
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        want = 0o755 if stat.S_ISDIR(mode) else 0o644
        if stat.S_IMODE(mode) != want:
            bad.append(f"{path.relative_to(root.parent)} {stat.filemode(mode)}")
    return bad
