"""Compile a forward model with a built-in plan, through the real passes."""

from __future__ import annotations

import onnx
import pytest

from tensoropt.ir.mesh import Mesh
from tensoropt.passes.compile import compile_step
from tensoropt.passes.plans import builtin_plan, prepare_model
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tests.helpers.steps import import_proto


def verified_on_two(mesh: str) -> tuple:
    """Marks of an equivalence case on ``mesh``: on 2 devices its compile verifies the
    passes (as every test's does); on more it compares trained values alone
    (``numerics_only``): the passes' plans on those meshes are verified by the program
    tests (test_plan_is_program, test_zero_program, ...), and verifying them again costs
    a third of each case."""
    return () if mesh == "2" else (pytest.mark.numerics_only,)


def make_mesh(spec: str, plan: str) -> Mesh:
    dims = tuple(int(x) for x in spec.split("x"))
    names = ("dp", "tp") if len(dims) == 2 else ("tp",) if plan == "megatron" else ("dp",)
    return Mesh(dims, names)


def compile_model(proto: onnx.ModelProto, plan: str, mesh: str, outdir, options=None):
    """Compile ``proto`` into ``outdir``; returns (CompileResult, BuiltPlan)."""
    model = import_proto(proto)
    prepare_model(plan, model)
    step = build_training_step(model, options or TrainingOptions())
    built = builtin_plan(plan, step.model.graph, step.signature, make_mesh(mesh, plan))
    return compile_step(step, built.plan, built.data_axes, str(outdir)), built


def recompute_collectives(path, tmp_path, capsys) -> tuple[int, int]:
    """Collectives per device of the data-parallel plan of the export at ``path`` on 2
    devices, without and with every block recomputed (``compile --json``)."""
    import json

    from tensoropt.cli import main

    capsys.readouterr()
    counts = []
    for recompute in ("none", "all"):
        argv = ["compile", str(path), "--plan", "data-parallel", "--devices", "2",
                "--recompute", recompute, "-o", str(tmp_path / recompute), "--json"]  # fmt: skip
        assert main(argv) == 0
        counts.append(json.loads(capsys.readouterr().out)["collectives_per_device"])
    return counts[0], counts[1]
