"""Compute time of one op's local shard, forward plus backward (a roofline).

time = sum over kernels of max(flops / rate, bytes / memory bandwidth, floor), where
rate is the profile's measured throughput for the op's family when it has one
(a calibrated profile), else peak FLOP/s times efficiency. A calibrated profile
with measured rate-vs-size curves (``op_curves``) replaces the family's term by
the time the curve gives at the op's size, interpolated log-log between measured
sizes: FLOPs / FLOP/s for matmul and conv, bytes / bytes/s for memory-bound
families (small kernels are slower per FLOP and per byte), and a measured
backward-to-forward ratio curve (``op_backward``) replaces the fixed 2x below; an op
type with curves of its own (calibrate measures the zoo's activations, whose backward
ranges from nearly free to several element-wise ops) uses those first.

A MatMul, Gemm, Conv or BatchNormalization with a measured training-step grid
(``op_train_grids``: FLOPs per second of forward + backward + the SGD-momentum update
of the op's weight inside a training step, against the op's shape, see
:class:`~tensoropt.cost.cluster.RateGrid`) takes its time from it directly, and the
cost model then charges those weights' update only beyond momentum SGD's
(``grid_update_slots``).
Neither a rate-against-FLOPs curve nor forward x backward ratio fits these: a MatMul's
rate follows its rows, onnxruntime runs a Conv inside a training step in another layout
than alone (a forward-only chain of Convs ran 2x faster), the weight-gradient
convolution's cost follows the channels, and BatchNormalization's backward is a dozen
element-wise ops broadcasting over channels that the LayerNorm-like norm curve priced
at a twentieth of what they took on small feature maps.

Without measurements (the built-in profiles): the backward of a contraction (MatMul,
Gemm, Conv) is two contractions of the same size; the backward of other ops is taken
as twice the forward traffic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tensoropt.cost.cluster import ClusterProfile, OpCurve
from tensoropt.ir.layout import numel

_FAMILIES = {
    "MatMul": "matmul",
    "Gemm": "matmul",
    "Einsum": "matmul",
    "Conv": "conv",
    "ConvTranspose": "conv",
    "Softmax": "softmax",
    "LogSoftmax": "softmax",
    "LayerNormalization": "norm",
    "BatchNormalization": "norm",
    "ReduceMean": "reduce",
    "ReduceSum": "reduce",
    "ReduceMax": "reduce",
    "GlobalAveragePool": "reduce",
    "MaxPool": "pool",
    "AveragePool": "pool",
}
# A score at or below this is a mask's: exp(score - row max) underflows to 0.
MASK_SCORE = -1e4
# Ops that move no data on a device (views, shape arithmetic).
_FREE = frozenset(
    {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Constant", "Size"}
)


def family(op_type: str) -> str:
    return _FAMILIES.get(op_type, "elementwise")


def numel_or_zero(shape: Sequence[int] | None) -> float:
    """The element count of ``shape``; 0 for an unknown one (None)."""
    return 0.0 if shape is None else numel(shape)


def forward_flops(op_type: str, attrs, in_shapes, out_shapes) -> float:
    """FLOPs of the forward op on these (local) shapes."""
    out = numel_or_zero(out_shapes[0]) if out_shapes else 0.0
    if op_type == "MatMul" and in_shapes[0]:
        return 2.0 * out * in_shapes[0][-1]
    if op_type == "Gemm" and in_shapes[0]:
        k = in_shapes[0][0] if attrs.get("transA", 0) else in_shapes[0][-1]
        return 2.0 * out * k
    if op_type in ("Conv", "ConvTranspose") and in_shapes[1]:
        w = in_shapes[1]
        per_out = numel(w[1:])
        base = out if op_type == "Conv" else numel_or_zero(in_shapes[0])
        return 2.0 * base * per_out
    if family(op_type) in ("softmax", "norm"):
        return 8.0 * out
    return float(out)


def curve_rate(curve: OpCurve, size: float) -> float:
    """The curve's rate at ``size``: log-log interpolation, constant beyond the ends."""
    sizes = [p[0] for p in curve.points]
    rates = [p[1] for p in curve.points]
    if size <= sizes[0] or len(sizes) == 1:
        return rates[0]
    if size >= sizes[-1]:
        return rates[-1]
    return float(np.exp(np.interp(np.log(size), np.log(sizes), np.log(rates))))


def contraction_rows(op_type: str, attrs, in_shapes) -> float:
    """Output rows of the GEMM a contraction runs (what its packing cost is shared by).

    MatMul with a 2-D (shared) B folds A's batch dimensions into the rows; batched
    B keeps one GEMM per batch, of A's last-but-one dimension. Gemm: M (after transA).
    """
    a = list(in_shapes[0] or []) if in_shapes else []
    if not a:
        return 1.0
    if op_type == "Gemm":
        return float(a[-1] if attrs.get("transA", 0) else a[0])
    b = list(in_shapes[1] or []) if len(in_shapes) > 1 else []
    if len(a) == 1:
        return 1.0
    if len(b) <= 2:
        return numel(a[:-1])
    return float(a[-2])


