"""Approximate, memory-bounded index of which prompt prefixes were sent to which backend.

Like SGLang's approximate radix tree or llm-d's prefix scorer, it records routing decisions, not the
backends' real cache contents, so it can be wrong when a backend evicts: it is a hint weighed against
load, never a promise. Keys are the chained chunk hashes of ``kvgate.features``; because each hash
covers its whole prefix, a flat map from hash to backends is a radix tree in disguise.

Shared prefixes (a system prompt every conversation starts with) are recognised by their fan-out: a
chunk that many different chunks have followed is a branching point, and everything up to the deepest
such chunk is common to many requests. ``match`` reports that depth so policies can ignore it: a
prefix that every conversation shares is no reason to send a new conversation to one node.

Memory is bounded with two generations: new entries go to ``current``; when it holds half the budget,
``current`` becomes ``previous`` and the old ``previous`` is dropped. A hit in ``previous`` is copied
forward, so prefixes in use survive and cold ones age out in O(1) amortised time, with no per-entry LRU
bookkeeping on the hot path.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

HOT_FANOUT = 3  # continuations seen after a chunk that make it a shared branching point
MAX_HOLDERS = 8  # a prefix recorded on more nodes than this is everywhere: keep the latest few


@dataclass(frozen=True, slots=True)
class Match:
    depth: dict[str, int]  # backend -> leading chunks it probably holds
    shared: int  # leading chunks that are common to many requests (up to the deepest branching point)


# An entry: (holders, fan-out). Tuples keep the index compact and copy-free to age.
_Entry = tuple[tuple[str, ...], int]


class PrefixIndex:
    def __init__(self, max_entries: int = 1_000_000) -> None:
        self.max_entries = max_entries
        self._current: dict[str, _Entry] = {}
        self._previous: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)

    def _get(self, h: str) -> _Entry | None:
        found = self._current.get(h)
        if found is None:
            found = self._previous.get(h)
            if found is not None:
                self._put(h, found)
        return found

    def _put(self, h: str, entry: _Entry) -> None:
        self._current[h] = entry
        if len(self._current) >= self.max_entries // 2:
            self._previous = self._current
            self._current = {}

    def match(self, hashes: Sequence[str], eligible: Collection[str]) -> Match:
        """Leading chunks each eligible backend probably holds, and how many are widely shared."""
        alive: set[str] = set()
        last_nodes: tuple[str, ...] | None = None
        depth: dict[str, int] = {}
        shared = 0
        i = 0
        for i, h in enumerate(hashes):
            entry = self._get(h)
            if entry is None:
                break
            nodes, fanout = entry
            if fanout >= HOT_FANOUT:
                shared = i + 1
            if nodes != last_nodes:
                # Holders only change where conversations branch; between branches the walk is one
                # dict lookup per chunk.
                here = (
                    {n for n in nodes if n in eligible} if last_nodes is None else alive.intersection(nodes)
                )
                for gone in alive - here:
                    depth[gone] = i
                alive = here
                last_nodes = nodes
        else:
            i = len(hashes)
        for n in alive:
            depth[n] = i
        return Match({n: d for n, d in depth.items() if d > 0}, shared)

    def record(self, hashes: Sequence[str], node: str) -> None:
        """Remember that ``node`` was sent (and so will cache) every chunk of ``hashes``."""
        current, previous = self._current, self._previous
        for i, h in enumerate(hashes):
            entry = current.get(h) or previous.get(h)
            if entry is None:
                self._insert_new(hashes, i, node)
                return
            nodes, fanout = entry
            if node not in nodes:
                self._put(h, ((*nodes[-(MAX_HOLDERS - 1) :], node), fanout))
            elif h not in current:
                self._put(h, entry)

    def _insert_new(self, hashes: Sequence[str], first: int, node: str) -> None:
        """Insert ``hashes[first:]``, all new: a chain hash never seen has no known descendants."""
        if first > 0:
            parent = hashes[first - 1]
            holders, fanout = self._current.get(parent) or self._previous.get(parent) or ((node,), 0)
            if fanout < HOT_FANOUT:
                self._put(parent, (holders, fanout + 1))  # a new continuation of the parent
        holders_new = (node,)
        tail = hashes[first:]
        self._current.update(dict.fromkeys(tail[:-1], (holders_new, 1)))  # one C loop, not a generator
        self._current[tail[-1]] = (holders_new, 0)
        if len(self._current) >= self.max_entries // 2:
            self._previous = self._current
            self._current = {}
