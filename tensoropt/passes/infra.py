"""Pass infrastructure: a pass runs ``requires -> call -> ensures``; a manager chains passes.

The compile pipeline's state is more than a model: the training step, the plan, the
annotation, the layouts and the local template travel together, so a pass maps one
frozen :class:`CompileState` to the next (fields are filled in as passes run; the
ONNX model inside is mutated in place by the passes that rewrite the graph, as the
underlying functions always did). A pass is a frozen dataclass whose fields are its
options; there is no registry: a pipeline is the tuple of passes it runs.

Failures, and what they name:

- ``requires`` / ``ensures`` (the pass's own pre- and postconditions) and the
  well-formedness verifier (:mod:`tensoropt.passes.verify`, run on the input and after
  every pass when a manager has one) raise :class:`VerificationError`, whose one-line
  message names where (before / after which pass), the check and the node or value.
- A :class:`~tensoropt.errors.TensorOptError` raised inside a pass is bad input (the
  pass names the tensor or plan unit): it propagates unchanged, one line for the CLI.
- Any other exception is a bug of the pass: it becomes a :class:`PassError` naming the
  failing pass and the passes that ran before it, chained to the original.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import onnx
import onnx_ir as ir

from tensoropt.errors import TensorOptError
from tensoropt.ir.layout import Layout
from tensoropt.ir.plan import Plan
from tensoropt.passes.annotate import Annotation
from tensoropt.passes.partition import LocalTemplate
from tensoropt.passes.training_step import TrainingStep

log = logging.getLogger(__name__)


class VerificationError(TensorOptError):
    """A pass broke (or was handed) an ill-formed graph, annotation or device graph set."""


class PassError(RuntimeError):
    """A pass failed with an internal error; names the pass and those that ran before."""


class Violation(Exception):
    """One failed well-formedness check, before it is placed in the pipeline."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(check, detail)
        self.check = check  # e.g. "topological-order"
        self.detail = detail  # names the node or value and what is wrong

    def __str__(self) -> str:
        return f"check {self.check!r}: {self.detail}"


@dataclass(frozen=True, slots=True)
class CompileState:
    """What the compile passes hand each other (see the module docstring).

    ``model`` is the forward model before build-training-step and the training step
    after it. ``annotated`` is the step as annotate saw it (serialised before any
    conversion is inserted): the unpartitioned reference the output directory keeps.
    """

    model: ir.Model
    plan: Plan | None = None
    data_axes: tuple[int, ...] | None = None
    step: TrainingStep | None = None
    annotation: Annotation | None = None
    annotated: onnx.ModelProto | None = None
    layouts: Mapping[ir.Value, Layout] | None = None
    template: LocalTemplate | None = None

    @staticmethod
    def of_step(step: TrainingStep, plan: Plan, data_axes: Sequence[int] | None) -> CompileState:
        axes = None if data_axes is None else tuple(data_axes)
        return CompileState(step.model, plan, axes, step)

    def replace(self, **changes) -> CompileState:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class PassResult:
    state: CompileState
    modified: bool  # whether the pass changed the graph or added to the state


class Pass(abc.ABC):
    """One step of the pipeline. Subclasses are frozen dataclasses (fields = options)."""

    name: ClassVar[str]

    def requires(self, state: CompileState) -> None:  # noqa: B027 (optional hook)
        """Preconditions on the input; raise :class:`Violation`. None by default."""

    @abc.abstractmethod
    def call(self, state: CompileState) -> PassResult: ...

    def ensures(self, state: CompileState) -> None:  # noqa: B027 (optional hook)
        """Postconditions on the output; raise :class:`Violation`. None by default."""

    def __call__(self, state: CompileState) -> PassResult:
        try:
            self.requires(state)
        except Violation as v:
            raise _placed(v, f"before pass {self.name!r} (its precondition)") from None
        result = self.call(state)
        if not isinstance(result, PassResult):
            raise PassError(f"pass {self.name!r} returned {type(result).__name__}, not PassResult")
        try:
            self.ensures(result.state)
        except Violation as v:
            raise _placed(v, f"after pass {self.name!r} (its postcondition)") from None
        return result


Verifier = Callable[[CompileState], None]  # raises Violation on an ill-formed state


def _placed(v: Violation, where: str) -> VerificationError:
    return VerificationError(
        f"pass verification failed {where}: {v}; this is a tensoropt bug, report it with "
        "the model and the command"
    )


@dataclass(frozen=True, slots=True)
class PassManager:
    """Runs ``passes`` in order, verifying the input and every output when given a verifier.

    ``history``: names of passes that already ran on the state this manager receives
    (a manager split by :meth:`split_after` keeps them so messages still name them).
    """

    passes: tuple[Pass, ...]
    verifier: Verifier | None = None
    history: tuple[str, ...] = ()

    def __call__(self, state: CompileState) -> PassResult:
        if self.verifier is not None and not self.history and self.passes:
            self._verify(state, f"before pass {self.passes[0].name!r} (the pipeline's input)")
        modified = False
        ran = list(self.history)
        for p in self.passes:
            log.debug("running pass %s", p.name)
            try:
                result = p(state)
            except (TensorOptError, PassError):
                raise
            except Exception as exc:
                raise PassError(
                    f"pass {p.name!r} failed (after passes {ran}): {type(exc).__name__}: {exc}"
                ) from exc
            state = result.state
            modified = modified or result.modified
            ran.append(p.name)
            if self.verifier is not None:
                self._verify(state, f"after pass {p.name!r}")
        return PassResult(state, modified)

    def _verify(self, state: CompileState, where: str) -> None:
        assert self.verifier is not None
        try:
            self.verifier(state)
        except Violation as v:
            raise _placed(v, where) from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def split_after(self, name: str) -> tuple[PassManager, PassManager]:
        """Two managers: the passes up to ``name`` and the rest (which knows what ran)."""
        if name not in self.names:
            raise ValueError(f"no pass {name!r} in {list(self.names)}")
        k = self.names.index(name) + 1
        first = dataclasses.replace(self, passes=self.passes[:k])
        rest = dataclasses.replace(
            self, passes=self.passes[k:], history=(*self.history, *self.names[:k])
        )
        return first, rest
