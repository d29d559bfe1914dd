"""ZeRO is a layout choice of the unit program: what the cost model prices is what
compile emits, and the emitted graph holds the collectives each stage promises.

For zoo gpt, bert and resnet50 tiny and a real torch.onnx export of GPT-2, built-in
data-parallel (and megatron on 2x2) on meshes 2, 4 and 2x2, ZeRO stages 1, 2 and 3 on
every unit that has a ZeRO axis:

- the conversions the partitioner inserts give, as a multiset of (kind, mesh axes, local
  input bytes), exactly the collectives the cost model priced;
- compiled for real, the device files of the first and last rank hold exactly the priced
  collectives (kind, group of ranks, input bytes).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from tensoropt.cli.common import build_step
from tensoropt.cost.cluster import builtin
from tensoropt.cost.model import build_problem, estimate_plan, search_graph_of
from tensoropt.ir.builder import static_shape
from tensoropt.ir.layout import Layout, Shard, local_shape
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import ZeroStage
from tensoropt.models import build_model
from tensoropt.models.io import save_model
from tensoropt.passes.annotate import annotate_roots, complete_plan, plan_zero
from tensoropt.passes.compile import compile_step
from tensoropt.passes.plans import builtin_plan, with_zero
from tensoropt.passes.units import itemsize, shard_layout, zero_shards
from tests.helpers.program import emitted, inserted, priced, priced_axes, search_args

STAGES = (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS)


@pytest.fixture(scope="module")
def models(tmp_path_factory, exported):
    folder = tmp_path_factory.mktemp("zero")
    paths = {}
    for name in ("gpt", "bert", "resnet50", "mlp"):
        path = folder / f"{name}.onnx"
        save_model(build_model(name, "tiny"), str(path))
        paths[name] = path
    paths["gpt2-export"] = exported("gpt2")
    return paths


def mesh_of(spec: str, plan: str) -> Mesh:
    dims = tuple(int(x) for x in spec.split("x"))
    names = ("dp", "tp") if len(dims) == 2 else ("tp",) if plan == "megatron" else ("dp",)
    return Mesh(dims, names)


def zero_case(path, plan_name: str, spec: str, stage: ZeroStage, optimizer: str = "sgd"):
    """(step, search graph, plan with ZeRO, data axes, roots, unit stages, problem)."""
    step = build_step(search_args(path, optimizer), load_weights=False, plan=plan_name)
    sg = search_graph_of(step)
    built = builtin_plan(plan_name, sg.graph, sg.signature, mesh_of(spec, plan_name))
    plan = with_zero(built.plan, sg.graph, sg.signature, built.data_axes, stage, "test").plan
    roots = complete_plan(sg.graph, sg.signature, plan, built.data_axes, sg.units)
    zero = plan_zero(plan, sg.units)
    mp = build_problem(sg, plan.mesh, builtin("h100"), only=roots, zero=zero)
    return step, sg, plan, built.data_axes, roots, zero, mp


def _inserted(sg, mp, roots, zero) -> Counter:
    return inserted(sg, annotate_roots(sg.graph, sg.units, roots, mp.mesh, zero=zero))


def _priced(mp) -> Counter:
    return priced_axes(mp, (0,) * len(mp.units))


CASES = [
    *((name, "data-parallel", spec) for name in ("gpt", "bert", "resnet50")
      for spec in ("2", "4", "2x2")),
    ("gpt", "megatron", "2x2"),
    ("bert", "megatron", "2x2"),
    ("gpt2-export", "data-parallel", "2"),  # its batch is 2
    ("gpt2-export", "megatron", "2x2"),
]  # fmt: skip
QUICK = {("gpt", "data-parallel", "2"), ("gpt", "megatron", "2x2")}


def _params():
    for name, plan, spec in CASES:
        for stage in STAGES:
            quick = (name, plan, spec) in QUICK
            marks = () if quick else (pytest.mark.slow,)
            yield pytest.param(
                name, plan, spec, stage, marks=marks, id=f"{name}-{plan}-{spec}-zero{int(stage)}"
            )


@pytest.mark.parametrize(("name", "plan_name", "spec", "stage"), list(_params()))
def test_zero_emits_what_was_priced(models, name, plan_name, spec, stage):
    _, sg, _, _, roots, zero, mp = zero_case(models[name], plan_name, spec, stage)
    assert zero and set(zero.values()) == {stage}
    found = _inserted(sg, mp, roots, zero)
    assert found == _priced(mp), (name, plan_name, spec, stage)
    # ZeRO reduce-scatters the gradients that data parallelism all-reduces
    assert sum(n for (kind, _, _), n in found.items() if kind == "ReduceScatter") >= len(zero)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{int(s)}")
@pytest.mark.parametrize(
    ("name", "plan_name", "spec"),
    [
        ("gpt", "data-parallel", "2x2"),
        ("gpt2-export", "megatron", "2x2"),
        ("bert", "megatron", "2x2"),
    ],
)
def test_compiled_zero_device_graphs_hold_the_priced_collectives(
    models, name, plan_name, spec, stage, tmp_path
):
    step, _, plan, data_axes, _, _, mp = zero_case(models[name], plan_name, spec, stage)
    ranks = (0, mp.mesh.size - 1)
    want = {rank: priced(mp, (0,) * len(mp.units), rank) for rank in ranks}
    compile_step(step, plan, data_axes, str(tmp_path))  # rewrites the priced graph
    for rank in ranks:
        device = onnx.load(str(tmp_path / f"device_{rank}.onnx"), load_external_data=False)
        assert emitted(device) == want[rank], (name, stage, rank)


def test_stage_two_is_stage_one_in_one_micro_batch(models):
    """At micro_batches=1 ZeRO-2 emits the program of ZeRO-1 and prices the same."""
    one = zero_case(models["gpt"], "data-parallel", "4", ZeroStage.OPTIMIZER)
    two = zero_case(models["gpt"], "data-parallel", "4", ZeroStage.GRADIENTS)
    assert _priced(one[-1]) == _priced(two[-1])
    assert _inserted(one[1], one[-1], one[4], one[5]) == _inserted(two[1], two[-1], two[4], two[5])
    for mp1, mp2 in ((one[-1], two[-1]),):
        for p1, p2 in zip(mp1.programs, mp2.programs, strict=True):
            assert p1[0].entries == p2[0].entries
            assert p1[0].strategies == p2[0].strategies
    choice = (0,) * len(one[-1].units)
    assert one[-1].problem.evaluate(choice) == two[-1].problem.evaluate(choice)


def test_stage_three_gathers_for_forward_and_again_for_backward(models, tmp_path):
    """Every ZeRO-3 parameter is stored as its shard; a parameter the backward reads is
    gathered twice: once read only by forward nodes, once only by backward nodes."""
    step, sg, plan, data_axes, roots, zero, mp = zero_case(
        models["mlp"], "data-parallel", "2", ZeroStage.PARAMETERS
    )
    shards = []  # before compile: it rewrites the step's graph
    for k, unit in enumerate(sg.units.units):
        if unit.root.name in zero:
            for z in zero_shards(sg.units, k, roots[unit.root.name], mp.mesh):
                value = unit.externals[z.index]
                shards.append((z.param, local_shape(static_shape(value), z.shard, mp.mesh)))
    assert shards
    compile_step(step, plan, data_axes, str(tmp_path))
    device = onnx.load(str(tmp_path / "device_0.onnx"))
    inputs = {v.name: v for v in device.graph.input}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in device.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    roles = {n.name: {p.key: p.value for p in n.metadata_props}.get("tensoropt.role")
             for n in device.graph.node}  # fmt: skip
    twice = 0
    for param, shard in shards:
        dims = [d.dim_value for d in inputs[param].type.tensor_type.shape.dim]
        assert tuple(dims) == tuple(shard)  # stored as the shard
        gathers = [n for n in readers[param] if n.op_type == "AllGather"]
        assert 1 <= len(gathers) <= 2
        phases = [{roles[r.name] for r in readers[g.output[0]]} for g in gathers]
        if len(gathers) == 2:
            twice += 1
            assert sorted(map(sorted, phases)) == [["backward"], ["forward"]]
        assert any(roles[n.name] == "optimizer" for n in readers[param])  # updates the shard
    assert twice > 0


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_zero_memory_is_the_sharded_states_parameters_and_one_full_buffer(models, optimizer):
    """The estimate's memory falls by what each stage shards, parameter by parameter:
    stage 1 (and 2) the optimizer states in and out, stage 3 also the parameter, its
    gradient and the new parameter, less one constant for the full-size transients:
    twice the parameters of the unit that places the most."""
    path = models["mlp"]
    states = {"sgd": 1, "adam": 2}[optimizer]
    _, sg, plan, _, roots, zero, _ = zero_case(
        path, "data-parallel", "4", ZeroStage.OPTIMIZER, optimizer
    )
    profile = builtin("h100")
    mem = {
        s: estimate_plan(sg, roots, plan.mesh, profile, zero={u: s for u in zero}).memory_bytes
        for s in (ZeroStage.NONE, *STAGES)
    }
    full = sharded = 0.0
    for k, unit in enumerate(sg.units.units):
        if unit.root.name not in zero:
            continue
        for z in zero_shards(sg.units, k, roots[unit.root.name], plan.mesh):
            value = unit.externals[z.index]
            e = float(np.prod(local_shape(static_shape(value), z.use, plan.mesh)))
            s = float(np.prod(local_shape(static_shape(value), z.shard, plan.mesh)))
            assert s * 4 == e and any(isinstance(p, Shard) for p in z.shard.placements)
            full += e * itemsize(value)
            sharded += s * itemsize(value)
    saved_states = 2 * states * (full - sharded)
    assert mem[ZeroStage.NONE] - mem[ZeroStage.OPTIMIZER] == pytest.approx(saved_states)
    assert mem[ZeroStage.GRADIENTS] == mem[ZeroStage.OPTIMIZER]
    # stage 3: parameter in, gradient and new parameter out as shards; the transients of
    # the largest unit once
    largest = max(
        sum(
            float(np.prod(static_shape(v))) * itemsize(v)
            for v in unit.externals
            if v.name in sg.params and sg.units.owner.get(v.name) == k
        )
        for k, unit in enumerate(sg.units.units)
    )
    assert largest > 0
    assert mem[ZeroStage.OPTIMIZER] - mem[ZeroStage.PARAMETERS] == pytest.approx(
        3 * full - 2 * sharded - 2 * largest
    )


def test_shard_layout_splits_the_largest_dimension_the_zero_axes_divide():
    one = Mesh((2,), ("dp",))
    two = Mesh((2, 2), ("dp", "tp"))
    rep = Layout.parse("R")
    assert shard_layout(rep, (0,), (6, 4), one) == Layout.parse("S(0)")
    assert shard_layout(rep, (0,), (4, 6), one) == Layout.parse("S(1)")
    assert shard_layout(rep, (0,), (4, 4), one) == Layout.parse("S(0)")  # ties: first
    assert shard_layout(rep, (0,), (3, 5), one) is None  # nothing divides: refused
    # a dimension the root layout does not split is preferred, even a smaller one
    assert shard_layout(Layout.parse("RS(0)"), (0,), (8, 2), two) == Layout.parse("S(1)S(0)")
    # the only one left is split already: still correct, gathered on tp to convert
    assert shard_layout(Layout.parse("RS(0)"), (0,), (8,), two) == Layout.parse("S(0)S(0)")
    # several ZeRO axes split one dimension over all of them
    assert shard_layout(Layout.parse("RR"), (0, 1), (6, 8), two) == Layout.parse("S(1)S(1)")
