"""Exception classes and exit codes. Every user-facing failure is one of these.

The CLI turns a :class:`TensorOptError` into one line on stderr and its exit code.
Messages name the thing that failed (file, node, tensor, dimension) and say what
the user can do about it.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """The ``tensoropt`` command's exit codes (listed in ``tensoropt --help``)."""

    OK = 0
    INTERNAL = 1  # a bug (with its traceback), or a runtime worker that died or hung
    BAD_INPUT = 2  # bad input or an infeasible request: one line on stderr
    VERIFY_FAILED = 3  # `run --verify`: the distributed run differs from one device
    BROKEN_PIPE = 141  # stdout closed early (`tensoropt inspect out | head`): 128 + SIGPIPE
    INTERRUPTED = 130  # Ctrl-C or SIGTERM: 128 + SIGINT


EXIT_CODE_MEANINGS: tuple[tuple[ExitCode, str], ...] = (
    (ExitCode.OK, "ok"),
    (
        ExitCode.INTERNAL,
        "internal error (a traceback), a runtime or search worker died or hung, or "
        "onnxruntime failed a graph (one line)",
    ),
    (ExitCode.BAD_INPUT, "bad input or an infeasible request (one line on stderr)"),
    (ExitCode.VERIFY_FAILED, "`run --verify`: the distributed run differs from one device"),
    (ExitCode.INTERRUPTED, "interrupted (Ctrl-C, SIGTERM)"),
    (ExitCode.BROKEN_PIPE, "stdout was closed early (`| head`)"),
)


def exit_codes_help() -> str:
    """The exit codes as a ``--help`` epilog section."""
    rows = [f"  {int(code):<4} {meaning}" for code, meaning in EXIT_CODE_MEANINGS]
    return "\n".join(["exit codes:", *rows])


class TensorOptError(Exception):
    """Bad input or an infeasible request; exit code 2."""

    exit_code = ExitCode.BAD_INPUT


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
    """A runtime worker died or timed out (names the rank), or a search worker died
    (names the device counts left unsolved). Exit code 1."""

    exit_code = ExitCode.INTERNAL
