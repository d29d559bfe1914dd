"""Frontier Tracking: the Pareto frontier of parallelisation strategies, exactly.

Public entry points: :func:`solve` (one cost problem -> :class:`SearchResult`) and
:func:`merge_frontiers` (results per device count -> one (devices, time, memory) frontier).

The names are imported on first use (PEP 562): the solver pulls in numba and the
compiled kernels, which a command that only reads a constant of a submodule (the
CLI's parsers, ``tensoropt --help``) does not need.
"""

import importlib

_WHERE = {
    "MergedPoint": "merge",
    "merge_frontiers": "merge",
    "BlockMode": "solver",
    "Pruning": "solver",
    "SearchResult": "solver",
    "SearchStats": "solver",
    "evaluate_choices": "solver",
    "solve": "solver",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