def conv_key(attrs, in_shapes, out_shapes) -> tuple[float, float, int]:
    """(channels, output positions, kernel side) of a Conv's local shard.

    channels = sqrt(Cin * Cout) / group (the calibrated cases have Cin = Cout);
    positions = batch x output spatial size (the N of the GEMM a convolution is);
    kernel side = the larger kernel dimension (1 for a pointwise convolution).
    """
    w = list(in_shapes[1] or []) if len(in_shapes) > 1 else []
    out = list(out_shapes[0] or []) if out_shapes else []
    if len(w) < 3 or len(out) < 3:
        return 1.0, 1.0, 1
    group = float(attrs.get("group", 1))
    cin = float(w[1]) * group
    channels = math.sqrt(cin * float(w[0])) / group
    positions = float(out[0]) * numel(out[2:])
    return channels, positions, int(max(w[2:]))


# Ops whose forward + backward time a calibrated profile measures inside a training
# step against their shape (``op_train_grids``), by the grid's name.
TRAIN_FAMILIES = {
    "MatMul": "matmul",
    "Gemm": "matmul",
    "Conv": "conv",
    "BatchNormalization": "batchnorm",
}


# Inputs whose SGD-momentum update a training-step grid entry already holds: the
# calibrated cases train exactly these (MatMul's B, Conv's W, BatchNorm's scale and
# bias; Gemm's bias C and Conv's bias are not in the cases and are charged as usual).
_GRID_PARAM_SLOTS = {"MatMul": (1,), "Gemm": (1,), "Conv": (1,), "BatchNormalization": (1, 2)}
GRID_UPDATE_STATES = 1  # the cases' optimizer: SGD with momentum (one state)


def _grid_slices(op_type: str, profile: ClusterProfile):
    """The profile's training-step grid slices for ``op_type`` (empty: none)."""
    return profile.op_train_grids.get(TRAIN_FAMILIES.get(op_type, ""), ())


def grid_update_slots(op_type: str, profile: ClusterProfile) -> tuple[int, ...]:
    """Input slots of ``op_type`` whose optimizer update ``op_time`` already charges
    (through the profile's training-step grid); () when it has none for the op."""
    return _GRID_PARAM_SLOTS.get(op_type, ()) if _grid_slices(op_type, profile) else ()


def train_key(op_type: str, attrs, in_shapes, out_shapes, flops: float):
    """(kernel side, first key, second key) of an op's training-step grid, or None.

    MatMul and Gemm: (1, GEMM rows, sqrt(K * N)); Conv: :func:`conv_key`;
    BatchNormalization: (1, channels, batch x spatial positions)."""
    if op_type == "Conv":
        channels, positions, kernel = conv_key(attrs, in_shapes, out_shapes)
        return kernel, channels, positions
    if op_type in ("MatMul", "Gemm"):
        rows = contraction_rows(op_type, attrs, in_shapes)
        return 1, rows, math.sqrt(flops / (2.0 * rows))
    if op_type == "BatchNormalization" and in_shapes and len(in_shapes[0] or []) >= 2:
        x = list(in_shapes[0])
        return 1, float(x[1]), float(x[0]) * numel(x[2:])
    return None


def _train_time(op_type, attrs, in_shapes, out_shapes, flops, profile) -> float | None:
    """Forward + backward seconds from the profile's training-step grid of the op, or
    None when it has none (then: forward curve x backward ratio)."""
    slices = _grid_slices(op_type, profile)
    key = train_key(op_type, attrs, in_shapes, out_shapes, flops) if slices else None
    if key is None or flops <= 0:
        return None
    kernel, first, second = key
    _, grid = min(slices, key=lambda s: abs(math.log(s[0] / max(kernel, 1))))
    return flops / grid.rate(first, second)


def _kernel_time(
    fam: str, flops: float, traffic: float, profile: ClusterProfile, op_type: str = ""
) -> float:
    """Forward seconds of one kernel of family ``fam`` (the op type's own curve first)."""
    curve = profile.op_curves.get(op_type) or profile.op_curves.get(fam)
    if curve is not None and curve.work == "flops":
        return max(flops / curve_rate(curve, flops), traffic / profile.memory_bandwidth)
    if curve is not None:
        return traffic / curve_rate(curve, traffic) if traffic > 0 else 0.0
    rate = profile.op_throughput.get(fam, profile.peak_flops * profile.efficiency)
    return max(flops / rate, traffic / profile.memory_bandwidth)


def masked_time(
    op_type: str, out_shapes: Sequence[Sequence[int]], masked: float, profile: ClusterProfile
) -> float:
    """Extra forward seconds of a Softmax whose input holds ``masked`` (a fraction) of
    masking scores (<= MASK_SCORE, as a causal attention mask adds): onnxruntime's CPU
    Softmax takes a slow path for every score whose exp underflows, measured ~8x its
    whole plain time at half the scores masked (calibrate: ``softmax_masked_s``)."""
    if op_type != "Softmax" or masked <= 0 or not out_shapes:
        return 0.0
    return masked * numel_or_zero(out_shapes[0]) * profile.softmax_masked_s


