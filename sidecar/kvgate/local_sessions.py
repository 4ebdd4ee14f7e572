"""The bindings this sidecar knows, in process memory: a bounded LRU map of session key -> (backend,
when Redis last confirmed it). The session store (``kvgate.sessions``) reads it first, answers from it
while Redis is down, and writes every answer Redis gives into it."""

from __future__ import annotations

import asyncio
from collections import OrderedDict


class LocalSessions:
    """Bounded LRU map: key -> (backend, monotonic time it was last confirmed with Redis)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._changed: asyncio.Event | None = None  # made only while a decision waits for a binding

    def get(self, key: str) -> tuple[str, float] | None:
        entry = self._map.get(key)
        if entry is not None:
            self._map.move_to_end(key)
        return entry

    def __len__(self) -> int:
        return len(self._map)

    def set(self, key: str, node: str, confirmed: float) -> None:
        self._map[key] = (node, confirmed)
        self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def changed(self) -> asyncio.Event:
        """Set by the next ``set``: a decision waiting for a binding to be learnt looks again."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed
