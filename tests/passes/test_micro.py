"""Micro-batching: k micro-batches with accumulated gradients train exactly like one batch.

Each case compiles a zoo tiny model with a built-in plan and ``micro_batches`` k, runs
three steps on the local backend and compares loss and parameters against the
single-device full-batch step (``--verify``), within 1e-4. The cut (phases, accumulated
values, the manifest's ``micro``) and the refusals are checked on the compiled files.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import onnx
import pytest

from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import build_problem, priced_collectives, search_graph_of
from tensoropt.errors import PlanError
from tensoropt.ir.builder import ROLE_KEY
from tensoropt.ir.layout import Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.models import build_model
from tensoropt.passes.compile import compile_step
from tensoropt.passes.micro import PHASE_KEY, MicroError, micro_roots
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
from tensoropt.passes.plans import builtin_plan, prepare_model
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tensoropt.runtime.run import run_steps
from tests.helpers.compile import make_mesh
from tests.helpers.program import emitted_per_step, priced_per_step
from tests.helpers.steps import import_proto

SGD = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind.SGD, lr=0.01, momentum=0.9))
MODELS = {"mlp": ("data-parallel", "megatron"), "gpt": ("data-parallel", "megatron"),
          "bert": ("data-parallel", "megatron"), "rnnlm": ("data-parallel",)}  # fmt: skip
QUICK = {("mlp", "data-parallel", "2", 2), ("gpt", "megatron", "2x2", 2),
         ("bert", "data-parallel", "4", 2)}  # fmt: skip


def _step(name: str, plan: str, mesh: str, k: int, options: TrainingOptions = SGD):
    model = import_proto(build_model(name, "tiny"))
    prepare_model(plan, model)
    step = build_training_step(model, options)
    built = builtin_plan(plan, step.model.graph, step.signature, make_mesh(mesh, plan))
    return step, dataclasses.replace(built.plan, micro_batches=k), built.data_axes


def _compile(tmp_path, name, plan, mesh, k, options: TrainingOptions = SGD):
    step, p, axes = _step(name, plan, mesh, k, options)
    out = tmp_path / "out"
    compile_step(step, p, axes, str(out))
    return out


def _cases():
    for name, plans in MODELS.items():
        for plan in plans:
            for mesh in ("2", "4", "2x2"):
                for k in (2, 4):
                    if k == 4 and mesh != "2":
                        continue  # the tiny batch (8) splits 4 ways on 2 ranks at most
                    quick = (name, plan, mesh, k) in QUICK
                    marks = () if quick else (pytest.mark.slow,)
                    case_id = f"{name}-{plan}-{mesh}-k{k}"
                    yield pytest.param(name, plan, mesh, k, marks=marks, id=case_id)


@pytest.mark.parametrize(("name", "plan", "mesh", "k"), list(_cases()))
def test_micro_batched_step_equals_single_device(name, plan, mesh, k, tmp_path):
    out = _compile(tmp_path, name, plan, mesh, k)
    report = run_steps(out, 3, "local", verify=True, threads=1).verify
    assert report is not None and len(report.per_step) == 3
    assert report.max_rel_error_loss <= 1e-4, report.to_json()
    assert report.max_rel_error_params <= 1e-4, report.to_json()


def test_adam_micro_batched_step_equals_single_device(tmp_path):
    adam = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind.ADAM, lr=1e-3))
    out = _compile(tmp_path, "mlp", "megatron", "2x2", 2, adam)
    report = run_steps(out, 3, "local", verify=True, threads=1).verify
    assert report is not None and report.ok, report.to_json()


def test_micro_batched_run_equals_the_plain_run(tmp_path):
    """The same plan with k=2 and k=1 gives the same losses and parameters."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = run_steps(_compile(tmp_path / "a", "mlp", "data-parallel", "2", 1), 2, "local")
    two = run_steps(_compile(tmp_path / "b", "mlp", "data-parallel", "2", 2), 2, "local")
    assert one.losses == pytest.approx(two.losses, rel=1e-5)
    for key, value in one.params.items():
        assert two.params[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_manifest_and_device_graphs_record_the_cut(tmp_path):
    out = _compile(tmp_path, "gpt", "megatron", "2x2", 2)
    manifest = json.loads((out / "manifest.json").read_text())
    cut = manifest["micro"]
    assert cut["batches"] == 2
    assert cut["accumulate"], cut
    assert manifest["mesh"]["shape"] == [2, 2]  # the plan's mesh, not the micro mesh
    data = [n for n, e in manifest["inputs"].items() if e["kind"] in ("data", "labels")]
    assert data and all(manifest["inputs"][n]["micro_dim"] == 0 for n in data)
    assert all(len(e["placements"]) == 2 for e in manifest["inputs"].values())
    plan = json.loads((out / "plan.json").read_text())
    assert plan["micro_batches"] == 2
    device = onnx.load(str(out / "device_0.onnx"), load_external_data=False)
    phases = Counter()
    for node in device.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        phases[meta.get(PHASE_KEY)] += 1
        if meta.get(ROLE_KEY) in ("forward", "loss") and node.input:
            assert meta[PHASE_KEY] == "micro", node.name  # (constants go where read)
        if meta.get(ROLE_KEY) == "optimizer":
            assert meta[PHASE_KEY] == "step", node.name
    assert phases["micro"] > 0 and phases["step"] > 0
    made = {o for n in device.graph.node for o in n.output}
    assert set(cut["accumulate"]) <= made


def test_k_that_does_not_divide_the_batch_is_refused(tmp_path):
    step, plan, axes = _step("gpt", "data-parallel", "2", 3)
    with pytest.raises(MicroError, match=r"--micro-batches 3 does not divide the batch") as e:
        compile_step(step, plan, axes, str(tmp_path / "out"))
    assert "batch 8 over data-parallel size 2 (4 per rank)" in str(e.value)
    assert isinstance(e.value, PlanError)  # a TensorOptError: exit 2, one line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name",
    ["vgg16", *(pytest.param(n, marks=pytest.mark.slow) for n in ("resnet50", "inception_v3"))],
)
def test_max_pools_split_the_batch_over_micro_batches(name, tmp_path):
    """MaxPool's gradient reads its indices modulo the plane (``reduced_indices``), so a
    pool keeps the batch split and the CNNs compile with micro-batches; the runtime tests
    run vgg16 and resnet50 against one device."""
    step, plan, axes = _step(name, "data-parallel", "2", 2)
    compile_step(step, plan, axes, str(tmp_path / "out"))
    assert (tmp_path / "out" / "manifest.json").exists()


