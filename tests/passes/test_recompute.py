"""Activation recomputation (``Plan.recompute``, ``compile --recompute``).

- blocks are found by structure: a GPT layer gives an attention and an MLP half around
  the residual stream, an MLP one block per weight layer; names are deterministic;
- a recomputed step reruns the same ops: the parameters after three steps are
  bit-identical to the plain step's (one device, and partitioned plans against the same
  plan without recompute), and the backward reads no activation of a recomputed block
  but its input;
- partitioned and recomputed, every zoo model (and real torch.onnx exports) trains like
  the single-device plain step within 1e-4 on meshes 2, 4 and 2x2, local backend, and
  on the MPI backend for a few cases;
- the estimate drops the saved activations and adds the forward time again;
- refusals: a random op in a chosen block, a block name the model does not have.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tensoropt.errors import PlanError
from tensoropt.ir.builder import ROLE_KEY
from tensoropt.models import MODEL_NAMES, build_model
from tensoropt.passes.compile import compile_step
from tensoropt.passes.optimizer import OptimizerKind, OptimizerOptions
from tensoropt.passes.plans import builtin_plan, prepare_model
from tensoropt.passes.recompute import (
    RECOMPUTE_KEY,
    RECOMPUTE_OF_KEY,
    apply_recompute,
    find_blocks,
    select_blocks,
)
from tensoropt.passes.training_step import TrainingOptions, build_training_step
from tensoropt.runtime.run import run_steps
from tensoropt.runtime.verify import param_floor, rel_error
from tests.helpers.compile import make_mesh, verified_on_two
from tests.helpers.steps import HEAVY_MODELS, import_proto

SGD = TrainingOptions(optimizer=OptimizerOptions(OptimizerKind.SGD, lr=0.01, momentum=0.9))
BLOCK_MODELS = ("gpt", "bert", "mlp")  # models where megatron finds blocks


def _step(proto: onnx.ModelProto, plan: str = "data-parallel"):
    model = import_proto(proto)
    prepare_model(plan, model)
    return build_training_step(model, SGD)


def _compile(proto, plan: str, mesh: str, out, recompute: str) -> tuple[str, ...]:
    """Compile with ``--recompute recompute`` semantics; returns the chosen blocks."""
    step = _step(proto, plan)
    built = builtin_plan(plan, step.model.graph, step.signature, make_mesh(mesh, plan))
    names = select_blocks(find_blocks(step.model.graph, step.signature.data_inputs), recompute)
    plan_obj = dataclasses.replace(built.plan, recompute=names)
    compile_step(step, plan_obj, built.data_axes, str(out))
    return names


def _params_after(out, steps: int = 3):
    return run_steps(out, steps, "local", verify=True, threads=1)


# -- blocks ----------------------------------------------------------------------------


def test_gpt_layers_give_an_attention_and_an_mlp_block():
    step = _step(build_model("gpt", "tiny"))
    blocks = find_blocks(step.model.graph, step.signature.data_inputs)
    assert [b.name for b in blocks] == [f"block_{i}" for i in range(len(blocks))]
    mlp = [b for b in blocks if any("/mlp/" in n for n in b.nodes)]
    assert len(mlp) == 2  # one per layer of the tiny GPT
    for layer, block in enumerate(mlp):
        assert all(n.startswith(f"h{layer}/") for n in block.nodes), block
        assert f"h{layer}/mlp/fc_in/MatMul" in block.nodes
        assert block.output == f"h{layer}/Add_1_out"  # the residual join ends it
        assert block.input == f"h{layer}/Add_out"  # the attention half's residual join
    attention_1 = next(b for b in blocks if "h1/attn/q_proj/MatMul" in b.nodes)
    assert attention_1.input == "h0/Add_1_out" and attention_1.output == "h1/Add_out"
    covered = [n for b in blocks for n in b.nodes]
    assert len(covered) == len(set(covered))  # disjoint


def test_mlp_gives_one_block_per_weight_layer():
    step = _step(build_model("mlp", "tiny"))
    blocks = find_blocks(step.model.graph, step.signature.data_inputs)
    weights = [n.name for n in step.model.graph if n.op_type == "MatMul" and "fc" in n.name]
    contractions = [[n for n in b.nodes if n.endswith("MatMul")] for b in blocks]
    assert all(len(c) == 1 for c in contractions)
    assert len(blocks) == len(weights) + 1  # the output layer is the last block
    assert blocks[-1].output == "logits"


def test_select_blocks_by_name_node_all_none_and_nothing():
    step = _step(build_model("gpt", "tiny"))
    blocks = find_blocks(step.model.graph, step.signature.data_inputs)
    assert select_blocks(blocks, "all") == tuple(b.name for b in blocks)
    assert select_blocks(blocks, "none") == ()
    assert select_blocks(blocks, "block_[13]") == ("block_1", "block_3")
    assert select_blocks(blocks, ".*/mlp/.*") == ("block_1", "block_3")
    with pytest.raises(PlanError, match=r"--recompute 'nope': matches no block .*block_0"):
        select_blocks(blocks, "nope")
    with pytest.raises(PlanError, match="not a regular expression"):
        select_blocks(blocks, "(")


def test_a_plan_naming_an_unknown_block_is_refused():
    step = _step(build_model("mlp", "tiny"))
    with pytest.raises(PlanError, match="plan recompute: no block 'block_9'"):
        apply_recompute(step.model, step.signature.data_inputs, ("block_9",))


def _dropout_model(ratio: float) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w0 = helper.make_tensor("w0", TensorProto.FLOAT, [8, 8], rng.normal(size=64).tolist())
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [8, 4], rng.normal(size=32).tolist())
    r = helper.make_tensor("ratio", TensorProto.FLOAT, [], [ratio])
    t = helper.make_tensor("train", TensorProto.BOOL, [], [True])
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h"], name="fc0"),
        helper.make_node("Relu", ["h"], ["a"], name="act0"),
        helper.make_node("Dropout", ["a", "ratio", "train"], ["d"], name="drop0"),
        helper.make_node("MatMul", ["d", "w1"], ["logits"], name="fc1"),
    ]
    graph = helper.make_graph(
        nodes,
        "dropout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 4])],
        [w0, w1, r, t],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_a_block_with_an_active_dropout_is_refused():
    step = _step(_dropout_model(0.1))
    blocks = find_blocks(step.model.graph, step.signature.data_inputs)
    names = tuple(b.name for b in blocks)
    with pytest.raises(PlanError, match=r"node 'drop0' \(Dropout\) draws random numbers"):
        apply_recompute(step.model, step.signature.data_inputs, names)


def test_a_block_with_a_zero_ratio_dropout_is_recomputed():
    step = _step(_dropout_model(0.0))
    blocks = find_blocks(step.model.graph, step.signature.data_inputs)
    names = tuple(b.name for b in blocks)
    assert apply_recompute(step.model, step.signature.data_inputs, names) > 0


# -- what the pass emits -------------------------------------------------------------


def _forward_reads(graph, names: tuple[str, ...], data_inputs):
    """Values of recomputed blocks (inputs aside) that non-recompute backward nodes read."""
    blocks = {b.name: b for b in find_blocks(graph, data_inputs) if b.name in names}
    made = {}
    for node in graph:
        for v in node.outputs:
            made[v.name] = node.name
    inside = {n for b in blocks.values() for n in b.nodes}
    outputs = {b.output for b in blocks.values()}
    found = []
    for node in graph:
        if node.metadata_props.get(ROLE_KEY) != "backward" or RECOMPUTE_KEY in node.metadata_props:
            continue
        for v in node.inputs:
            if v is not None and made.get(v.name) in inside and v.name not in outputs:
                found.append(v.name)
    return found


@pytest.mark.parametrize("name", ["gpt", "mlp", "resnet50"])
def test_the_backward_reads_clones_and_only_the_block_input_stays(name):
    step = _step(build_model(name, "tiny"))
    graph, data = step.model.graph, step.signature.data_inputs
    names = tuple(b.name for b in find_blocks(graph, data))
    assert _forward_reads(graph, names, data)  # before: the backward reads activations
    added = apply_recompute(step.model, data, names)
    assert added > 0
    assert _forward_reads(graph, names, data) == []
    clones = [n for n in graph if RECOMPUTE_OF_KEY in n.metadata_props]
    originals = {n.name: n for n in graph}
    for clone in clones:
        original = originals[clone.metadata_props[RECOMPUTE_OF_KEY]]
        assert clone.op_type == original.op_type
        assert clone.metadata_props[ROLE_KEY] == "backward"
    # applying the same blocks again (compile after the estimate) adds nothing
    assert apply_recompute(step.model, data, names) == 0


@pytest.mark.parametrize("name", ["gpt", "mlp", "resnet50", "bert"])
def test_one_device_recompute_is_bit_identical(name, tmp_path):
    proto = build_model(name, "tiny")
    _compile(proto, "data-parallel", "1", tmp_path / "plain", "none")
    _compile(proto, "data-parallel", "1", tmp_path / "rc", "all")
    plain = _params_after(tmp_path / "plain")
    rc = _params_after(tmp_path / "rc")
    assert rc.losses == plain.losses
    assert rc.params.keys() == plain.params.keys()
    for key, value in plain.params.items():
        np.testing.assert_array_equal(rc.params[key], value, err_msg=key)
    device = onnx.load(str(tmp_path / "rc" / "device_0.onnx"), load_external_data=False)
    assert any(n.name.endswith("__rc") for n in device.graph.node)


@pytest.mark.parametrize(
    ("name", "plan", "mesh"),
    [("gpt", "data-parallel", "4"), ("gpt", "megatron", "2x2"), ("resnet50", "data-parallel", "2")],
)
def test_partitioned_recompute_is_bit_identical_to_the_plain_plan(name, plan, mesh, tmp_path):
    """The dependency adds no collective here (the gradient sum keeps the batch dim),
    and the same plan with and without recompute trains bit for bit alike."""
    proto = build_model(name, "tiny")
    _compile(proto, plan, mesh, tmp_path / "plain", "none")
    _compile(proto, plan, mesh, tmp_path / "rc", "all")
    plain = _params_after(tmp_path / "plain")
    rc = _params_after(tmp_path / "rc")
    assert rc.losses == plain.losses
    for key, value in plain.params.items():
        np.testing.assert_array_equal(rc.params[key], value, err_msg=key)


# -- equivalence against the single-device plain step ----------------------------------

MESHES = ("2", "4", "2x2")
QUICK = {
    ("gpt", "megatron", "2x2"),
    ("mlp", "data-parallel", "4"),
    ("resnet50", "data-parallel", "2"),
}
EXPORTS = (
    ("gpt2", "megatron", "2x2"),
    ("llama", "data-parallel", "2"),
    ("resnet", "data-parallel", "2"),
)
MPI = (
    pytest.param("gpt", "megatron", "2x2", marks=pytest.mark.slow),
    ("mlp", "data-parallel", "2"),
)


def _cases():
    for name in MODEL_NAMES:
        for mesh in MESHES[:1] if name in HEAVY_MODELS else MESHES:  # heavy: mesh 2 only
            plans = ["data-parallel"] + (["megatron"] if name in BLOCK_MODELS else [])
            for plan in plans:
                marks = () if (name, plan, mesh) in QUICK else (pytest.mark.slow,)
                marks += verified_on_two(mesh)
                yield pytest.param(name, plan, mesh, marks=marks, id=f"{name}-{plan}-{mesh}")


def _assert_equivalent(result, reference):
    assert result.verify is not None and result.verify.ok, result.verify.to_json()
    floor = param_floor(reference.params)
    assert (
        max(rel_error(a, b) for a, b in zip(result.losses, reference.losses, strict=True)) <= 1e-4
    )
    for key, value in reference.params.items():
        assert rel_error(result.params[key], value, floor) <= 1e-4, key


@pytest.mark.parametrize(("name", "plan", "mesh"), list(_cases()))
def test_recomputed_partitioned_step_equals_single_device(name, plan, mesh, tmp_path):
    proto = build_model(name, "tiny")
    _compile(proto, plan, "1", tmp_path / "ref", "none")  # the plan's model rewrite, 1 device
    names = _compile(proto, plan, mesh, tmp_path / "out", "all")
    assert names
    _assert_equivalent(_params_after(tmp_path / "out"), _params_after(tmp_path / "ref"))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "plan", "mesh"), EXPORTS)
def test_recomputed_real_exports_equal_single_device(exported, name, plan, mesh, tmp_path):
    proto = onnx.load(str(exported(name)))
    _compile(proto, plan, "1", tmp_path / "ref", "none")
    assert _compile(proto, plan, mesh, tmp_path / "out", "all")
    _assert_equivalent(_params_after(tmp_path / "out"), _params_after(tmp_path / "ref"))


@pytest.mark.mpi
@pytest.mark.numerics_only  # an MPI run against the local one of a plan verified there
@pytest.mark.parametrize(("name", "plan", "mesh"), MPI)
def test_recomputed_step_on_mpi_equals_local(name, plan, mesh, tmp_path):
    proto = build_model(name, "tiny")
    _compile(proto, plan, mesh, tmp_path / "out", "all")
    local = run_steps(tmp_path / "out", 3, "local", threads=1)
    mpi = run_steps(tmp_path / "out", 3, backend="mpi", verify=True)
    assert mpi.verify is not None and mpi.verify.ok, mpi.verify.to_json()
    assert mpi.losses == local.losses
    for key, value in local.params.items():
        np.testing.assert_array_equal(mpi.params[key], value, err_msg=key)


@pytest.mark.parametrize(("plan", "mesh"), [("data-parallel", "2"), ("megatron", "2x2")])
def test_the_runtime_split_runs_each_recompute_after_the_gradient_it_waits_for(
    plan, mesh, tmp_path
):
    """The runtime puts a compute node in the segment of its first consumer; a clone also
    waits for its block's dependency on the gradient, so it never runs with the forward
    of its original when a collective separates them."""
    from tensoropt.runtime.split import split_graph

    _compile(build_model("gpt", "tiny"), plan, mesh, tmp_path / "out", "all")
    model = onnx.load(str(tmp_path / "out" / "device_0.onnx"))
    world = 2 if mesh == "2" else 4
    split = split_graph(model, 0, world, [v.name for v in model.graph.input])
    segment = {}
    for stage in split.stages:
        if stage.segment is not None:
            for node in stage.segment.model.graph.node:
                segment[node.name] = stage.segment.index
    meta = {n.name: {p.key: p.value for p in n.metadata_props} for n in model.graph.node}
    producer = {o: n.name for n in model.graph.node for o in n.output}
    later = 0
    clones = [name for name, m in meta.items() if RECOMPUTE_OF_KEY in m]
    assert clones
    for name in clones:
        block = meta[name][RECOMPUTE_KEY]
        where = next(n for n in model.graph.node if n.name == f"{block}__after_where")
        grad_sum = next(n for n in model.graph.node if n.name == f"{block}__after_sum")
        grad_made = segment.get(producer[grad_sum.input[0]], -1)
        assert segment[name] >= segment[where.name] >= grad_made, name
        later += segment[name] > segment[meta[name][RECOMPUTE_OF_KEY]]
    if plan == "megatron":  # collectives inside the forward and backward: later segments
        assert later > 0
    # data-parallel: the gradient all-reduces feed only the update, so forward and
    # backward are one segment, where the dependency alone orders the recompute
