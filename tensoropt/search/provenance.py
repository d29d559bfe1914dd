"""Back-pointers for frontier points: an append-only DAG of how each point was built.

Every frontier point carries one node id. A node is one of

- ``EMPTY`` (id 0): the point carries no strategy choice (an edge-table entry);
- ``LEAF(unit, strategy)``: the point picked `strategy` for `unit`;
- ``PAIR(left, right)``: the point is the sum of two points (a Minkowski-sum step);
- ``SHIFT(child, offset)``: the child's unit indices shifted by `offset` (one more copy of
  a repeated block, whose work was done once).

Nodes are only created for points that survive pruning, so the arena grows with the sum of
the pruned frontier sizes, not with the candidate products. Subtrees are shared, never
copied: a repeated block's tree is referenced by every copy through a SHIFT node.

Recovery walks all requested roots at once with numpy (one iteration per tree level), so
recovering a whole frontier costs O(points x units) array work and no Python loop per node.
"""

from __future__ import annotations

import numpy as np

EMPTY = 0
_LEAF, _PAIR, _SHIFT = 1, 2, 3


class Provenance:
    """The node arena. Ids are int64 indices into three parallel arrays."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._kind = np.zeros(capacity, dtype=np.int8)
        self._a = np.zeros(capacity, dtype=np.int64)
        self._b = np.zeros(capacity, dtype=np.int64)
        self._n = 1  # id 0 is EMPTY

    def __len__(self) -> int:
        return self._n

    def _append(self, kind: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        k = len(a)
        need = self._n + k
        if need > len(self._kind):
            cap = max(need, 2 * len(self._kind))
            self._kind = np.resize(self._kind, cap)
            self._a = np.resize(self._a, cap)
            self._b = np.resize(self._b, cap)
        ids = np.arange(self._n, need, dtype=np.int64)
        self._kind[self._n : need] = kind
        self._a[self._n : need] = a
        self._b[self._n : need] = b
        self._n = need
        return ids

    def leaves(self, unit: int, n_strategies: int) -> np.ndarray:
        """One LEAF node per strategy of `unit`, in strategy order."""
        units = np.full(n_strategies, unit, dtype=np.int64)
        return self._append(_LEAF, units, np.arange(n_strategies, dtype=np.int64))

    def pairs(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """PAIR nodes for element-wise (left, right); EMPTY operands pass the other through."""
        out = np.where(left == EMPTY, right, left)
        both = (left != EMPTY) & (right != EMPTY)
        if both.any():
            out[both] = self._append(_PAIR, left[both], right[both])
        return out

    def shift(self, ids: np.ndarray, offset: int) -> np.ndarray:
        """SHIFT nodes moving every unit index below `ids` by `offset` (EMPTY stays EMPTY)."""
        if offset == 0:
            return ids
        out = ids.copy()
        live = ids != EMPTY
        if live.any():
            out[live] = self._append(_SHIFT, ids[live], np.full(int(live.sum()), offset))
        return out

    def recover(self, roots: np.ndarray, n_units: int) -> np.ndarray:
        """Choice matrix (len(roots) x n_units); every unit must be assigned exactly once."""
        n = len(roots)
        choice = np.full((n, n_units), -1, dtype=np.int64)
        hits = np.zeros(n, dtype=np.int64)
        row = np.arange(n, dtype=np.int64)
        node = np.asarray(roots, dtype=np.int64)
        off = np.zeros(n, dtype=np.int64)
        kind, a, b = self._kind, self._a, self._b
        while len(node):
            k = kind[node]
            leaf = k == _LEAF
            if leaf.any():
                choice[row[leaf], a[node[leaf]] + off[leaf]] = b[node[leaf]]
                np.add.at(hits, row[leaf], 1)
            pair = k == _PAIR
            shift = k == _SHIFT
            row = np.concatenate([row[pair], row[pair], row[shift]])
            off = np.concatenate([off[pair], off[pair], off[shift] + b[node[shift]]])
            node = np.concatenate([a[node[pair]], b[node[pair]], a[node[shift]]])
        if (hits != n_units).any() or (choice < 0).any():
            raise AssertionError("provenance does not assign every unit exactly once")
        return choice
