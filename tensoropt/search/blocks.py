"""Repeated blocks: do the work of one transformer layer once, not once per layer.

A :class:`Region` is `count` consecutive blocks of `size` units starting at `first`. Block 0
stays in the outer problem like any other units. Blocks 1..hi are *covered*: they have the
same unit tables, the same internal edges, and each block b connects only to blocks b-1 and
b+1, by the same cross edges every time. The units of a block that have cross edges to the
next block are its *ports* P (relative indices). Everything else may touch the covered part
only at the ports of block hi (for example the LM head reading the last residual stream).

The transfer factor T over (P of block 0, P of block 1) holds, for every pair of port
strategies, the frontier of block 1 (its units, internal edges and the cross edges from
block 0) with its non-port units eliminated. Block b+1 costs the same table, moved by
b * size units (a SHIFT back-pointer). Chaining n = hi copies is a min-plus matrix power in
the frontier semiring; it is composed by repeated squaring (T^2c = T^c ⊗ T^c moved by c
blocks), so that while the frontiers stay small the cost is logarithmic in the depth. In the
exact mode squaring stops once the frontiers start to grow (mean entry size more than
GROWTH times larger), because then a chain of small factors is cheaper to sweep than a few
large ones; the remaining blocks go into the outer problem as a chain of the powers that were
computed (binary decomposition of n), which variable elimination sweeps like a vector.

Regions come from the problem's hints (validated; a wrong hint is a PlanError) or are
detected from the tables alone: units are hashed by their cost vectors and by the relative
offsets and tables of their edges, the smallest period with a long run of equal hashes is
found, and the candidate phases are validated with the same check as hints.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import numpy as np

from tensoropt.errors import PlanError
from tensoropt.ir.costs import BlockHint
from tensoropt.search.elimination import eliminate, elimination_order
from tensoropt.search.factor import Context, Factor, multiply, multiply_all, translate
from tensoropt.search.prepared import Prepared

log = logging.getLogger(__name__)

GROWTH = 1.5
MAX_REGIONS = 8


@dataclass(frozen=True, slots=True)
class Region:
    """A validated run of identical blocks; blocks 1..hi are composed, block 0 is outer."""

    first: int
    size: int
    count: int
    ports: tuple[int, ...]
    hi: int

    def unit(self, block: int, j: int) -> int:
        return self.first + block * self.size + j

    def block_of(self, i: int) -> int:
        """Block index of unit i, or -1 when i is outside the region."""
        if not self.first <= i < self.first + self.count * self.size:
            return -1
        return (i - self.first) // self.size

    def covers_unit(self, i: int) -> bool:
        return 1 <= self.block_of(i) <= self.hi

    def covers_edge(self, a: int, b: int) -> bool:
        ba, bb = self.block_of(a), self.block_of(b)
        if ba == bb:
            return 1 <= ba <= self.hi
        return 0 <= ba < self.hi and bb == ba + 1


# ----------------------------------------------------------------------------- validation


class _Signatures:
    """Ids of unit cost vectors and edge tables, for exact equality tests by integer."""

    def __init__(self, prep: Prepared) -> None:
        ids: dict[bytes, int] = {}
        self.unit = [
            ids.setdefault(t.tobytes() + b"|" + m.tobytes(), len(ids))
            for t, m in zip(prep.unit_t, prep.unit_m, strict=True)
        ]
        self.edge = {
            k: ids.setdefault(repr(t.shape).encode() + t.tobytes() + m.tobytes(), len(ids))
            for k, (t, m) in prep.edges.items()
        }


def _classify(sig: _Signatures, first: int, size: int, count: int) -> tuple:
    end = first + count * size
    internal: list[dict] = [{} for _ in range(count)]
    cross: list[dict] = [{} for _ in range(max(count - 1, 0))]
    touches: list[tuple[int, int]] = []
    for (a, b), eid in sig.edge.items():
        ba = (a - first) // size if first <= a < end else -1
        bb = (b - first) // size if first <= b < end else -1
        if ba < 0 and bb < 0:
            continue
        ja, jb = a - first - ba * size, b - first - bb * size
        if ba == bb:
            internal[ba][(ja, jb)] = eid
        elif ba >= 0 and bb == ba + 1:
            cross[ba][(ja, jb)] = eid
        else:
            touches += [(bx, jx) for bx, jx in ((ba, ja), (bb, jb)) if bx >= 0]
    return internal, cross, touches


def _check_hi(sig: _Signatures, first: int, size: int, parts: tuple, hi: int) -> str | None:
    internal, cross, touches = parts
    ref = [sig.unit[first + size + j] for j in range(size)]
    ports = {ja for ja, _ in cross[0]}
    for b in range(1, hi + 1):
        if [sig.unit[first + b * size + j] for j in range(size)] != ref:
            return f"block {b} has unit costs different from block 1"
        if internal[b] != internal[1]:
            return f"block {b} has internal edges different from block 1"
    for b in range(hi):
        if cross[b] != cross[0]:
            return f"edges from block {b} to block {b + 1} differ from those of blocks 0 -> 1"
    extra = list(touches)
    if hi < len(cross):
        extra += [(hi, ja) for ja, _ in cross[hi]]
    for b, j in extra:
        if 1 <= b < hi or (b == hi and j not in ports):
            return f"unit {j} of block {b} has an edge that skips a block or leaves the region"
    return None


def check_region(prep: Prepared, sig: _Signatures, first: int, size: int, count: int):
    """The Region for blocks (first, size, count), or a reason string why it does not hold."""
    if count < 3 or first + count * size > prep.n_units:
        return "needs >= 3 blocks inside the problem"
    parts = _classify(sig, first, size, count)
    reason = _check_hi(sig, first, size, parts, count - 1)
    hi = count - 1
    if reason is not None:
        hi = count - 2
        if _check_hi(sig, first, size, parts, hi) is not None:
            return reason
    ports = tuple(sorted({ja for ja, _ in parts[1][0]}))
    return Region(first, size, count, ports, hi)


# ----------------------------------------------------------------------------- detection


def _neighbourhood_ids(prep: Prepared, sig: _Signatures, masked: set[int]) -> np.ndarray:
    incident: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for (a, b), eid in sig.edge.items():
        incident[a].append((1, b - a, eid))
        incident[b].append((-1, b - a, eid))
    ids: dict[tuple, int] = {}
    out = np.empty(prep.n_units, dtype=np.int64)
    for i in range(prep.n_units):
        key = (sig.unit[i], tuple(sorted(incident[i])))
        out[i] = -1 - i if i in masked else ids.setdefault(key, len(ids))
    return out


def _runs(eq: np.ndarray, min_len: int) -> list[tuple[int, int]]:
    padded = np.concatenate([[False], eq, [False]]).astype(np.int8)
    d = np.diff(padded)
    starts, stops = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, stops, strict=True) if e - s >= min_len]


def _score(prep: Prepared, r: Region) -> tuple[int, int, int]:
    """Fewer port strategies first (the transfer table is their square), then coverage."""
    return (-port_dim(prep, r), r.hi * r.size, -r.first)


def _best_for_period(prep: Prepared, sig: _Signatures, code: np.ndarray, size: int):
    eq = code[:-size] == code[size:]
    best = None
    for s, length in _runs(eq, 2 * size):
        for first in range(max(0, s - size), s + size):
            top = (s + length + size - first) // size + 1
            for count in range(min(top, (prep.n_units - first) // size), max(top - 3, 2), -1):
                r = check_region(prep, sig, first, size, count)
                if isinstance(r, Region) and r.hi >= 2:
                    score = _score(prep, r)
                    if best is None or score > best[0]:
                        best = (score, r)
                    break
    return best


def port_dim(prep: Prepared, r: Region) -> int:
    out = 1
    for p in r.ports:
        out *= prep.dims[r.unit(0, p)]
    return out


def detect_regions(prep: Prepared) -> list[Region]:
    """Repeated-block regions found from the tables alone (disjoint, largest first).

    Detection reads only which tables are equal (the signatures, numbered in order of
    first appearance), the edges and the strategy counts: sibling problems with the same
    structure and other prices (one mesh's micro-batch counts, ZeRO stages, the problem
    with one more micro-batch slot) find the same regions, detected once per process."""
    return list(_found(prep).detected)


def auto_regions(prep: Prepared) -> list[Region]:
    """``worthwhile(prep, detect_regions(prep))``, the regions the automatic mode
    composes: the table work it compares reads only the edges and strategy counts, so
    this too is found once per structure."""
    found = _found(prep)
    if found.chosen is None:
        found.chosen = tuple(worthwhile(prep, list(found.detected)))
    return list(found.chosen)


@dataclass(slots=True)
class _Found:
    detected: tuple[Region, ...]
    chosen: tuple[Region, ...] | None = None  # auto_regions', once asked


def _found(prep: Prepared) -> _Found:
    sig = _Signatures(prep)
    key = (tuple(sig.unit), tuple(sig.edge.items()), prep.dims)
    found = _DETECTED.get(key)
    if found is None:
        found = _DETECTED[key] = _Found(tuple(_detect(prep, sig)))
        if len(_DETECTED) > _DETECTED_MAX:
            _DETECTED.popitem(last=False)
    else:
        _DETECTED.move_to_end(key)
    return found


# (signatures, edges, strategy counts) -> the regions detected and chosen, least
# recently used out first
_DETECTED: OrderedDict[tuple, _Found] = OrderedDict()
_DETECTED_MAX = 256


def _detect(prep: Prepared, sig: _Signatures) -> list[Region]:
    masked: set[int] = set()
    regions: list[Region] = []
    while len(regions) < MAX_REGIONS:
        code = _neighbourhood_ids(prep, sig, masked)
        best = None
        found: list[int] = []
        for size in range(1, prep.n_units // 3 + 1):
            if any(size % f == 0 for f in found):
                continue
            cand = _best_for_period(prep, sig, code, size)
            if cand is None:
                continue
            found.append(size)
            if best is None or cand[0] > best[0]:
                best = cand
        if best is None:
            break
        r = best[1]
        regions.append(r)
        masked.update(range(r.first, r.first + r.count * r.size))
    return regions


def hinted_regions(prep: Prepared, hints: tuple[BlockHint, ...]) -> list[Region]:
    """Validate the problem's block hints; a hint that does not hold is a PlanError."""
    sig = _Signatures(prep)
    regions: list[Region] = []
    taken: set[int] = set()
    for j, h in enumerate(hints):
        r = check_region(prep, sig, h.first_unit, h.units_per_block, h.count)
        if not isinstance(r, Region):
            raise PlanError(
                f"blocks[{j}] (first_unit={h.first_unit}, units_per_block="
                f"{h.units_per_block}, count={h.count}): {r}; fix or drop the hint"
            )
        span = set(range(r.first, r.first + r.count * r.size))
        if span & taken:
            raise PlanError(f"blocks[{j}]: overlaps an earlier block hint")
        taken |= span
        if r.hi >= 2:
            regions.append(r)
        else:
            log.info("block hint %d covers fewer than 2 composable blocks; not used", j)
    return regions


