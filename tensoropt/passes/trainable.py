"""Which initializers are trained.

Exporters store constants as initializers too (scalars, attention scales, mask
fills, Pow exponents, rotary tables, shape tensors). The default policy trains a
float initializer only when it has rank >= 1 (or is a scalar the exporter records as a
torch parameter) and reaches the loss through differentiable input slots. Slots that
take shapes, exponents, indices, axes, bounds or running statistics are not
differentiable by policy; additive masks (values at or below -1e4, or infinite) are
frozen; rotary tables (which reach the loss only through Sin/Cos) are frozen; so are
the constants the importer makes (``ir/canonical.py``: a resize's interpolation
weights). ``--trainable``/``--freeze`` regexes override, with ``--freeze`` winning.

Files from ``torch.onnx.export(dynamo=True)`` say more, and the policy reads it:
an initializer whose ``pkg.torch.export.graph_signature.InputSpec.kind`` is not
``PARAMETER`` (a buffer such as BatchNorm statistics or ``inv_freq``) is frozen,
and so is a constant the exporter folded from a ``sin``/``cos`` node (recorded in
``pkg.onnxscript.optimizer.folded_from``: rotary tables whose Sin/Cos were folded
away), and so is one folded from a computation that read an activation (only its
shape can have been read: the attention scale of an opset-20 export of
``scaled_dot_product_attention``) or from the exporter's anonymous ``val_N`` values
and torch's tensor constructors alone (a ``torch.zeros`` made in forward: a mask base,
``nn.LSTM``'s initial state), and so is an all-zero constant folded from positions
(``arange`` and comparisons, no parameter): an attention mask that masks nothing, which
HuggingFace models build when no padding is given. See docs/design/exports.md.

An initializer the optimizer folded from a parameter through an op that repeats it,
which the importer could not give back as the parameter (``importer.
_collapse_broadcast_copies`` and ``_regather_copies`` give back a class token expanded to
the batch and a bias table gathered at constant buckets; a table whose values repeat
stays), is still trained, since the file cannot say which entries were one parameter;
the summary warns, naming the parameter and ``optimize=False`` (:func:`folded_copies`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tensoropt.errors import NoTrainableParamsError, TensorOptError
from tensoropt.ir.importer import REPLICATING
from tensoropt.ir.vocab import MADE_KEY
from tensoropt.passes.autodiff import is_float

# op_type -> input slots that never carry a trained gradient by policy.
_FROZEN_SLOTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}),
    "Expand": frozenset({1}),
    "Tile": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}),
    "Split": frozenset({1}),
    "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}),
    "Pad": frozenset({1, 2, 3}),
    "Pow": frozenset({1}),
    "Gather": frozenset({1}),
    "GatherND": frozenset({1}),
    "GatherElements": frozenset({1}),
    "Where": frozenset({0}),
    "Clip": frozenset({1, 2}),
    "Dropout": frozenset({1, 2}),
    "BatchNormalization": frozenset({3, 4}),
    "ReduceMean": frozenset({1}),
    "ReduceSum": frozenset({1}),
    "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}),
    "CumSum": frozenset({1}),
    "Trilu": frozenset({1}),
}
# Ops through which nothing is trained by default (positional tables).
_FROZEN_OPS = frozenset({"Sin", "Cos"})
_MASK_THRESHOLD = -1e4
# torch.onnx (dynamo) provenance metadata on initializers.
_TORCH_KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
_FOLDED_FROM_KEY = "pkg.onnxscript.optimizer.folded_from"
_FOLDED_TABLE = re.compile(r"'(sin|cos)(_\d+)?'")
_FOLDED_NAME = re.compile(r"'([^']*)'")  # the names of the list folded_from records
_ANONYMOUS = re.compile(r"val_\d+")  # the exporter's names for values torch did not name
# torch ops that make a tensor from nothing but a shape (named after the op)
_CONSTRUCTOR = re.compile(r"(zeros|ones|full|empty|zeros_like|ones_like|full_like)(_\d+)?")
# constants the exporter names itself (a function's literal, a lifted tensor constant)
_EXPORTER_CONSTANT = re.compile(
    r"(const|scalar_tensor\w*|_tensor_constant\d*|lifted_tensor\w*)(_\d+)?"
)
# torch ops the exporter names folded values after (the FX node of an aten call is named
# after the op): arithmetic, shape and conversion ops that build position tables (ALiBi's
# slopes times key positions, repeated to the batch). A folded constant whose recorded
# sources are these, constructors and anonymous values alone read no parameter, which
# would be recorded by its own name.
_TORCH_OP = re.compile(
    r"(arange|mul|add|sub|rsub|div|pow|neg|reciprocal|exp|log|log2|sqrt|rsqrt|floor|ceil"
    r"|floor_divide|remainder|fmod|clamp|clamp_min|clamp_max|abs|sign|minimum|maximum"
    r"|where|masked_fill|cumsum|unsqueeze|squeeze|view|reshape|_unsafe_view|expand|repeat"
    r"|repeat_interleave|cat|stack|slice|select|index|permute|transpose|flatten|clone"
    r"|contiguous|alias|detach|lift_fresh_copy|convert_element_type\w*|_to_copy|to|type_as"
    r"|ge|gt|le|lt|eq|ne|logical_\w+|bitwise_\w+|tril|triu)(_\d+)?"
)
# torch ops that build an attention mask from positions alone (arange, comparisons):
# a folded constant made through them and all zero is a mask that masks nothing
_MASK_BUILDER = re.compile(r"(arange|ge|gt|le|lt|eq|ne|logical_\w+|bitwise_\w+|tril|triu)(_\d+)?")
_COPIES_CHECKED = 1 << 22  # elements: larger folded tensors are not read for repeats


@dataclass(frozen=True, slots=True)
class TrainableSelection:
    """The trained parameters (in graph initializer order) and the frozen ones."""

    trained: tuple[str, ...]
    frozen: tuple[str, ...]
    # trained initializer -> the parameters it repeats values of (:func:`folded_copies`)
    copies: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # frozen scalar -> the names it was folded from (:func:`folded_scalar`)
    folded: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def summary(self, graph: ir.Graph) -> str:
        """One line for the user: what is trained and which float initializers of the
        file are not (integer initializers are shapes and indices: never trainable, not
        counted; nor are the constants the importer made, ``MADE_KEY``); then a warning
        line per trained folded copy (:func:`folded_copies`). ``graph`` is the whole
        model's: the counts are global, not per device."""
        elements = sum(int(np.prod(graph.initializers[n].shape.numpy())) for n in self.trained)
        kept = sum(
            is_float(v) and MADE_KEY not in v.metadata_props
            for v in (graph.initializers[n] for n in self.frozen)
        )
        line = f"training {len(self.trained)} parameters ({elements:,} elements, whole model)"
        if kept:
            line += (
                f"; {kept} float initializer{'s' if kept > 1 else ''} not trained "
                "(constants, masks, buffers or --freeze)"
            )
        for name, sources in self.copies:
            shape = list(graph.initializers[name].shape.numpy())
            of = f" {', '.join(repr(s) for s in sources)}" if sources else " a parameter"
            line += (
                f"\nwarning: initializer {name!r} {shape} repeats values the exporter folded "
                f"from{of}: each copy is trained on its own, which the torch model does not "
                "do; export with torch.onnx.export(..., optimize=False) to keep the "
                f"parameter, or --freeze {name!r}"
            )
        for name, sources in self.folded:
            of = ", ".join(repr(s) for s in sources)
            line += (
                f"\nwarning: scalar {name!r} is a value the exporter computed from {of} "
                "ahead of time (a learned temperature's exp, say) and is not trained; "
                "if that is a parameter, export with torch.onnx.export(..., optimize=False) "
                f"to train it, or --trainable {name!r} to train the computed value instead"
            )
        return line


