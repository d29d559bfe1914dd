"""A search's share of this machine's memory, checked as its frontiers grow.

Exact frontiers of large meshes can outgrow the machine: the GPT-3 175B shape at 1024
devices reached 23 GB resident on a 24 GB machine before the kernel killed the process
(benchmarks/RESULTS.md, "Pipeline stages"). A search instead stops with one line that
names the device count and mesh and says what to narrow. ``explore`` gives each process
that solves problems what it holds when the search starts and an even share of the
memory then available (:data:`SHARE` of /proc/meminfo's MemAvailable). The process's
resident memory is checked against it as each problem starts (:func:`solving`), once the
factor products have made 64 MiB of frontier points since the last reading
(``factor.multiply``, :func:`made`), and before the bounds' passes make 64 MiB of arrays
(``bounds._ask``, :func:`about_to_make`).
Without a share (``solve`` called directly, or no /proc) nothing is checked.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

from tensoropt.errors import InfeasibleError

SHARE = 0.85  # of the memory available at the start, split between the solving processes
GIB = 2**30

_limit: list[float | None] = [None]  # bytes this process may hold while it searches
_where: list[str] = ["the search"]  # what it is solving now (for the message)


# The cycle collector's thresholds while a search runs. A full collection traverses every
# object the process holds, and a search holds millions (the search graph, programs,
# tables): on the GPT-3 175B shape with stages at 64, 256 and 1024 devices, 8 full
# collections took 15.4 s of a 107 s search. With these, young objects are collected
# every 100k allocations and the older generations in effect not until the search ends
# (measured: no full collection, 2.6 s in all).
SEARCH_GC_THRESHOLDS = (100_000, 50, 1000)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the body with :data:`SEARCH_GC_THRESHOLDS`; the thresholds before, after."""
    old = gc.get_threshold()
    gc.set_threshold(*SEARCH_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


class SearchMemoryError(InfeasibleError):
    """A search outgrew its share of the machine's memory (exit code 2)."""


def available_bytes() -> float | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_bytes() -> float | None:
    """This process's resident memory (/proc/self/statm), or None where there is none."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return float(pages * os.sysconf("SC_PAGE_SIZE"))


def share(processes: int) -> float | None:
    """Bytes each of ``processes`` solving processes may hold (None: unknown): what this
    process holds now (a forked worker starts with it) and an even share of SHARE of
    the memory still available."""
    free, held = available_bytes(), resident_bytes()
    if free is None or held is None:
        return None
    return held + SHARE * free / max(processes, 1)


@contextlib.contextmanager
def limited(limit: float | None) -> Iterator[None]:
    """Check this process against ``limit`` bytes while the block runs."""
    before = _limit[0]
    _limit[0] = limit
    try:
        yield
    finally:
        _limit[0] = before


def set_limit(limit: float | None) -> None:
    """The limit of a pool worker, for its whole life."""
    _limit[0] = limit


def solving(what: str) -> None:
    """Name what this process solves now, for the message of :func:`check`, and check
    the share before it starts."""
    _where[0] = what
    check()


# bytes counted by :func:`made` and :func:`about_to_make` since the resident size was
# last read
_unread: list[float] = [0.0]
READ_EVERY = 64 * 2**20
"""Bytes counted between two readings of the resident size."""


def made(nbytes: float) -> None:
    """Count ``nbytes`` just made, and :func:`check` once the bytes counted since the
    last reading reach :data:`READ_EVERY`. The factor products count the points they
    keep: a reading per product (about 14 us) was 2% of a search that makes 100k
    mostly small products, and what goes unseen stays under 64 MiB."""
    if _limit[0] is None:
        return
    _unread[0] += nbytes
    if _unread[0] >= READ_EVERY:
        check()


def about_to_make(nbytes: float) -> None:
    """:func:`check` with ``nbytes`` about to be made, reading the resident size (about
    14 us) only once the bytes announced since the last reading reach
    :data:`READ_EVERY`: the bounds' passes announce every elimination step's arrays,
    mostly small ones, so what goes unseen stays under 64 MiB."""
    if _limit[0] is None:
        return
    _unread[0] += nbytes
    if _unread[0] >= READ_EVERY:
        check(nbytes)


def check(extra: float = 0.0) -> None:
    """Raise SearchMemoryError when this process holds more than its limit, or would
    once it makes ``extra`` more bytes (checked before a large allocation)."""
    limit = _limit[0]
    if limit is None:
        return
    _unread[0] = 0.0
    held = resident_bytes()
    if held is None or held + extra <= limit:
        return
    made = f" and {extra / GIB:.1f} GiB about to be made" if extra else ""
    raise SearchMemoryError(
        f"{_where[0]} needs more memory than this machine leaves it: {held / GIB:.1f} GiB "
        f"held{made} against a share of {limit / GIB:.1f} GiB (what it held at the start and "
        f"{SHARE:.0%} of the memory then available, split between the solving processes); "
        "search fewer or "
        "smaller device counts (--devices), fewer axes (--axes split, --stages 1), fewer "
        "processes (--jobs 1), or within a stated slack (--epsilon, e.g. 0.05)"
    )
