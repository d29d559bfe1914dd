"""Per-device training-step graphs written by hand, with their output directories.

These are golden examples of the contract between the partitioner and the runtime
(docs/design/CONTRACTS.md): per-device graphs with ``ai.tensoropt`` collectives,
the unpartitioned training step (``annotated.onnx``) and a correct manifest. The
runtime's tests and benchmarks use them, and they work before (and independently
of) the compiler. Two families:

* :func:`mlp_case` -- a 3-matrix MLP on a ``(dp, tp)`` mesh: data parallel over
  ``dp`` (gradient AllReduce), Megatron tensor parallel over ``tp`` (column-
  parallel W1/b1, row-parallel W2: one AllReduce forward, one backward), SGD with
  momentum. ``dp = tp = 1`` is the unpartitioned step.
* :func:`a2a_case` -- ZeRO-style sharded weight on an ``(n,)`` mesh: AllGather of
  the weight, AllToAll from batch- to feature-sharded and back, ReduceScatter of
  the weight gradient, AllReduce of the loss. Plain SGD.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tensoropt.ir.vocab import COLLECTIVE_DOMAIN as DOMAIN
from tensoropt.ir.vocab import OptimizerState
from tensoropt.runtime.manifest import MANIFEST_SCHEMA, block_of, sha256_file

OPSET = 20
MOMENTUM = OptimizerState.MOMENTUM
PARAMS = ("W0", "W1", "b1", "W2")  # the MLP case's parameters, in update order


@dataclass(frozen=True, slots=True)
class ValueSpec:
    """A graph input of the case: global shape, placements, initial global value."""

    name: str
    kind: str  # data | labels | param | state
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    init: np.ndarray | None = None  # params and states only
    dtype: str = "float32"


@dataclass(frozen=True, slots=True, eq=False)
class Case:
    """A complete hand-built compile result, ready to be written as an output dir."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    devices: tuple[onnx.ModelProto, ...]
    annotated: onnx.ModelProto
    values: tuple[ValueSpec, ...]
    step: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(np.prod(self.mesh_shape))