def _reaches_loss(graph: ir.Graph, sources: Iterable[ir.Value], non_diff) -> set[ir.Value]:
    """Values from which some ``sources`` value is reached through differentiable slots."""
    reached: set[ir.Value] = set(sources)
    for node in reversed(list(graph)):
        if not any(v in reached for v in node.outputs):
            continue
        if non_diff(node.op_type) or node.op_type in _FROZEN_OPS:
            continue
        frozen = _FROZEN_SLOTS.get(node.op_type, frozenset())
        for slot, value in enumerate(node.inputs):
            if value is not None and slot not in frozen and is_float(value):
                reached.add(value)
    return reached


def _is_mask(value: ir.Value) -> bool:
    tensor = value.const_value
    if tensor is None or isinstance(tensor, ir.ExternalTensor):
        return False
    array = tensor.numpy()
    return bool(array.size) and bool(np.any((array <= _MASK_THRESHOLD) | np.isinf(array)))


def _not_a_torch_parameter(value: ir.Value, produced: set[str]) -> bool:
    """The exporter says ``value`` is a buffer, or was folded from Sin/Cos (a table), or
    was folded from a computation that read an activation (a value some node of the
    graph makes, in ``produced``): no parameter is a function of an activation, so only
    the activation's shape was read, e.g. ``1 / sqrt(q.shape[-1])``, the attention
    scale an opset-20 export of ``scaled_dot_product_attention`` folds into a [1]
    constant; or folded from the exporter's anonymous values, tensor constructors and
    torch ops alone (``val_8``, ``zeros``, ``arange``, ``mul``), as a
    ``torch.zeros(b, 1, t, t)`` mask base made in forward is, ``nn.LSTM``'s zero initial
    state, and BLOOM's ALiBi table; or an attention mask that masks nothing
    (:func:`_empty_mask`). A root-level parameter named like one of those ops would be
    misread."""
    kind = value.metadata_props.get(_TORCH_KIND_KEY)
    if kind is not None and kind != "PARAMETER":
        return True
    folded = value.metadata_props.get(_FOLDED_FROM_KEY, "")
    if not folded:
        return False
    if _FOLDED_TABLE.search(folded):
        return True
    names = _FOLDED_NAME.findall(folded)
    if any(name in produced for name in names):
        return True
    # folded from the exporter's own anonymous values, torch's tensor constructors and
    # ops alone (``torch.zeros(...)`` made in forward, as nn.LSTM's initial state is;
    # shape arithmetic; BLOOM's ALiBi table): a parameter would be named by its torch name
    if names and all(_made_name(name) for name in names):
        return True
    return _empty_mask(value, names)


