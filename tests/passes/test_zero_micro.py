"""ZeRO stages under micro-batching: compiled, priced as emitted, and equal to one device.

On the micro mesh (``passes.micro``) a ZeRO unit's gradient is partial over the
micro-batches and over its ZeRO axes; the stage decides the order of the two sums:

- stage 1: the sum over the micro-batches comes first (the runtime accumulates the full
  gradient), the reduce-scatter over the ZeRO axes runs once per step;
- stages 2 and 3: the reduce-scatter runs in every micro-batch and only the shard is
  accumulated; stage 3 also gathers the stored shard for the forward and the backward
  of every micro-batch.

Checked here: the collectives the cost model prices per step equal those the device
files issue per step (as a multiset of kind, group and input bytes; phases counted);
each stage's reduce-scatters and accumulated values are where the stage says; the
estimate's accumulation buffer is the full gradient (stage 1) or the shard (2, 3); and
three SGD steps equal the single-device full-batch step within 1e-4 (zoo gpt, mlp,
bert and a real GPT-2 export; meshes 2, 4, 2x2; k 2 and 4).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest

from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import build_problem, estimate_plan, search_graph_of
from tensoropt.ir.builder import static_shape
from tensoropt.ir.layout import local_shape
from tensoropt.ir.plan import ZeroStage
from tensoropt.ir.vocab import ZERO_GATHER_KEY
from tensoropt.models import build_model
from tensoropt.passes.annotate import plan_zero
from tensoropt.passes.compile import compile_step
from tensoropt.passes.micro import micro_roots
from tensoropt.passes.plans import builtin_plan, prepare_model, with_zero
from tensoropt.passes.training_step import build_training_step
from tensoropt.passes.units import itemsize
from tests.helpers.compile import make_mesh
from tests.helpers.program import emitted_per_step, priced_per_step
from tests.helpers.steps import import_proto
from tests.passes.test_zero_equivalence import ADAM, SGD, check_equivalent

BATCH = 16  # divides into k = 4 micro-batches on 4 data-parallel ranks


def zoo(name: str) -> onnx.ModelProto:
    return build_model(name, "tiny", batch=BATCH)


def zero_micro_step(proto, plan_name: str, spec: str, stage: int, k: int, options=SGD):
    """(training step, plan with ZeRO ``stage`` on every unit that has a ZeRO axis and
    ``k`` micro-batches, data axes)."""
    model = import_proto(proto)
    prepare_model(plan_name, model)
    step = build_training_step(model, options)
    graph, sig = step.model.graph, step.signature
    built = builtin_plan(plan_name, graph, sig, make_mesh(spec, plan_name))
    plan = with_zero(built.plan, graph, sig, built.data_axes, ZeroStage(stage), "test").plan
    assert any(u.zero is ZeroStage(stage) for u in plan.units.values())
    return step, dataclasses.replace(plan, micro_batches=k), built.data_axes


def compile_zero_micro(proto, plan_name, spec, stage, k, outdir, options=SGD):
    step, plan, axes = zero_micro_step(proto, plan_name, spec, stage, k, options)
    compile_step(step, plan, axes, str(outdir))
    return plan


def _problem(step, plan, axes):
    sg = search_graph_of(step)
    roots, _ = micro_roots(sg.graph, sg.signature, plan, axes)
    zero = plan_zero(plan, sg.units)
    mp = build_problem(
        sg, plan.mesh, builtin("h100"), only=roots, micro_batches=plan.micro_batches, zero=zero
    )
    return sg, roots, zero, mp


def _device(out, rank: int) -> onnx.ModelProto:
    return onnx.load(str(out / f"device_{rank}.onnx"), load_external_data=False)


def _phase(node: onnx.NodeProto) -> str | None:
    return next((p.value for p in node.metadata_props if p.key == "tensoropt.phase"), None)


# -- priced = emitted ----------------------------------------------------------------

QUICK = {("gpt", "data-parallel", "2", 2, 2), ("mlp", "data-parallel", "2x2", 3, 2),
         ("gpt", "megatron", "2x2", 1, 2), ("bert", "data-parallel", "4", 3, 4)}  # fmt: skip


def _grid():
    for name in ("gpt", "mlp", "bert"):
        for spec in ("2", "4", "2x2"):
            for stage in (1, 2, 3):
                for k in (2, 4):
                    yield name, "data-parallel", spec, stage, k
    for stage in (1, 2, 3):
        yield "gpt", "megatron", "2x2", stage, 2


def _params():
    for case in _grid():
        marks = () if case in QUICK else (pytest.mark.slow,)
        yield pytest.param(*case, marks=marks, id="-".join(map(str, case)))


@pytest.mark.parametrize(("name", "plan_name", "spec", "stage", "k"), list(_params()))
def test_zero_micro_emits_what_was_priced_and_trains_like_one_device(
    name, plan_name, spec, stage, k, tmp_path
):
    step, plan, axes = zero_micro_step(zoo(name), plan_name, spec, stage, k)
    _, _, zero, mp = _problem(step, plan, axes)
    assert zero
    choice = (0,) * len(mp.units)
    last = plan.mesh.size - 1
    want = {r: priced_per_step(mp, choice, r) for r in (0, last)}
    out = tmp_path / "out"
    compile_step(step, plan, axes, str(out))
    for rank, priced in want.items():
        assert emitted_per_step(_device(out, rank), k) == priced, rank
    check_equivalent(out)


# -- where each stage sums -----------------------------------------------------------


def _accumulated_elements(out) -> int:
    """Elements of every value device 0 accumulates over the micro-batches."""
    model = _device(out, 0)
    shapes = {
        vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in [*model.graph.value_info, *model.graph.output, *model.graph.input]
    }
    names = json.loads((out / "manifest.json").read_text())["micro"]["accumulate"]
    return sum(int(np.prod(shapes[n])) for n in names)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_reduce_scatters_and_accumulates_where_it_says(stage, tmp_path):
    """Stage 1 reduce-scatters once per step (the step phase) and accumulates whole
    gradients; stages 2 and 3 reduce-scatter in every micro-batch and accumulate shards
    (half the elements on two ranks); stage 3 gathers each stored shard in the micro phase
    only. Accumulated elements: stage 1 those of stage 0, stages 2 and 3 fewer."""
    out = tmp_path / "z"
    compile_zero_micro(zoo("gpt"), "data-parallel", "2", stage, 2, out)
    nodes = _device(out, 0).graph.node
    scatters = [n for n in nodes if n.op_type == "ReduceScatter"]
    assert scatters
    want = "step" if stage == 1 else "micro"
    assert {_phase(n) for n in scatters} == {want}
    gathers = [n for n in nodes if n.op_type == "AllGather"]
    if stage == 3:
        # the stored shards are gathered for the forward and backward of every
        # micro-batch; the new shard leaves the step as it is
        stored = [n for n in gathers if any(p.key == ZERO_GATHER_KEY for p in n.metadata_props)]
        assert stored and {_phase(n) for n in stored} == {"micro"}
        assert not [n for n in gathers if "__new" in n.input[0]]
    else:
        # the new parameter is gathered once per step, after the update
        new = [n for n in gathers if "__new" in n.input[0]]
        assert new and {_phase(n) for n in new} == {"step"}
    plain = tmp_path / "plain"
    step, plan, axes = zero_micro_step(zoo("gpt"), "data-parallel", "2", 1, 2)
    units = {n: dataclasses.replace(u, zero=ZeroStage.NONE) for n, u in plan.units.items()}
    compile_step(step, dataclasses.replace(plan, units=units), axes, str(plain))
    zeroed, whole = _accumulated_elements(out), _accumulated_elements(plain)
    if stage == 1:
        assert zeroed == whole
    else:
        assert zeroed < 0.6 * whole, (zeroed, whole)


def test_estimate_holds_the_full_gradient_at_stage_1_and_the_shard_at_stage_2(tmp_path):
    """Stages 1 and 2 differ under micro-batching only in the accumulation buffer: the
    estimate's memory differs by exactly the sharded parameters' elements minus their
    shards' (bytes), and so do the values the device files accumulate, a gradient made
    whole on every rank (the embedding's gathered backward) included: it is sliced to
    its shard in every micro-batch. Stage 2 issues the reduce-scatters k times: it is
    slower."""
    estimates, accumulated = {}, {}
    # at batch 8 (fewer tokens than twice the vocabulary) the embedding's backward
    # gathers the incoming gradient and scatters it whole on every rank
    proto = build_model("gpt", "tiny", batch=8)
    for stage in (1, 2):
        step, plan, axes = zero_micro_step(proto, "data-parallel", "2", stage, 2)
        sg, roots, zero, mp = _problem(step, plan, axes)
        estimates[stage] = estimate_plan(
            sg, roots, plan.mesh, builtin("h100"), micro_batches=2, zero=zero
        )
        compile_step(step, plan, axes, str(tmp_path / str(stage)))
        accumulated[stage] = _accumulated_elements(tmp_path / str(stage))
    saved, elements = 0.0, 0
    for k, unit in enumerate(sg.units.units):
        program = mp.programs[k][0]
        for z in program.shards:
            value = unit.externals[z.index]
            whole = np.prod(local_shape(static_shape(value), z.use, mp.mesh))
            shard = np.prod(local_shape(static_shape(value), z.shard, mp.mesh))
            saved += float(whole - shard) * itemsize(value)
            elements += int(whole - shard)
    assert saved > 0
    assert estimates[1].memory_bytes - estimates[2].memory_bytes == pytest.approx(saved, abs=1)
    assert accumulated[1] - accumulated[2] == elements
    assert estimates[2].time_s > estimates[1].time_s
    assert estimates[2].collectives > estimates[1].collectives


# -- a real export ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "stage", "k"),
    [
        pytest.param("gpt2", 3, 2, id="gpt2-zero3-k2"),
        pytest.param("gpt2", 1, 2, id="gpt2-zero1-k2", marks=pytest.mark.slow),
        pytest.param("gpt2", 2, 4, id="gpt2-zero2-k4", marks=pytest.mark.slow),
        pytest.param("llama", 3, 2, id="llama-zero3-k2", marks=pytest.mark.slow),
    ],
)
def test_zero_micro_on_a_real_export_trains_like_one_device(name, stage, k, tmp_path):
    """The tests/exports models are exported at batch 2; here at batch 8, so that two
    data-parallel ranks hold k micro-batches each."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    from tests.exports.models import CASES, export

    case = CASES[name]

    def inputs(gen):
        return {
            key: torch.cat([value, *(case.inputs(gen)[key] for _ in range(3))])
            for key, value in case.inputs(gen).items()
        }

    path = tmp_path / f"{name}.onnx"
    export(dataclasses.replace(case, inputs=inputs), str(path))
    proto = onnx.load(str(path))
    step, plan, axes = zero_micro_step(proto, "data-parallel", "2", stage, k)
    _, _, _, mp = _problem(step, plan, axes)
    choice = (0,) * len(mp.units)
    want = priced_per_step(mp, choice, 0)
    out = tmp_path / "out"
    compile_step(step, plan, axes, str(out))
    assert emitted_per_step(_device(out, 0), k) == want
    check_equivalent(out)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_micro_adam_step_equals_single_device(stage, tmp_path):
    """Adam's two states per parameter are shards updated once per step from the
    accumulated gradient (its shard at stages 2 and 3)."""
    out = tmp_path / "out"
    compile_zero_micro(zoo("mlp"), "data-parallel", "2x2", stage, 2, out, ADAM)
    check_equivalent(out)
