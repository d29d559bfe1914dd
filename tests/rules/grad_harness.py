"""Finite-difference harness for the gradient rules.

A :class:`GradCase` is a small ONNX graph (usually one node) with float64 inputs.
:func:`check_gradients` builds loss = sum_i sum(out_i * R_i) with random weights
R_i (a Builder tagged role=loss), runs ``build_gradients`` with ``GRAD_RULES``,
exposes the gradients as graph outputs, checks the model with onnx.checker
(full_check), runs it and compares every gradient with central finite
differences of the forward model in float64.

Executors: onnxruntime where it has float64 kernels for every op of the graph,
else ``onnx.reference.ReferenceEvaluator`` (onnxruntime's CPU build has no
float64 Conv, ConvTranspose, AveragePool, Erf, LeakyRelu, ...). Independently,
the gradient graph is converted to float32 and run in onnxruntime, which is what
the runtime will execute; that run is compared with the float64 gradients at
float32 precision (it catches ops or attribute forms onnxruntime cannot run).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from tensoropt.ir.builder import ROLE_KEY, Builder
from tensoropt.passes.autodiff import build_gradients
from tensoropt.rules.grad import GRAD_RULES

OPSET = 20
RTOL, ATOL = 1e-5, 1e-7  # float64 analytic vs central differences
F32_RTOL, F32_ATOL = 2e-3, 2e-4  # float32 onnxruntime run vs float64, scaled by max |grad|
FULL_FD_LIMIT = 96  # tensors up to this many elements are checked coordinate by coordinate
SAMPLED_COORDS = 48
DIRECTIONS = 3


@dataclass(frozen=True)
class Const:
    """A constant node input (stored as an initializer)."""

    value: np.ndarray


@dataclass(frozen=True)
class GradCase:
    """A small graph to differentiate. Float ``inputs`` are differentiated unless
    listed in ``frozen``; other inputs (ints, bools) are only fed."""

    nodes: tuple[onnx.NodeProto, ...]
    inputs: Mapping[str, np.ndarray]
    outputs: tuple[str, ...]
    initializers: Mapping[str, np.ndarray] = field(default_factory=dict)
    loss_outputs: tuple[str, ...] | None = None
    frozen: frozenset[str] = frozenset()
    opset: int = OPSET
    label: str = ""

    def wrt(self) -> list[str]:
        return [n for n, a in self.inputs.items() if a.dtype.kind == "f" and n not in self.frozen]


def node_case(
    op_type: str,
    args: Sequence[np.ndarray | Const | None],
    attrs: Mapping[str, object] | None = None,
    *,
    num_outputs: int = 1,
    loss_outputs: Sequence[int] | None = None,
    frozen: Sequence[int] = (),
    opset: int = OPSET,
) -> GradCase:
    """A one-node case: arrays become graph inputs ``x<i>``, :class:`Const` become
    initializers ``c<i>``, None an empty optional input."""
    names, inputs, inits = [], {}, {}
    for i, arg in enumerate(args):
        if arg is None:
            names.append("")
        elif isinstance(arg, Const):
            names.append(f"c{i}")
            inits[f"c{i}"] = np.asarray(arg.value)
        else:
            names.append(f"x{i}")
            inputs[f"x{i}"] = np.asarray(arg)
    outputs = tuple(f"y{k}" for k in range(num_outputs))
    node = helper.make_node(op_type, names, list(outputs), name="fwd", **dict(attrs or {}))
    chosen = None if loss_outputs is None else tuple(outputs[k] for k in loss_outputs)
    return GradCase(
        nodes=(node,),
        inputs=inputs,
        outputs=outputs,
        initializers=inits,
        loss_outputs=chosen,
        frozen=frozenset(f"x{i}" for i in frozen),
        opset=opset,
        label=f"{op_type} {dict(attrs or {})} "
        + " ".join(f"{n}:{a.shape}" for n, a in {**inputs, **inits}.items()),
    )


def make_model(case: GradCase) -> onnx.ModelProto:
    """The forward model of ``case`` (opset 20 unless the case says otherwise), shapes
    inferred with data propagation."""
    graph = helper.make_graph(
        list(case.nodes),
        "case",
        [
            helper.make_tensor_value_info(
                n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)
            )
            for n, a in case.inputs.items()
        ],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in case.outputs],
        initializer=[
            numpy_helper.from_array(np.asarray(v), n) for n, v in case.initializers.items()
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    if all(o.type.tensor_type.HasField("shape") for o in model.graph.output):
        return model
    # onnx leaves some shapes open (e.g. GatherND with runtime indices): take them from a run.
    runner, _ = make_runner(model)
    for out, value in zip(model.graph.output, runner(dict(case.inputs)), strict=True):
        out.CopyFrom(
            helper.make_tensor_value_info(
                out.name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)
            )
        )
    return model


# ---------------------------------------------------------------- executors


Runner = Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]


def _ort_runner(model: onnx.ModelProto) -> Runner:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in model.graph.output]
    return lambda feeds: session.run(names, dict(feeds))


class Erf(OpRun):
    """float64-exact Erf (onnx.reference computes it in float32)."""

    op_domain = ""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


class Gelu(OpRun):
    """float64-exact Gelu (onnx.reference expands it through its float32 Erf)."""

    op_domain = ""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
            return (0.5 * x * (1 + np.tanh(inner)),)
        erf = np.vectorize(math.erf, otypes=[x.dtype])
        return (0.5 * x * (1 + erf(x / math.sqrt(2))),)


class Mean(OpRun):
    """onnx.reference accumulates in place and fails to broadcast a scalar first input."""

    op_domain = ""

    def _run(self, *xs):
        return (functools.reduce(np.add, xs) / len(xs),)


class GlobalMaxPool(OpRun):
    """onnx.reference drops a dimension on 1-D spatial inputs."""

    op_domain = ""

    def _run(self, x):
        return (np.max(x, axis=tuple(range(2, x.ndim)), keepdims=True),)


class GlobalAveragePool(OpRun):
    """See :class:`GlobalMaxPool`."""

    op_domain = ""

    def _run(self, x):
        return (np.mean(x, axis=tuple(range(2, x.ndim)), keepdims=True),)


class AveragePool(OpRun):
    """A plain numpy AveragePool (onnx.reference mishandles ceil_mode with dilations).
    Explicit pads only; the output size follows onnxruntime (a last window that would
    start beyond the input and its begin pad is dropped)."""

    op_domain = ""

    def _run(self, x, **_):
        attrs = {a.name: helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        kernel = list(attrs["kernel_shape"])
        dims = len(kernel)
        strides = attrs.get("strides", [1] * dims)
        dilations = attrs.get("dilations", [1] * dims)
        pads = attrs.get("pads", [0] * (2 * dims))
        include = bool(attrs.get("count_include_pad", 0))
        spatial = x.shape[2:]
        positions, valid = [], []
        for i, (size, k, st_, d) in enumerate(
            zip(spatial, kernel, strides, dilations, strict=True)
        ):
            span = size + pads[i] + pads[dims + i] - ((k - 1) * d + 1)
            out = (-(-span // st_) if attrs.get("ceil_mode", 0) else span // st_) + 1
            if (out - 1) * st_ >= size + pads[i]:
                out -= 1
            taps = np.arange(out)[:, None] * st_ - pads[i] + np.arange(k)[None, :] * d
            lo, hi = (-pads[i], size + pads[dims + i]) if include else (0, size)
            positions.append(taps)
            valid.append(((taps >= lo) & (taps < hi), (taps >= 0) & (taps < size)))
        total = np.zeros((*x.shape[:2], *(p.shape[0] for p in positions)), dtype=x.dtype)
        count = np.zeros(total.shape[2:])
        for k in np.ndindex(*kernel):
            picks = [
                np.clip(p[:, kk], 0, n - 1) for p, kk, n in zip(positions, k, spatial, strict=True)
            ]
            inside = functools.reduce(
                np.multiply.outer, [v[1][:, kk] * 1.0 for v, kk in zip(valid, k, strict=True)]
            )
            counted = functools.reduce(
                np.multiply.outer, [v[0][:, kk] * 1.0 for v, kk in zip(valid, k, strict=True)]
            )
            total += x[(slice(None), slice(None), *np.ix_(*picks))] * inside
            count += counted
        return (total / count,)


class ConvTranspose(OpRun):
    """A plain numpy ConvTranspose (onnx.reference mishandles group > 1)."""

    op_domain = ""

    def _run(self, x, w, bias=None, **_):
        attrs = {a.name: helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        n, c_in, *spatial = x.shape
        group = int(attrs.get("group", 1))
        c_out_g, *kernel = w.shape[1:]
        dims = len(spatial)
        strides = attrs.get("strides", [1] * dims)
        dilations = attrs.get("dilations", [1] * dims)
        pads = attrs.get("pads", [0] * (2 * dims))
        extra = attrs.get("output_padding", [0] * dims)
        full = [
            s * (i - 1) + (k - 1) * d + 1 + e
            for s, i, k, d, e in zip(strides, spatial, kernel, dilations, extra, strict=True)
        ]
        out = np.zeros((n, group, c_out_g, *full), dtype=x.dtype)
        xg = x.reshape(n, group, c_in // group, *spatial)
        wg = w.reshape(group, c_in // group, c_out_g, *kernel)
        for k in np.ndindex(*kernel):
            contrib = np.einsum("ngc...,gco->ngo...", xg, wg[(..., *k)])
            window = tuple(
                slice(kk * d, kk * d + s * (i - 1) + 1, s)
                for kk, d, s, i in zip(k, dilations, strides, spatial, strict=True)
            )
            out[(slice(None), slice(None), slice(None), *window)] += contrib
        crop = tuple(slice(pads[i], full[i] - pads[dims + i]) for i in range(dims))
        out = out.reshape(n, group * c_out_g, *full)[(slice(None), slice(None), *crop)]
        if bias is not None:
            out = out + bias.reshape(1, -1, *([1] * dims))
        return (out,)


def make_runner(model: onnx.ModelProto) -> tuple[Runner, str]:
    """onnxruntime when it implements every op at these dtypes, else the reference."""
    try:
        return _ort_runner(model), "onnxruntime"
    except Exception as exc:  # onnxruntime raises its own NotImplemented class
        if "NOT_IMPLEMENTED" not in str(exc) and "not implemented" not in str(exc).lower():
            raise
    evaluator = ReferenceEvaluator(
        model,
        new_ops=[Erf, Gelu, Mean, ConvTranspose, AveragePool, GlobalMaxPool, GlobalAveragePool],
    )
    names = [o.name for o in model.graph.output]
    return lambda feeds: list(evaluator.run(names, dict(feeds))), "reference"


# ---------------------------------------------------------------- gradient graph


@dataclass(frozen=True)
class GradModel:
    proto: onnx.ModelProto
    weights: dict[str, np.ndarray]  # R_i per loss output
    wrt: list[str]
    new_nodes: list[ir.Node]


def build_grad_model(
    case: GradCase, forward: onnx.ModelProto, rng: np.random.Generator
) -> GradModel:
    """Append loss and backward to ``forward``; gradients become outputs ``grad__<input>``."""
    model = ir.from_proto(forward)
    graph = model.graph
    n_forward = len(graph)
    by_name = {v.name: v for v in graph.outputs}
    loss_names = case.loss_outputs or tuple(
        n for n in case.outputs if by_name[n].dtype in (ir.DataType.DOUBLE, ir.DataType.FLOAT)
    )
    b = Builder(graph)
    lb = b.tagged(role="loss", unit="loss")
    weights, terms = {}, []
    for name in loss_names:
        out = by_name[name]
        r = rng.standard_normal(tuple(out.shape)).astype(out.dtype.numpy())
        weights[name] = r
        # The driver's precondition: every value on a path to the loss has a static shape.
        prod = lb.op("Mul", [out, lb.const(r)], dtype=out.dtype, shape=r.shape)
        terms.append(lb.op("ReduceSum", [prod], {"keepdims": 0}, dtype=out.dtype, shape=[]))
    loss = terms[0]
    for term in terms[1:]:
        loss = lb.op("Add", [loss, term], dtype=loss.dtype, shape=[])
    inputs = {v.name: v for v in graph.inputs}
    wrt = case.wrt()
    grads = build_gradients(graph, loss, [inputs[n] for n in wrt], GRAD_RULES, b)
    new_nodes = list(graph)[n_forward:]
    out_b = b.tagged(role="backward", unit="outputs")
    for name, grad in zip(wrt, grads, strict=True):
        ident = out_b.op("Identity", [grad], dtype=inputs[name].dtype, shape=inputs[name].shape)
        ident.name = f"grad__{name}"
        graph.outputs.append(ident)
    loss_out = lb.op("Identity", [loss], dtype=loss.dtype, shape=[])
    loss_out.name = "loss"
    graph.outputs.append(loss_out)
    return GradModel(ir.to_proto(model), weights, wrt, new_nodes)


def to_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every float64 tensor, type and Cast target made float32."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    del graph.value_info[:]
    for vi in [*graph.input, *graph.output]:
        if vi.type.tensor_type.elem_type == TensorProto.DOUBLE:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    for i, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.DOUBLE:
            arr = numpy_helper.to_array(init).astype(np.float32)
            graph.initializer[i].CopyFrom(numpy_helper.from_array(arr, init.name))
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.DOUBLE:
                arr = numpy_helper.to_array(attr.t).astype(np.float32)
                attr.t.CopyFrom(numpy_helper.from_array(arr, attr.t.name))
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.DOUBLE:
                attr.i = TensorProto.FLOAT
    return out


# ---------------------------------------------------------------- finite differences


def _fd_plan(array: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Perturbation directions: unit vectors (all, or a sample) plus random directions."""
    size = array.size
    coords = (
        range(size) if size <= FULL_FD_LIMIT else rng.choice(size, SAMPLED_COORDS, replace=False)
    )
    directions = []
    for k in coords:
        unit = np.zeros(size)
        unit[k] = 1.0
        directions.append(unit.reshape(array.shape))
    n_random = 0 if size <= FULL_FD_LIMIT else DIRECTIONS
    directions += [rng.standard_normal(array.shape) for _ in range(n_random)]
    return directions


