"""Synthetic transformer-shaped cost problems, for benchmarks and tests of the search.

Not a cost model: it imitates the *structure* of one (units per layer, strategies from
placements per mesh axis, redistribution tables from an alpha-beta model, memory from
parameter / gradient / Adam state and activation shards) so that the solver can be measured
on problems that look like real ones. Times are rounded to multiples of 2**-32 s and memory
to whole bytes, so sums of a few thousand terms are exact in float64 and solvers can be
compared by equality.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from tensoropt.ir.costs import BlockHint, CostProblem, Edge, Strategy, Unit

R, B, H, P = (
    0,
    1,
    2,
    3,
)  # placement of a tensor on one mesh axis: replicated, batch, hidden, partial
_NAMES = {R: "R", B: "S(0)", H: "S(2)", P: "P"}
_PEAK = 100e12  # flop/s
_ALPHA = 5e-6  # s per collective
_BW = (25e9, 150e9)  # bytes/s of mesh axis 0 (across nodes) and axis >= 1 (inside a node)

# option -> (input placement, output placement, splits compute, splits weights);
# "Z" is data parallel with gradients and Adam state sharded over the axis (ZeRO).
_OPTIONS = {
    "matmul": {
        "R": (R, R, False, False),
        "B": (B, B, True, False),
        "Z": (B, B, True, False),
        "C": (R, H, True, True),
        "K": (H, P, True, True),
    },
    "bmm": {"R": (R, R, False, False), "B": (B, B, True, False), "H": (H, H, True, False)},
    "elementwise": {"R": (R, R, False, False), "B": (B, B, True, False), "H": (H, H, True, False)},
}
# kinds that may recompute their activations in the backward pass (less memory, more time)
_RECOMPUTE = ("bmm",)
# (name, kind, flops factor, params factor) of one layer, in order
_LAYER = (
    ("ln1", "elementwise", 0.0, 0.0),
    ("qkv", "matmul", 3.0, 3.0),
    ("scores", "bmm", 1.0, 0.0),
    ("softmax", "elementwise", 0.0, 0.0),
    ("ctx", "bmm", 1.0, 0.0),
    ("proj", "matmul", 1.0, 1.0),
    ("add1", "elementwise", 0.0, 0.0),
    ("ln2", "elementwise", 0.0, 0.0),
    ("fc1", "matmul", 4.0, 4.0),
    ("gelu", "elementwise", 0.0, 0.0),
    ("fc2", "matmul", 4.0, 4.0),
    ("add2", "elementwise", 0.0, 0.0),
)
# edges inside a layer (src, dst) by name, plus residual stream edges
_INNER = (
    ("ln1", "qkv"),
    ("qkv", "scores"),
    ("scores", "softmax"),
    ("softmax", "ctx"),
    ("qkv", "ctx"),
    ("ctx", "proj"),
    ("proj", "add1"),
    ("add1", "ln2"),
    ("ln2", "fc1"),
    ("fc1", "gelu"),
    ("gelu", "fc2"),
    ("fc2", "add2"),
    ("add1", "add2"),
)
_FROM_PREV = (("add2", "ln1"), ("add2", "add1"))


@dataclass(frozen=True, slots=True)
class _Op:
    name: str
    kind: str
    flops: float
    params: float  # bytes of weights
    act: float  # bytes of the output activation
    options: tuple[tuple[str, ...], ...]  # one option name per mesh axis, per strategy
    recompute: tuple[bool, ...]  # per strategy


def _q_time(t: float) -> float:
    return round(t * 2**32) / 2**32


def _op(name: str, kind: str, fl: float, pa: float, mesh: tuple[int, ...], dims: dict) -> _Op:
    tokens, hidden, jitter = dims["tokens"], dims["hidden"], dims["jitter"]
    flops = 6.0 * tokens * hidden * hidden * fl + 10.0 * tokens * hidden
    # replicating a matmul across an axis is never worth it: offer R only on size-1 axes
    wide = tuple(o for o in _OPTIONS[kind] if o != "R" or kind == "elementwise")
    per_axis = [wide if n > 1 else ("R",) for n in mesh]
    flags = (False, True) if kind in _RECOMPUTE else (False,)
    combos = list(itertools.product(itertools.product(*per_axis), flags))
    act = 2.0 * tokens * hidden * (4.0 if name in ("fc1", "gelu") else 1.0)
    if kind == "bmm":
        act *= 4.0  # attention scores are large
    return _Op(
        name,
        kind,
        flops * jitter[name],
        2.0 * hidden * hidden * pa,
        act * jitter[name],
        tuple(c[0] for c in combos),
        tuple(c[1] for c in combos),
    )


def _unit(op: _Op, mesh: tuple[int, ...]) -> Unit:
    strategies = []
    for opt, recompute in zip(op.options, op.recompute, strict=True):
        split = wsplit = zsplit = 1
        comm = 0.0
        for n, o, ax in zip(mesh, opt, range(len(mesh)), strict=True):
            _, _, cs, ws = _OPTIONS[op.kind][o]
            split *= n if cs else 1
            wsplit *= n if ws else 1
            zsplit *= n if o == "Z" else 1
            if o in "BZ" and op.params:  # gradient AllReduce (or ReduceScatter + AllGather)
                extra = 1.15 if o == "Z" else 1.0
                comm += extra * (2 * _ALPHA + 2 * (n - 1) / n * op.params / _BW[min(ax, 1)])
        t = op.flops / split / _PEAK * (1.5 if recompute else 1.0) + comm + 1e-6
        mem = op.params / wsplit + 3.0 * op.params / (wsplit * zsplit)
        mem += op.act / split * (0.25 if recompute else 1.0)
        label = "".join(_NAMES[_OPTIONS[op.kind][o][1]] for o in opt) + ("+rc" if recompute else "")
        strategies.append(Strategy(label, _q_time(t), float(round(mem))))
    return Unit(op.name, tuple(strategies))


def _redistribute(src: int, dst: int, n: int, nbytes: float, ax: int) -> float:
    bw = _BW[min(ax, 1)]
    if src in (dst, R):
        return 0.0
    if src == P:
        if dst == R:
            return 2 * _ALPHA + 2 * (n - 1) / n * nbytes / bw
        return _ALPHA + (n - 1) / n * nbytes / bw
    if dst == R:
        return _ALPHA + (n - 1) / n * nbytes / bw
    return _ALPHA + (n - 1) / n / n * nbytes / bw


def _edge(a: int, b: int, src: _Op, dst: _Op, mesh: tuple[int, ...]) -> Edge:
    ts, ms = [], []
    for so in src.options:
        trow, mrow = [], []
        for do in dst.options:
            t = mem = 0.0
            outs = [_OPTIONS[src.kind][o][1] for o in so]
            local = src.act / math.prod(n for n, p in zip(mesh, outs, strict=True) if p in (B, H))
            for ax, (n, o_out, o_in) in enumerate(zip(mesh, outs, do, strict=True)):
                c = _redistribute(o_out, _OPTIONS[dst.kind][o_in][0], n, local, ax)
                t += 2 * c  # forward and backward
                mem += local if c else 0.0
            trow.append(_q_time(t))
            mrow.append(float(round(mem)))
        ts.append(tuple(trow))
        ms.append(tuple(mrow))
    return Edge(a, b, tuple(ts), tuple(ms))


def transformer_problem(
    layers: int,
    mesh: tuple[int, ...],
    *,
    hidden: int = 4096,
    tokens: int = 8192,
    seed: int = 0,
    hint: bool = False,
) -> CostProblem:
    """A decoder stack: embedding, `layers` identical 12-unit layers, final LN, head."""
    rng = random.Random(seed)
    jitter = {name: rng.uniform(0.8, 1.25) for name, *_ in _LAYER}
    jitter.update(embed=1.0, lnf=1.0, head=1.0)
    dims = {"tokens": tokens, "hidden": hidden, "jitter": jitter}
    ops = [_op("embed", "elementwise", 0.0, 12.0, mesh, dims)]
    for _ in range(layers):
        ops += [_op(n, k, f, p, mesh, dims) for n, k, f, p in _LAYER]
    ops += [
        _op("lnf", "elementwise", 0.0, 0.0, mesh, dims),
        _op("head", "matmul", 12.0, 12.0, mesh, dims),
    ]
    units = tuple(_unit(op, mesh) for op in ops)
    index = {name: j for j, (name, *_) in enumerate(_LAYER)}
    pairs: list[tuple[int, int]] = [(0, 1 + index["ln1"]), (0, 1 + index["add1"])]
    for layer in range(layers):
        base = 1 + layer * len(_LAYER)
        pairs += [(base + index[s], base + index[d]) for s, d in _INNER]
        if layer:
            prev = base - len(_LAYER)
            pairs += [(prev + index[s], base + index[d]) for s, d in _FROM_PREV]
    last = 1 + (layers - 1) * len(_LAYER) + index["add2"]
    pairs += [(last, len(ops) - 2), (len(ops) - 2, len(ops) - 1)]
    edges = tuple(_edge(a, b, ops[a], ops[b], mesh) for a, b in pairs)
    blocks = (BlockHint(1, len(_LAYER), layers),) if hint and layers >= 3 else ()
    return CostProblem(units, edges, math.prod(mesh), mesh, blocks)


MESHES = {1: (1,), 2: (2,), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8)}
