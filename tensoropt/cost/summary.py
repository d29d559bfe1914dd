"""One-line summaries of plans: which layers use which parallelism."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

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


class Summarizer:
    """Summaries of many plans of one problem (unit kinds are computed once each)."""

    def __init__(self, mp: MeshProblem, sg: SearchGraph):
        self.mp = mp
        self.sg = sg
        self.weighted = [
            k
            for k, info in enumerate(mp.units)
            if any(v is not None and v.name in sg.params for v in info.node.inputs)
        ]
        self.kinds: dict[tuple[int, int], str] = {}

    def __call__(self, choice: Sequence[int]) -> str:
        by_op: dict[str, Counter] = defaultdict(Counter)
        for k in self.weighted:
            s = choice[k]
            kind = self.kinds.get((k, s))
            if kind is None:
                kind = self.kinds[(k, s)] = unit_kind(self.mp, self.sg, k, s)
            by_op[self.mp.units[k].node.op_type][kind] += 1
        if self.mp.mesh.size > 1 and self._all_replicated(choice, by_op):
            return ALL_REPLICATED
        return _render(by_op)

    def _all_replicated(self, choice: Sequence[int], by_op: dict[str, Counter]) -> bool:
        """No unit (weight layers first, then every other one) splits anything."""
        if any(kind != REPLICATED for kinds in by_op.values() for kind in kinds):
            return False
        weighted = set(self.weighted)
        return all(
            unit_kind(self.mp, self.sg, k, choice[k]) == REPLICATED
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