def op_time(
    op_type: str,
    attrs,
    in_shapes: Sequence[Sequence[int] | None],
    out_shapes: Sequence[Sequence[int]],
    itemsize: int,
    profile: ClusterProfile,
    masked: float = 0.0,
) -> float:
    """Forward + backward seconds of one op on its local shapes; ``masked``: the
    fraction of a Softmax's scores that a mask sets (:func:`masked_time`)."""
    if op_type in _FREE:
        return 0.0
    return _op_time(op_type, attrs, in_shapes, out_shapes, itemsize, profile) + masked_time(
        op_type, out_shapes, masked, profile
    )


def _op_time(op_type, attrs, in_shapes, out_shapes, itemsize: int, profile) -> float:
    flops, traffic = _work(op_type, attrs, in_shapes, out_shapes, itemsize)
    fam = family(op_type)
    trained = _train_time(op_type, attrs, in_shapes, out_shapes, flops, profile)
    if trained is not None:
        return max(trained, profile.op_floor_s)
    fwd = max(_kernel_time(fam, flops, traffic, profile, op_type), profile.op_floor_s)
    backward = profile.op_backward.get(op_type) or profile.op_backward.get(fam)
    if backward is not None:  # measured backward-to-forward ratio at this size
        size = flops if backward.work == "flops" else traffic
        return fwd * (1.0 + curve_rate(backward, max(size, 1.0)))
    # Without a measurement: a contraction's backward is two contractions of its size
    # (dX and dW); other ops' backward is taken as twice the forward traffic. Both 3x.
    return 3.0 * fwd


def forward_time(
    op_type: str,
    attrs,
    in_shapes: Sequence[Sequence[int] | None],
    out_shapes: Sequence[Sequence[int]],
    itemsize: int,
    profile: ClusterProfile,
    masked: float = 0.0,
) -> float:
    """Forward seconds of one op on its local shapes (a recomputed forward node): the
    forward part of :func:`op_time`, from the forward curves (a training-step grid holds
    forward and backward together)."""
    if op_type in _FREE:
        return 0.0
    flops, traffic = _work(op_type, attrs, in_shapes, out_shapes, itemsize)
    plain = max(_kernel_time(family(op_type), flops, traffic, profile, op_type), profile.op_floor_s)
    return plain + masked_time(op_type, out_shapes, masked, profile)


def _work(op_type: str, attrs, in_shapes, out_shapes, itemsize: int) -> tuple[float, float]:
    """(forward FLOPs, bytes read and written) of one op on its local shapes."""
    flops = forward_flops(op_type, attrs, in_shapes, out_shapes)
    traffic = itemsize * (
        sum(numel_or_zero(s) for s in in_shapes) + sum(numel_or_zero(s) for s in out_shapes)
    )
    return flops, traffic


# The optimizer update as passes/optimizer.py emits it, one element-wise op at a time
# (nothing fuses them): (ops, element accesses per parameter element) by state count.
# Plain SGD: Mul(lr, g), Sub(p, .) -> 2 ops, 2 + 3 accesses. Momentum: Mul(mu, m),
# Add(., g), Mul(lr, .), Sub(p, .) -> 4 ops, 10. Adam: 19 ops (moments, squares, bias
# corrections on scalars, Sqrt, Div, the step), 33 accesses.
_UPDATE_OPS = {0: (2, 5), 1: (4, 10), 2: (19, 33)}


def update_time(param_elements: float, states: int, itemsize: int, profile) -> float:
    """Optimizer update of a parameter shard: memory-bound element-wise ops.

    Charged op by op as emitted (``_UPDATE_OPS``): each reads and writes whole
    tensors, so the traffic is 2x (momentum) to 4.7x (Adam) that of a fused update
    that touches param, grad and state once; each op costs at least the op floor."""
    ops, accesses = _UPDATE_OPS[states]
    traffic = itemsize * param_elements * accesses
    curve = profile.op_curves.get("elementwise")
    per_op = traffic / ops
    bandwidth = profile.memory_bandwidth if curve is None else curve_rate(curve, per_op)
    return max(traffic / bandwidth, ops * profile.op_floor_s)


def accumulate_time(param_elements: float, micro: int, itemsize: int, profile) -> float:
    """Gradient accumulation over ``micro`` micro-batches, as the runtime does it
    (``runtime.micro.accumulate``): a copy of the first micro-batch's gradient (2
    accesses per element), then one in-place add per further micro-batch (3: read both,
    write the sum), each a memory-bound element-wise pass over the gradient."""
    if micro <= 1:
        return 0.0
    curve = profile.op_curves.get("elementwise")

    def one(accesses: int) -> float:
        traffic = itemsize * param_elements * accesses
        bandwidth = profile.memory_bandwidth if curve is None else curve_rate(curve, traffic)
        return max(traffic / bandwidth, profile.op_floor_s)

    return one(2) + (micro - 1) * one(3)
