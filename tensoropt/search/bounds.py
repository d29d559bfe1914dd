"""Exact bound pruning for variable elimination: drop partial plans that cannot reach the
frontier.

Why: in hub-structured graphs (an LSTM's shared recurrent weight, the Split of the input
projection and the Concat of the hidden states each touch all time steps) every factor of
the time sweep carries the hubs in its scope. Most joint hub assignments lead only to
dominated plans, but the plain DP keeps a full, growing frontier for each of them.

How: scalar min-sum DPs over the same elimination steps give, for every entry e of every
product the schedule will form, lower bounds of the time and of the memory that the rest
of the problem adds to any partial plan of e (``lb_t[e]``, ``lb_m[e]``: an inside pass,
then an outside pass as in a junction tree). Weighted-sum DPs (time/memory scalarised with
a few weights) give *incumbents*: values of complete plans. A partial point p of entry e
is dropped iff an incumbent q satisfies q <= p + lb(e) in both coordinates, not equal in
both. Every completion c of p has p + c >= p + lb(e), so every plan through p is strictly
dominated by the plan of q; the frontier plans themselves are never dropped (a frontier
value cannot be strictly dominated). The frontier is therefore unchanged, point for point.

Floating point: incumbents are inflated by a relative 1e-9 before the test, so a rounding
error in the DP's sums cannot turn a tie into a drop. Epsilon mode prunes with external
incumbents only (plans returned by other problems): the problem's own incumbents are not
returned, and the epsilon cover argument would compound through them (docs/design/search.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tensoropt.search import memory
from tensoropt.search.frontier import Table, prune_groups
from tensoropt.search.jit import compiled

INFLATE = 1e-9  # relative slack on incumbents (rounding of the DP's float sums)
WEIGHTS = 17  # scalarisations tried for incumbents (time weight 0..1, both ends excluded)
LB_WEIGHTS = 5  # of them carried as convex lower bounds (more: slower outside pass)
BATCH = 6  # weight channels per incumbent pass


@dataclass(frozen=True, slots=True)
class Bound:
    """Per output entry of one product: lower bounds of what the rest adds; incumbents.

    lb_t, lb_m: least time and least memory the rest adds (the rest's ideal point).
    lb_w (channels x entries, optional): least w.r the rest adds, for each weight row of
    `weights` (w_t, w_m > 0). Together they bound the set p + rest from below by a convex
    polygon: every plan x through point p has x >= p + (lb_t, lb_m) and
    w.x >= w.p + lb_w for every channel.
    """

    lb_t: np.ndarray  # float64, one per output entry (C order over the output scope)
    lb_m: np.ndarray
    inc_t: np.ndarray  # incumbent staircase: time ascending, memory strictly descending
    inc_m: np.ndarray
    lb_w: np.ndarray | None = None  # (channels, entries); float32 rounded down from solve
    weights: np.ndarray | None = None  # float64 (channels, 2): (w_t, w_m), both > 0

    def keep(self, g: np.ndarray, t: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Mask of the candidate points (output entry g, time t, memory m) to keep.

        A point is dropped iff the region R = {x >= a, w.x >= b_c} (a = p + ideal of the
        rest, b_c = w_c.p + lb_w[c]) lies in the upward closure of the staircase and holds
        no incumbent itself: then every plan through p is strictly dominated. (A tie with
        an incumbent can only happen through the ideal-point test, which keeps it.) R (upward
        closed) escapes the closure iff it meets the open lower quadrant of a corner
        (t_j, m_{j-1}) of the staircase (t_k = m_{-1} = +inf), iff a < corner and
        w_c.corner > b_c for every channel (take x = corner - tiny).
        """
        at, am = t + self.lb_t[g], m + self.lb_m[g]
        it, im = self.inc_t, self.inc_m
        k = len(it)
        lo = np.searchsorted(it, at, side="right")  # first corner with corner_t > a_t
        hi = k - np.searchsorted(im[::-1], am, side="right")  # last corner, corner_m > a_m
        # Corners lo..hi meet a < corner; none: the ideal point is covered (old test).
        tie = np.zeros(len(at), dtype=bool)
        kk = np.clip(lo - 1, 0, max(k - 1, 0))
        if k:
            tie = (lo >= 1) & (it[kk] == at) & (im[kk] == am)
        drop = (lo > hi) & ~tie
        if self.lb_w is None or self.weights is None or k < 2:
            return ~drop
        # Candidates whose open corners are all finite (1 <= lo <= hi <= k - 1).
        cand = np.flatnonzero((lo <= hi) & (lo >= 1) & (hi <= k - 1))
        if not len(cand):
            return ~drop
        drop[cand] = self._covered(
            g[cand], t[cand], m[cand], at[cand], am[cand], lo[cand], hi[cand]
        )
        return ~drop

    def _covered(self, g, t, m, at, am, lo, hi) -> np.ndarray:
        """For candidates with corners lo..hi (all finite): is every corner cut off by a
        channel (w.corner <= b)? Then no incumbent q lies in the region either (so no plan
        through p can be q's own plan): each q_i with q_i >= a is below corner i or i + 1
        of the range in one coordinate and equal in the other, so w.q < w.corner <= b."""
        assert self.lb_w is not None and self.weights is not None
        w = self.weights
        b = w[:, :1] * t + w[:, 1:] * m + self.lb_w[:, g]  # (channels, n)
        ct, cm = self.inc_t[1:], self.inc_m[:-1]  # corners 1..k-1 (index j - 1)
        vc = w[:, :1] * ct + w[:, 1:] * cm  # (channels, corners)
        return _all_corners_cut(np.ascontiguousarray(b), np.ascontiguousarray(vc), lo, hi)


@compiled()
def _all_corners_cut(b, vc, lo, hi):
    """ok[i]: every corner j in lo[i]..hi[i] has a channel c with b[c, i] >= vc[c, j - 1]
    (compiled: one loop per candidate that stops at its first corner no channel cuts)."""
    n_ch, n = b.shape
    ok = np.ones(n, dtype=np.bool_)
    for i in range(n):
        for j in range(lo[i], hi[i] + 1):
            cut = False
            for c in range(n_ch):
                if b[c, i] >= vc[c, j - 1]:
                    cut = True
                    break
            if not cut:
                ok[i] = False
                break
    return ok


@dataclass(frozen=True, slots=True)
class Step:
    """One elimination step: multiply `inputs` (factor ids, in product order), sum out
    `var` (None: nothing), giving factor `out`."""

    inputs: tuple[int, ...]
    var: int | None
    out: int


def _expand(arr: np.ndarray, scope: tuple[int, ...], joint: tuple[int, ...], dims) -> np.ndarray:
    """A channel-first table over `scope` (sorted) as a broadcastable one over `joint`."""
    shape = [arr.shape[0], *(dims[v] if v in scope else 1 for v in joint)]
    return arr.reshape(shape)


def _reduce_to(
    arr: np.ndarray, joint: tuple[int, ...], scope: tuple[int, ...], dims: dict[int, int]
) -> np.ndarray:
    """Min over the joint axes not in `scope` (arr may be broadcastable only)."""
    arr = np.broadcast_to(arr, (arr.shape[0], *(dims[v] for v in joint)))
    axes = tuple(1 + i for i, v in enumerate(joint) if v not in scope)
    return arr.min(axis=axes) if axes else np.array(arr)


@compiled()
def _entry_argmins(offsets, t, m, weights):
    """Per weight (w_t, w_m) and entry: the index of the point of least score w_t t + w_m m
    (the float numpy gives; scores are finite), the first of equal ones, -1 for an empty
    entry. One scan per entry: a stable sort of every point per weight picked the same
    points and took 6% of the all-axes GPT-2-medium search."""
    channels, entries = weights.shape[0], offsets.size - 1
    out = np.full((channels, entries), -1, dtype=np.int64)
    for c in range(channels):
        wt, wm = weights[c, 0], weights[c, 1]
        for e in range(entries):
            best, arg = np.inf, -1
            for i in range(offsets[e], offsets[e + 1]):
                score = wt * t[i] + wm * m[i]
                if arg < 0 or score < best:
                    best, arg = score, i
            out[c, e] = arg
    return out


def _entry_min(table: Table, values: np.ndarray) -> np.ndarray:
    """Minimum of `values` (one per point) over each entry; +inf for empty entries."""
    out = np.full(table.n_entries, np.inf)
    nonempty = np.flatnonzero(table.sizes)
    if len(nonempty):
        out[nonempty] = np.minimum.reduceat(values, table.offsets[nonempty])
    return out


@dataclass(frozen=True, slots=True)
class Schedule:
    """Steps still to run, the factors they start from, and the roots they end in."""

    steps: list[Step]
    scopes: dict[int, tuple[int, ...]]  # every factor id (live and future)
    dims: dict[int, int]
    roots: list[int]  # factor ids left over after all steps (scope ())

    def joint(self, step: Step) -> tuple[int, ...]:
        return tuple(sorted({v for i in step.inputs for v in self.scopes[i]}))

    def shape(self, fid: int) -> tuple[int, ...]:
        return tuple(self.dims[v] for v in self.scopes[fid])


def _sum(parts: list[np.ndarray]) -> np.ndarray:
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _ask(sched: Schedule, st: Step, channels: int, arrays: int) -> None:
    """Check the search's memory share (``search.memory``) for ``arrays`` float64 arrays
    of ``channels`` channels over ``st``'s joint scope before a pass makes them. A wide
    scope (parameters shared by every layer, as ALBERT's) made arrays of 0.4 to 3.3 GiB
    each and took a worker to 23 GB before the kernel killed it; the search stops in one
    line instead."""
    cells = channels * math.prod(sched.dims[v] for v in sched.joint(st))
    memory.about_to_make(8.0 * cells * arrays)


def _inside(sched: Schedule, leaves: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Channel-wise min-sum over the steps: a table (channels, *shape) for every factor."""
    tab = dict(leaves)
    for st in sched.steps:
        _ask(sched, st, tab[st.inputs[0]].shape[0], len(st.inputs) + 2)  # parts, sums
        joint = sched.joint(st)
        total = _sum([_expand(tab[i], sched.scopes[i], joint, sched.dims) for i in st.inputs])
        tab[st.out] = _reduce_to(total, joint, sched.scopes[st.out], sched.dims)
    return tab


def _outside(sched: Schedule, inside: dict[int, np.ndarray]) -> dict[tuple[int, int], np.ndarray]:
    """Per (step index, product index): the least the rest adds, per output entry and
    channel, as (channels, entries)."""
    dims, scopes = sched.dims, sched.scopes
    roots = [inside[r].reshape(inside[r].shape[0]) for r in sched.roots]
    out: dict[int, np.ndarray] = {}
    for k, r in enumerate(sched.roots):
        others = [v for j, v in enumerate(roots) if j != k]
        out[r] = _sum(others) if others else np.zeros_like(roots[k])
    per_product: dict[tuple[int, int], np.ndarray] = {}
    for j in range(len(sched.steps) - 1, -1, -1):
        st = sched.steps[j]
        # parts, suffix sums, the prefix and the sum of both
        _ask(sched, st, inside[st.inputs[0]].shape[0], 2 * len(st.inputs) + 3)
        joint = sched.joint(st)
        rest = _expand(out[st.out], scopes[st.out], joint, dims)
        parts = [_expand(inside[i], scopes[i], joint, dims) for i in st.inputs]
        n = len(parts)
        # suffix[i] = rest + parts[i:]; prefix[i] = parts[:i] (None when empty).
        suffix = [rest] * (n + 1)
        for i in range(n - 1, -1, -1):
            suffix[i] = suffix[i + 1] + parts[i]
        # Product p multiplies inputs[0..p] by inputs[p+1]; the last one (p = n-2, or 0
        # when n = 1) sums out the variable and gives `out`; the others keep the joint
        # scope so far, whose rest is `out`'s rest plus the inputs not yet multiplied.
        acc = set(scopes[st.inputs[0]])
        for p in range(n - 2):
            acc |= set(scopes[st.inputs[p + 1]])
            sub = _reduce_to(suffix[p + 2], joint, tuple(sorted(acc)), dims)
            per_product[(j, p)] = sub.reshape(sub.shape[0], -1)
        per_product[(j, max(n - 2, 0))] = out[st.out].reshape(out[st.out].shape[0], -1)
        prefix = None
        for i, fid in enumerate(st.inputs):
            others = suffix[i + 1] if prefix is None else prefix + suffix[i + 1]
            out[fid] = _reduce_to(others, joint, scopes[fid], dims)
            prefix = parts[i] if prefix is None else prefix + parts[i]
    return per_product


Plans = tuple[np.ndarray, np.ndarray, np.ndarray]  # (score, time, memory), channel first


def _leaf_plans(sched: Schedule, fid: int, table: Table, weights: np.ndarray) -> Plans:
    """Per weight and entry of a leaf: the score, time and memory of its least-score point
    (+inf for empty entries)."""
    shape = (len(weights), table.n_entries)
    w64 = np.ascontiguousarray(weights, dtype=np.float64)
    found = _entry_argmins(table.offsets, table.t, table.m, w64)
    ok = found >= 0
    if not table.t.size:  # no points at all
        score, t, m = np.full(shape, np.inf), np.full(shape, np.inf), np.full(shape, np.inf)
    else:  # every channel at once: the same float operations per entry
        at = np.maximum(found, 0)
        t = np.where(ok, table.t[at], np.inf)
        m = np.where(ok, table.m[at], np.inf)
        score = np.where(ok, w64[:, :1] * t + w64[:, 1:] * m, np.inf)
    full = (len(weights), *sched.shape(fid))
    return score.reshape(full), t.reshape(full), m.reshape(full)


def _add(a: Plans, b: Plans) -> Plans:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def _expand_plans(p: Plans, scope: tuple[int, ...], joint: tuple[int, ...], dims) -> Plans:
    return (
        _expand(p[0], scope, joint, dims),
        _expand(p[1], scope, joint, dims),
        _expand(p[2], scope, joint, dims),
    )


def _argmin_to(p: Plans, joint: tuple[int, ...], scope: tuple[int, ...], dims) -> Plans:
    """Per channel and entry of `scope`: the least-score plan over the other joint axes,
    with its time and memory (the values of that very plan, not separate minima)."""
    full = (p[0].shape[0], *(dims[v] for v in joint))
    kept = [1 + i for i, v in enumerate(joint) if v in scope]
    gone = [1 + i for i, v in enumerate(joint) if v not in scope]
    if not gone:
        return tuple(np.array(np.broadcast_to(x, full)) for x in p)  # type: ignore[return-value]
    perm = [0, *kept, *gone]
    shape = (full[0], *(full[a] for a in kept), -1)
    flat = [np.broadcast_to(x, full).transpose(perm).reshape(shape) for x in p]
    idx = np.argmin(flat[0], axis=-1)[..., None]
    s, t, m = (np.take_along_axis(x, idx, -1)[..., 0] for x in flat)
    return s, t, m


def _plans_inside(sched: Schedule, leaves: dict[int, Table], weights: np.ndarray):
    ins = {i: _leaf_plans(sched, i, tb, weights) for i, tb in leaves.items()}
    for st in sched.steps:
        _ask(sched, st, len(weights), 3 * (len(st.inputs) + 2))  # (score, t, m) of each
        joint = sched.joint(st)
        parts = [_expand_plans(ins[i], sched.scopes[i], joint, sched.dims) for i in st.inputs]
        total = parts[0]
        for part in parts[1:]:
            total = _add(total, part)
        ins[st.out] = _argmin_to(total, joint, sched.scopes[st.out], sched.dims)
    return ins


def _merge_frontier(
    front: tuple[np.ndarray, np.ndarray], p: Plans
) -> tuple[np.ndarray, np.ndarray]:
    """The non-dominated (time, memory) of `front` (a staircase) and the finite plans of
    `p`. New points dominated by the staircase are dropped first with one binary search
    (most are: many entries share the same best plans), so only a few get sorted."""
    score, t, m = (x.ravel() for x in np.broadcast_arrays(*p))
    ok = np.isfinite(score)
    t, m = t[ok], m[ok]
    ft, fm = front
    if len(ft):
        j = np.searchsorted(ft, t, side="right") - 1
        new = (j < 0) | (fm[np.maximum(j, 0)] > m)
        t, m = np.concatenate([ft, t[new]]), np.concatenate([fm, m[new]])
    keep = prune_groups(np.zeros(len(t), dtype=np.int64), t, m)
    return t[keep], m[keep]


def _incumbents(
    sched: Schedule, leaves: dict[int, Table], weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Values of complete plans: for every output entry e of every step and every weight w,
    the plan of least w.(t, m) among the plans through e (an inside and an outside
    min-sum pass that carry the time and memory of the minimising plan, like max-marginals
    in a junction tree). Forcing each entry gives many different plans near the frontier,
    not only its supported points. Returned as a staircase (time ascending)."""
    dims, scopes = sched.dims, sched.scopes
    ins = _plans_inside(sched, leaves, weights)
    roots = [tuple(x.reshape(x.shape[0]) for x in ins[r]) for r in sched.roots]
    zero: Plans = tuple(np.zeros_like(x) for x in roots[0])  # type: ignore[assignment]
    out: dict[int, Plans] = {}
    for k, r in enumerate(sched.roots):
        rest = zero
        for j, v in enumerate(roots):
            rest = _add(rest, v) if j != k else rest  # type: ignore[arg-type]
        out[r] = rest
    front = _merge_frontier((np.zeros(0), np.zeros(0)), _add(out[sched.roots[0]], roots[0]))
    produced = {st.out for st in sched.steps}
    for st in reversed(sched.steps):
        joint = sched.joint(st)
        # a step holds its suffix sums and two more (time, memory and weighted-sum
        # arrays over its joint scope and the weights)
        _ask(sched, st, len(weights), 3 * (len(st.inputs) + 3))
        rest = _expand_plans(out.pop(st.out), scopes[st.out], joint, dims)
        del ins[st.out]
        parts = [_expand_plans(ins[i], scopes[i], joint, dims) for i in st.inputs]
        suffix = [rest] * (len(parts) + 1)
        for i in range(len(parts) - 1, -1, -1):
            suffix[i] = _add(suffix[i + 1], parts[i])
        front = _merge_frontier(front, _argmin_to(suffix[0], joint, scopes[st.out], dims))
        prefix = None
        for i, fid in enumerate(st.inputs):
            if fid in produced:
                others = suffix[i + 1] if prefix is None else _add(prefix, suffix[i + 1])
                out[fid] = _argmin_to(others, joint, scopes[fid], dims)
            prefix = parts[i] if prefix is None else _add(prefix, parts[i])
    return front


def _staircase(t: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The non-dominated (time, memory) points, time ascending, inflated by INFLATE."""
    if not len(t):
        return np.zeros(0), np.zeros(0)
    keep = prune_groups(np.zeros(len(t), dtype=np.int64), t, m)  # sorted by time
    return t[keep] * (1.0 + INFLATE), m[keep] * (1.0 + INFLATE)


def _leaf_channels(sched: Schedule, fid: int, table: Table, weights: np.ndarray) -> np.ndarray:
    chans = [_entry_min(table, table.t), _entry_min(table, table.m)]
    chans += [_entry_min(table, w[0] * table.t + w[1] * table.m) for w in weights]
    return np.stack(chans).reshape((len(chans), *sched.shape(fid)))


class Dominated(Exception):
    """Raised by :func:`compute_bounds` when the given incumbents strictly dominate every
    plan of the problem (:func:`beyond`): the search has nothing to return."""


_LOWERED = 1.0 - 1e-9  # the DP's float sums, lowered to stay lower bounds


def beyond(
    t_low: float,
    m_low: float,
    weights: np.ndarray,
    w_low: np.ndarray,
    inc_t: np.ndarray,
    inc_m: np.ndarray,
) -> bool:
    """Whether every point x with x >= (t_low, m_low) and w.x >= w_low[c] for each weight
    row w = weights[c] (both components >= 0) is strictly dominated by one of the
    incumbents (inc_t, inc_m): no more time, no more memory, not equal in both.

    Proof: a point that no incumbent strictly dominates lies at or below a corner of the
    incumbents' staircase: (t_1, inf), (t_(i+1), m_i) or (inf, m_n) (time ascending). That
    corner then satisfies every bound (they only grow up and to the right), so when no
    corner does, there is no such point. The infinite corners meet the bounds unless the
    ideal point is beyond the first time and the last memory."""
    if not len(inc_t):
        return False
    keep = prune_groups(np.zeros(len(inc_t), dtype=np.int64), inc_t, inc_m)
    st, sm = inc_t[keep], inc_m[keep]  # staircase: time ascending, memory descending
    if not (t_low > st[0] and m_low > sm[-1]):
        return False
    a, b = st[1:], sm[:-1]  # the staircase's inner corners
    inside = (t_low <= a) & (m_low <= b)
    if len(weights):
        wt, wm = weights[:, 0], weights[:, 1]
        vc = wt[:, None] * a[None, :] + wm[:, None] * b[None, :]
        inside &= np.all(vc >= np.asarray(w_low)[:, None], axis=0)
    return not bool(inside.any())


def _root_lows(sched: Schedule, ins: dict[int, np.ndarray]) -> np.ndarray:
    """Per channel, the least value over every plan: the sum over the roots, lowered."""
    total = sum(ins[r].reshape(ins[r].shape[0]).astype(np.float64) for r in sched.roots)
    return np.asarray(total) * _LOWERED


class BoundSet:
    """A Bound per product of the schedule, handed out once each (then freed: the stored
    bounds shrink as the sweep advances)."""

    def __init__(self, per_product: dict[tuple[int, int], Bound]) -> None:
        self._per = per_product

    def __len__(self) -> int:
        return len(self._per)

    def get(self, key: tuple[int, int]) -> Bound | None:
        return self._per.pop(key, None)


def compute_bounds(
    sched: Schedule,
    leaves: dict[int, Table],
    convex: bool = True,
    external: tuple[np.ndarray, np.ndarray] | None = None,
    own: bool = True,
) -> BoundSet | None:
    """Bounds for every product of the schedule: key (step index, product index), where
    the products of a step with n inputs are numbered 0..max(n-2, 0) and the last one
    yields the step's output. None: no feasible plan (nothing to prune against).
    convex: also carry LB_WEIGHTS weighted lower bounds (stronger, costs an outside pass
    of that many more channels).
    external: (time, memory) of plans found elsewhere (another mesh of the same device
    count): they join the incumbents, so partial plans strictly dominated by one of them
    are dropped as well. With them, the problem's own incumbents come from every fourth
    weight only (5 of 17): the external staircase already bounds most of the frontier,
    and the own plans cost an inside and an outside pass per weight (measured on
    GPT-2-medium at 4 devices, every axis: solves 17.7 -> 13.2 s of CPU, the same
    frontier; one weight: 13.9 s).
    own: False leaves the problem's own incumbents out (epsilon mode: a plan dropped for
    one of them would be covered only by a plan that is not returned); None when there
    are then no incumbents."""
    if not own and (external is None or not len(external[0])):
        return None
    plain = {i: _leaf_channels(sched, i, tb, np.zeros((0, 2))) for i, tb in leaves.items()}
    lows = _inside(sched, plain)
    t_min = sum(float(lows[r][0].reshape(-1)[0]) for r in sched.roots)
    m_min = sum(float(lows[r][1].reshape(-1)[0]) for r in sched.roots)
    if not (math.isfinite(t_min) and math.isfinite(m_min)):
        return None
    frac = np.linspace(0.0, 1.0, WEIGHTS + 2)[1:-1]
    weights = np.stack([frac / max(t_min, 1e-300), (1.0 - frac) / max(m_min, 1e-300)], axis=1)
    lw = weights[np.unique(np.linspace(0, WEIGHTS - 1, LB_WEIGHTS).round().astype(np.int64))]
    ext = None
    if external is not None and len(external[0]):
        ext = (np.asarray(external[0], dtype=np.float64), np.asarray(external[1], dtype=np.float64))
        ideal = _root_lows(sched, lows)
        if beyond(ideal[0], ideal[1], weights[:0], ideal[:0], *ext):
            raise Dominated
    lw_inside = None
    if convex:  # the weighted channels' inside pass: also an exact test of the whole
        leaf = {i: _leaf_channels(sched, i, tb, lw) for i, tb in leaves.items()}
        lw_inside = _inside(sched, leaf)
        if ext is not None:
            low = _root_lows(sched, lw_inside)
            if beyond(low[0], low[1], lw, low[2:], *ext):
                raise Dominated
    ts: list[np.ndarray] = []
    ms: list[np.ndarray] = []
    if not own:
        own_w = weights[:0]
    elif external is None or not len(external[0]):
        own_w = weights
    else:
        own_w = weights[::4]
    for lo in range(0, len(own_w), BATCH):  # a few channels at a time: bounded memory
        t_part, m_part = _incumbents(sched, leaves, own_w[lo : lo + BATCH])
        ts.append(t_part)
        ms.append(m_part)
    if external is not None:
        ts.append(np.asarray(external[0], dtype=np.float64))
        ms.append(np.asarray(external[1], dtype=np.float64))
    inc_t, inc_m = _staircase(np.concatenate(ts), np.concatenate(ms))
    if not convex:
        prod = _outside(sched, {i: v[:2] for i, v in lows.items()})
        return BoundSet({key: Bound(v[0], v[1], inc_t, inc_m) for key, v in prod.items()})
    assert lw_inside is not None
    prod = _outside(sched, lw_inside)
    per = {
        key: Bound(_down32(v[0]), _down32(v[1]), inc_t, inc_m, _down32(v[2:]), lw)
        for key, v in prod.items()
    }
    return BoundSet(per)


def _down32(x: np.ndarray) -> np.ndarray:
    """float32 copy rounded toward -inf: still a lower bound, half the memory."""
    y = x.astype(np.float32)
    up = y > x
    y[up] = np.nextafter(y[up], np.float32(-np.inf))
    return y
