"""Splitting device graphs at collectives: segment counts, contents, and pre-checks."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from tensoropt.errors import TensorOptError
from tensoropt.ir.vocab import COLLECTIVE_DOMAIN as DOMAIN
from tensoropt.ir.vocab import CollectiveKind
from tensoropt.runtime.engine import LocalEngine
from tensoropt.runtime.program import check_collective_order
from tensoropt.runtime.split import collective_order, split_graph
from tests.helpers.handbuilt import a2a_case, mlp_case


def _plans(case):
    fed = {v.name for v in case.values}
    return [split_graph(m, r, case.world_size, fed) for r, m in enumerate(case.devices)]


def test_megatron_block_has_one_allreduce_forward_and_one_backward():
    plans = _plans(mlp_case(dp=1, tp=2))
    for plan in plans:
        kinds = [c.kind for c in plan.collectives]
        assert kinds == [CollectiveKind.ALL_REDUCE] * 2
        assert plan.num_segments == 3
        assert plan.collectives[0].group == (0, 1)


def test_data_parallel_gradient_allreduces_share_one_batch():
    plan = _plans(mlp_case(dp=4, tp=1))[2]
    assert [len(s.collectives) for s in plan.stages] == [5, 0]  # loss + 4 gradients
    assert plan.num_segments == 2


def test_2d_mesh_groups_follow_mesh_axes():
    plans = _plans(mlp_case(dp=2, tp=2))
    groups = {c.group for c in plans[3].collectives}
    assert groups == {(1, 3), (2, 3)}  # dp group of rank 3 and its tp group


def test_initializers_stay_inside_segments_and_params_are_fed():
    case = mlp_case(dp=2, tp=1)
    plan = _plans(case)[0]
    fed = {v.name for v in case.values}
    assert set(plan.feeds) == fed
    seg_inits = {
        t.name for s in plan.stages if s.segment for t in s.segment.model.graph.initializer
    }
    assert seg_inits and not (seg_inits & fed)  # constants only
    for stage in plan.stages:
        if stage.segment is not None:
            assert not any(n.domain == DOMAIN for n in stage.segment.model.graph.node)
            onnx.checker.check_model(stage.segment.model)


def test_collective_order_matches_split_plan():
    case = a2a_case(2)
    for r, model in enumerate(case.devices):
        assert collective_order(model, r, 2) == _plans(case)[r].collectives


def _retype(model: onnx.ModelProto, index: int, op_type: str) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    nodes = [n for n in m.graph.node if n.domain == DOMAIN]
    nodes[index].op_type = op_type
    return m


def test_mismatched_collective_kinds_are_refused_naming_rank_and_node():
    case = mlp_case(dp=2, tp=1)
    devices = list(case.devices)
    devices[1] = _retype(devices[1], 1, "AllGather")
    node = [n for n in devices[1].graph.node if n.domain == DOMAIN][1].name
    fed = {v.name for v in case.values}
    plans = [split_graph(m, r, 2, fed) for r, m in enumerate(devices)]
    with pytest.raises(TensorOptError, match=rf"rank 1: collective #1 is AllGather node '{node}'"):
        check_collective_order({p.rank: p.collectives for p in plans})


def test_group_disagreement_is_refused():
    case = mlp_case(dp=2, tp=1)
    devices = [onnx.ModelProto() for _ in range(2)]
    for d, m in zip(devices, case.devices, strict=True):
        d.CopyFrom(m)
    node = next(n for n in devices[1].graph.node if n.domain == DOMAIN)
    node.attribute[0].ints[:] = [1, 0]  # rank 1 says (1, 0), rank 0 says (0, 1)
    fed = {v.name for v in case.values}
    plans = [split_graph(m, r, 2, fed) for r, m in enumerate(devices)]
    with pytest.raises(TensorOptError, match="does not match rank 1"):
        check_collective_order({p.rank: p.collectives for p in plans})


def test_group_without_own_rank_is_refused():
    case = mlp_case(dp=2, tp=1)
    with pytest.raises(TensorOptError, match="does not contain rank 2"):
        split_graph(case.devices[0], 2, 4, {v.name for v in case.values})


# ------------------------------------------------------------- property: random graphs


@st.composite
def random_graphs(draw):
    """A random DAG over [2, 4] floats: unary/binary ops and (identity-like) collectives."""
    n = draw(st.integers(1, 14))
    values = ["x"]
    nodes = []
    collective_nodes = []
    for i in range(n):
        kind = draw(st.sampled_from(["Relu", "Add", "Mul", "coll", "coll"]))
        a = draw(st.sampled_from(values))
        out = f"v{i}"
        if kind == "coll":
            nodes.append(helper.make_node("AllReduce", [a], [out], name=f"c{i}", domain=DOMAIN,
                                          group=[0]))  # fmt: skip
            collective_nodes.append(i)
        elif kind == "Relu":
            nodes.append(helper.make_node("Relu", [a], [out], name=f"n{i}"))
        else:
            b = draw(st.sampled_from([*values, "k"]))
            nodes.append(helper.make_node(kind, [a, b], [out], name=f"n{i}"))
        values.append(out)
    outs = draw(st.lists(st.sampled_from(values[1:]), min_size=1, max_size=3, unique=True))
    return nodes, outs


def _model(nodes, outs, domain_op: str | None) -> onnx.ModelProto:
    fixed = []
    for node in nodes:
        if node.domain == DOMAIN and domain_op:
            node = helper.make_node(domain_op, list(node.input), list(node.output), name=node.name)
        fixed.append(node)
    k = numpy_helper.from_array(np.full((2, 4), 0.5, np.float32), "k")
    graph = helper.make_graph(
        fixed, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2, 4]) for o in outs],
        initializer=[k],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _min_segments(nodes) -> int:
    """Longest chain of 'collective then compute' on any path, plus one."""
    depth: dict[str, int] = {"x": 0, "k": 0}
    pending: dict[str, bool] = {"x": False, "k": False}  # produced by a collective?
    best = 0
    for node in nodes:
        d = 0
        for name in node.input:
            d = max(d, depth[name] + (1 if pending[name] and node.domain != DOMAIN else 0))
        depth[node.output[0]] = d
        pending[node.output[0]] = node.domain == DOMAIN
        if node.domain != DOMAIN:
            best = max(best, d)
    return best + 1


@settings(max_examples=40)
@given(random_graphs())
def test_split_execution_equals_whole_graph_with_fewest_segments(graph):
    nodes, outs = graph
    model = _model(nodes, outs, None)
    plan = split_graph(model, 0, 1, {"x"})
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    got = LocalEngine({0: plan}).step({0: {"x": x}})[0]
    whole = _model(nodes, outs, "Identity")  # a one-rank AllReduce is the identity
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(whole.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    for name, value in zip(outs, sess.run(outs, {"x": x}), strict=True):
        np.testing.assert_array_equal(got[name], value)
    # ASAP levels: the last segment sits at the lowest level any schedule allows
    # (the longest collective-then-compute chain); dead segments are dropped.
    last = max((i for i, st_ in enumerate(plan.stages) if st_.segment), default=-1)
    assert last + 1 <= _min_segments(nodes)
    live = {n for node in nodes for n in node.input} | set(outs)
    no_dead = all(o in live for node in nodes for o in node.output)
    if no_dead and any(n.domain != DOMAIN for n in nodes):
        assert last + 1 == _min_segments(nodes)


def test_compute_runs_in_the_segment_of_its_first_consumer():
    """As late as possible: Relu(k) only feeds a node after the collective, so it runs
    there (in one session with its consumer, which can fuse them), not in segment 0."""
    nodes = [
        helper.make_node("Neg", ["x"], ["a"], name="neg"),
        helper.make_node("AllReduce", ["a"], ["r"], name="c", domain=DOMAIN, group=[0]),
        helper.make_node("Relu", ["k"], ["t"], name="relu"),
        helper.make_node("Mul", ["r", "t"], ["y"], name="mul"),
    ]
    plan = split_graph(_model(nodes, ["y"], None), 0, 1, {"x"})
    names = [[n.name for n in s.segment.model.graph.node] if s.segment else [] for s in plan.stages]
    assert names == [["neg"], ["relu", "mul"]]
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(LocalEngine({0: plan}).step({0: {"x": x}})[0]["y"], -0.5 * x)


def test_gradients_are_freed_as_soon_as_their_allreduce_returns():
    """Data parallelism all-reduces every gradient in one batch: each gradient is
    dropped right after its own all-reduce, not after the whole batch (which holds
    every gradient twice, reduced and not, until the batch ends)."""
    for plan in _plans(mlp_case(dp=2, tp=1)):
        freed = [n for s in plan.stages for names in s.release_after for n in names]
        reduced = [c.input for c in plan.collectives]
        assert len(reduced) > 1 and sorted(freed) == sorted(reduced)
        for stage in plan.stages:
            assert len(stage.release_after) == len(stage.collectives)