def _made_name(name: str) -> bool:
    """A name the exporter gives a value it made (anonymous, a constant of its own, a
    tensor constructor's or a torch op's output), not a parameter's."""
    return any(p.fullmatch(name) for p in (_ANONYMOUS, _CONSTRUCTOR, _EXPORTER_CONSTANT, _TORCH_OP))


def _empty_mask(value: ir.Value, names: list[str]) -> bool:
    """An additive attention mask that masks nothing, folded by the exporter: all zero,
    built from positions (``arange``, comparisons) and no parameter (no dotted torch
    name). HuggingFace models build one ``[batch, 1, S, S]`` when no padding is given;
    trained, it would become a learned attention bias per sample and position."""
    if any("." in name for name in names) or not any(_MASK_BUILDER.fullmatch(n) for n in names):
        return False
    tensor = value.const_value
    if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.size > _COPIES_CHECKED:
        return False
    return not np.any(tensor.numpy())


def folded_scalar(value: ir.Value, produced: set[str]) -> tuple[str, ...] | None:
    """The named sources of a float scalar the exporter's optimizer folded from values
    that are neither its anonymous ones, its own constants, tensor constructors,
    activations (``produced``) nor a table's Sin/Cos: ``exp`` folded from a ``scale``
    parameter (CLIP's learned temperature, ``scale.exp()``). The scalar is not trained
    (no rank >= 1, no ``PARAMETER`` kind), and the parameter is gone from the file. None
    otherwise."""
    if value.shape is None or len(value.shape) != 0 or not is_float(value):
        return None
    folded = value.metadata_props.get(_FOLDED_FROM_KEY, "")
    if not folded or _FOLDED_TABLE.search(folded):
        return None
    names = _FOLDED_NAME.findall(folded)
    if any(name in produced for name in names):
        return None
    named = tuple(n for n in names if not _made_name(n))
    return named or None


