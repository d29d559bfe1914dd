"""Pipeline stages: the exact frontier over contiguous stage cuts (1F1B pricing).

A pipelined plan cuts the forward graph, in its topological order, into p contiguous
stages at allowed cut positions 0 = c_0 < c_1 < ... < c_p = L; stage s holds the layers
[c_s, c_(s+1)) on a sub-mesh of its own, and every step runs m micro-batches under a
1F1B schedule. How one stage's layers are split over its sub-mesh is an intra-op plan
with a frontier of its own; this module combines those frontiers, exactly, over the
cuts.

Pricing of stage s under one of its intra-op plans (docs/design/pipeline.md):

    tau_s = (m + p - 1) * (f_s + b_s + x_s) + u_s
    mem_s = w_s + min(p - s, m) * a_s

with f_s + b_s its forward and backward time for one micro-batch, x_s the point-to-point
time of its boundary activations and gradients per micro-batch, u_s its once-per-step
work (gradient synchronisation, update), w_s its parameters, gradients and optimizer
state, and a_s the activations one micro-batch leaves for the backward. Under 1F1B every
stage runs m slots of work and p - 1 slots of bubble at the pace of its own slot, and
stage s holds at most min(p - s, m) micro-batches in flight (the first stage p). The
step's time is the largest tau_s and its memory per device the largest mem_s:

    T = max_s tau_s,    M = max_s mem_s.

Both compose by max, which is monotone, so a dynamic program over cut positions that
keeps, for every (stages used, position), the Pareto set of (max tau, max mem) of the
prefixes ending there is exact: a prefix that another prefix dominates can only lead to
completions that the same completion of the other dominates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from tensoropt.cost.pipeline import in_flight, stage_time
from tensoropt.search.frontier import prune_groups
from tensoropt.search.jit import compiled

__all__ = [
    "PipelinePoint",
    "Staircase",
    "in_flight",
    "pareto",
    "plan_frontier",
    "stage_frontier",
    "stage_time",
]

# a stage's intra-op points: (tau, mem, payload), payload identifying the intra-op plan
StagePoints = Sequence[tuple[float, float, Hashable]]


@dataclass(frozen=True, slots=True)
class PipelinePoint:
    """One point of the pipelined frontier: its step time, memory per device, the cut
    positions (c_0 = 0, ..., c_p = L) and the payload of each stage's intra-op plan."""

    time_s: float
    memory_bytes: float
    cuts: tuple[int, ...]
    plans: tuple[Hashable, ...]


def pareto(points: list[PipelinePoint]) -> list[PipelinePoint]:
    """The points no other point dominates (time ascending; of equal points the first)."""
    points.sort(key=lambda q: (q.time_s, q.memory_bytes))
    out: list[PipelinePoint] = []
    for q in points:
        if not out or q.memory_bytes < out[-1].memory_bytes:
            out.append(q)
    return out


class Staircase:
    """A Pareto set of (time, memory) points as two arrays, time ascending and memory
    descending (the incumbents of :func:`plan_frontier`)."""

    __slots__ = ("times", "memories")

    def __init__(self) -> None:
        self.times = np.empty(0)
        self.memories = np.empty(0)

    def add(self, points: Sequence[PipelinePoint]) -> None:
        """Join ``points`` (none of which a point already held equals or dominates)."""
        if not points:
            return
        times = np.concatenate([self.times, [q.time_s for q in points]])
        memories = np.concatenate([self.memories, [q.memory_bytes for q in points]])
        keep = prune_groups(np.zeros(times.size, dtype=np.int64), times, memories)
        self.times, self.memories = times[keep], memories[keep]


def stage_frontier(
    positions: Sequence[int],
    stages: int,
    frontier_of: Callable[[int, int, int], StagePoints],
) -> list[PipelinePoint]:
    """The exact (T, M) frontier over every way to cut ``positions`` (the allowed cut
    positions, first = 0 and last = L, increasing) into ``stages`` non-empty contiguous
    stages, each stage taking one of the points ``frontier_of(start, end, stage)`` of
    its own (already priced as tau_s, mem_s for that stage index; an empty sequence: the
    stage cannot hold that range). Time ascending."""
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    cut = list(positions)
    if len(cut) < stages + 1:
        return []
    n = len(cut)
    # best[k]: prefixes of s stages ending at cut[k]; s = 0: the empty prefix at cut[0]
    best: dict[int, list[PipelinePoint]] = {0: [PipelinePoint(0.0, 0.0, (cut[0],), ())]}
    for s in range(stages):
        last = s == stages - 1
        nxt: dict[int, list[PipelinePoint]] = {}
        ends = [n - 1] if last else range(s + 1, n - (stages - s - 1))
        for k in ends:
            found: list[PipelinePoint] = []
            for i, prefixes in best.items():
                if i >= k:
                    continue
                points = frontier_of(cut[i], cut[k], s)
                for pre in prefixes:
                    for tau, mem, payload in points:
                        found.append(
                            PipelinePoint(
                                max(pre.time_s, tau),
                                max(pre.memory_bytes, mem),
                                (*pre.cuts, cut[k]),
                                (*pre.plans, payload),
                            )
                        )
            if found:
                nxt[k] = pareto(found)
        best = nxt
    return best.get(n - 1, [])


