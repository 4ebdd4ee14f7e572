"""Approximate, memory-bounded index of which prompt prefixes were sent to which backend.

Like SGLang's approximate radix tree or llm-d's prefix scorer, it records routing decisions, not the
backends' real cache contents, so it can be wrong when a backend evicts (``kvgate.residency`` cuts a
match to what each backend's cache size says it still holds): it is a hint weighed against load,
never a promise. Keys are the chained chunk hashes of ``kvgate.features``; because each hash
covers its whole prefix, a flat map from hash to backends is a radix tree in disguise.

Shared prefixes (a system prompt every conversation starts with) are recognised by their fan-out: a
chunk that many different chunks have followed is a branching point, and everything up to the deepest
such chunk is common to many requests. ``match`` reports that depth so policies can ignore it: a
prefix that every conversation shares is no reason to send a new conversation to one node.

Memory is bounded with two generations: new entries go to ``current``; when it holds half the budget,
``current`` becomes ``previous`` and the old ``previous`` is dropped. A hit in ``previous`` is copied
forward, so prefixes in use survive and cold ones age out in O(1) amortised time, with no per-entry LRU
bookkeeping on the hot path. Each generation is stored as a few small dicts (segments of at most
``max_entries / SEGMENTS``), and a dropped one is freed a few hundred entries per ``record``: growing
one dict past 350,000 entries (a resize) or freeing half a million at once each stalled a decision for
3 to 12 ms.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

HOT_FANOUT = 3  # continuations seen after a chunk that make it a shared branching point
MAX_HOLDERS = 8  # a prefix recorded on more nodes than this is everywhere: keep the latest few
FREE_PER_RECORD = 512  # entries of a dropped generation freed per record() call
SEGMENTS = 16  # per max_entries: a segment holds at most max_entries / SEGMENTS


@dataclass(frozen=True, slots=True)
class Match:
    depth: dict[str, int]  # backend -> leading chunks it probably holds
    shared: int  # leading chunks that are common to many requests (up to the deepest branching point)
    generation: int = -1  # the index's generation when the walk began (see ``record``)


# An entry is one string: the fan-out digit, then each holder between separators ("2|b1|b3|"). A
# string, not a tuple: a dict of strings is invisible to Python's cyclic GC, and a million tracked
# entries made each full collection stall a decision for 13 ms. Backend ids never contain SEP (the
# config refuses control characters in them).
_Entry = str
SEP = "\x1f"


def _entry(holders: Sequence[str], fanout: int) -> _Entry:
    return f"{min(fanout, HOT_FANOUT)}{SEP}{SEP.join(holders)}{SEP}"


def _fanout(e: _Entry) -> int:
    return ord(e[0]) - 48


def _holders(e: _Entry) -> list[str]:
    return e[2:-1].split(SEP)


class _Generation:
    """Entries of one generation, in segments (newest last) so that no dict grows large."""

    def __init__(self, segment: int) -> None:
        self.segment = segment
        self.parts: list[dict[str, _Entry]] = [{}]
        self.size = 0

    def get(self, h: str) -> _Entry | None:
        return self.find(h, len(self.parts) - 1)[0]  # newest segment first

    def find(self, h: str, hint: int) -> tuple[_Entry | None, int]:
        """``get``, trying segment ``hint`` first; returns the entry and the segment that held it (the
        hint for the next hash). A chain's hashes are added together, so a walk down a prompt finds
        the next hash in the segment that held the last: one lookup instead of one per segment (a full
        generation has 8). A key lives in one segment only, so where it is found is where it is."""
        parts = self.parts
        if hint < len(parts):
            found = parts[hint].get(h)
            if found is not None:
                return found, hint
        for i in range(len(parts) - 1, -1, -1):
            if i != hint:
                found = parts[i].get(h)
                if found is not None:
                    return found, i
        return None, hint

    def set(self, h: str, entry: _Entry) -> None:
        """Overwrite in place where a segment holds ``h``, else add it."""
        for part in self.parts:
            if h in part:
                part[h] = entry
                return
        self.add_new([h], entry)

    def add_new(self, keys: Sequence[str], entry: _Entry) -> None:
        """Add keys no segment holds (a new chain's hashes): appended to the newest segment, a new one
        when it is full; one C loop per segment, not a generator."""
        while keys:
            last = self.parts[-1]
            if len(last) >= self.segment:
                last = {}
                self.parts.append(last)
            room = self.segment - len(last)
            before = len(last)
            last.update(dict.fromkeys(keys[:room], entry))
            self.size += len(last) - before
            keys = keys[room:]


class PrefixIndex:
    def __init__(self, max_entries: int = 1_000_000) -> None:
        self.max_entries = max_entries
        self._segment = max(1, max_entries // SEGMENTS)
        self._current = _Generation(self._segment)
        self._previous = _Generation(self._segment)
        self._retired: list[dict[str, _Entry]] = []  # segments of dropped generations, freed bit by bit
        self._generation = 0  # how many times the current generation was started

    def __len__(self) -> int:
        return self._current.size + self._previous.size

    def sizes(self) -> dict[str, int]:
        return {
            "prefix_index_blocks": len(self),
            "prefix_index_bound": self.max_entries,
            "prefix_index_retired_segments": len(self._retired),
        }

    def _get(self, h: str, hints: list[int]) -> _Entry | None:
        """The entry for ``h`` (a hit in the previous generation is copied forward); ``hints`` are the
        segments, in the current and the previous generation, where the walk found its last hash."""
        found, hints[0] = self._current.find(h, hints[0])
        if found is None:
            found, hints[1] = self._previous.find(h, hints[1])
            if found is not None:
                self._put(h, found)
        return found

    def _put(self, h: str, entry: _Entry) -> None:
        self._current.set(h, entry)
        if self._current.size >= self.max_entries // 2:
            self._age()

    def _age(self) -> None:
        self._generation += 1
        self._retired += self._previous.parts
        self._previous = self._current
        self._current = _Generation(self._segment)

    def _free_some(self) -> None:
        budget = FREE_PER_RECORD
        while self._retired and budget > 0:
            old = self._retired[-1]
            n = min(budget, len(old))
            for _ in range(n):
                old.popitem()
            budget -= n
            if not old:
                self._retired.pop()

    def match(self, hashes: Sequence[str], eligible: Collection[str]) -> Match:
        """Leading chunks each eligible backend probably holds, and how many are widely shared."""
        generation = self._generation
        alive: set[str] = set()
        last_nodes: str | None = None
        depth: dict[str, int] = {}
        shared = 0
        i = 0
        hints = [0, 0]
        segment = self._current.parts[-1]
        for i, h in enumerate(hashes):
            # The segment that held the last hash, inline: a returning prompt's walk is this one
            # lookup per chunk. ``_get`` (every segment, then the previous generation) only on a miss.
            entry = segment.get(h)
            if entry is None:
                entry = self._get(h, hints)
                if entry is None:
                    break
                parts = self._current.parts  # a copy forward may have begun a new generation
                segment = parts[hints[0]] if hints[0] < len(parts) else parts[-1]
            if _fanout(entry) >= HOT_FANOUT:
                shared = i + 1
            nodes = entry[1:]
            if nodes != last_nodes:
                # Holders only change where conversations branch; between branches the walk is one
                # dict lookup per chunk.
                held = _holders(entry)
                here = {n for n in held if n in eligible} if last_nodes is None else alive.intersection(held)
                for gone in alive - here:
                    depth[gone] = i
                alive = here
                last_nodes = nodes
        else:
            i = len(hashes)
        for n in alive:
            depth[n] = i
        return Match({n: d for n, d in depth.items() if d > 0}, shared, generation)

    def record(self, hashes: Sequence[str], node: str, matched: Match | None = None) -> None:
        """Remember that ``node`` was sent (and so will cache) every chunk of ``hashes``.

        ``matched``: this decision's ``match`` of the same hashes. The chunks it found ``node``
        holding are skipped: the walk copied them into the current generation with ``node`` among
        their holders, so walking them again would change nothing (a chat's next turn returns to the
        previous turn's chunks on the backend holding them; walking them twice was two fifths of the
        index's time in a burst of such turns). Unless a new generation began since the walk: then
        they sit in the previous one, and are walked again to be copied forward. What another
        decision records meanwhile (this one awaits its session's claim) can only have pushed
        ``node`` out of a chunk held by more than ``MAX_HOLDERS`` nodes: a chunk that is everywhere,
        as far as routing is concerned."""
        if self._retired:
            self._free_some()
        needle = f"{SEP}{node}{SEP}"
        hint_current = hint_previous = 0
        held = matched.depth.get(node, 0) if matched and matched.generation == self._generation else 0
        for i in range(held, len(hashes)):
            h = hashes[i]
            current, previous = self._current, self._previous
            in_current, hint_current = current.find(h, hint_current)
            entry = in_current
            if entry is None:
                entry, hint_previous = previous.find(h, hint_previous)
            if entry is None:
                self._insert_new(hashes, i, node)
                return
            if needle not in entry:
                self._put(h, _entry([*_holders(entry)[-(MAX_HOLDERS - 1) :], node], _fanout(entry)))
            elif in_current is None:
                self._put(h, entry)

    def _insert_new(self, hashes: Sequence[str], first: int, node: str) -> None:
        """Insert ``hashes[first:]``, all new: a chain hash never seen has no known descendants."""
        if first > 0:
            parent = hashes[first - 1]
            known = self._current.get(parent) or self._previous.get(parent) or _entry([node], 0)
            if _fanout(known) < HOT_FANOUT:
                self._put(parent, f"{_fanout(known) + 1}{known[1:]}")  # a new continuation of the parent
        tail = hashes[first:]
        self._current.add_new(tail[:-1], _entry([node], 1))
        self._current.add_new(tail[-1:], _entry([node], 0))  # no continuation yet
        if self._current.size >= self.max_entries // 2:
            self._age()