class _Graph:
    """A tiny node accumulator: ``op`` returns the name of its (single) output."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def op(self, op_type: str, *inputs: str, domain: str = "", **attrs) -> str:
        out = f"v{len(self.nodes)}_{op_type}"
        node = helper.make_node(
            op_type, list(inputs), [out], name=f"n{len(self.nodes)}_{op_type}", domain=domain
        )
        node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
        self.nodes.append(node)
        return out

    def const(self, value: float | Sequence[int], dtype=np.float32) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def collective(self, kind: str, x: str, group: Sequence[int], **attrs) -> str:
        if len(group) == 1:
            return x  # a group of one needs no communication
        return self.op(kind, x, domain=DOMAIN, group=list(group), **attrs)

    def rename(self, value: str, name: str) -> None:
        """Make ``name`` (a graph output) the output of the node that produced ``value``."""
        for node in self.nodes:
            for i, out in enumerate(node.output):
                if out == value:
                    node.output[i] = name
                    for other in self.nodes:
                        for j, inp in enumerate(other.input):
                            if inp == value:
                                other.input[j] = name
                    return
        self.nodes.append(helper.make_node("Identity", [value], [name], name=f"id_{name}"))


def _local_shape(spec: ValueSpec, mesh: Sequence[int], coords: Sequence[int]) -> list[int]:
    block = block_of(spec.shape, spec.placements, mesh, coords)
    return [s.stop - s.start for s in block]


def _finish(
    g: _Graph,
    values: Sequence[ValueSpec],
    outputs: Mapping[str, list[int]],
    mesh: Sequence[int],
    coords: Sequence[int],
    step: dict,
) -> onnx.ModelProto:
    inputs, inits = [], list(g.inits)
    for spec in values:
        shape = _local_shape(spec, mesh, coords)
        dtype = helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))
        inputs.append(helper.make_tensor_value_info(spec.name, dtype, shape))
        if spec.init is not None:
            block = block_of(spec.shape, spec.placements, mesh, coords)
            inits.append(numpy_helper.from_array(np.ascontiguousarray(spec.init[block]), spec.name))
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()]
    graph = helper.make_graph(g.nodes, "step", inputs, outs, initializer=inits)
    opsets = [helper.make_opsetid("", OPSET)]
    if any(n.domain == DOMAIN for n in g.nodes):
        opsets.append(helper.make_opsetid(DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    helper.set_model_props(model, {"tensoropt.step": json.dumps(step)})
    return model


def _step_json(values: Sequence[ValueSpec], optimizer: dict) -> dict:
    params = [v.name for v in values if v.kind == "param"]
    states = [v.name for v in values if v.kind == "state"]
    labels = next((v.name for v in values if v.kind == "labels"), None)
    return {
        "schema": "tensoropt.step/1",
        "loss": "loss",
        "data_inputs": [v.name for v in values if v.kind == "data"],
        "labels": labels,
        "labels_high": None,
        "input_high": {},
        "params": params,
        "states": states,
        "carry": {f"{n}__new": n for n in params + states},
        "optimizer": optimizer,
    }


def _sgd(g: _Graph, p: str, grad: str, mom: str | None, lr: str, mu: str | None):
    """Momentum SGD (``mom`` given) or plain SGD; returns (new param, new momentum)."""
    if mom is None:
        return g.op("Sub", p, g.op("Mul", grad, lr)), None
    m_new = g.op("Add", g.op("Mul", mom, mu), grad)
    return g.op("Sub", p, g.op("Mul", m_new, lr)), m_new


def _coords_of(rank: int, mesh: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(c) for c in np.unravel_index(rank, tuple(mesh)))


def _axis_group(rank: int, mesh: Sequence[int], axis: int) -> list[int]:
    coords = list(_coords_of(rank, mesh))
    group = []
    for i in range(mesh[axis]):
        coords[axis] = i
        group.append(int(np.ravel_multi_index(tuple(coords), tuple(mesh))))
    return group


# ----------------------------------------------------------------------- MLP case


def mlp_case(
    dp: int, tp: int, batch: int = 8, d: int = 6, h: int = 8, lr: float = 0.05, seed: int = 0
) -> Case:
    """Megatron MLP (tensor parallel over tp) with data parallelism over dp."""
    rng = np.random.default_rng(seed)
    mesh = (dp, tp)
    norm = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    params = [
        ValueSpec("W0", "param", (d, d), ("R", "R"), norm(d, d)),
        ValueSpec("W1", "param", (d, h), ("R", "S(1)"), norm(d, h)),
        ValueSpec("b1", "param", (h,), ("R", "S(0)"), np.full(h, 0.1, np.float32)),
        ValueSpec("W2", "param", (h, d), ("R", "S(0)"), norm(h, d)),
    ]
    states = [
        ValueSpec(
            MOMENTUM.of(p.name), "state", p.shape, p.placements, np.zeros(p.shape, np.float32)
        )
        for p in params
    ]
    values = (
        ValueSpec("x", "data", (batch, d), ("S(0)", "R")),
        ValueSpec("labels", "labels", (batch, d), ("S(0)", "R")),
        *params,
        *states,
    )
    step = _step_json(values, {"kind": "sgd", "lr": lr, "momentum": 0.9})
    devices = tuple(_mlp_device(r, mesh, values, step, batch * d, lr) for r in range(dp * tp))
    single = _mlp_device(0, (1, 1), values, step, batch * d, lr)
    return Case(mesh, ("dp", "tp"), devices, single, values, step)


def _mlp_device(
    rank: int, mesh: tuple[int, int], values: Sequence[ValueSpec], step: dict, n: int, lr: float
) -> onnx.ModelProto:
    g = _Graph()
    dpg, tpg = _axis_group(rank, mesh, 0), _axis_group(rank, mesh, 1)
    # forward
    u = g.op("MatMul", "x", "W0")
    hpre = g.op("Add", g.op("MatMul", u, "W1"), "b1")
    a = g.op("Relu", hpre)
    z = g.collective("AllReduce", g.op("MatMul", a, "W2"), tpg)
    diff = g.op("Sub", z, "labels")
    lsum = g.op("ReduceSum", g.op("Mul", diff, diff), keepdims=0)
    loss = g.op("Mul", g.collective("AllReduce", lsum, dpg), g.const(1.0 / n))
    # backward
    dz = g.op("Mul", diff, g.const(2.0 / n))
    grads = {"W2": g.op("MatMul", g.op("Transpose", a, perm=[1, 0]), dz)}
    da = g.op("MatMul", dz, g.op("Transpose", "W2", perm=[1, 0]))
    dh = g.op("Mul", da, g.op("Cast", g.op("Greater", hpre, g.const(0.0)), to=TensorProto.FLOAT))
    grads["b1"] = g.op("ReduceSum", dh, g.const([0], np.int64), keepdims=0)
    grads["W1"] = g.op("MatMul", g.op("Transpose", u, perm=[1, 0]), dh)
    du = g.collective("AllReduce", g.op("MatMul", dh, g.op("Transpose", "W1", perm=[1, 0])), tpg)
    grads["W0"] = g.op("MatMul", g.op("Transpose", "x", perm=[1, 0]), du)
    # gradient sync over dp, then momentum SGD
    lr_c, mu_c = g.const(lr), g.const(0.9)
    coords = _coords_of(rank, mesh)
    outputs = {"loss": []}
    news = {}
    for name in PARAMS:
        grad = g.collective("AllReduce", grads[name], dpg)
        news[name], news[MOMENTUM.of(name)] = _sgd(g, name, grad, MOMENTUM.of(name), lr_c, mu_c)
    g.rename(loss, "loss")
    specs = {v.name: v for v in values}
    for name in (*PARAMS, *(MOMENTUM.of(p) for p in PARAMS)):
        g.rename(news[name], f"{name}__new")
        outputs[f"{name}__new"] = _local_shape(specs[name], mesh, coords)
    return _finish(g, values, outputs, mesh, coords, step)


# ------------------------------------------------------------ AllGather/A2A case


def a2a_case(
    n: int, batch: int = 8, d: int = 4, h: int = 8, lr: float = 0.1, seed: int = 1
) -> Case:
    """Sharded weight gathered for use, AllToAll around a Tanh, ReduceScatter of dW."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32)
    values = (
        ValueSpec("x", "data", (batch, d), ("S(0)",)),
        ValueSpec("labels", "labels", (batch, h), ("S(0)",)),
        ValueSpec("W", "param", (d, h), ("S(0)",), w),
    )
    step = _step_json(values, {"kind": "sgd", "lr": lr, "momentum": 0.0})
    devices = tuple(_a2a_device(r, n, values, step, batch * h, lr) for r in range(n))
    single = _a2a_device(0, 1, values, step, batch * h, lr)
    return Case((n,), ("d",), devices, single, values, step)