def plan_frontier(
    positions: Sequence[int],
    taus: Sequence[np.ndarray],
    mems: Sequence[np.ndarray],
    payload: Hashable = None,
    memory_budget: float | None = None,
    incumbents: Staircase | None = None,
) -> list[PipelinePoint]:
    """:func:`stage_frontier` when every stage has one point (one intra-op plan):
    ``taus[s][i, k]`` and ``mems[s][i, k]`` price stage s over ``positions[i]`` to
    ``positions[k]`` (inf where it cannot hold them; read for i < k only). Points with
    memory above ``memory_budget`` are left out, and those a point of ``incumbents``
    equals or dominates (the frontier of the plans cut before this one: the Pareto set
    of all plans' points, first of equal points kept, is then the same). Time ascending.

    The same frontier, found by the epsilon-constraint method instead of Pareto sets per
    state: with the memory cap C (first the budget), a bottleneck dynamic program gives
    the least T* = max_s tau_s over the cuts whose stages all hold at most C; a second one
    gives the least M* = max_s mem_s over the cuts whose stages all take at most T* and
    hold at most C, and its cuts. (T*, M*) is a frontier point (no cut is faster within
    C, none holds less within T*), every frontier point is reached this way, and the
    next one has memory below M*: C becomes the float below M*. A plan costs (frontier
    points) x 2 P positions^2 compiled steps (`_sweep` and `_bottleneck`) where the
    Pareto sets cost P x positions^2 Python products per point of every set.

    With ``incumbents``, a point (T*, M*) that one of them equals or dominates is left
    out, and the cap drops below the least memory of the incumbents within T*: every
    later point is slower than T*, so it is left out too unless it holds less than that
    (the points of a plan whose cuts all lose cost a few sweeps, not one per point)."""
    stages = len(taus)
    n = len(positions)
    if stages < 1 or n < stages + 1:
        return []
    # a 3-D array (stage_grids) passes through uncopied; a list of 2-D ones is stacked
    tau = np.ascontiguousarray(taus, dtype=np.float64)
    mem = np.ascontiguousarray(mems, dtype=np.float64)
    cap = math.inf if memory_budget is None else float(memory_budget)
    inc = Staircase() if incumbents is None else incumbents
    times, memories, cuts = _sweep(tau, mem, cap, inc.times, inc.memories)
    at = list(positions)
    plans = (payload,) * stages
    return [
        PipelinePoint(t, m, tuple(at[c] for c in row), plans)
        for t, m, row in zip(times.tolist(), memories.tolist(), cuts.tolist(), strict=True)
    ]


@compiled()
def _sweep(tau, mem, cap, inc_times, inc_memories):
    """The epsilon-constraint loop of :func:`plan_frontier`: per frontier point that no
    incumbent (``inc_times`` ascending, ``inc_memories`` descending) equals or
    dominates, its time, memory (the largest stage entries of its cuts) and cut
    indices."""
    stages = tau.shape[0]
    times, memories, found = [], [], []
    while True:
        t_star = _bottleneck(tau, mem, tau, cap, math.inf)[0]
        if not math.isfinite(t_star):
            break
        m_star, cuts = _bottleneck(mem, mem, tau, cap, t_star)
        # the least memory of the incumbents within t_star: this point and every later
        # one (slower) must hold less to be kept
        within = np.searchsorted(inc_times, t_star, side="right")
        if within > 0 and inc_memories[within - 1] <= m_star:
            cap = np.nextafter(inc_memories[within - 1], -math.inf)
            continue
        time_s, memory = tau[0, cuts[0], cuts[1]], mem[0, cuts[0], cuts[1]]
        for s in range(1, stages):
            time_s = max(time_s, tau[s, cuts[s], cuts[s + 1]])
            memory = max(memory, mem[s, cuts[s], cuts[s + 1]])
        times.append(time_s)
        memories.append(memory)
        found.append(cuts)
        cap = np.nextafter(m_star, -math.inf)
    out = np.empty((len(found), stages + 1), dtype=np.int64)
    for r in range(len(found)):
        out[r] = found[r]
    return np.array(times), np.array(memories), out


@compiled()
def _bottleneck(cost, mem, tau, cap, t_limit):
    """The least max_s cost[s, c_s, c_(s+1)] over the cuts 0 = c_0 < ... < c_P = n - 1
    whose stages are all allowed (non-empty, mem <= cap, tau <= t_limit), and those cuts
    (inf and no cuts when there are none). Per stage and end position, the first start of
    the least value wins, as numpy's argmin picks it (compiled, no arrays). Only what a
    cut can use is read: the first stage starts at 0, stage s at s or later and ends at
    most n - P + s, the last ends at n - 1 (P n^2 steps at most, 2 n for P = 2)."""
    stages, n = cost.shape[0], cost.shape[1]
    best = np.full(n, np.inf)
    best[0] = 0.0  # costs are nonnegative: max(0, x) = x
    nxt = np.empty(n)
    back = np.zeros((stages, n), dtype=np.int64)
    for s in range(stages):
        nxt[:] = np.inf
        k_first = n - 1 if s == stages - 1 else s + 1
        for k in range(k_first, n - stages + s + 1):
            value, arg = np.inf, 0
            # best is inf before position s (s stages hold s segments at least), and
            # an inf start never wins: max(inf, x) < value is false
            for i in range(s, 1 if s == 0 else k):
                if mem[s, i, k] <= cap and tau[s, i, k] <= t_limit:
                    v = max(best[i], cost[s, i, k])
                    if v < value:
                        value, arg = v, i
            nxt[k] = value
            back[s, k] = arg
        best, nxt = nxt, best
    cuts = np.empty(stages + 1, dtype=np.int64)
    if not math.isfinite(best[n - 1]):
        return math.inf, cuts[:0]
    cuts[stages] = n - 1
    for s in range(stages - 1, -1, -1):
        cuts[s] = back[s, cuts[s + 1]]
    return best[n - 1], cuts
