"""Options and helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import errno
import math
import os
import tempfile
from collections.abc import Mapping

import numpy as np

from tensoropt.errors import TensorOptError
from tensoropt.streams import is_stream

TRAINING_HELP = """\
training options (the update is part of the compiled graph, so compile takes them too):
  the loss is built from the model's first float output: 'auto' uses a scalar output
  as the loss as it is, gives logits (rank >= 2) cross entropy against integer labels
  of shape logits[:-1], and a rank-1 output mean squared error.
  By default a float initializer is trained when it has rank >= 1 (or is a scalar the
  torch exporter records as a parameter) and reaches the loss through differentiable
  inputs; --trainable/--freeze REGEX override (freeze wins).
"""


class Given(argparse.Action):
    """Store the value like the default action, and record that the command line gave it
    (:func:`given`): a default can then be told from the same value given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


class GivenAppend(Given):
    """``action="append"`` that records the option as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = [*(getattr(namespace, self.dest, None) or ()), values]
        super().__call__(parser, namespace, items, option_string)


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the command line set ``dest`` (an option stored by :class:`Given`)."""
    return dest in getattr(args, "given", ())


def add_model_input_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input-shape",
        action=GivenAppend,
        metavar="NAME=D0xD1",
        help="pin the dynamic dimensions of a model input, e.g. --input-shape "
        "input_ids=8x128 (repeatable); its static dimensions keep their sizes",
    )


def add_training_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training step")
    group.add_argument("--loss", choices=["auto", "ce", "mse"], default="auto", action=Given)
    group.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", action=Given)
    group.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    group.add_argument(
        "--momentum",
        type=float,
        default=0.9,
        action=Given,
        help="SGD momentum (default 0.9; 0 = plain SGD)",
    )
    group.add_argument(
        "--trainable", metavar="REGEX", action=Given, help="also train initializers matching"
    )
    group.add_argument(
        "--freeze", metavar="REGEX", action=Given, help="never train initializers matching"
    )
    add_model_input_options(parser)


def check_lr(lr: float) -> None:
    """Refuse a learning rate the float32 update cannot use: not positive, not finite
    (nan gives a nan loss, as --momentum nan would), or one whose float32 overflows to
    inf or rounds to 0 (the update is float32). Like --momentum: one line, exit 2."""
    if not (math.isfinite(lr) and lr > 0):
        raise TensorOptError(f"--lr must be a positive finite number, got {lr}")
    largest = float(np.finfo(np.float32).max)
    if lr > largest:
        raise TensorOptError(
            f"--lr {lr} overflows float32, the update's type (largest {largest:.3g}); "
            "give a learning rate like 0.01"
        )
    if np.float32(lr) == 0:
        raise TensorOptError(
            f"--lr {lr} rounds to 0 in float32, the update's type; give a learning rate like 0.01"
        )


def training_options(args: argparse.Namespace):
    """The training-step options of ``args`` (commands that only search may lack the
    learning rate: it changes no layout and no cost)."""
    from tensoropt.passes.loss import LossKind
    from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
    from tensoropt.passes.training_step import TrainingOptions

    lr = getattr(args, "lr", 0.01)
    momentum = getattr(args, "momentum", 0.9)
    check_lr(lr)
    if not 0 <= momentum < 1:
        raise TensorOptError(f"--momentum must be in [0, 1), got {momentum}")
    return TrainingOptions(
        loss=LossKind(getattr(args, "loss", "auto")),
        optimizer=OptimizerOptions(
            kind=OptimizerKind(getattr(args, "optimizer", "sgd")), lr=lr, momentum=momentum
        ),
        trainable=getattr(args, "trainable", None),
        freeze=getattr(args, "freeze", None),
    )


