"""What each backend's prefix cache holds, from its own KV events: the exact index.

Fed by ``kvgate.kv_subscriber`` (decoded by ``kvgate.kv_events``); read by the planner, which asks
how many leading blocks of a prompt (``kvgate.kv_hashes``) a backend holds. Per backend and per
data-parallel rank it keeps the set of block hashes stored and not yet removed (with a count: vLLM
can hold two copies of one block and reports each), the last sequence number and the block size.

The sequence number decides how far the view can be trusted:

* ``full``: every event since the engine started was applied (the stream began at 0, or a replay
  filled the gap). A block not in the set is not held.
* ``partial``: events were missed (a late subscriber, a gap no replay filled). Blocks seen since are
  held, but blocks stored before may be held too: the planner takes the larger of this view and
  the approximate index's for that backend. A restart (the sequence back to 0) or a cleared cache
  makes the view full again: the engine's cache is then empty and every block will be reported.
* ``stale``: the backend prefilled tokens (its scraped prefix-cache misses grew by two blocks or
  more) and no event came within ``stale_s``: the stream is down. The approximate index serves
  that backend until events flow again.

Memory is bounded: each backend keeps at most ``max_blocks`` hashes; past that the oldest stored
are dropped first (vLLM evicts least recently used blocks, and a block stored long ago is the one
most likely gone).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvgate.features import CHUNK_BYTES, Features
from kvgate.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvgate.kv_hashes import lazy_chain


class View(enum.Enum):
    NONE = "none"  # no event seen yet
    FULL = "full"
    PARTIAL = "partial"
    STALE = "stale"


class Applied(enum.Enum):
    OK = "ok"
    GAP = "gap"  # events were missed (the subscriber replays them first when it can): view partial
    RESTART = "restart"  # the sequence went back: a new engine, its view cleared
    OLD = "old"  # a message already applied (a replay overlapping the live stream): skipped


@dataclass(slots=True)
class _Backend:
    ranks: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> hash -> copies, oldest first
    seq: int = -1  # the last sequence number applied (one publisher stream per backend)
    full: bool = False
    block_size: int = 0
    last_event: float = 0.0
    misses: float | None = None  # prefix-cache misses (tokens) at the last scrape
    misses_at_event: float | None = None  # ... as they were when the last event came
    stale: bool = False


class ExactIndex:
    def __init__(
        self, max_blocks: int = 262_144, stale_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_blocks = max_blocks
        self.stale_s = stale_s
        self.clock = clock
        self._b: dict[str, _Backend] = {}
        self.dropped = 0  # hashes dropped to stay within max_blocks

    # -- feeding ------------------------------------------------------------------------------------
    def next_seq(self, backend: str) -> int | None:
        """The sequence number the backend's next message should carry (None before the first)."""
        b = self._b.get(backend)
        return None if b is None or b.seq < 0 else b.seq + 1

    def apply(self, backend: str, seq: int, batch: EventBatch, replayed: bool = False) -> Applied:
        """``replayed``: the message came from the replay socket, which may repeat applied ones; on
        the live stream (ordered, as ZMQ keeps it) a number that goes back means a new engine."""
        b = self._b.setdefault(backend, _Backend())
        result = Applied.OK
        if b.seq < 0:
            b.full = seq == 0
            result = Applied.OK if seq == 0 else Applied.GAP  # a late subscriber: no snapshot exists
        elif seq <= b.seq:
            if replayed:
                return Applied.OLD
            b.ranks.clear()  # a new engine, with an empty cache (its first messages may be lost)
            b.full = seq == 0
            result = Applied.RESTART
        elif seq != b.seq + 1:
            b.full = False
            result = Applied.GAP
        b.seq = seq
        self._events(b, b.ranks.setdefault(batch.rank, {}), batch)
        b.last_event = self.clock()
        b.misses_at_event = b.misses
        b.stale = False
        return result

    def _events(self, b: _Backend, held: dict[int, int], batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                b.block_size = ev.block_size
                for h in ev.hashes:
                    held[h] = held.pop(h, 0) + 1  # moved to the end: the newest
            elif isinstance(ev, BlockRemoved):
                for h in ev.hashes:
                    n = held.get(h)
                    if n is None:
                        continue
                    if n > 1:
                        held[h] = n - 1
                    else:
                        del held[h]
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
                if len(b.ranks) == 1:
                    b.full = True  # empty now, and everything stored from here is reported
        over = len(held) - self.max_blocks
        if over > 0:
            for h in list(itertools.islice(held, over)):
                del held[h]
            self.dropped += over

    def scraped(self, backend: str, misses: float) -> None:
        """The backend's prefix-cache misses (tokens prefilled, from ``/metrics``) at a scrape: grown
        by two blocks or more with no event for ``stale_s`` means the stream is not reaching us."""
        b = self._b.get(backend)
        if b is None:
            return
        b.misses = misses
        if b.misses_at_event is None:
            b.misses_at_event = misses
            return
        grown = misses - b.misses_at_event
        if b.block_size and grown >= 2 * b.block_size and self.clock() - b.last_event > self.stale_s:
            b.stale = True
        elif grown < 0:  # counters reset: the engine restarted
            b.misses_at_event = misses

    def restart(self, backend: str) -> None:
        """The backend's engine started again: nothing it held is left, and the stream starts over."""
        b = self._b.get(backend)
        if b is not None:
            b.ranks.clear()
            b.seq = -1
            b.full = False

    def forget(self, backend: str) -> None:
        """The backend left, or its publisher changed: nothing is known of it until events come."""
        self._b.pop(backend, None)

    # -- reading ------------------------------------------------------------------------------------
    def view(self, backend: str) -> View:
        b = self._b.get(backend)
        if b is None or b.seq < 0 or not b.block_size:
            return View.NONE
        if b.stale:
            return View.STALE
        return View.FULL if b.full else View.PARTIAL

    def last_event(self, backend: str) -> float | None:
        b = self._b.get(backend)
        return None if b is None or b.seq < 0 else b.last_event

    def block_size(self, backend: str) -> int:
        b = self._b.get(backend)
        return b.block_size if b is not None else 0

    def depth(self, backend: str, hashes: Iterable[int]) -> int:
        """Leading blocks of ``hashes`` the backend holds (on any of its ranks)."""
        return self.depths([backend], hashes).get(backend, 0)

    def depths(self, backends: Sequence[str], hashes: Iterable[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each backend holds; reads ``hashes`` only as far as some
        backend (rank) still holds every block so far, so a lazy chain is hashed no further."""
        live = [(bid, held) for bid in backends if (b := self._b.get(bid)) for held in b.ranks.values()]
        out = dict.fromkeys(backends, 0)
        for n, h in enumerate(hashes, 1):
            live = [(bid, held) for bid, held in live if h in held]
            if not live:
                break
            for bid, _ in live:
                out[bid] = n
        return out

    def size(self, backend: str) -> int:
        b = self._b.get(backend)
        return sum(len(r) for r in b.ranks.values()) if b is not None else 0

    def prefix_depths(
        self, f: Features, tokens: tuple[int, ...], nodes: list[str], approx: dict[str, int], shared: int
    ) -> tuple[dict[str, int], int]:
        """Each backend's held prefix from its KV events, in the approximate index's unit (chunks of
        the prompt's bytes, so the policy weighs both alike). A backend whose view is partial gets the
        deeper of the two views; one with no view, or a stale one, keeps the approximate depth
        (``approx``). When every backend has a full view, the part every one of them holds is the
        shared part."""
        by_size: dict[int, list[str]] = {}  # the backends with a view, by their block size
        views = {n: self.view(n) for n in nodes}
        for n, view in views.items():
            if view in (View.FULL, View.PARTIAL):
                by_size.setdefault(self.block_size(n), []).append(n)
        depth = dict(approx)
        for size, same in by_size.items():
            held = self.depths(same, lazy_chain(tokens, size, (len(tokens) - 1) // size))
            for n, blocks in held.items():
                chunks = int(blocks * size * f.bytes_per_token / CHUNK_BYTES)
                depth[n] = chunks if views[n] is View.FULL else max(chunks, approx.get(n, 0))
        if all(v is View.FULL for v in views.values()):
            shared = min(depth.get(n, 0) for n in nodes)
        return depth, shared
