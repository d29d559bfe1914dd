"""Frontier Tracking: the Pareto frontier of parallelisation strategies, exactly.

Public entry points: :func:`solve` (one cost problem -> :class:`SearchResult`) and
:func:`merge_frontiers` (results per device count -> one (devices, time, memory) frontier).

The names are imported on first use (PEP 562): the solver pulls in numba and the
compiled kernels, which a command that only reads a constant of a submodule (the
CLI's parsers, ``tensoropt --help``) does not need.
"""

from tensoropt.lazy import names_on_first_use

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

__getattr__ = names_on_first_use(__name__, _WHERE)