def test_unit_left_replicated_over_the_micro_axis_splits_its_batch(tmp_path):
    """rnnlm's first LSTM step reads a constant initial state of batch size: completed
    alone it stays replicated over the micro axis and its weight gradient would need
    every micro-batch; the unit splits its batch instead (a slice by micro index)."""
    step, plan, axes = _step("rnnlm", "data-parallel", "2", 2)
    roots, _ = micro_roots(step.model.graph, step.signature, plan, axes)
    split = roots["lstm1/t0/MatMul"].outputs[0].placements[0]
    assert split == Shard(0)
    out = tmp_path / "out"
    compile_step(step, plan, axes, str(out))
    assert json.loads((out / "manifest.json").read_text())["micro"]["index"] == "__micro_index__"


# -- the plan is the program, per step ------------------------------------------------


@pytest.mark.parametrize(
    ("name", "plan", "mesh", "k"),
    [("gpt", "data-parallel", "2", 2), ("gpt", "megatron", "2x2", 2),
     pytest.param("bert", "megatron", "2", 4, marks=pytest.mark.slow),
     pytest.param("mlp", "megatron", "2x2", 2, marks=pytest.mark.slow)],
)  # fmt: skip
def test_priced_collectives_per_step_equal_the_issued_ones(name, plan, mesh, k, tmp_path):
    step, p, axes = _step(name, plan, mesh, k)
    sg = search_graph_of(step)
    roots, _ = micro_roots(sg.graph, sg.signature, p, axes)
    mp = build_problem(sg, p.mesh, builtin("h100"), only=roots, micro_batches=k)
    choice = (0,) * len(mp.units)
    priced = {r: priced_per_step(mp, choice, r) for r in (0, p.mesh.size - 1)}
    micro_only = [c for c in priced_collectives(mp, (0,) * len(mp.units)) if c.times == k]
    out = tmp_path / "out"  # (compile localizes the step: price it first)
    compile_step(step, p, axes, str(out))
    for rank, want in priced.items():
        device = onnx.load(str(out / f"device_{rank}.onnx"), load_external_data=False)
        assert emitted_per_step(device, k) == want, (name, plan, mesh, rank)
    assert micro_only or plan == "data-parallel"  # megatron reduces inside each micro-batch


