"""The compile pipeline's steps as passes (:mod:`tensoropt.passes.infra`).

``build-training-step -> check-plan -> recompute -> annotate -> insert-redistribution ->
cut-micro-batches -> localize -> micro-template`` (the two micro passes change nothing
when the plan has one micro-batch; recompute changes nothing when it recomputes no block).
Each pass wraps the existing function of that step; its ``requires`` / ``ensures``
state what the step needs and promises. Lowering per rank is not a pass: it is a loop
over ranks in :func:`tensoropt.passes.compile.compile_step`, cheap per rank, on the
template the last pass makes.

Verification (:mod:`tensoropt.passes.verify`) is chosen by :class:`PipelineOptions`,
which the caller passes; ``tensoropt compile --verify-passes`` turns it on, and the
test suite turns it on for every test by replacing :data:`DEFAULT_OPTIONS` (the options
:func:`compile_step` uses when given none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import onnx_ir as ir

from tensoropt.ir.layout import Layout
from tensoropt.passes.annotate import annotate
from tensoropt.passes.infra import CompileState, Pass, PassManager, PassResult, Violation
from tensoropt.passes.insert_redistribution import insert_redistribution
from tensoropt.passes.micro import MICRO_KEY, annotate_micro, cut_phases, to_plan_mesh
from tensoropt.passes.partition import localize
from tensoropt.passes.plans import check_plan
from tensoropt.passes.recompute import apply_recompute
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tensoropt.passes.verify import DeviceCheck, Verifier


def _need(state: CompileState, *fields: str) -> None:
    for field in fields:
        if getattr(state, field) is None:
            raise Violation("requires", f"the state has no {field.replace('_', ' ')}")


def _absent(state: CompileState, *fields: str) -> None:
    for field in fields:
        if getattr(state, field) is not None:
            raise Violation("requires", f"the state already has a {field.replace('_', ' ')}")


@dataclass(frozen=True, slots=True)
class BuildTrainingStep(Pass):
    """Forward model -> training step (loss, backward, optimizer), in place."""

    name: ClassVar[str] = "build-training-step"
    options: TrainingOptions = TrainingOptions()

    def requires(self, state: CompileState) -> None:
        _absent(state, "step")

    def call(self, state: CompileState) -> PassResult:
        step = build_training_step(state.model, self.options)
        return PassResult(state.replace(model=step.model, step=step), True)

    def ensures(self, state: CompileState) -> None:
        _need(state, "step")
        if not state.step.signature.loss:  # type: ignore[union-attr]
            raise Violation("ensures", "the training step names no loss output")


@dataclass(frozen=True, slots=True)
class CheckPlan(Pass):
    """Refuse a plan that does not fit the model (names the unit, tensor and sizes)."""

    name: ClassVar[str] = "check-plan"

    def requires(self, state: CompileState) -> None:
        _need(state, "step", "plan")

    def call(self, state: CompileState) -> PassResult:
        check_plan(state.model.graph, state.plan)  # type: ignore[arg-type]
        return PassResult(state, False)


@dataclass(frozen=True, slots=True)
class Recompute(Pass):
    """Clone the plan's recomputed blocks into the backward (``passes.recompute``)."""

    name: ClassVar[str] = "recompute"

    def requires(self, state: CompileState) -> None:
        _need(state, "step", "plan")
        _absent(state, "annotation")

    def call(self, state: CompileState) -> PassResult:
        assert state.step is not None and state.plan is not None
        added = apply_recompute(state.model, state.step.signature.data_inputs, state.plan.recompute)
        return PassResult(state, added > 0)


@dataclass(frozen=True, slots=True)
class Annotate(Pass):
    """A strategy for every node and a layout for every value, from the plan."""

    name: ClassVar[str] = "annotate"

    def requires(self, state: CompileState) -> None:
        _need(state, "step", "plan")
        _absent(state, "annotation")

    def call(self, state: CompileState) -> PassResult:
        step = state.step
        assert step is not None and state.plan is not None
        how = annotate if state.plan.micro_batches == 1 else annotate_micro
        ann = how(state.model.graph, step.signature, state.plan, state.data_axes)
        annotated = ir.serde.serialize_model(state.model)  # before any conversion
        return PassResult(state.replace(annotation=ann, annotated=annotated), True)

    def ensures(self, state: CompileState) -> None:
        _need(state, "annotation", "annotated")
        ann = state.annotation
        assert ann is not None
        fixed = set(ann.units.fixed)  # nodes of no unit run whole, on replicated values
        for node in state.model.graph:
            if node not in ann.strategies and node not in fixed:
                raise Violation("ensures", f"node {node.name!r} ({node.op_type}) has no strategy")


