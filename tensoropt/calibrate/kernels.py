"""Per-op-family compute rates of onnxruntime on this machine (``tensoropt calibrate``).

Each case is one op on fixed shapes. It is measured as the slope between a model
holding the op once and a model holding it R times (a chain when the op keeps its
input shape, else R independent copies of the op): ``(t(R) - t(1)) / (R - 1)``. The
slope is the time of one kernel inside a graph, without the fixed cost of one
``session.run`` call, which is what the cost model adds up per op. FLOPs and bytes
of a case come from :mod:`tensoropt.cost.compute` itself, so a measured rate
means exactly what ``op_time`` divides by.

Sessions use the runtime's options (:class:`~tensoropt.runtime.program.SessionConfig`)
with the intra-op thread count pinned to what one rank gets.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tensoropt.calibrate.stats import (
    STEADY_SPREAD,
    Sample,
    evict_caches,
    steady_sample,
    time_call,
)
from tensoropt.cost.compute import family, forward_flops
from tensoropt.runtime.lowering import lower_row_sums
from tensoropt.runtime.program import SessionConfig

CONTRACTIONS = ("matmul", "conv")
# Element-wise ops whose backward differs most from an Add's: each gets its own forward
# curve and backward ratio (the zoo's activations; backward ratios measured 0.05 to 8).
OWN_CURVE_OPS = ("Relu", "Mul", "Sigmoid", "Tanh", "Gelu")
# Shape grids of the training-step rates (cost.cluster: op_train_grids)
GRID_ROWS = (16, 64, 256, 1024)
GRID_SIDES = (64, 256, 1024)
QUICK_GRID = ((16, 64, 256), (64, 512))
# Conv: channels (Cin = Cout) x spatial side (positions = batch x side^2) x kernel size
CONV_BATCH = 8
CONV_GRID = ((8, 32, 128), (1, 2, 4, 16, 32), (1, 3))
QUICK_CONV_GRID = ((8, 32, 128), (2, 4, 16), (1, 3))
_ITEMSIZE = 4  # float32


@dataclass(frozen=True, slots=True)
class KernelCase:
    """One op on fixed shapes; ``chain`` when the output can feed the next copy."""

    op_type: str
    shapes: tuple[tuple[int, ...], ...]  # data input first, then parameters
    out_shape: tuple[int, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    chain: bool = True

    @property
    def family(self) -> str:
        return family(self.op_type)

    @property
    def flops(self) -> float:
        return forward_flops(self.op_type, dict(self.attrs), self.shapes, [self.out_shape])

    @property
    def traffic(self) -> float:
        elements = sum(math.prod(s) for s in self.shapes) + math.prod(self.out_shape)
        return float(_ITEMSIZE * elements)

    @property
    def curve_key(self) -> str:
        """The profile's curve this case measures: its op type's own, or its family's."""
        return self.op_type if self.op_type in OWN_CURVE_OPS else self.family

    @property
    def work(self) -> float:
        """What the family's rate is per: FLOPs for contractions, bytes otherwise."""
        return self.flops if self.family in CONTRACTIONS else self.traffic

    def label(self) -> str:
        dims = " x ".join("x".join(map(str, s)) for s in self.shapes)
        return f"{self.op_type} {dims}"


@dataclass(frozen=True, slots=True)
class KernelResult:
    case: KernelCase
    seconds: Sample  # one kernel, inside a graph
    copies: int = 1  # R of the slope
    step: Sample | None = None  # one copy's forward + backward + update in a step graph

    @property
    def rate(self) -> float:
        """Work per second (FLOP/s or bytes/s)."""
        return self.case.work / self.seconds.median


def _matmul(m: int, k: int) -> KernelCase:
    return KernelCase("MatMul", ((m, k), (k, k)), (m, k))


def _conv(n: int, c: int, hw: int, kernel: int) -> KernelCase:
    pad = kernel // 2
    attrs = (("kernel_shape", (kernel, kernel)), ("pads", (pad,) * 4))
    return KernelCase("Conv", ((n, c, hw, hw), (c, c, kernel, kernel)), (n, c, hw, hw), attrs)