def folded_copies(value: ir.Value) -> tuple[str, ...] | None:
    """The parameters ``value`` repeats values of, when the exporter folded it from a
    parameter through an op that repeats its input (it names the value or an
    intermediate after the op: ``expand``, ``embedding``, ``index``...) and its values do
    repeat, and the importer left it (a relative position bias whose table's values
    repeat: which entries were one element cannot be told). Trained, each copy learns on
    its own; torch trains one parameter. The parameters are the dotted names the
    exporter recorded (else its other non-anonymous names; empty when it recorded none).
    None: not such a copy."""
    names = _FOLDED_NAME.findall(value.metadata_props.get(_FOLDED_FROM_KEY, ""))
    if not names or not any(REPLICATING.fullmatch(n) for n in (value.name or "", *names)):
        return None
    tensor = value.const_value
    if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.size > _COPIES_CHECKED:
        return None
    array = tensor.numpy()
    if np.unique(array).size == array.size:
        return None
    named = [n for n in names if not _ANONYMOUS.fullmatch(n)]
    dotted = [n for n in named if "." in n]
    return tuple(dotted or [n for n in named if not REPLICATING.fullmatch(n)])


def _compile(pattern: str | None, flag: str) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise TensorOptError(
            f"{flag} {pattern!r} is not a valid regular expression: {exc}"
        ) from None


def select_trainable(
    graph: ir.Graph,
    loss_sources: Iterable[ir.Value],
    non_diff,
    *,
    trainable: str | None = None,
    freeze: str | None = None,
) -> TrainableSelection:
    """Apply the default policy, then the ``--trainable``/``--freeze`` overrides."""
    reached = _reaches_loss(graph, loss_sources, non_diff)
    produced = {v.name for node in graph for v in node.outputs if v.name}
    force_on = _compile(trainable, "--trainable")
    force_off = _compile(freeze, "--freeze")
    names = list(graph.initializers)
    for flag, pattern, found in (
        ("--trainable", trainable, force_on),
        ("--freeze", freeze, force_off),
    ):
        # a pattern that names nothing (a typo) would leave the default policy in force
        if found is not None and not any(found.search(n) for n in names):
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise TensorOptError(
                f"{flag} {pattern!r} matches no initializer of the model ({shown}); give a "
                "pattern that names some"
            )
    trained, frozen = [], []
    for name, value in graph.initializers.items():
        floaty = is_float(value)
        # a scalar is trained when the exporter says it is a parameter (a learned
        # temperature); other scalars are the exporter's constants
        ranked = value.shape is not None and (
            len(value.shape) >= 1 or value.metadata_props.get(_TORCH_KIND_KEY) == "PARAMETER"
        )
        default = (
            floaty
            and ranked
            and value in reached
            and not _is_mask(value)
            and MADE_KEY not in value.metadata_props  # the importer's constants
            and not _not_a_torch_parameter(value, produced)
        )
        on = default or bool(floaty and force_on and force_on.search(name))
        if force_off and force_off.search(name):
            on = False
        (trained if on else frozen).append(name)
    if not trained:
        if force_off is not None and any(force_off.search(n) for n in frozen):
            raise NoTrainableParamsError(
                f"--freeze {freeze!r} froze every parameter, so nothing would be trained; "
                "use a narrower pattern"
            )
        raise NoTrainableParamsError(
            "the model has no trainable parameters: no float initializer of rank >= 1 "
            "reaches the loss; check the model's weights, or select some with --trainable REGEX"
        )
    copies = []
    for name in trained:
        sources = folded_copies(graph.initializers[name])
        if sources is not None:
            copies.append((name, sources))
    folded = []
    for name in frozen:
        value = graph.initializers[name]
        if value not in reached or (force_off and force_off.search(name)):
            continue
        sources = folded_scalar(value, produced)
        if sources is not None:
            folded.append((name, sources))
    return TrainableSelection(tuple(trained), tuple(frozen), tuple(copies), tuple(folded))
