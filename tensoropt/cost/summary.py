"""One-line summaries of plans: which layers use which parallelism."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

from tensoropt.cost.model import MeshProblem, SearchGraph
from tensoropt.ir.layout import Partial, Shard


def unit_kind(mp: MeshProblem, sg: SearchGraph, k: int, s: int) -> str:
    """e.g. ``tp=4 x dp=2``: per mesh axis, tp when an owned weight is sharded on it,
    dp when only the work is split, nothing when replicated."""
    info = mp.units[k]
    strategy = info.strategies[s]
    parts = []
    for a, n in enumerate(mp.mesh.shape):
        weight_split = any(
            v is not None
            and v.name in sg.params
            and lay is not None
            and isinstance(lay.placements[a], Shard)
            for v, lay in zip(info.node.inputs, strategy.inputs, strict=False)
        )
        layouts = [*(x for x in strategy.inputs if x is not None), *strategy.outputs]
        work_split = any(isinstance(lay.placements[a], (Shard, Partial)) for lay in layouts)
        if weight_split:
            parts.append(f"tp={n}")
        elif work_split:
            parts.append(f"dp={n}")
    return " x ".join(parts) if parts else REPLICATED


REPLICATED = "replicated"
# A plan that splits no unit on a mesh of several devices: every rank computes the whole
# step, so more devices only add synchronisation. Said plainly, not as "replicated on X".
ALL_REPLICATED = "replicated (no faster than 1 device)"


def replicates_all(summary: str) -> bool:
    """Whether a point's summary (with what it uses after it) is :data:`ALL_REPLICATED`'s."""
    return summary.startswith(ALL_REPLICATED)


def kind_table(mp: MeshProblem, sg: SearchGraph) -> tuple[tuple[str, ...], ...]:
    """:func:`unit_kind` of every (unit, strategy); repeated layers share their row (the
    kinds depend on the root's op, which of its inputs are parameters and the strategies).
    """
    rows: dict[tuple, tuple[str, ...]] = {}
    out = []
    for k, info in enumerate(mp.units):
        weights = tuple(v is not None and v.name in sg.params for v in info.node.inputs)
        key = (info.strategies, weights)
        row = rows.get(key)
        if row is None:
            row = rows[key] = tuple(unit_kind(mp, sg, k, s) for s in range(len(info.strategies)))
        out.append(row)
    return tuple(out)


class Summarizer:
    """Summaries of many plans of one problem.

    Every (weight unit, strategy) is one category (op type, kind); a plan's summary counts
    the categories its choice picks, in the order of first appearance (one gather and one
    count per plan, not a loop over units)."""

    def __init__(
        self,
        mp: MeshProblem,
        sg: SearchGraph,
        kinds: tuple[tuple[str, ...], ...] | None = None,
    ):
        self.mp = mp
        self.sg = sg
        self.kinds = kinds if kinds is not None else kind_table(mp, sg)
        self.weighted = np.array(
            [
                k
                for k, info in enumerate(mp.units)
                if any(v is not None and v.name in sg.params for v in info.node.inputs)
            ],
            dtype=np.intp,
        )
        categories: dict[tuple[str, str], int] = {}
        flat: list[int] = []
        offsets: list[int] = []
        for k in self.weighted:
            offsets.append(len(flat))
            op = mp.units[k].node.op_type
            flat += [categories.setdefault((op, kind), len(categories)) for kind in self.kinds[k]]
        self.categories = list(categories)
        self.flat = np.array(flat, dtype=np.intp)
        self.offsets = np.array(offsets, dtype=np.intp)
        self.replicated = np.array([kind == REPLICATED for _, kind in self.categories], dtype=bool)

    def __call__(self, choice: Sequence[int]) -> str:
        if self.mp.mesh.size == 1:  # one device splits nothing: not "replicated on X" per op
            return REPLICATED
        picked = self.flat[self.offsets + np.asarray(choice, dtype=np.intp)[self.weighted]]
        cats, first, counts = np.unique(picked, return_index=True, return_counts=True)
        by_op: dict[str, Counter] = defaultdict(Counter)
        for i in np.argsort(first, kind="stable"):
            op, kind = self.categories[cats[i]]
            by_op[op][kind] = int(counts[i])
        if self.mp.mesh.size > 1 and self.replicated[cats].all() and self._rest_replicated(choice):
            return ALL_REPLICATED
        return _render(by_op)

    def _rest_replicated(self, choice: Sequence[int]) -> bool:
        """No unit other than the weight layers splits anything either."""
        weighted = set(self.weighted.tolist())
        return all(
            self.kinds[k][choice[k]] == REPLICATED
            for k in range(len(self.mp.units))
            if k not in weighted
        )


def summarize(mp: MeshProblem, sg: SearchGraph, choice: Sequence[int]) -> str:
    """``dp=8 on Gather; tp=4 x dp=2 on MatMul (24), dp=8 on MatMul (2)``: weight layers only."""
    return Summarizer(mp, sg)(choice)


def _render(by_op: dict[str, Counter]) -> str:
    parts = []
    for op, kinds in sorted(by_op.items(), key=lambda kv: -sum(kv[1].values())):
        if len(kinds) == 1:
            (kind,) = kinds
            parts.append(f"{kind} on {op}")
        else:
            inner = ", ".join(f"{kind} ({n})" for kind, n in kinds.most_common())
            parts.append(f"{op}: {inner}")
    return "; ".join(parts) if parts else REPLICATED
