"""Compute time of one op's local shard, forward plus backward (a roofline).

time = sum over kernels of max(flops / rate, bytes / memory bandwidth, floor), where
rate is the profile's measured throughput for the op's family when it has one
(a calibrated profile), else peak FLOP/s times efficiency. A calibrated profile
with measured rate-vs-size curves (``op_curves``) replaces the family's term by
the time the curve gives at the op's size, interpolated log-log between measured
sizes: FLOPs / FLOP/s for matmul and conv, bytes / bytes/s for memory-bound
families (small kernels are slower per FLOP and per byte), and a measured
backward-to-forward ratio curve (``op_backward``) replaces the fixed 2x below.
A measured rate grid of a contraction family (``op_grids``: FLOP/s against the
GEMM's rows and operand side, see :class:`~tensoropt.cost.cluster.RateGrid`) is
preferred over its curve: a MatMul's rate depends on its shape, not only its FLOPs.
The backward of a
contraction (MatMul, Gemm, Conv) is two contractions of the same size; the
backward of other ops is taken as twice the forward traffic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tensoropt.cost.cluster import ClusterProfile, OpCurve

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
# Ops that move no data on a device (views, shape arithmetic).
_FREE = frozenset(
    {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Constant", "Size"}
)


def family(op_type: str) -> str:
    return _FAMILIES.get(op_type, "elementwise")


def _numel(shape: Sequence[int] | None) -> float:
    return 0.0 if shape is None else float(np.prod(shape, dtype=np.float64))


def forward_flops(op_type: str, attrs, in_shapes, out_shapes) -> float:
    """FLOPs of the forward op on these (local) shapes."""
    out = _numel(out_shapes[0]) if out_shapes else 0.0
    if op_type == "MatMul" and in_shapes[0]:
        return 2.0 * out * in_shapes[0][-1]
    if op_type == "Gemm" and in_shapes[0]:
        k = in_shapes[0][0] if attrs.get("transA", 0) else in_shapes[0][-1]
        return 2.0 * out * k
    if op_type in ("Conv", "ConvTranspose") and in_shapes[1]:
        w = in_shapes[1]
        per_out = float(np.prod(w[1:], dtype=np.float64))
        base = out if op_type == "Conv" else _numel(in_shapes[0])
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
        return float(np.prod(a[:-1], dtype=np.float64))
    return float(a[-2])


def _kernel_time(
    fam: str, flops: float, traffic: float, profile: ClusterProfile, rows: float = 0.0
) -> float:
    """Forward seconds of one kernel of family ``fam`` (``rows``: see contraction_rows)."""
    grid = profile.op_grids.get(fam)
    if grid is not None and rows > 0 and flops > 0:
        side = math.sqrt(flops / (2.0 * rows))  # sqrt(K * N)
        return max(flops / grid.rate(rows, side), traffic / profile.memory_bandwidth)
    curve = profile.op_curves.get(fam)
    if curve is not None and curve.work == "flops":
        return max(flops / curve_rate(curve, flops), traffic / profile.memory_bandwidth)
    if curve is not None:
        return traffic / curve_rate(curve, traffic) if traffic > 0 else 0.0
    rate = profile.op_throughput.get(fam, profile.peak_flops * profile.efficiency)
    return max(flops / rate, traffic / profile.memory_bandwidth)


def op_time(
    op_type: str,
    attrs,
    in_shapes: Sequence[Sequence[int] | None],
    out_shapes: Sequence[Sequence[int]],
    itemsize: int,
    profile: ClusterProfile,
) -> float:
    """Forward + backward seconds of one op on its local shapes."""
    if op_type in _FREE:
        return 0.0
    flops = forward_flops(op_type, attrs, in_shapes, out_shapes)
    traffic = itemsize * (sum(_numel(s) for s in in_shapes) + sum(_numel(s) for s in out_shapes))
    fam = family(op_type)
    rows = contraction_rows(op_type, attrs, in_shapes) if fam == "matmul" else 0.0
    fwd = max(_kernel_time(fam, flops, traffic, profile, rows), profile.op_floor_s)
    backward = profile.op_backward.get(fam)
    if backward is not None:  # measured backward-to-forward ratio at this size
        size = flops if backward.work == "flops" else traffic
        return fwd * (1.0 + curve_rate(backward, max(size, 1.0)))
    # Without a measurement: a contraction's backward is two contractions of its size
    # (dX and dW); other ops' backward is taken as twice the forward traffic. Both 3x.
    return 3.0 * fwd


def update_time(param_elements: float, states: int, itemsize: int, profile) -> float:
    """Optimizer update of a parameter shard: memory-bound over param, grad and state."""
    traffic = itemsize * param_elements * (2 + 2 * states + 1)
    curve = profile.op_curves.get("elementwise")
    bandwidth = profile.memory_bandwidth if curve is None else curve_rate(curve, traffic)
    return max(traffic / bandwidth, profile.op_floor_s)