def _loss_fn(case: GradCase, runner: Runner, outputs: list[str], weights: dict[str, np.ndarray]):
    def loss(feeds: Mapping[str, np.ndarray]) -> float:
        arrays = {n: np.asarray(a) for n, a in feeds.items()}
        values = dict(zip(outputs, runner(arrays), strict=True))
        return float(sum(np.sum(values[n] * w) for n, w in weights.items()))

    return loss


def check_gradients(case: GradCase, seed: int = 0) -> dict[str, np.ndarray]:
    """Run every check on ``case``; return the float64 gradients by input name."""
    rng = np.random.default_rng(seed)
    forward = make_model(case)
    gm = build_grad_model(case, forward, rng)
    _check_new_nodes(gm.new_nodes)
    onnx.checker.check_model(gm.proto, full_check=True)
    feeds = dict(case.inputs)
    runner, _ = make_runner(gm.proto)
    names = [o.name for o in gm.proto.graph.output]
    results = dict(zip(names, runner(feeds), strict=True))
    grads = {n: results[f"grad__{n}"] for n in gm.wrt}
    fwd_runner, _ = make_runner(forward)
    loss = _loss_fn(case, fwd_runner, [o.name for o in forward.graph.output], gm.weights)
    np.testing.assert_allclose(results["loss"], loss(feeds), rtol=1e-12, atol=1e-12)
    for name in gm.wrt:
        _compare_fd(case, name, grads[name], feeds, loss, rng)
    _check_float32(gm, feeds, results)
    return grads


