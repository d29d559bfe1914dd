"""Options and helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping

import numpy as np

from tensoropt.errors import TensorOptError

TRAINING_HELP = """\
training options (the update is part of the compiled graph, so compile takes them too):
  the loss is built from the model's first float output: 'auto' uses a scalar output
  as the loss as it is, gives logits (rank >= 2) cross entropy against integer labels
  of shape logits[:-1], and a rank-1 output mean squared error.
  By default a float initializer is trained when it has rank >= 1 and reaches the loss
  through differentiable inputs; --trainable/--freeze REGEX override (freeze wins).
"""


def add_model_input_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input-shape",
        action="append",
        metavar="NAME=D0xD1",
        help="pin a dynamic model input, e.g. --input-shape input_ids=8x128 (repeatable)",
    )


def add_training_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training step")
    group.add_argument("--loss", choices=["auto", "ce", "mse"], default="auto")
    group.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    group.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    group.add_argument(
        "--momentum", type=float, default=0.9, help="SGD momentum (default 0.9; 0 = plain SGD)"
    )
    group.add_argument("--trainable", metavar="REGEX", help="also train initializers matching")
    group.add_argument("--freeze", metavar="REGEX", help="never train initializers matching")
    add_model_input_options(parser)


def training_options(args: argparse.Namespace):
    from tensoropt.passes.loss import LossKind
    from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
    from tensoropt.passes.training_step import TrainingOptions

    if args.lr <= 0:
        raise TensorOptError(f"--lr must be positive, got {args.lr}")
    if not 0 <= args.momentum < 1:
        raise TensorOptError(f"--momentum must be in [0, 1), got {args.momentum}")
    return TrainingOptions(
        loss=LossKind(args.loss),
        optimizer=OptimizerOptions(
            kind=OptimizerKind(args.optimizer), lr=args.lr, momentum=args.momentum
        ),
        trainable=args.trainable,
        freeze=args.freeze,
    )


def build_step(args: argparse.Namespace, *, load_weights: bool = True):
    """Import ``args.model`` and build its training step (TrainingStep)."""
    from tensoropt.ir.importer import ImportOptions, import_model, parse_input_shapes
    from tensoropt.passes.training_step import build_training_step
    from tensoropt.rules.grad import GRAD_RULES

    options = ImportOptions(
        load_weights=load_weights,
        input_shapes=parse_input_shapes(args.input_shape),
        supported_ops=supported_ops(GRAD_RULES),
    )
    model = import_model(args.model, options)
    return build_training_step(model, training_options(args))


def supported_ops(grad_rules) -> frozenset[str]:
    """Ops the whole pipeline handles: a gradient rule or a non-differentiable marking."""
    return grad_rules.supported()


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write a file completely or not at all (temp file in the same dir + rename)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise TensorOptError(f"{path}: directory {directory} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_npz_atomic(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(path, buffer.getvalue())


def print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, default=float)
    sys.stdout.write("\n")


def progress(iterable, *, total: int, desc: str):
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, disable=None, leave=False)


def search_graph(args: argparse.Namespace):
    """Import ``args.model`` without its weights and describe it for the cost model."""
    import onnx_ir as ir

    from tensoropt.cost.model import SearchGraph
    from tensoropt.ir.builder import Builder
    from tensoropt.ir.importer import ImportOptions, import_model, parse_input_shapes
    from tensoropt.passes.loss import LossKind, build_loss
    from tensoropt.passes.trainable import select_trainable
    from tensoropt.rules.grad import GRAD_RULES
    from tensoropt.search.driver import graph_batch

    options = ImportOptions(
        load_weights=False,
        input_shapes=parse_input_shapes(args.input_shape),
        supported_ops=supported_ops(GRAD_RULES),
    )
    model = import_model(args.model, options)
    pristine = ir.serde.deserialize_model(ir.serde.serialize_model(model))  # for the step
    graph = model.graph
    # The loss is part of the step: its layout decisions (e.g. a vocab-sharded LM head
    # feeding the softmax) cost communication, so it is part of the search graph.
    loss = LossKind(getattr(args, "loss", "auto"))
    spec = build_loss(graph, loss, Builder(graph, prefix="t_"))
    selection = select_trainable(
        graph,
        [spec.source],
        GRAD_RULES.is_non_differentiable,
        trainable=args.trainable,
        freeze=args.freeze,
    )
    data = tuple(v.name for v in graph.inputs if v.name not in graph.initializers)
    states = 2 if args.optimizer == "adam" else (1 if args.momentum else 0)
    saved = saved_for_backward(pristine, loss, args.trainable, args.freeze)
    batch = graph_batch(graph, data)
    return SearchGraph(graph, frozenset(selection.trained), data, states, batch, saved)


def saved_for_backward(model, loss, trainable, freeze) -> frozenset[str]:
    """Names of the forward values that the backward of ``model``'s step reads.

    These stay alive from the forward to the backward; every other forward value is
    freed once its forward consumers ran. The cost model counts only these as
    activation memory (measured: counting every op output over-estimated gpt-small's
    per-device memory by 50-70%). ``model`` (a weightless import) is mutated: loss and
    gradients are appended; the optimizer, which reads only parameters and gradients,
    and shape inference are skipped."""
    from tensoropt.ir.builder import ROLE_KEY, Builder
    from tensoropt.passes.autodiff import build_gradients
    from tensoropt.passes.loss import build_loss
    from tensoropt.passes.trainable import select_trainable
    from tensoropt.rules.grad import GRAD_RULES

    graph = model.graph
    builder = Builder(graph, prefix="t_")
    spec = build_loss(graph, loss, builder)
    selection = select_trainable(
        graph, [spec.source], GRAD_RULES.is_non_differentiable, trainable=trainable, freeze=freeze
    )
    params = [graph.initializers[n] for n in selection.trained]
    build_gradients(graph, spec.loss, params, GRAD_RULES, builder)
    forward: set[str] = set()
    read: set[str] = set()
    for node in graph:
        role = node.metadata_props.get(ROLE_KEY)
        if role in ("forward", "loss"):
            forward.update(v.name for v in node.outputs if v is not None)
        elif role == "backward":
            read.update(v.name for v in node.inputs if v is not None)
    return frozenset(forward & read)


def parse_bytes(text: str, flag: str) -> float:
    """``16GiB``, ``80GB``, ``512MiB`` or a plain number of bytes."""
    import re

    units = {
        "": 1,
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
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in units:
        raise TensorOptError(f"{flag} {text!r}: give a size like 16GiB, 80GB or 512MiB")
    return float(match.group(1)) * units[match.group(2).upper()]


def parse_devices(text: str) -> list[int]:
    """``1,2,4,8`` or a range ``1..64`` (powers of two) or ``1-8`` (every count)."""
    import re

    text = text.strip()
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            out, d = [], 1
            while d <= hi:
                if d >= lo:
                    out.append(d)
                d *= 2
        elif re.fullmatch(r"\d+-\d+", text):
            lo, hi = (int(x) for x in text.split("-"))
            out = list(range(lo, hi + 1))
        else:
            out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise TensorOptError(
            f"--devices {text!r}: give counts like 1,2,4,8, a range 1..64 (powers of two) "
            "or 1-8 (every count)"
        ) from None
    if not out or any(d < 1 for d in out):
        raise TensorOptError(f"--devices {text!r}: device counts must be positive")
    return sorted(set(out))
