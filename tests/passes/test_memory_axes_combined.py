"""The memory-for-time axes together: every combination of ZeRO, micro-batching and
recomputation compiles exactly what it prices and trains like one device."""

from __future__ import annotations

import json

import pytest

from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tests.cli.cli_run import cli


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("axes") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


def test_zero_with_micro_batches_compiles_from_the_command_line_and_a_plan_file(
    gpt, tmp_path, capsys
):
    """``--zero N --micro-batches K`` compiles (plan.json records both), and so does a
    plan file that asks for both; each trains like one device."""
    from tests.passes.test_zero_equivalence import check_equivalent

    out = tmp_path / "both"
    args = ("compile", gpt, "--devices", 2, "--plan", "data-parallel")
    assert cli(capsys, *args, "-o", out, "--zero", 2, "--micro-batches", 2).code == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["micro_batches"] == 2
    assert {unit.get("zero") for unit in plan["units"].values()} >= {2}
    check_equivalent(out)
    zeroed = tmp_path / "zeroed"
    assert cli(capsys, *args, "-o", zeroed, "--zero", 3).code == 0
    plan = json.loads((zeroed / "plan.json").read_text())
    plan["micro_batches"] = 2
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    again = tmp_path / "again"
    result = cli(capsys, "compile", gpt, "--devices", 2, "--plan", path, "-o", again)
    assert result.code == 0
    recorded = json.loads((again / "plan.json").read_text())
    assert recorded["micro_batches"] == 2
    assert {unit.get("zero") for unit in recorded["units"].values()} >= {3}
    check_equivalent(again)


# -- combinations that are built: priced = emitted, and equal to one device ------------

COMBOS = [
    pytest.param("megatron", "2x2", 3, 1, "all", id="megatron-2x2-zero3-recompute"),
    pytest.param("data-parallel", "2", 1, 1, "all", id="dp-2-zero1-recompute"),
    pytest.param("megatron", "2x2", 0, 2, "all", id="megatron-2x2-micro2-recompute"),
    pytest.param("data-parallel", "2", 3, 2, "all", id="dp-2-zero3-micro2-recompute"),
    pytest.param("megatron", "2x2", 2, 2, "block_1", id="megatron-2x2-zero2-micro2-recompute1",
                 marks=pytest.mark.slow),
    pytest.param(
        "data-parallel", "4", 0, 2, "block_1", id="dp-4-micro2-recompute1", marks=pytest.mark.slow
    ),
    pytest.param("data-parallel", "2", 2, 1, "block_2", id="dp-2-zero2-recompute1",
                 marks=pytest.mark.slow),
]  # fmt: skip


def _combined_step(plan_name: str, mesh: str, stage: int, k: int, recompute: str):
    import dataclasses

    from tensoropt.ir.plan import ZeroStage
    from tensoropt.passes.plans import builtin_plan, prepare_model, with_zero
    from tensoropt.passes.recompute import find_blocks, select_blocks
    from tensoropt.passes.training_step import build_training_step
    from tests.helpers.compile import make_mesh
    from tests.helpers.steps import import_proto
    from tests.passes.test_micro import SGD

    model = import_proto(build_model("gpt", "tiny"))
    prepare_model(plan_name, model)
    step = build_training_step(model, SGD)
    graph, sig = step.model.graph, step.signature
    built = builtin_plan(plan_name, graph, sig, make_mesh(mesh, plan_name))
    plan, axes = built.plan, built.data_axes
    if stage:
        plan = with_zero(plan, graph, sig, axes, ZeroStage(stage), "--zero").plan
    blocks = select_blocks(find_blocks(graph, sig.data_inputs), recompute)
    return step, dataclasses.replace(plan, micro_batches=k, recompute=blocks), axes


@pytest.mark.parametrize(("plan_name", "mesh", "stage", "k", "recompute"), COMBOS)
def test_combined_axes_emit_what_was_priced_and_train_like_one_device(
    plan_name, mesh, stage, k, recompute, tmp_path
):
    import onnx

    from tensoropt.cost.cluster import builtin
    from tensoropt.cost.model import build_problem, search_graph_of
    from tensoropt.passes.annotate import complete_plan, plan_zero
    from tensoropt.passes.compile import compile_step
    from tensoropt.passes.micro import micro_roots
    from tensoropt.passes.recompute import apply_recompute
    from tensoropt.runtime.run import run_steps
    from tests.helpers.program import emitted_per_step, priced_per_step

    step, plan, axes = _combined_step(plan_name, mesh, stage, k, recompute)
    assert plan.recompute
    apply_recompute(step.model, step.signature.data_inputs, plan.recompute)
    sg = search_graph_of(step)
    if k > 1:
        roots, _ = micro_roots(sg.graph, sg.signature, plan, axes)
    else:
        roots = complete_plan(sg.graph, sg.signature, plan, axes, sg.units)
    zero = plan_zero(plan, sg.units)
    assert bool(zero) == bool(stage)
    mp = build_problem(sg, plan.mesh, builtin("h100"), only=roots, micro_batches=k, zero=zero)
    choice = (0,) * len(mp.units)
    last = plan.mesh.size - 1
    want = {r: priced_per_step(mp, choice, r) for r in (0, last)}
    out = tmp_path / "out"
    compile_step(step, plan, axes, str(out))
    for rank, priced in want.items():
        device = onnx.load(str(out / f"device_{rank}.onnx"), load_external_data=False)
        assert emitted_per_step(device, k) == priced, rank
        reruns = [n for n in device.graph.node if any(
            p.key == "tensoropt.recompute" for p in n.metadata_props)]  # fmt: skip
        assert reruns, "the recomputed forward is in every device graph"
    report = run_steps(out, 3, "local", verify=True, threads=1).verify
    assert report is not None and len(report.per_step) == 3
    assert report.max_rel_error_loss <= 1e-4, report.to_json()
    assert report.max_rel_error_params <= 1e-4, report.to_json()


def test_recomputed_forward_is_priced_once_per_micro_batch():
    """The recomputed forward reruns in the backward of every micro-batch: on the tiny
    gpt every op costs h100's per-kernel floor, so recomputing everything adds about k
    times the k = 1 figure (it was priced once per step)."""
    from tensoropt.cli.cmd_compile import estimate_of

    added = {}
    for k in (1, 2):
        times = []
        for recompute in ("none", "all"):
            step, plan, axes = _combined_step("data-parallel", "2", 0, k, recompute)
            times.append(estimate_of(step, plan, axes, "h100").time_s)
        added[k] = times[1] - times[0]
    assert added[1] > 0
    assert added[2] > 1.5 * added[1], added
