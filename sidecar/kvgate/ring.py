"""Immutable consistent-hash ring (mmh3) with a bounded-load walk.

Points: ``vnodes * weight`` per node, at ``mmh3("<node id>#<i>")``, node ids sorted first so every
sidecar builds the same ring from the same membership. A ring is built off the hot path when membership
changes and swapped whole; nothing mutates it per request. Load never moves points (that would move
keys and throw cache away): it only decides which nodes the walk may stop at.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping

import mmh3


def key_hash(key: str) -> int:
    # Hash the UTF-8 bytes, never the str: mmh3 crashes the process on a str holding a lone surrogate
    # (a client's X-Session-ID can carry one), and the bytes give the same value for every valid str.
    return int(mmh3.hash(key.encode("utf-8", "surrogatepass"), signed=False))


class Ring:
    __slots__ = ("_hashes", "_nodes", "nodes")

    def __init__(self, weights: Mapping[str, float], vnodes: int = 160) -> None:
        points: list[tuple[int, str]] = []
        for node in sorted(weights):
            count = max(1, round(vnodes * weights[node]))
            points.extend((key_hash(f"{node}#{i}"), node) for i in range(count))
        points.sort()
        self._hashes = [h for h, _ in points]
        self._nodes = [n for _, n in points]
        self.nodes: tuple[str, ...] = tuple(sorted(weights))

    def __len__(self) -> int:
        return len(self.nodes)

    def walk(self, key: str) -> Iterator[str]:
        """Distinct nodes clockwise from the key's position: the key's owner first."""
        if not self._hashes:
            return
        start = bisect.bisect_left(self._hashes, key_hash(key))
        seen: set[str] = set()
        n = len(self._hashes)
        for i in range(n):
            node = self._nodes[(start + i) % n]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.nodes):
                    return

    def owner(self, key: str) -> str | None:
        return next(self.walk(key), None)
