"""glibc malloc settings for processes that run training steps and collectives.

By default glibc serves allocations of 128 KiB and more with a fresh ``mmap`` and
returns them with ``munmap`` on free (the threshold then adapts, but only upwards
after such a free). Every step and every collective allocates its buffers anew
(numpy results, receive buffers, padded chunks), so each call paid page faults on
fresh zero pages. Measured on this project's 2-core machine, 2 MPI ranks, 256 KiB
buffer: AllReduce 404 us, ReduceScatter 277 us, AllGather 252 us with glibc's
defaults; 50, 37 and 24 us with the heap serving them (``MALLOC_MMAP_THRESHOLD_`` =
32 MiB). Freed memory then stays in the heap for the next step (``run --profile``
trims it once, when its step loop starts, see :mod:`tensoropt.runtime.profiling`).

Child processes also get transparent huge pages for malloc's memory (the glibc tunable
``glibc.malloc.hugetlb=1``: malloc madvises its heap and its mmap chunks, so a kernel
whose THP mode is ``madvise`` backs them with 2 MiB pages). onnxruntime's buffers come
from malloc; with 4 KiB pages, an op that streams more than the TLB's reach (8 MiB on
this project's EPYC) misses the TLB on every page, and inside a VM each miss is a
nested page walk. Measured on this project's 2-core VM, fresh processes taking turns:
the 4M-element Add kernel 2.9-4.3e10 B/s with 4 KiB pages, 4.1-4.6e10 with the
tunable; the 1M-element Mul 4.3-5.3e10 and 5.1-5.8e10.

``MALLOC_ENV`` goes into the environment of the MPI ranks (set before the
interpreter starts, so every allocation sees it), and :func:`spawn_environment` into
that of spawned calibration processes; :func:`tune_process` applies the thresholds
with ``mallopt`` in a running process (the local backend, calibration's parent). The
huge-page tunable is read only when a process starts, so in-process runs (the local
backend) go without it. A user's own ``MALLOC_*`` variables win; a user's own
``GLIBC_TUNABLES`` keep their value and gain ``glibc.malloc.hugetlb`` unless they set it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator, Mapping

MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed mmap threshold on 64-bit
TRIM_THRESHOLD = 256 << 20  # keep up to this much free heap between steps

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
}

TUNABLES = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb"
HUGETLB_TUNABLE = f"{HUGETLB}=1"  # madvise(MADV_HUGEPAGE) on malloc's memory (glibc >= 2.35)

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_done = False


def _tunables(current: str | None) -> str:
    """``current`` GLIBC_TUNABLES with the huge-page tunable added unless it sets one."""
    if not current:
        return HUGETLB_TUNABLE
    if any(item.split("=", 1)[0] == HUGETLB for item in current.split(":")):
        return current
    return f"{current}:{HUGETLB_TUNABLE}"


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with the malloc settings added."""
    base = os.environ if base is None else base
    return {**MALLOC_ENV, **base, TUNABLES: _tunables(base.get(TUNABLES))}


@contextlib.contextmanager
def spawn_environment() -> Iterator[None]:
    """This process's environment holds :func:`child_env` for the block: what
    ``multiprocessing``'s spawned children start with (they inherit ``os.environ``)."""
    changes = {k: v for k, v in child_env().items() if os.environ.get(k) != v}
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def tune_process() -> bool:
    """Apply the settings to this process with glibc's ``mallopt`` (once).

    Returns False where there is no glibc (the settings are an optimisation only)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    _done = True
    return True
