"""Frontier Tracking: the Pareto frontier of parallelisation strategies, exactly.

Public entry points: :func:`solve` (one cost problem -> :class:`SearchResult`) and
:func:`merge_frontiers` (results per device count -> one (devices, time, memory) frontier).
"""

from tensoropt.search.merge import MergedPoint, merge_frontiers
from tensoropt.search.solver import (
    BlockMode,
    Pruning,
    SearchResult,
    SearchStats,
    evaluate_choices,
    solve,
)

__all__ = [
    "BlockMode",
    "MergedPoint",
    "Pruning",
    "SearchResult",
    "SearchStats",
    "evaluate_choices",
    "merge_frontiers",
    "solve",
]
