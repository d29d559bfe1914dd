"""In-place optimizer updates in the step phase (``runtime.inplace``).

- the graph check accepts an update whose other readers all run before it, and refuses
  a reader that may run after it (directly or through a view), a producer that is not
  elementwise, a state read after the segment, and a view that leaves the segment;
- on compiled micro-batched plans every carried state is written in place, except a
  ZeRO-1/2 parameter (its new value is an AllGather's result, not a segment's);
- the step's new state *is* the old state's buffer, and the run equals the one that
  keeps its outputs apart, bit for bit (the ZeRO + micro-batch runtime tests verify
  against the single-device step on both backends).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tensoropt.cli import main
from tensoropt.runtime import micro
from tensoropt.runtime.driver import _feeds, _state_names
from tensoropt.runtime.engine import LocalEngine, initial_state, load_device, split_all
from tensoropt.runtime.inplace import in_place_outputs, in_place_pairs
from tensoropt.runtime.manifest import InputKind, load_outdir
from tensoropt.runtime.run import run_steps
from tests.helpers.runs import assert_same_run
from tests.passes.test_zero_equivalence import ADAM
from tests.passes.test_zero_micro import compile_zero_micro, zoo

CARRY = {"w__new": "w"}


def _model(nodes, outputs=("w__new",)):
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("w", "g")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in outputs]
    return helper.make_model(helper.make_graph(nodes, "g", vi, outs))


def _pairs(nodes, outputs=("w__new",), later=()):
    return in_place_pairs(_model(nodes, outputs), outputs, CARRY, set(later))


def test_an_update_whose_other_readers_run_first_is_in_place():
    nodes = [
        helper.make_node("Mul", ["w", "g"], ["u"]),  # reads w, an ancestor of the update
        helper.make_node("Sub", ["w", "u"], ["w__new"]),  # elementwise: may overwrite w
    ]
    assert _pairs(nodes) == (("w__new", "w"),)


@pytest.mark.parametrize(
    "nodes",
    [
        # another reader of w is no ancestor of the update: it may run after the write
        [
            helper.make_node("Sub", ["w", "g"], ["w__new"]),
            helper.make_node("Mul", ["w", "g"], ["other"]),
        ],
        # the same through a view onnxruntime may alias
        [
            helper.make_node("Identity", ["w"], ["view"]),
            helper.make_node("Sub", ["w", "g"], ["w__new"]),
            helper.make_node("Mul", ["view", "g"], ["other"]),
        ],
        # a producer that is not elementwise reads w
        [helper.make_node("MatMul", ["w", "g"], ["w__new"])],
    ],
    ids=["late-reader", "late-view-reader", "matmul-producer"],
)
def test_an_unsafe_update_keeps_its_own_buffer(nodes):
    outputs = ("w__new", "other") if any("other" in n.output for n in nodes) else ("w__new",)
    assert _pairs(nodes, outputs) == ()


def test_a_state_read_after_the_segment_or_leaving_it_keeps_its_buffer():
    update = [helper.make_node("Sub", ["w", "g"], ["w__new"])]
    assert _pairs(update, later={"w"}) == ()  # a later segment or collective reads w
    leaves = [*update, helper.make_node("Identity", ["w"], ["view"])]
    assert _pairs(leaves, ("w__new", "view")) == ()


def _plans(out):
    manifest = load_outdir(out)
    models = {r: load_device(manifest, r) for r in range(manifest.world_size)}
    return manifest, models, split_all(manifest, models)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("inplace") / "gpt.onnx"
    assert main(["model", "gpt", "-o", str(path)]) == 0
    return path


@pytest.mark.parametrize(
    ("plan", "extra"),
    [
        ("data-parallel", ("--zero", 0)),
        ("data-parallel", ("--zero", 1)),
        ("data-parallel", ("--zero", 2)),
        ("data-parallel", ("--zero", 3)),
        ("megatron", ()),
        ("data-parallel", ("--stages", 2)),
    ],
    ids=["zero0", "zero1", "zero2", "zero3", "megatron", "stages"],
)
def test_every_carried_state_of_a_micro_batched_step_is_in_place(plan, extra, gpt, tmp_path):
    out = tmp_path / "out"
    argv = ["compile", gpt, "--plan", plan, "--devices", 2, "--optimizer", "adam"]
    argv += ["--micro-batches", 2, *extra, "-o", out]
    assert main([str(a) for a in argv]) == 0
    manifest, _, plans = _plans(out)
    for r, rank_plan in plans.items():
        carry = manifest.carry_of(r)
        done = in_place_outputs(rank_plan.step)
        params = {o for o, i in carry.items() if manifest.inputs[i].kind is InputKind.PARAM}
        # ZeRO 1 and 2 update the parameter's shard and all-gather the new parameter
        want = set(carry) - params if extra in (("--zero", 1), ("--zero", 2)) else set(carry)
        assert params and set(done) == want
        assert all(carry[o] == i for o, i in done.items())


def test_the_new_state_is_the_old_buffer_and_the_run_is_unchanged(tmp_path, monkeypatch):
    out = tmp_path / "out"
    compile_zero_micro(zoo("gpt"), "data-parallel", "2", 3, 2, out, ADAM)
    manifest, models, plans = _plans(out)
    state = {r: initial_state(manifest, models[r], _state_names(manifest, r), r) for r in plans}
    data = (InputKind.DATA, InputKind.LABELS)
    batch = {i.name: np.zeros(i.global_shape, dtype=i.dtype) for i in manifest.inputs_of(*data)}
    feeds = {r: _feeds(manifest, batch, state[r], r) for r in plans}
    outs = LocalEngine(plans).step(feeds)
    for r in plans:
        for o, i in manifest.carry_of(r).items():
            assert outs[r][o] is state[r][i], o
    in_place = run_steps(out, 3, backend="local")
    # the same plan with every output kept apart
    monkeypatch.setattr(micro, "mark_in_place", lambda plan, carry: plan)
    apart = run_steps(out, 3, backend="local")
    assert in_place.start_step == apart.start_step == 0
    assert_same_run(apart, in_place)
