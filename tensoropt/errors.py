"""Exception classes. Every user-facing failure is one of these.

The CLI turns a :class:`TensorOptError` into one line on stderr and exit code 2.
Messages name the thing that failed (file, node, tensor, dimension) and say what
the user can do about it.
"""

from __future__ import annotations


class TensorOptError(Exception):
    """Bad input or an infeasible request; exit code 2."""

    exit_code = 2


class ModelLoadError(TensorOptError):
    """The file is missing, not ONNX, or truncated."""


class UnsupportedOpError(TensorOptError):
    """The model uses ops that tensoropt has no rule for."""


class DynamicShapeError(TensorOptError):
    """A tensor dimension is not a static integer."""


class NoTrainableParamsError(TensorOptError):
    """Nothing in the model would be trained."""


class DataError(TensorOptError):
    """A --data file is missing arrays or has wrong shapes."""


class ShardingError(TensorOptError):
    """A plan asks for a split that is not legal (e.g. does not divide a dimension)."""


class PlanError(TensorOptError):
    """A plan file is malformed or does not fit the model or mesh."""


class InfeasibleError(TensorOptError):
    """No strategy satisfies the request (e.g. a memory budget)."""


class ClusterError(TensorOptError):
    """An unknown cluster profile or a malformed cluster file."""


class OutputDirError(TensorOptError):
    """A compiled output directory is missing files or was tampered with."""


class WorkerFault(TensorOptError):
    """A runtime worker died or timed out; names the rank. Exit code 1."""

    exit_code = 1
