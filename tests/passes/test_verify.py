"""The well-formedness verifier: for each pass, a deliberately broken result is reported
with that pass's name, the check and the node or value (tensoropt.passes.verify)."""

from __future__ import annotations

import dataclasses
import re

import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

import tensoropt.passes.pipeline as pipeline
import tensoropt.passes.verify as verify
from tensoropt.ir.layout import Layout, Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.vocab import COLLECTIVE_DOMAIN
from tensoropt.passes.annotate import Annotation
from tensoropt.passes.infra import CompileState, VerificationError
from tensoropt.passes.plans import data_parallel
from tensoropt.passes.training_step import TrainingOptions
from tensoropt.runtime.device_check import check_device_graphs
from tests.cli import models
from tests.cli.cli_run import assert_bad_input, cli
from tests.helpers.steps import import_proto

DP2 = Mesh((2,), ("dp",))


def _run(mesh: Mesh = DP2) -> CompileState:
    built = data_parallel(mesh)
    state = CompileState(import_proto(models.mlp_block()), built.plan, built.data_axes)
    options = pipeline.PipelineOptions(verify=True, device_check=check_device_graphs)
    return pipeline.full_pipeline(TrainingOptions(), options)(state).state


def _broken(pass_name: str, check: str, *names: str):
    """Expect a VerificationError naming the pass, the check and ``names``, in that order."""
    fragments = [f"after pass '{pass_name}': check '{check}'", *names]
    return pytest.raises(VerificationError, match=".*".join(map(re.escape, fragments)))


def _wrap(monkeypatch, name: str, after):
    """Replace ``pipeline.<name>`` by the real function followed by ``after(result, args)``."""
    real = getattr(pipeline, name)

    def broken(*args, **kwargs):
        result = real(*args, **kwargs)
        return after(result, *args)

    monkeypatch.setattr(pipeline, name, broken)


def test_a_correct_pipeline_passes_every_check():
    state = _run()
    assert state.template is not None
    verify.Verifier(check_device_graphs)(state)  # and again on the final state


def test_build_training_step_leaving_a_shape_unknown(monkeypatch):
    def after(step, *_):
        node = next(n for n in step.model.graph if n.metadata_props.get("tensoropt.role") == "loss")
        node.outputs[0].shape = None
        node.outputs[0].name = "broken_loss_value"
        return step

    _wrap(monkeypatch, "build_training_step", after)
    with _broken("build-training-step", "static-shapes", "value 'broken_loss_value'"):
        _run()


def test_check_plan_leaving_the_graph_out_of_order(monkeypatch):
    def after(result, graph, plan):
        last = list(graph)[-1]
        graph.remove(last)
        graph.insert_before(next(iter(graph)), last)
        return result

    _wrap(monkeypatch, "check_plan", after)
    with _broken("check-plan", "topological-order", "which no earlier node"):
        _run()


def test_annotate_leaving_a_value_without_layout(monkeypatch):
    def after(ann: Annotation, graph, *_):
        value = next(v for v in graph.inputs if v.name == "x")
        layouts = {v: lay for v, lay in ann.layouts.items() if v is not value}
        return dataclasses.replace(ann, layouts=layouts)

    _wrap(monkeypatch, "annotate", after)
    with _broken("annotate", "layouts", "value 'x' has no layout"):
        _run()


def test_annotate_giving_a_node_an_illegal_strategy(monkeypatch):
    def after(ann: Annotation, graph, *_):
        nodes = {n.name: n for n in graph}
        strategies = dict(ann.strategies)
        strategies[nodes["mm0"]] = strategies[nodes["gelu"]]  # a Gelu strategy on a MatMul
        return dataclasses.replace(ann, strategies=strategies)

    _wrap(monkeypatch, "annotate", after)
    with _broken("annotate", "strategy-legal", "node 'mm0' (MatMul)"):
        _run()


def test_annotate_sharding_a_dim_that_does_not_divide(monkeypatch):
    def after(ann: Annotation, graph, *_):
        value = next(v for v in graph.inputs if v.name == "x")  # [8, 8] on 3 devices
        layouts = {**ann.layouts, value: Layout((Shard(0),))}
        return dataclasses.replace(ann, layouts=layouts)

    _wrap(monkeypatch, "annotate", after)
    with _broken("annotate", "shard-divisibility", "'x'", "8"):
        _run(Mesh((3,), ("dp",)))


def test_insert_redistribution_adding_a_node_that_reads_the_future(monkeypatch):
    def after(layouts, graph, ann):
        late = list(graph)[-1].outputs[0]
        node = ir.Node("", "Identity", [late], name="reads_the_future", num_outputs=1)
        node.outputs[0].shape = late.shape
        node.outputs[0].dtype = late.dtype
        graph.insert_before(next(iter(graph)), node)
        return {**layouts, node.outputs[0]: layouts[late]}

    _wrap(monkeypatch, "insert_redistribution", after)
    with _broken("insert-redistribution", "topological-order", "node 'reads_the_future'"):
        _run()


