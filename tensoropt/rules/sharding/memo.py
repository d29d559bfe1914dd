"""A bounded memo for the sharding rules' pure functions (least recently used out first)."""

from __future__ import annotations

from collections import OrderedDict


class Memo:
    """A bounded memo of a pure function's results, least recently used out first.

    The sharding rules are pure functions of an op's plain-data view (and a strategy and
    mesh shape); deep models repeat the same views in every layer, so their strategies,
    local forms and conversion volumes are computed once per distinct key. The bound
    keeps a long-lived process (a test run, a notebook) from growing without limit.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict = OrderedDict()

    def get(self, key):
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key, value):
        self._items[key] = value
        if len(self._items) > self.maxsize:
            self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)