def build_step(args: argparse.Namespace, *, load_weights: bool = True, plan: str | None = None):
    """Import ``args.model`` and build its training step (TrainingStep); ``plan``: the
    built-in plan it is for, which may rewrite the forward model first (megatron)."""
    from tensoropt.ir.importer import ImportOptions, import_model, parse_input_shapes
    from tensoropt.passes.training_step import build_training_step
    from tensoropt.rules.grad import GRAD_RULES
    from tensoropt.search.memory import fewer_collections

    options = ImportOptions(
        load_weights=load_weights,
        input_shapes=parse_input_shapes(args.input_shape),
        supported_ops=supported_ops(GRAD_RULES),
    )
    # the step's graph is millions of objects, almost none of them garbage: full
    # collections traversed them all (GPT-3 175B shape: about half of the 9 s it took)
    with fewer_collections():
        model = import_model(args.model, options)
        if plan is not None:
            from tensoropt.passes.plans import prepare_model

            prepare_model(plan, model)
        return build_training_step(model, training_options(args))


def supported_ops(grad_rules) -> frozenset[str]:
    """Ops the whole pipeline handles: a gradient rule or a non-differentiable marking."""
    return grad_rules.supported()


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write a file completely or not at all (``runtime.checkpoint.write_atomic``: a
    symlink's target is replaced and the link kept, a stream is written through); a
    missing directory is one line."""
    from tensoropt.runtime.checkpoint import write_atomic as replace

    _check_target_directory(path)
    replace(path, data)


def save_npz_atomic(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """An .npz of ``arrays`` written as :func:`write_atomic` writes a file."""
    from tensoropt.runtime.checkpoint import save_npz

    _check_target_directory(path)
    save_npz(path, arrays)


def _check_target_directory(path: str | os.PathLike) -> None:
    if is_stream(path):
        return
    directory = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(directory):
        raise TensorOptError(f"{path}: directory {directory} does not exist; create it first")


def progress(iterable, *, total: int, desc: str, label=None):
    """``iterable`` with its progress on stderr: a bar on a terminal, otherwise a line
    every ten seconds once the work has taken that long (``cli.progress``).
    ``label(item)`` names the item under way in those lines."""
    from tensoropt.cli.progress import Progress, Steps

    return Steps(iterable, lambda: Progress(total, desc=desc, announce=False), label)


def search_graph(args: argparse.Namespace):
    """The search graph of ``args.model``: its real training step, imported without weights.

    It is the same step `compile` partitions (same passes, same options), so what the
    search prices is what compile emits."""
    from tensoropt.cost.model import search_graph_of
    from tensoropt.search.memory import fewer_collections

    step = build_step(args, load_weights=False)
    with fewer_collections():
        return search_graph_of(step)


_BYTE_UNITS = {
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(text: str, flag: str) -> float:
    """``16GiB``, ``80GB``, ``512MiB``, ``1000000B``: a number with its unit.

    A bare number is refused: ``10`` would otherwise be 10 bytes, which nobody means."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match and float(match.group(1)) <= 0:  # no plan holds nothing: not "infeasible"
        raise TensorOptError(f"{flag} {text!r}: give a positive size like 16GiB or 512MiB")
    if match and not match.group(2):
        raise TensorOptError(
            f"{flag} {text!r}: give a unit: {match.group(1)}GiB, {match.group(1)}MiB "
            f"or {match.group(1)}B"
        )
    if not match or match.group(2).upper() not in _BYTE_UNITS:
        raise TensorOptError(f"{flag} {text!r}: give a size like 16GiB, 80GB or 512MiB")
    return float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()]


DEVICES_HELP = (
    "device counts: a list 1,2,4,8; A-B every count from A to B (3-5 = 3,4,5); A..B the "
    "powers of two from A to B, both powers of two (1..64 = 1,2,4,...,64); counts up to "
    "2**20, at most 1024 of them"
)


MAX_DEVICES = 2**20
"""The largest device count a search takes: far beyond any cluster, and small enough that
enumerating a count's 2-D meshes stays quick (a count near 2**40 took minutes)."""
MAX_COUNTS = 1024
"""The most device counts one search takes (``1-1024`` at most; ``1..1048576`` is 21)."""


