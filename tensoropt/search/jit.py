"""numba's ``njit`` with its on-disk cache where it can write one.

The search's compiled loops (:mod:`tensoropt.search.paretosum`, the bounds' corner test)
compile once per install, and later processes load them from numba's cache (beside the
module, else in the user's cache directory). Where neither can be written (a read-only
install and home), numba refuses ``cache=True`` when the function is decorated; the
functions are then compiled in each process instead, a few seconds on first use.
"""

from __future__ import annotations

from numba import njit


def compiled(**options):
    """Decorator: ``njit(cache=True, **options)``, or ``njit(**options)`` without a cache."""

    def wrap(fn):
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:  # no writable cache location for this module
            return njit(**options)(fn)

    return wrap