@dataclass(frozen=True, slots=True)
class InsertRedistribution(Pass):
    """Conversions wherever a producer's layout differs from what a consumer needs."""

    name: ClassVar[str] = "insert-redistribution"

    def requires(self, state: CompileState) -> None:
        _need(state, "annotation")
        _absent(state, "layouts")

    def call(self, state: CompileState) -> PassResult:
        assert state.annotation is not None
        layouts = insert_redistribution(state.model.graph, state.annotation)
        return PassResult(state.replace(layouts=layouts), True)

    def ensures(self, state: CompileState) -> None:
        """Every annotated node reads each input in the layout its strategy needs."""
        _need(state, "layouts")
        ann, layouts = state.annotation, state.layouts
        assert ann is not None and layouts is not None
        for node in state.model.graph:
            if node not in ann.strategies:
                continue
            for i, value in enumerate(node.inputs):
                need = ann.input_layout(node, i)
                if value is None or need is None:
                    continue
                have = layouts.get(value)
                if have != need:
                    raise Violation(
                        "ensures",
                        f"node {node.name!r} ({node.op_type}) input {i} ({value.name!r}) is "
                        f"{have} but its strategy needs {need}",
                    )


@dataclass(frozen=True, slots=True)
class CutMicroBatches(Pass):
    """Micro-batched plans: every node tagged with its phase, all-reduces over the
    micro axis rewritten for accumulation, the cut in the model's metadata."""

    name: ClassVar[str] = "cut-micro-batches"

    def requires(self, state: CompileState) -> None:
        _need(state, "annotation", "layouts", "plan")
        _absent(state, "template")

    def call(self, state: CompileState) -> PassResult:
        assert state.plan is not None and state.step is not None
        k = state.plan.micro_batches
        if k == 1:
            return PassResult(state, False)
        assert state.annotation is not None and state.layouts is not None
        layouts = dict(state.layouts)
        graph = state.model.graph
        cut = cut_phases(graph, state.step.signature, state.annotation.mesh, layouts, k)
        state.model.metadata_props[MICRO_KEY] = json.dumps(cut.to_json())
        return PassResult(state.replace(layouts=layouts), True)


@dataclass(frozen=True, slots=True)
class MicroTemplate(Pass):
    """Micro-batched plans: the micro-mesh template as the plan's ranks run it."""

    name: ClassVar[str] = "micro-template"

    def requires(self, state: CompileState) -> None:
        _need(state, "template", "plan")

    def call(self, state: CompileState) -> PassResult:
        assert state.plan is not None and state.template is not None
        if state.plan.micro_batches == 1:
            return PassResult(state, False)
        template = to_plan_mesh(state.template, state.plan.mesh, state.plan.micro_batches)
        return PassResult(state.replace(template=template), True)

    def ensures(self, state: CompileState) -> None:
        assert state.plan is not None and state.template is not None
        if state.template.mesh != state.plan.mesh:
            raise Violation("ensures", "the template is not on the plan's mesh")


@dataclass(frozen=True, slots=True)
class Localize(Pass):
    """Local attributes, constants and shapes: the rank-independent template."""

    name: ClassVar[str] = "localize"

    def requires(self, state: CompileState) -> None:
        _need(state, "annotation", "layouts")
        _absent(state, "template")

    def call(self, state: CompileState) -> PassResult:
        assert state.annotation is not None and state.layouts is not None
        layouts: dict[ir.Value, Layout] = dict(state.layouts)  # localize adds scaled outputs
        template = localize(state.model, state.annotation, layouts)
        _type_constants(state.model.graph)
        return PassResult(state.replace(layouts=layouts, template=template), True)

    def ensures(self, state: CompileState) -> None:
        _need(state, "template")


def _type_constants(graph: ir.Graph) -> None:
    """Give every Constant's output the dtype and shape of the tensor it holds.

    localize's output scaling (``partition._scale_output``) makes its factor Constant
    without them; the IR keeps every value typed so later checks and passes can rely
    on shapes."""
    for node in graph:
        out = node.outputs[0] if node.op_type == "Constant" and node.outputs else None
        if out is None or out.shape is not None or "value" not in node.attributes:
            continue
        tensor = node.attributes["value"].as_tensor()
        out.dtype = tensor.dtype
        out.shape = ir.Shape(list(tensor.shape))


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    """How the pipeline runs. ``verify``: check well-formedness between passes.
    ``device_check``: the runtime's collective-order check for the lowered device
    graphs (passes cannot import the runtime layer; the CLI and tests hand it in)."""

    verify: bool = False
    device_check: DeviceCheck | None = None

    def verifier(self) -> Verifier | None:
        return Verifier(self.device_check) if self.verify else None


# The options compile_step uses when its caller gives none (tests replace it to verify).
DEFAULT_OPTIONS = PipelineOptions()

FRONT_HALF = (
    CheckPlan(),
    Recompute(),
    Annotate(),
    InsertRedistribution(),
    CutMicroBatches(),
    Localize(),
    MicroTemplate(),
)


def front_half(options: PipelineOptions) -> PassManager:
    """check-plan -> recompute -> annotate -> insert-redistribution -> cut-micro-batches ->
    localize -> micro-template."""
    return PassManager(FRONT_HALF, options.verifier())


def full_pipeline(training: TrainingOptions, options: PipelineOptions) -> PassManager:
    """build-training-step, then the front half."""
    return PassManager((BuildTrainingStep(training), *FRONT_HALF), options.verifier())