def test_estimate_accounts_for_micro_batches(tmp_path):
    """Compute and per-micro-batch collectives x k: the estimated time grows with k;
    the manifest keeps the estimate compile priced."""
    from tensoropt.cli.cmd_compile import estimate_of

    times = {}
    for k in (1, 2, 4):
        step, p, axes = _step("gpt", "megatron", "2", k)
        times[k] = estimate_of(step, p, axes, "h100")
    assert times[1].time_s < times[2].time_s < times[4].time_s
    assert times[1].collectives < times[2].collectives < times[4].collectives


def test_search_problem_per_micro_batch_count(tmp_path):
    """``build_problem(..., micro_batches=k)`` is one searchable problem per (mesh, k):
    its frontier's least memory falls with k (activations of a micro-batch) and its
    fastest time grows (k forward and backward passes of a smaller batch)."""
    from tensoropt.models.io import save_model
    from tensoropt.search.solver import solve
    from tests.helpers.program import graph_of

    save_model(build_model("gpt", "tiny"), str(tmp_path / "gpt.onnx"))
    sg = graph_of(tmp_path / "gpt.onnx")
    least, fastest = {}, {}
    for k in (1, 2, 4):
        mp = build_problem(sg, Mesh((2,), ("dp",)), builtin("h100"), micro_batches=k)
        assert mp.problem.devices == 2  # the plan's devices; the micro mesh has k x 2
        assert mp.mesh.shape == ((k, 2) if k > 1 else (2,))
        points = solve(mp.problem).points
        least[k] = min(p.memory_bytes for p in points)
        fastest[k] = min(p.time_s for p in points)
    assert least[1] > least[2] > least[4]
    assert fastest[1] < fastest[2] < fastest[4]


# -- a unit's program on the micro mesh ----------------------------------------------


@pytest.mark.parametrize(
    ("name", "mesh", "k", "falls_back"),
    [("gpt", "2x2", 2, False), ("bert", "2", 4, False), ("rnnlm", "4", 4, True)],
)
def test_micro_programs_run_the_plan_mesh_program_per_micro_batch(name, mesh, k, falls_back):
    """Every node of a unit's program on the micro mesh takes its plan-mesh program's
    strategy on the plan's axes and its micro-axis program's on the micro axis, where
    the op can run the pair; a node that cannot takes a legal strategy of the micro mesh
    (rnnlm on 4 devices in 4 micro-batches: a batch of 8 leaves some pairs no split)."""
    from tensoropt.cost.model import micro_choices
    from tensoropt.ir.plan import ZeroStage
    from tensoropt.passes import sharding_adapter as sa
    from tensoropt.passes.micro import MICRO_AXIS, micro_mesh
    from tensoropt.passes.units import ProgramCache, combine_axes

    adam = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind.ADAM, lr=0.01))
    step, _, _ = _step(name, "data-parallel", mesh, k, adam)
    sg = search_graph_of(step)
    plan_mesh = make_mesh(mesh, "megatron")
    su, micro = sg.units, micro_mesh(plan_mesh, k)
    programs = ProgramCache(su, micro)
    plain, along = ProgramCache(su, plan_mesh), ProgramCache(su, Mesh((k,), (MICRO_AXIS,)))
    offered = micro_choices(sg, plan_mesh, k)
    paired = chose = 0
    for u, unit in enumerate(su.units):
        for strategy, real in offered[unit.root.name]:
            for zero in (ZeroStage.NONE, ZeroStage.PARAMETERS):
                try:
                    got = programs.program(u, strategy, zero)
                except PlanError:  # no ZeRO axis under this strategy
                    continue
                a = plain.program(u, real, zero)
                b = along.program(u, dataclasses.replace(strategy, axes=strategy.axes[:1]))
                assert got.strategies[0] == strategy
                for i in range(1, len(unit.nodes)):
                    node = unit.nodes[i]
                    pair = combine_axes(node, b.strategies[i], a.strategies[i], micro)
                    if pair is not None:
                        paired += 1
                        assert got.strategies[i] == pair, (unit.root.name, node.name, zero)
                    else:
                        chose += 1
                        assert got.strategies[i] in sa.candidates(node, micro)
    assert paired > 0
    assert (chose > 0) == falls_back