def _compare_fd(case, name, grad, feeds, loss, rng) -> None:
    x = feeds[name]
    assert grad.shape == x.shape, f"{case.label}: grad of {name} has shape {grad.shape}"
    assert np.all(np.isfinite(grad)), f"{case.label}: non-finite gradient of {name}"
    eps = 1e-6 * max(1.0, float(np.max(np.abs(x))) if x.size else 1.0)
    analytic, numeric = [], []
    for direction in _fd_plan(x, rng):
        plus = loss({**feeds, name: x + eps * direction})
        minus = loss({**feeds, name: x - eps * direction})
        numeric.append((plus - minus) / (2 * eps))
        analytic.append(float(np.sum(grad * direction)))
    np.testing.assert_allclose(
        analytic, numeric, rtol=RTOL, atol=ATOL, err_msg=f"{case.label}: d loss / d {name}"
    )


def _check_new_nodes(nodes: list[ir.Node]) -> None:
    for node in nodes:
        role = node.metadata_props.get(ROLE_KEY)
        assert role in ("loss", "backward"), f"node {node.name} has role {role!r}"
        assert node.domain == "", f"backward node {node.name} uses domain {node.domain!r}"


def _check_float32(gm: GradModel, feeds: Mapping[str, np.ndarray], expected_all) -> None:
    """The float32 graph in onnxruntime agrees with the float64 run on every output
    (forward outputs too, so a reference-evaluator forward cannot drift from
    onnxruntime's semantics unnoticed)."""
    model = to_float32(gm.proto)
    runner = _ort_runner(model)
    feeds32 = {n: a.astype(np.float32) if a.dtype == np.float64 else a for n, a in feeds.items()}
    names = [o.name for o in model.graph.output]
    results = dict(zip(names, runner(feeds32), strict=True))
    for name, expected in expected_all.items():
        if not np.issubdtype(expected.dtype, np.floating):
            np.testing.assert_array_equal(results[name], expected, err_msg=f"float32 run, {name}")
            continue
        scale = max(1.0, float(np.max(np.abs(expected))) if expected.size else 1.0)
        np.testing.assert_allclose(
            results[name],
            expected,
            rtol=F32_RTOL,
            atol=F32_ATOL * scale,
            err_msg=f"float32 onnxruntime run vs float64, output {name}",
        )