# ----------------------------------------------------------------------------- cost estimate

MAX_PORT_DIM = 1 << 12


def _outer_scopes(prep: Prepared, regions: list[Region]) -> list[tuple[int, ...]]:
    scopes = [(i,) for i in range(prep.n_units) if not any(r.covers_unit(i) for r in regions)]
    scopes += [k for k in prep.edges if not any(r.covers_edge(*k) for r in regions)]
    for r in regions:
        for b in range(r.hi):
            scopes.append(
                tuple(r.unit(b, p) for p in r.ports) + tuple(r.unit(b + 1, p) for p in r.ports)
            )
    return scopes


def _transfer_work(prep: Prepared, r: Region) -> int:
    scopes = [(r.unit(1, j),) for j in range(r.size)]
    scopes += [k for k in prep.edges if r.block_of(k[1]) == 1 and r.block_of(k[0]) in (0, 1)]
    keep = {r.unit(0, p) for p in r.ports} | {r.unit(1, p) for p in r.ports}
    todo = {v for s in scopes for v in s} - keep
    return elimination_order(scopes, dict(enumerate(prep.dims)), todo)[1] + port_dim(prep, r) ** 2


def table_work(prep: Prepared, regions: list[Region]) -> int:
    """Table work (see elimination_order) of solving with these regions composed."""
    scopes = _outer_scopes(prep, regions)
    todo = {v for s in scopes for v in s}
    work = elimination_order(scopes, dict(enumerate(prep.dims)), todo)[1]
    return work + sum(_transfer_work(prep, r) for r in regions)


