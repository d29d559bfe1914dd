"""Compute terms the cost model reads off the training-step graph: the masked Softmax's
slow path and the backward's sums of a value's gradient contributions."""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import tensoropt.cost.model as model
from tensoropt.calibrate.kernels import MASK_FILL, causal_scores
from tensoropt.cost.cluster import builtin, from_json
from tensoropt.cost.compute import MASK_SCORE, forward_time, op_time
from tensoropt.errors import ClusterError
from tensoropt.ir.builder import static_shape
from tensoropt.ir.mesh import Mesh
from tensoropt.passes.autodiff import ACCUMULATES_KEY


def _search_graph(tmp_path, name: str, preset: str = "tiny"):
    from tensoropt.cli.common import search_graph
    from tensoropt.models import build_model, save_model

    path = tmp_path / f"{name}.onnx"
    save_model(build_model(name, preset), str(path))
    args = argparse.Namespace(model=str(path), input_shape=None, trainable=None, freeze=None,
                              optimizer="sgd", momentum=0.9, loss="auto")  # fmt: skip
    return search_graph(args)


@pytest.fixture(scope="module")
def gpt_sg(tmp_path_factory):
    return _search_graph(tmp_path_factory.mktemp("gpt"), "gpt")


def _softmax_after(producer_op: str, inputs, consts: dict[str, np.ndarray]) -> ir.Node:
    """A graph ``Softmax(producer_op(*inputs))`` with ``consts`` as initializers."""
    shape = [2, 4, 4]
    nodes = [
        helper.make_node(producer_op, inputs, ["s"], name="p"),
        helper.make_node("Softmax", ["s"], ["y"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = ir.serde.deserialize_model(proto).graph
    return next(n for n in g if n.op_type == "Softmax")


def test_zoo_causal_attention_masks_the_triangle_above_the_diagonal(gpt_sg):
    softmaxes = [n for n in gpt_sg.graph if n.op_type == "Softmax"]
    assert softmaxes
    for node in softmaxes:
        seq = static_shape(node.outputs[0])[-1]
        # the zoo's mask: -1e9 above the diagonal of [S, S], broadcast over batch and heads
        assert model.masked_fraction(node) == pytest.approx((seq - 1) / (2 * seq), rel=1e-12)


def test_where_masks_count_the_branch_that_holds_the_fill():
    cond = np.tril(np.ones((4, 4), dtype=bool))
    fill = np.array(-3.0e38, dtype=np.float32)
    keep = _softmax_after("Where", ["c", "x", "f"], {"c": cond, "f": fill})
    assert model.masked_fraction(keep) == pytest.approx(float(np.mean(~cond)))
    swapped = _softmax_after("Where", ["c", "f", "x"], {"c": cond, "f": fill})
    assert model.masked_fraction(swapped) == pytest.approx(float(np.mean(cond)))
    mild = _softmax_after("Where", ["c", "x", "f"], {"c": cond, "f": np.array(-1.0, np.float32)})
    assert model.masked_fraction(mild) == 0.0


def test_only_constant_masks_at_or_below_the_mask_score_count():
    mask = np.zeros((4, 4), dtype=np.float32)
    mask[0, 1:] = MASK_SCORE  # 3 of 16 entries, exactly at the threshold
    mask[1, 2] = MASK_SCORE / 2  # not a mask's score
    added = _softmax_after("Add", ["x", "m"], {"m": mask})
    assert model.masked_fraction(added) == 3 / 16
    runtime = _softmax_after("Add", ["x", "x"], {})  # no constant: nothing to read
    assert model.masked_fraction(runtime) == 0.0


def test_masked_scores_cost_the_calibrated_time_each():
    profile = dataclasses.replace(builtin("h100"), softmax_masked_s=3e-9)
    shape = [8, 64, 64]
    plain = op_time("Softmax", {"axis": -1}, [shape], [shape], 4, profile)
    masked = op_time("Softmax", {"axis": -1}, [shape], [shape], 4, profile, masked=0.25)
    assert masked - plain == pytest.approx(0.25 * math.prod(shape) * 3e-9, rel=1e-12)
    fwd = forward_time("Softmax", {"axis": -1}, [shape], [shape], 4, profile, masked=0.25)
    fwd0 = forward_time("Softmax", {"axis": -1}, [shape], [shape], 4, profile)
    assert fwd - fwd0 == pytest.approx(masked - plain, rel=1e-12)
    # other ops and the built-in (GPU) profiles: no such term
    assert op_time("Relu", {}, [shape], [shape], 4, profile, masked=0.5) == op_time(
        "Relu", {}, [shape], [shape], 4, profile
    )
    assert builtin("h100").softmax_masked_s == 0.0


def _one_device_time(sg, profile) -> float:
    mp = model.build_problem(sg, Mesh((1,), ("x",)), profile)
    return mp.problem.evaluate([0] * len(mp.problem.units))[0]


def test_the_search_prices_every_masked_softmax(gpt_sg):
    base = builtin("h100")
    slow = dataclasses.replace(base, softmax_masked_s=1e-6)
    expected = math.fsum(
        model.masked_fraction(n) * math.prod(static_shape(n.outputs[0])) * 1e-6
        for n in gpt_sg.graph
        if n.op_type == "Softmax"
    )
    assert expected > 0
    extra = _one_device_time(gpt_sg, slow) - _one_device_time(gpt_sg, base)
    assert extra == pytest.approx(expected, rel=1e-9)


def test_gradient_sums_are_marked_and_priced_with_the_value_they_sum(gpt_sg, monkeypatch):
    summed = model.accumulations(gpt_sg.graph)
    assert summed  # the residual stream: each layer's input feeds a norm and an Add
    producers = {v.name: n for n in gpt_sg.graph for v in n.outputs}
    consumers: dict[str, int] = {}
    for node in gpt_sg.graph:
        if node.metadata_props.get("tensoropt.role", "forward") == "forward":
            for v in node.inputs:
                if v is not None:
                    consumers[v.name] = consumers.get(v.name, 0) + 1
    marked = [n for n in gpt_sg.graph if ACCUMULATES_KEY in n.metadata_props]
    assert all(n.op_type == "Add" for n in marked) and len(marked) == sum(summed.values())
    for name, count in summed.items():
        if name in producers and name not in gpt_sg.params:
            assert count == consumers[name] - 1  # one Add fewer than the uses
    profile = builtin("h100")
    with_sums = _one_device_time(gpt_sg, profile)
    monkeypatch.setattr(model, "accumulations", lambda graph: {})
    without = _one_device_time(gpt_sg, profile)
    terms = []
    for name, count in summed.items():
        node = producers.get(name)
        if node is None or node.metadata_props.get("tensoropt.role", "forward") != "forward":
            continue  # a parameter's sum (tied weights) is not a forward value's
        shape = static_shape(next(v for v in node.outputs if v.name == name))
        terms.append(count * forward_time("Add", {}, [shape, shape], [shape], 4, profile))
    expected = math.fsum(terms)
    assert expected > 0
    assert with_sums - without == pytest.approx(expected, rel=1e-9)


def test_profiles_read_and_check_the_masked_softmax_rate():
    obj = {"base": "h100", "softmax_masked_s": 4.5e-9}
    assert from_json(obj, "p.json").softmax_masked_s == 4.5e-9
    with pytest.raises(ClusterError, match=r"p\.json\.softmax_masked_s"):
        from_json({"base": "h100", "softmax_masked_s": -1.0}, "p.json")


def test_calibration_masks_every_block_above_its_diagonal():
    x, count = causal_scores(32, 8, np.random.default_rng(0))
    blocks = x.reshape(-1, 8, 8)
    above = np.triu(np.ones((8, 8), dtype=bool), k=1)
    assert np.all(blocks[:, above] == np.float32(MASK_FILL))
    assert np.all(blocks[:, ~above] > MASK_SCORE)
    assert count == 4 * 28
    assert x.dtype == np.float32  # the kernel case's input type


def test_a_calibrated_profile_floors_nodes_at_streaming_their_saved_bytes(gpt_sg):
    """With a near-free kernel curve and a slow memory, a node's price is the floor: its
    bytes and its backward's at the memory bandwidth, where it reads or makes a value
    the backward reads; nodes that touch no saved value and contractions keep their
    kernel price."""
    from tensoropt.cost.cluster import OpCurve
    from tensoropt.passes.autodiff import unit_of

    fast = OpCurve("bytes", ((1.0, 1e18), (1e12, 1e18)))
    profile = dataclasses.replace(
        builtin("h100"), op_curves={"elementwise": fast}, memory_bandwidth=1e6
    )
    mesh = Mesh((1,), ("x",))
    mp = model.build_problem(gpt_sg, mesh, profile)
    pricer = model._Pricer(gpt_sg, mesh, profile)
    backward = model.backward_bytes(gpt_sg.graph)
    summed = model.accumulations(gpt_sg.graph)
    floored = kept = 0
    for unit in mp.units:
        node = unit.node
        seconds, _ = pricer.node(node, unit.strategies[0])
        touches = any(
            v is not None and v.name in gpt_sg.saved for v in (*node.inputs, *node.outputs)
        )
        contraction = node.op_type in ("MatMul", "Gemm", "Conv")
        plain = node.op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
        if touches and not contraction and not plain:
            moved = sum(
                math.prod(static_shape(v)) * 4
                for v in (*node.inputs, *node.outputs)
                if v is not None
            ) + backward.get(unit_of(node), 0.0)
            if any(summed.get(v.name) for v in node.outputs):
                assert seconds >= moved / 1e6 * (1 - 1e-12)  # plus its gradient sums
            else:
                assert seconds == pytest.approx(moved / 1e6, rel=1e-12)
            floored += 1
        elif contraction or not touches:
            assert seconds < 1.0  # the kernel price: far below any floor at 1 MB/s
            kept += 1
    assert floored and kept


def test_numel_multiplies_in_order_like_numpy():
    """The cost model's element counts: the float64 product numpy gives, bit for bit,
    on short shapes whose products pass 2**53 too (where rounding order matters)."""
    from tensoropt.ir.layout import numel

    rng = np.random.default_rng(7)
    shapes = [(), (1,), (3, 0, 5), (2**40, 3, 7)]
    shapes += [
        tuple(int(d) for d in rng.integers(1, 2**20, size=n))
        for n in range(1, 7)
        for _ in range(50)
    ]
    for shape in shapes:
        want = float(np.prod(shape, dtype=np.float64))
        assert numel(shape) == want and type(numel(shape)) is float, shape
    assert any(math.prod(s) > 2**53 for s in shapes)


def test_edge_tables_are_their_crossings_summed(gpt_sg):
    """Every edge's tables equal its crossings' tables summed in order, priced afresh,
    on a micro mesh where repeated layers take their edges from the builder's cache
    (``_Builder.edges`` names an edge by its units' programs and its group's static key)."""
    from tensoropt.cost.model import ProblemFamily, graph_facts, micro_choices, split_offer
    from tensoropt.ir.plan import ZeroStage

    mesh = Mesh((2, 2), ("x", "y"))
    choices, _ = split_offer(micro_choices(gpt_sg, mesh, 2))
    family = ProblemFamily(gpt_sg, mesh, builtin("h100"), micro_batches=2, choices=choices)
    facts = graph_facts(gpt_sg)
    groups = facts.edge_groups
    # the builder's caches outlive a problem: the ZeRO problems after the plain one
    # change some units' programs, and with them their edges' names
    for zero in (ZeroStage.NONE, ZeroStage.PARAMETERS, ZeroStage.OPTIMIZER):
        named = len(family.builder.group_cache)
        mp = family.problem(zero_all=zero)
        by_pair = {(e.src, e.dst): e for e in mp.problem.edges}
        assert len(by_pair) == len(groups)
        for (a, b), cs in groups:
            times = np.zeros((len(mp.units[a].strategies), len(mp.units[b].strategies)))
            mems = np.zeros_like(times)
            for i, flip in cs:
                c = mp.crossings[i]
                t, m = family.builder._crossing_tables(c, mp.programs, *facts.crossings[i])
                times += t.T if flip else t
                mems += m.T if flip else m
            edge = by_pair[(a, b)]
            assert np.array_equal(np.asarray(edge.time_s), times), (zero, a, b)
            assert np.array_equal(np.asarray(edge.memory_bytes), mems), (zero, a, b)
        # repeated layers (and edges the ZeRO stage leaves alone) come from the cache
        assert len(family.builder.group_cache) - named < len(groups)