def parse_devices(text: str, flag: str = "--devices") -> list[int]:
    """``1,2,4,8``, ``A-B`` (every count) or ``A..B`` (powers of two, A and B among them)."""
    import re

    text = text.strip()
    usage = f"{flag} {text!r}: give counts like 1,2,4,8, 1-8 (every count) or 1..64 (powers of two)"
    numbers = [int(x) for x in re.findall(r"\d+", text)]
    if any(n > MAX_DEVICES for n in numbers):
        raise TensorOptError(
            f"{flag} {text!r}: device counts go up to {MAX_DEVICES} (2**20); give smaller counts"
        )
    if re.fullmatch(r"\d+-\d+", text) and numbers[1] - numbers[0] >= MAX_COUNTS:
        raise TensorOptError(
            f"{flag} {text!r}: that is {numbers[1] - numbers[0] + 1} device counts, and a "
            f"search takes at most {MAX_COUNTS}; give a list or A..B (powers of two)"
        )
    if re.fullmatch(r"\d+(\.\.|-)\d+", text) and min(numbers) < 1:
        raise TensorOptError(f"{flag} {text!r}: device counts must be at least 1")
    if re.fullmatch(r"\d+\.\.\d+", text):
        lo, hi = numbers
        odd = [x for x in (lo, hi) if x & (x - 1)]
        if odd:
            raise TensorOptError(
                f"{flag} {text!r}: A..B takes the powers of two from A to B, and {odd[0]} is "
                f"not one; use {lo}-{hi} for every count from {lo} to {hi}"
            )
        out = [1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi]
    elif re.fullmatch(r"\d+-\d+", text):
        lo, hi = (int(x) for x in text.split("-"))
        out = list(range(lo, hi + 1))
    elif re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        out = [int(x) for x in text.split(",")]
    else:
        raise TensorOptError(usage)
    if not out:
        raise TensorOptError(f"{flag} {text!r}: the range is empty; give the smaller count first")
    if any(d < 1 for d in out):
        raise TensorOptError(f"{flag} {text!r}: device counts must be at least 1")
    out = sorted(set(out))
    if len(out) > MAX_COUNTS:
        raise TensorOptError(
            f"{flag} {text!r}: that is {len(out)} device counts, and a search takes at "
            f"most {MAX_COUNTS}; search fewer counts at a time"
        )
    return out


def check_output_file(path: str | None, flag: str) -> None:
    """Refuse an output file that cannot be written, before any work or output: its
    directory must exist and take a new file, and the path must not be a directory. A
    symlink's target is what is written (its directory is checked); a stream (a FIFO,
    ``/dev/stdout``) is written through, so only its own permission counts."""
    if path is None:
        return
    if not path.strip():
        raise TensorOptError(f"{flag} {path!r}: give a file name")
    if os.path.isdir(path):
        raise TensorOptError(f"{flag} {path}: is a directory; give a file name")
    if path.endswith(os.sep):
        raise TensorOptError(f"{flag} {path}: names a directory (it ends in {os.sep}); give a file")
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TensorOptError(
                f"{flag} {path}: a symlink loop (it never reaches a file); give another path"
            ) from None
    if is_stream(path):
        if not os.access(path, os.W_OK):
            raise TensorOptError(f"{flag} {path}: cannot be written; choose another path")
        return
    _check_writable_dir(os.path.dirname(os.path.realpath(path)), flag, path)


def check_output_dir(path: str, flag: str) -> None:
    """Refuse an output directory whose parent cannot take it, before any work."""
    if not path.strip():
        raise TensorOptError(f"{flag} {path!r}: give a directory name")
    if os.path.exists(path) and not os.path.isdir(path):
        raise TensorOptError(f"{flag} {path}: exists and is not a directory; choose another path")
    _check_writable_dir(os.path.dirname(os.path.abspath(path)), flag, path)


def _check_writable_dir(directory: str, flag: str, path: str) -> None:
    """``directory`` exists and a file can be created in it: tried, since permission
    bits do not tell (root may write anywhere the bits say, but not in /proc)."""
    if not os.path.isdir(directory):
        raise TensorOptError(
            f"{flag} {path}: directory {directory} does not exist; create it first"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".tensoropt-probe-")
    except OSError as exc:
        reason = (exc.strerror or type(exc).__name__).lower()
        raise TensorOptError(
            f"{flag} {path}: cannot create files in {directory} ({reason}); choose another path"
        ) from None
    os.close(fd)
    os.unlink(probe)