def work_floor(prep: Prepared) -> int:
    """A lower bound of ``table_work(prep, [])``. In a connected part of the graph every
    unit but the last one eliminated still has a neighbour, whose domain is at least the
    smallest: such a step costs at least its unit's domain times that."""
    parent = list(range(prep.n_units))

    def root(u: int) -> int:
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for a, b in prep.edges:
        parent[root(a)] = root(b)
    total: dict[int, int] = {}
    largest: dict[int, int] = {}
    for u, d in enumerate(prep.dims):
        r = root(u)
        total[r] = total.get(r, 0) + d
        largest[r] = max(largest.get(r, 0), d)
    least = min(prep.dims, default=1)
    return least * sum(total[r] - largest[r] for r in total)


def worthwhile(prep: Prepared, regions: list[Region]) -> list[Region]:
    """The regions that lower the estimated table work, added one at a time. The work
    without regions (a greedy order over the whole graph) is computed only when a region
    does not already beat its lower bound (:func:`work_floor`)."""
    chosen: list[Region] = []
    if not regions:
        return chosen
    floor = work_floor(prep)
    best: int | None = None
    for r in regions:
        if port_dim(prep, r) > MAX_PORT_DIM:
            log.info(
                "blocks at unit %d: %d port strategies, too many; not used",
                r.first,
                port_dim(prep, r),
            )
            continue
        work = table_work(prep, chosen + [r])
        if best is None and work >= floor:
            best = table_work(prep, [])
        if best is None or work < best:
            chosen.append(r)
            best = work
        else:
            log.info("blocks at unit %d would not save work; not used", r.first)
    return chosen