def test_insert_redistribution_missing_a_conversion_breaks_its_postcondition(monkeypatch):
    def after(layouts, graph, ann):
        node = next(n for n in graph if n.name == "mm0")
        value = node.inputs[1]  # W0, which the strategy needs in a definite layout
        need = ann.input_layout(node, 1)
        wrong = Layout((Shard(0),)) if need != Layout((Shard(0),)) else Layout((Shard(1),))
        return {**layouts, value: wrong}

    _wrap(monkeypatch, "insert_redistribution", after)
    with pytest.raises(VerificationError, match=r"after pass 'insert-redistribution' \(its post"):
        _run()


def test_localize_leaving_a_shape_unknown(monkeypatch):
    def after(template, model, *_):
        node = next(n for n in model.graph if n.name == "gelu")
        node.outputs[0].shape = None
        return template

    _wrap(monkeypatch, "localize", after)
    with _broken("localize", "static-shapes", "value 'g'"):
        _run()


def test_localize_whose_device_graphs_disagree_on_a_group(monkeypatch):
    """Rank 1 names a different group for its first collective than rank 0 expects."""
    real = verify.lower_for_rank

    def lower(template, rank, values):
        proto = real(template, rank, values)
        if rank == 1:
            node = next(n for n in proto.graph.node if n.domain == COLLECTIVE_DOMAIN)
            kept = [a for a in node.attribute if a.name != "group"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("group", [1])])
        return proto

    monkeypatch.setattr(verify, "lower_for_rank", lower)
    with _broken("localize", "collective-groups", "rank 0", "does not match rank 1"):
        _run()


def test_device_graphs_keep_every_rank_and_drop_initializer_data():
    state = _run()
    assert state.template is not None
    devices = verify.device_graphs(state.template)
    assert sorted(devices) == [0, 1]
    for proto in devices.values():
        assert not proto.graph.initializer
        names = {i.name for i in proto.graph.input}
        assert {"W0", "W1", "b1"} <= names
    full = {i.name: numpy_helper.to_array(i) for i in state.template.proto.graph.initializer}
    assert "W0" in full  # the template itself is untouched


# -- the CLI flag ----------------------------------------------------------------------


def _out_of_order(monkeypatch) -> None:
    """check-plan leaves a dangling node reading a later value: silent without checks."""

    def after(result, graph, plan):
        late = list(graph)[-1].outputs[0]
        node = ir.Node("", "Identity", [late], name="dangling", num_outputs=1)
        node.outputs[0].shape = late.shape
        node.outputs[0].dtype = late.dtype
        graph.insert_before(next(iter(graph)), node)
        return result

    _wrap(monkeypatch, "check_plan", after)


def test_compile_verify_passes_flag(monkeypatch, tmp_path, capsys):
    model = tmp_path / "block.onnx"
    onnx.save(models.mlp_block(), str(model))
    monkeypatch.setattr(pipeline, "DEFAULT_OPTIONS", pipeline.PipelineOptions())  # no checks
    _out_of_order(monkeypatch)
    argv = ["compile", model, "--devices", "2", "--plan", "data-parallel"]
    quiet = cli(capsys, *argv, "-o", tmp_path / "quiet")
    assert quiet.code == 0, quiet
    outcome = cli(capsys, *argv, "-o", tmp_path / "checked", "--verify-passes")
    assert_bad_input(
        outcome, "compile", "after pass 'check-plan'", "'topological-order'", "'dangling'"
    )
    assert not (tmp_path / "checked").exists()


def test_every_test_compiles_with_pass_verification():
    assert pipeline.DEFAULT_OPTIONS.verify
    assert pipeline.DEFAULT_OPTIONS.device_check is check_device_graphs


@pytest.mark.numerics_only
def test_a_numerics_only_case_compiles_as_compile_does_by_default():
    assert not pipeline.DEFAULT_OPTIONS.verify


def test_the_equivalence_matrices_verify_on_two_devices_only():
    from tests.passes.test_equivalence import _cases

    cases = list(_cases())
    unverified = {c.id for c in cases if any(m.name == "numerics_only" for m in c.marks)}
    assert unverified and all(not c.id.endswith("-2") for c in cases if c.id in unverified)
    assert {c.id for c in cases if c.id.endswith("-2")}.isdisjoint(unverified)


def test_a_template_is_lowered_and_checked_once_until_it_changes(monkeypatch):
    checked = []

    def counting(devices):
        checked.append(len(devices))
        check_device_graphs(devices)

    verifier = verify.Verifier(counting)
    monkeypatch.setattr(pipeline, "Verifier", lambda device_check: verifier)
    state = _run()  # localize makes the template; micro-template hands it on as it is
    assert checked == [2]
    verifier(state)
    assert checked == [2]
    # the same template with one more node is another template: checked again
    state.template.proto.graph.node.append(helper.make_node("Identity", ["x"], ["x_copy"]))
    verifier(state)
    assert checked == [2, 2]