# ---------------------------------------------------------------- hypothesis helpers

FAST = settings(
    max_examples=12,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SLOW = settings(FAST, max_examples=60)


def rng_of(draw) -> np.random.Generator:
    """A numpy generator seeded from a hypothesis draw (so examples stay reproducible)."""
    return np.random.default_rng(draw(st.integers(0, 2**31 - 1), label="data seed"))


def shapes(min_rank: int = 0, max_rank: int = 3, min_side: int = 1, max_side: int = 4):
    return st.lists(st.integers(min_side, max_side), min_size=min_rank, max_size=max_rank).map(
        tuple
    )


@st.composite
def broadcastable_to(draw, shape: Sequence[int]) -> tuple[int, ...]:
    """A shape that numpy-broadcasts to ``shape``: some leading dims dropped, some set to 1."""
    drop = draw(st.integers(0, len(shape)))
    kept = shape[drop:]
    ones = draw(st.lists(st.booleans(), min_size=len(kept), max_size=len(kept)))
    return tuple(1 if one else d for d, one in zip(kept, ones, strict=True))


def normal(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    return rng.standard_normal(tuple(shape))


def positive(rng: np.random.Generator, shape: Sequence[int], lo=0.5, hi=2.0) -> np.ndarray:
    return rng.uniform(lo, hi, tuple(shape))


def away_from_zero(rng: np.random.Generator, shape: Sequence[int], margin=0.1) -> np.ndarray:
    """Values with |x| >= margin, random signs: away from the kink at 0."""
    magnitude = rng.uniform(margin, 2.0, tuple(shape))
    return np.where(rng.random(tuple(shape)) < 0.5, -magnitude, magnitude)


def distinct(rng: np.random.Generator, shapes_: Sequence[Sequence[int]], gap=0.05):
    """Arrays whose values are pairwise at least ``gap`` apart (no ties, no near-ties)."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes_]
    pool = rng.permutation(sum(sizes)) * gap - gap * sum(sizes) / 2
    pool = pool + rng.uniform(0, gap / 4, pool.shape)
    out, start = [], 0
    for shape, size in zip(shapes_, sizes, strict=True):
        out.append(pool[start : start + size].reshape(tuple(shape)))
        start += size
    return out