# ----------------------------------------------------------------------------- composition


def transfer(ctx: Context, prep: Prepared, r: Region) -> Factor:
    """T over (ports of block 0, ports of block 1): block 1 with the rest eliminated."""
    units = [r.unit(1, j) for j in range(r.size)]
    factors = [prep.unit_factor(ctx, u) for u in units]
    factors += [
        prep.edge_factor(ctx, key)
        for key in prep.edges
        if r.block_of(key[1]) == 1 and r.block_of(key[0]) in (0, 1)
    ]
    keep = {r.unit(0, p) for p in r.ports} | {r.unit(1, p) for p in r.ports}
    dims = {v: prep.dims[v] for f in factors for v in f.scope}
    t = multiply_all(ctx, eliminate(ctx, factors, dims, keep))
    if set(t.scope) != keep:
        raise AssertionError(f"transfer factor scope {t.scope} != ports {sorted(keep)}")
    return t


def chain_pieces(ctx: Context, prep: Prepared, r: Region, adaptive: bool) -> list[Factor]:
    """Factors covering blocks 1..hi: powers of T placed one after the other."""
    t = transfer(ctx, prep, r)
    powers = {1: t}
    c = 1
    while 2 * c <= r.hi:
        middle = frozenset(r.unit(c, p) for p in r.ports)
        sq = multiply(ctx, powers[c], translate(ctx, powers[c], c * r.size), middle)
        if adaptive and _mean_size(sq) > GROWTH * _mean_size(powers[c]):
            break
        c *= 2
        powers[c] = sq
    pieces, pos = [], 0
    for size in sorted(powers, reverse=True):
        while pos + size <= r.hi:
            pieces.append(translate(ctx, powers[size], pos * r.size))
            pos += size
    ctx.notes.append(
        f"blocks first={r.first} size={r.size} count={r.count} ports={len(r.ports)} "
        f"composed={r.hi} powers={sorted(powers)} pieces={len(pieces)}"
    )
    return pieces


def _mean_size(f: Factor) -> float:
    assert f.table is not None
    return float(f.table.sizes.mean()) if f.table.n_entries else 0.0
