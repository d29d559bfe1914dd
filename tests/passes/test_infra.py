"""The pass protocol and the pass manager (tensoropt.passes.infra)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import onnx_ir as ir
import pytest

from tensoropt.errors import PlanError, TensorOptError
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import Plan, UnitStrategy
from tensoropt.passes.infra import (
    CompileState,
    Pass,
    PassError,
    PassManager,
    PassResult,
    VerificationError,
    Violation,
)
from tensoropt.passes.pipeline import CheckPlan, PipelineOptions, front_half, full_pipeline
from tensoropt.passes.plans import data_parallel
from tensoropt.passes.training_step import TrainingOptions
from tests.cli import models
from tests.helpers.steps import import_proto


def _state() -> CompileState:
    return CompileState(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10))


@dataclass(frozen=True, slots=True)
class Record(Pass):
    """Appends its tag to the model's doc string; optionally breaks its own contract."""

    name: ClassVar[str] = "record"
    tag: str = "a"
    fail_requires: bool = False
    fail_ensures: bool = False
    crash: bool = False
    bad_input: bool = False

    def requires(self, state: CompileState) -> None:
        if self.fail_requires:
            raise Violation("requires", f"tag {self.tag!r} refused its input")

    def call(self, state: CompileState) -> PassResult:
        if self.crash:
            raise KeyError("missing")
        if self.bad_input:
            raise PlanError("plan unit 'mm0': the model has no node of that name")
        state.model.doc_string = (state.model.doc_string or "") + self.tag
        return PassResult(state, True)

    def ensures(self, state: CompileState) -> None:
        if self.fail_ensures:
            raise Violation("ensures", f"tag {self.tag!r} broke its output")


@dataclass(frozen=True, slots=True)
class Named(Record):
    name: ClassVar[str] = "named"


def test_passes_run_in_order_and_report_modification():
    result = PassManager((Record(tag="a"), Named(tag="b"), Record(tag="c")))(_state())
    assert result.state.model.doc_string == "abc"
    assert result.modified


def test_a_postcondition_failure_names_the_pass():
    manager = PassManager((Record(), Named(fail_ensures=True)))
    with pytest.raises(VerificationError) as info:
        manager(_state())
    message = str(info.value)
    assert "after pass 'named' (its postcondition)" in message
    assert "check 'ensures': tag 'a' broke its output" in message
    assert "\n" not in message


def test_a_precondition_failure_names_the_pass_and_stops_before_it_runs():
    state = _state()
    with pytest.raises(VerificationError, match=r"before pass 'named' \(its precondition\)"):
        PassManager((Record(tag="x"), Named(tag="y", fail_requires=True)))(state)
    assert state.model.doc_string == "x"


def test_an_internal_error_names_the_pass_and_those_before_it():
    manager = PassManager((Record(), Named(), Record(crash=True)))
    with pytest.raises(PassError) as info:
        manager(_state())
    assert str(info.value).startswith("pass 'record' failed (after passes ['record', 'named'])")
    assert isinstance(info.value.__cause__, KeyError)


def test_bad_input_errors_pass_through_unchanged():
    with pytest.raises(PlanError) as info:
        PassManager((Record(), Named(bad_input=True)))(_state())
    assert str(info.value) == "plan unit 'mm0': the model has no node of that name"


def test_a_split_manager_still_names_the_passes_before_the_split():
    manager = PassManager((Record(), Named(), Record(crash=True)))
    first, rest = manager.split_after("named")
    assert first.names == ("record", "named") and rest.names == ("record",)
    state = first(_state()).state
    with pytest.raises(PassError, match=r"after passes \['record', 'named'\]"):
        rest(state)
    with pytest.raises(ValueError, match="no pass 'nope'"):
        manager.split_after("nope")


def test_the_verifier_runs_on_the_input_and_after_every_pass():
    seen: list[str] = []

    def verifier(state: CompileState) -> None:
        seen.append(state.model.doc_string or "")
        if seen[-1].endswith("b"):
            raise Violation("toy", "the doc string ends in b")

    with pytest.raises(VerificationError) as info:
        PassManager((Record(tag="a"), Named(tag="b"), Record(tag="c")), verifier)(_state())
    assert seen == ["", "a", "ab"]
    assert "after pass 'named': check 'toy': the doc string ends in b" in str(info.value)


def test_a_bad_verifier_input_is_named_as_the_pipeline_input():
    def verifier(state: CompileState) -> None:
        raise Violation("toy", "always")

    with pytest.raises(VerificationError, match="before pass 'record' .the pipeline's input."):
        PassManager((Record(),), verifier)(_state())


def test_verification_error_is_a_user_facing_error():
    assert issubclass(VerificationError, TensorOptError)


# -- the compile passes ----------------------------------------------------------------


def _forward_state(mesh: Mesh) -> CompileState:
    built = data_parallel(mesh)
    return CompileState(import_proto(models.mlp_block()), built.plan, built.data_axes)


def test_the_full_pipeline_fills_the_state_in_order():
    result = full_pipeline(TrainingOptions(), PipelineOptions(verify=True))(
        _forward_state(Mesh((2,), ("dp",)))
    )
    state = result.state
    assert result.modified
    assert state.step is not None and state.step.model is state.model
    assert state.annotation is not None and state.annotated is not None
    assert state.layouts is not None and state.template is not None
    assert front_half(PipelineOptions()).names == (
        "check-plan",
        "recompute",
        "annotate",
        "insert-redistribution",
        "cut-micro-batches",
        "localize",
        "micro-template",
    )


def test_front_half_requires_a_training_step():
    with pytest.raises(VerificationError, match="before pass 'check-plan'.*no step"):
        front_half(PipelineOptions())(_forward_state(Mesh((2,), ("dp",))))


def test_check_plan_reports_a_foreign_plan_unchanged():
    state = full_pipeline(TrainingOptions(), PipelineOptions()).split_after("build-training-step")[
        0
    ](_forward_state(Mesh((2,), ("dp",))))
    mesh = Mesh((2,), ("dp",))
    foreign = Plan(mesh, {"no_such_node": UnitStrategy(index=0)}, source="test")
    with pytest.raises(PlanError, match="plan unit 'no_such_node': the model has no node"):
        CheckPlan()(state.state.replace(plan=foreign))
