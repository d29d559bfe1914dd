"""Validator harness for sharding rules: shard, run per device in onnxruntime, reassemble.

For one op instance (a :class:`Case`) and a mesh shape, every strategy that
``strategies_nd`` returns is checked: the inputs are distributed per the strategy's
layouts (``S``: slice, ``R``: copy, ``P``: n random addends), the localized op
(``localize_nd``: local attributes and replaced constants) runs once per device as a
one-node ONNX model, its outputs are scaled by ``output_scale`` and reassembled (``S``
concatenate, ``R`` all copies bit-identical, ``P`` sum), and the result is compared with the
full op run in onnxruntime.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from tensoropt.ir.layout import Layout, Partial, Replicate, Shard, assemble
from tensoropt.ir.mesh import Mesh
from tensoropt.rules.sharding import (
    SHARDING_RULES,
    OpView,
    ShardingRegistry,
    localize_nd,
    strategies_nd,
)

OPSET = 20


@dataclass
class Case:
    """One op instance. ``consts``: input indices that are constant (initializers)."""

    op_type: str
    inputs: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    consts: frozenset[int] = frozenset()
    n_outputs: int = 1
    # float32 cases: rtol/atol; float64 and exact dtypes ignore it
    tol: float = 1e-5

    def __str__(self) -> str:
        shapes = ",".join("-" if a is None else "x".join(map(str, a.shape)) for a in self.inputs)
        return f"{self.op_type}[{shapes}]{self.attrs if self.attrs else ''}"


def _attr_value(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return numpy_helper.from_array(v)
    return v


def _dtype(a: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(a.dtype)


def build_model(case: Case, inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> bytes:
    """One-node model: constant inputs become initializers, the rest graph inputs."""
    names = [f"x{i}" if a is not None else "" for i, a in enumerate(inputs)]
    while names and names[-1] == "":
        names.pop()
    outs = [f"y{j}" for j in range(case.n_outputs)]
    node = helper.make_node(
        case.op_type, names, outs, **{k: _attr_value(v) for k, v in attrs.items()}
    )
    graph_inputs, inits = [], []
    for i, a in enumerate(inputs):
        if a is None:
            continue
        if i in case.consts:
            inits.append(numpy_helper.from_array(a, f"x{i}"))
        else:
            graph_inputs.append(helper.make_tensor_value_info(f"x{i}", _dtype(a), a.shape))
    graph = helper.make_graph(
        [node], "g", graph_inputs, [onnx.ValueInfoProto(name=o) for o in outs], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    return model.SerializeToString()


@functools.lru_cache(maxsize=4096)
def _session(model: bytes) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def run(case: Case, inputs: Sequence[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    sess = _session(build_model(case, inputs, attrs))
    feed = {f"x{i}": a for i, a in enumerate(inputs) if a is not None and i not in case.consts}
    return sess.run(None, feed)


def op_view(case: Case, outputs: Sequence[np.ndarray]) -> OpView:
    return OpView(
        case.op_type,
        case.attrs,
        tuple(None if a is None else tuple(a.shape) for a in case.inputs),
        tuple(None if a is None else _dtype(a) for a in case.inputs),
        tuple(tuple(o.shape) for o in outputs),
        tuple(_dtype(o) for o in outputs),
        tuple(a if i in case.consts else None for i, a in enumerate(case.inputs)),
    )


def distribute(
    x: np.ndarray, layout: Layout, mesh: Mesh, rng: np.random.Generator
) -> dict[tuple[int, ...], np.ndarray]:
    """Per-device pieces: S slices, R copies, P random addends that sum to the value."""
    pieces: dict[tuple[int, ...], np.ndarray] = {(): x}
    for axis, p in enumerate(layout.placements):
        n = mesh.shape[axis]
        nxt: dict[tuple[int, ...], np.ndarray] = {}
        addends: dict[tuple[int, ...], list[np.ndarray]] = {}  # same on replicated copies
        for prefix, a in pieces.items():
            if isinstance(p, Shard):
                parts = np.split(a, n, axis=p.dim)
            elif isinstance(p, Partial):
                key = tuple(
                    0 if isinstance(layout.placements[k], Replicate) else c
                    for k, c in enumerate(prefix)
                )
                if key not in addends:
                    rand = [rng.standard_normal(a.shape).astype(a.dtype) for _ in range(n - 1)]
                    addends[key] = [*rand, (a - sum(rand)).astype(a.dtype)]
                parts = addends[key]
            else:
                parts = [a] * n
            for k, part in enumerate(parts):
                nxt[prefix + (k,)] = np.array(part, copy=True, order="C")
        pieces = nxt
    return pieces


def _compare(got: np.ndarray, want: np.ndarray, case: Case, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    tol = case.tol
    single = any(a is not None and a.dtype == np.float32 for a in case.inputs)
    if want.dtype == np.float64 and not single:
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=what)
    elif want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def validate(
    case: Case,
    mesh_shape: Sequence[int],
    seed: int = 0,
    registry: ShardingRegistry = SHARDING_RULES,
) -> int:
    """Check every strategy of ``case`` on a mesh; returns how many were checked."""
    rng = np.random.default_rng(seed)
    full = run(case, case.inputs, case.attrs)
    view = op_view(case, full)
    mesh = Mesh.of(*mesh_shape)
    strategies = strategies_nd(view, mesh.shape, registry)
    replicated = Layout.replicated(mesh.ndim)
    first = strategies[0]
    assert all(lay in (None, replicated) for lay in first.inputs), f"{case}: all-R not first"
    assert all(lay == replicated for lay in first.outputs), f"{case}: all-R not first"
    assert len(set(strategies)) == len(strategies), f"{case}: duplicate strategies"
    for strategy in strategies:
        _validate_one(case, view, full, strategy, mesh, rng, registry)
    return len(strategies)


def _validate_one(case, view, full, strategy, mesh, rng, registry) -> None:
    what = f"{case} strategy {strategy} on mesh {mesh}"
    local = localize_nd(view, strategy, mesh.shape, registry)
    per_input: list[dict | None] = []
    for i, (a, layout) in enumerate(zip(case.inputs, strategy.inputs, strict=True)):
        assert (a is None) == (layout is None), f"{what}: input {i} presence"
        if a is None:
            per_input.append(None)
            continue
        if local.const_inputs[i] is not None:
            assert i in case.consts and layout == Layout.replicated(mesh.ndim), what
            per_input.append(dict.fromkeys(mesh.all_coords(), local.const_inputs[i]))
            continue
        per_input.append(distribute(a, layout, mesh, rng))
    outs: dict[int, dict] = {j: {} for j in range(case.n_outputs)}
    for c in mesh.all_coords():
        ins = [None if d is None else d[c] for d in per_input]
        got_in = tuple(None if a is None else tuple(a.shape) for a in ins)
        assert got_in == local.input_shapes, f"{what}: local input shapes {got_in}"
        res = run(case, ins, dict(local.attributes))
        for j, r in enumerate(res):
            assert tuple(r.shape) == local.output_shapes[j], f"{what}: output {j} shape"
            scale = local.output_scale[j]
            outs[j][c] = r if scale is None else (r * scale).astype(r.dtype)
    for j, layout in enumerate(strategy.outputs):
        got = assemble(outs[j], layout, mesh, f"{what} output {j}")
        _compare(got, full[j], case, f"{what} output {j}")


def mesh_shapes_1d() -> list[tuple[int, ...]]:
    return [(2,), (3,)]


def product_shapes(*dims: Sequence[int]) -> list[tuple[int, ...]]:
    return [tuple(p) for p in itertools.product(*dims)]