def _a2a_device(
    rank: int, n: int, values: Sequence[ValueSpec], step: dict, count: int, lr: float
) -> onnx.ModelProto:
    g = _Graph()
    grp = list(range(n))
    w_full = g.collective("AllGather", "W", grp, axis=0)
    hid = g.op("MatMul", "x", w_full)  # [B/n, H]
    t = g.collective("AllToAll", hid, grp, split_axis=1, concat_axis=0)  # [B, H/n]
    s = g.op("Tanh", t)
    u = g.collective("AllToAll", s, grp, split_axis=0, concat_axis=1)  # [B/n, H]
    diff = g.op("Sub", u, "labels")
    lsum = g.op("ReduceSum", g.op("Mul", diff, diff), keepdims=0)
    loss = g.op("Mul", g.collective("AllReduce", lsum, grp), g.const(1.0 / count))
    du = g.op("Mul", diff, g.const(2.0 / count))
    ds = g.collective("AllToAll", du, grp, split_axis=1, concat_axis=0)
    dt = g.op("Mul", ds, g.op("Sub", g.const(1.0), g.op("Mul", s, s)))
    dh = g.collective("AllToAll", dt, grp, split_axis=0, concat_axis=1)
    dw_full = g.op("MatMul", g.op("Transpose", "x", perm=[1, 0]), dh)
    dw = g.collective("ReduceScatter", dw_full, grp, axis=0)
    w_new, _ = _sgd(g, "W", dw, None, g.const(lr), None)
    g.rename(loss, "loss")
    g.rename(w_new, "W__new")
    coords = (rank,)
    outputs = {"loss": [], "W__new": _local_shape(values[2], (n,), coords)}
    return _finish(g, values, outputs, (n,), coords, step)


# ------------------------------------------------------------------- writing


def write_outdir(case: Case, outdir: str | Path) -> Path:
    """Write ``device_<k>.onnx``, ``annotated.onnx``, ``plan.json`` and ``manifest.json``."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = []
    for k, model in enumerate(case.devices):
        onnx.checker.check_model(model)
        onnx.save(model, out / f"device_{k}.onnx")
        coords = list(_coords_of(k, case.mesh_shape))
        ranks.append(
            {"rank": k, "coords": coords, "file": f"device_{k}.onnx",
             "sha256": sha256_file(out / f"device_{k}.onnx")}
        )  # fmt: skip
    onnx.checker.check_model(case.annotated)
    onnx.save(case.annotated, out / "annotated.onnx")
    (out / "plan.json").write_text(json.dumps({"schema": "tensoropt.plan/1", "handbuilt": True}))
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "world_size": case.world_size,
        "mesh": {"shape": list(case.mesh_shape), "axis_names": list(case.axis_names)},
        "ranks": ranks,
        "step": case.step,
        "inputs": {
            v.name: {
                "kind": v.kind,
                "global_shape": list(v.shape),
                "dtype": v.dtype,
                "placements": list(v.placements),
            }
            for v in case.values
        },
        "outputs": {},
        "files": {f: sha256_file(out / f) for f in ("annotated.onnx", "plan.json")},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out