def _same(op: str, shape: tuple[int, ...], *params: tuple[int, ...], attrs=()) -> KernelCase:
    return KernelCase(op, (shape, *params), shape, attrs)


def _rows(n: int) -> tuple[int, int]:
    cols = min(n, 1024)
    return (max(1, n // cols), cols)


def cases(quick: bool) -> tuple[KernelCase, ...]:
    """The measured shapes: MatMul, Conv and BatchNorm on shape grids, memory-bound ops
    from 256 to 4M elements (the activations at three sizes), MaxPool."""
    # MatMul on the grid of rows x operand side (cost.cluster.RateGrid), plus the
    # squares in between for the FLOP-keyed curve and the backward ratios
    rows, sides = QUICK_GRID if quick else (GRID_ROWS, GRID_SIDES)
    out = [_matmul(m, k) for m in rows for k in sides]
    out += [_matmul(n, n) for n in ([] if quick else [32, 128, 512])]
    # Conv on the grid of channels x output positions x kernel size, measured as
    # training steps too (cost.cluster: op_train_grids)
    channels, sides, sizes = QUICK_CONV_GRID if quick else CONV_GRID
    out += [_conv(CONV_BATCH, c, hw, k) for k in sizes for c in channels for hw in sides]
    elems = (
        [1 << 10, 1 << 16, 1 << 20]
        if quick
        else [1 << 8, 1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
    )
    for n in elems:
        rows, cols = _rows(n)
        # 2-D like the others: the training step's ONNX shape inference with data
        # propagation took 7 GB on the step of a 1-D Add of 4M elements (4 copies),
        # 0.35 GB on the same Add as 4096 x 1024
        out.append(_same("Add", (rows, cols), (rows, cols)))
        if n in (1 << 12, 1 << 16, 1 << 20):
            out += [_same(op, (rows, cols), *([(rows, cols)] if op == "Mul" else []))
                    for op in OWN_CURVE_OPS]  # fmt: skip
        out.append(_same("Softmax", (rows, cols), attrs=(("axis", -1),)))
        out.append(
            _same("LayerNormalization", (rows, cols), (cols,), (cols,), attrs=(("axis", -1),))
        )
        out.append(KernelCase("ReduceMean", ((rows, cols),), (rows, 1), chain=False))
    # inference-form BatchNorm, as the zoo's CNNs use it, on the conv grid's
    # channels x positions (cost.cluster: op_train_grids["batchnorm"])
    channels, sides, _ = QUICK_CONV_GRID if quick else CONV_GRID
    for c in channels:
        for hw in sides:
            shape = (CONV_BATCH, c, hw, hw)
            out.append(_same("BatchNormalization", shape, *[(c,)] * 4))
    pools = [(8, 16, 16)] if quick else [(8, 16, 32), (8, 64, 16), (16, 64, 32)]
    pool_attrs = (("kernel_shape", (3, 3)), ("pads", (1, 1, 1, 1)))
    out += [_same("MaxPool", (n, c, hw, hw), attrs=pool_attrs) for n, c, hw in pools]
    return tuple(out)


def floor_case() -> KernelCase:
    """The smallest kernel: its time is the per-op floor of the cost model."""
    return _same("Relu", (4,))


def _value(name: str, shape: Sequence[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def build_model(case: KernelCase, copies: int) -> onnx.ModelProto:
    """``copies`` of the op: chained through the first input, or side by side.

    Every copy reads its own parameter tensors (weights, the second operand of an
    Add), as the ops of a training step do: a chain that reused one weight would
    run from cache and measure a rate no real graph sees.
    """
    rng = np.random.default_rng(0)
    params: list[onnx.TensorProto] = []
    tail: list[str] = []  # constant inputs every copy shares (the reduction axes)
    if case.op_type.startswith("Reduce"):
        params.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
        tail.append("axes")
    nodes, outputs = [], []
    prev = "x"
    for i in range(copies):
        names = []
        for j, shape in enumerate(case.shapes[1:]):
            value = (rng.standard_normal(shape) * 0.1).astype(np.float32)
            params.append(numpy_helper.from_array(value, f"p{i}_{j}"))
            names.append(f"p{i}_{j}")
        out = f"y{i}"
        source = prev if case.chain else "x"
        node = helper.make_node(case.op_type, [source, *names, *tail], [out], name=f"op{i}")
        for key, value in case.attrs:
            node.attribute.append(helper.make_attribute(key, value))
        nodes.append(node)
        prev = out
        if not case.chain:
            outputs.append(_value(out, case.out_shape))
    if case.chain:
        outputs = [_value(prev, case.out_shape)]
    graph = helper.make_graph(nodes, "kernel", [_value("x", case.shapes[0])], outputs, params)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def session(model: onnx.ModelProto, config: SessionConfig) -> ort.InferenceSession:
    """A CPU session of ``model`` with the runtime's options (``config``), in the form the
    runtime gives onnxruntime (:mod:`tensoropt.runtime.lowering`)."""
    return ort.InferenceSession(
        lower_row_sums(model).SerializeToString(),
        config.options(),
        providers=["CPUExecutionProvider"],
    )


def _runner(sess: ort.InferenceSession, x: np.ndarray) -> Callable[[], object]:
    names = [o.name for o in sess.get_outputs()]
    feeds = {"x": x}
    return lambda: sess.run(names, feeds)


@dataclass(frozen=True, slots=True)
class KernelOptions:
    threads: int
    repeats: int = 5
    block_seconds: float = 0.04  # minimum length of one timed block of calls
    chain_target_s: float = 4e-3  # aim for R copies to take about this long
    cold: bool = True  # evict the caches before every timed call (see time)
    cold_calls: int = 48  # at most this many calls per timed block when cold
    extra_repeats: int = 1  # up to repeats x (1 + this) when a case's spread is high
    # The forward kernel alone is timed with shorter blocks and no extra repeats (None:
    # as the step). The cost model prices a non-grid op's training step as forward x (1 +
    # backward ratio), and the ratio is measured as (step - forward - update) / forward,
    # so at a calibrated size the forward's own error cancels; grid ops (MatMul, Conv,
    # BatchNorm) take the step alone. The forward matters for a recomputed node
    # (cost.compute.forward_time) and between calibrated sizes.
    forward_block_seconds: float | None = None
    forward_cold_calls: int | None = None

    @property
    def max_repeats(self) -> int:
        """Repeats of a disturbed case (:func:`~tensoropt.calibrate.stats.steady_sample`)."""
        return self.repeats * (1 + self.extra_repeats)

    def forward(self) -> KernelOptions:
        """The options a case's forward kernel is timed with (see ``forward_block_seconds``)."""
        if self.forward_block_seconds is None:
            return self
        return dataclasses.replace(
            self,
            block_seconds=self.forward_block_seconds,
            cold_calls=self.forward_cold_calls or self.cold_calls,
            extra_repeats=0,
        )

    def time(self, fn: Callable[[], object], min_seconds: float) -> float:
        """Seconds per call of ``fn`` (:func:`~tensoropt.calibrate.stats.time_call`).

        Cold (the default), every call starts on evicted caches, as an op inside a
        training step does whose model's working set exceeds the cache: measured
        here, warm-cache rates under-estimated whole steps by 12-39% on one rank
        (docs/design/measured.md, "Cold caches").
        """
        if not self.cold:
            return time_call(fn, min_seconds=min_seconds, clock=self.clock)
        return time_call(
            fn, min_seconds=min_seconds, max_calls=self.cold_calls, clock=self.clock,
            before=evict_caches,
        )  # fmt: skip

    def slope(self, one: Callable[[], object], many: Callable[[], object], copies: int):
        """(seconds per extra copy, seconds of ``one``): a timed block of ``one`` (a
        graph holding the op once) and of ``many`` (``copies`` times); the difference
        leaves the op's own time, without ``session.run``'s fixed cost."""
        t1 = self.time(one, self.block_seconds)
        tr = self.time(many, self.block_seconds)
        return max((tr - t1) / (copies - 1), 1e-9), t1

    @property
    def clock(self) -> Callable[[], float]:
        """This thread's CPU time when onnxruntime runs on the calling thread alone
        (one intra-op thread): a busy machine then cannot slow the measurement; wall
        time otherwise (worker threads' CPU is not this thread's)."""
        return time.thread_time if self.threads == 1 else time.perf_counter

    @property
    def clock_name(self) -> str:
        return "thread_cpu" if self.threads == 1 else "wall"


def measure_case(
    case: KernelCase, opts: KernelOptions, x: np.ndarray | None = None
) -> tuple[KernelResult, Sample]:
    """(per-kernel time, per-``session.run`` overhead) of one case; its input ``x``
    (standard normal when not given)."""
    config = SessionConfig(intra_op_threads=opts.threads)
    if x is None:
        x = np.random.default_rng(1).standard_normal(case.shapes[0]).astype(np.float32)
    one = _runner(session(build_model(case, 1), config), x)
    for _ in range(3):
        one()  # warm-up: arena growth, first-run kernel selection
    first = opts.time(one, opts.block_seconds / 4)
    copies = int(min(64, max(4, round(opts.chain_target_s / max(first, 1e-7)))))
    many = _runner(session(build_model(case, copies), config), x)
    for _ in range(3):
        many()
    overhead = []

    def slope() -> float:
        per_op, t1 = opts.slope(one, many, copies)
        overhead.append(max(t1 - per_op, 0.0))
        return per_op

    per_op = steady_sample(slope, opts.repeats, opts.max_repeats)
    return KernelResult(case, per_op, copies), Sample.of(overhead)


# Masked Softmax cases: (rows, scores per row) with a causal mask over each square block
# of rows; two row lengths, as the slow path's cost per masked score differs with it
# (measured 5.6 ns at 64, 4.0 ns at 256 on the development VM)
MASKED_SOFTMAX = ((4096, 64), (1024, 256))
MASK_FILL = -1e9  # what the zoo's causal mask adds (models.transformer)


def causal_scores(rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Standard normal scores [rows, cols] with every square block of ``cols`` rows
    causally masked (above the diagonal set to MASK_FILL); and the masked count."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    blocks = x.reshape(-1, cols, cols)
    above = np.triu(np.ones((cols, cols), dtype=bool), k=1)
    blocks[:, above] = MASK_FILL
    return x, int(above.sum()) * blocks.shape[0]


def measure_masked_softmax(opts: KernelOptions) -> Sample:
    """Extra forward seconds per masked score of a Softmax (``softmax_masked_s``): the
    kernel on causally masked scores less the same kernel on plain ones, per masked
    score, one sample per row length of MASKED_SOFTMAX. The copies stand side by side
    on one input, so the input's values reach every copy (a chain would feed the next
    copy probabilities, which are never masked)."""
    per_score = []
    for rows, cols in MASKED_SOFTMAX:
        case = KernelCase("Softmax", ((rows, cols),), (rows, cols), (("axis", -1),), chain=False)
        masked, count = causal_scores(rows, cols, np.random.default_rng(3))
        plain = np.random.default_rng(3).standard_normal((rows, cols)).astype(np.float32)
        slow, _ = measure_case(case, opts, masked)
        fast, _ = measure_case(case, opts, plain)
        per_score.append(masked_excess(slow.seconds, fast.seconds) / count)
    return Sample.of(per_score)


def masked_excess(slow: Sample, fast: Sample) -> float:
    """Seconds the masked kernel takes over the plain one; 0 where the difference is
    within what separates two steady timings of one kernel (either timing's IQR, and at
    least STEADY_SPREAD of the plain one), i.e. where no slow path shows. Where the slow
    path is absent (onnxruntime 1.32 on the AMD host: 4096 x 64 scores 72.4 us masked
    and 72.5 plain), the difference of two equal timings is noise, and as a rate it
    moved 2.3x between two calibrations in a row; where it is present the masked kernel
    took several times the plain one (827 against 108 us)."""
    excess = slow.median - fast.median
    noise = max(slow.spread * slow.median, fast.spread * fast.median, STEADY_SPREAD * fast.median)
    return excess if excess > noise else 0.0
