"""What each backend's prefix cache still holds of what the gateway sent it: the approximate index's
model of the engine's eviction.

The prefix index (``kvgate.prefix_index``) remembers where each prefix was sent for as long as its
memory bound allows, far longer than a backend keeps it: an H100 serving an 8B model caches about
430,000 tokens, a few dozen long prompts. vLLM evicts the least recently used free blocks, a
request's tail blocks before its head. So each backend gets an LRU of the chunks sent there, a
prompt's head the most recent, as large as its cache (``vllm:cache_config_info``: blocks x block
size, in chunks at the model's bytes per token); a prefix the index says a backend holds counts only
down to the deepest chunk still in that LRU. A prompt longer than its hashes (``MAX_CHUNKS``) pushes
out as many chunks as it is long. An ordered LRU costs 10-40 us per decision for a prompt of 256
chunks (``kvgate-bench decisions``: p50 +0.03 ms at 50 KB, +0.19 ms at 500 KB); counting chunks
written with two generations instead, a third cheaper, kept dropped contexts too long and lost half
the gain under cache pressure at 3x (0.96 against 0.60 s).

Without it, under cache pressure (160 tenants' contexts filling three quarters of four caches) the
index credited backends with contexts they had dropped, sent turns there to prefill in full, and
ordered the gateway queue on prefixes that were gone.

Other gateway replicas and clients fill the same cache: each replica models only its own part of it,
the cache times the share of the engine's prompt tokens it sent (``Realized.own``). Not modelled: the
blocks running requests hold and their answers' blocks, which shrink the cache further. The realized
share (``kvgate.realized``) still scales what is left by what the engine serves.

Nothing to bring down: each LRU is bounded by its backend's cache and forgotten with the backend,
and emptied when its engine starts again (``Registry.started_again``).
A backend whose cache size is unknown keeps no LRU: the index is trusted as it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Cache:
    capacity: int  # chunks the backend's cache holds (this replica's part of it)
    lru: OrderedDict[str, None] = field(default_factory=OrderedDict)  # chunks sent there, oldest first


class Residency:
    def __init__(self) -> None:
        self._caches: dict[str, _Cache] = {}

    def __len__(self) -> int:
        return len(self._caches)

    def sent(self, node: str, hashes: Sequence[str], capacity: int | None, size: int = 0) -> None:
        """A prompt of ``size`` chunks (its ``hashes``: those it is hashed by, at most
        ``features.MAX_CHUNKS``) went to ``node``, whose cache holds ``capacity`` chunks (None:
        unknown, and nothing is modelled for it)."""
        if capacity is None or capacity <= 0:
            self._caches.pop(node, None)
            return
        cache = self._caches.get(node)
        if cache is None:
            cache = self._caches[node] = _Cache(capacity)
        cache.capacity = capacity
        lru = cache.lru
        for h in reversed(hashes):  # the head last: the most recent, evicted last
            lru[h] = None
            lru.move_to_end(h)
        keep = max(0, capacity - max(0, size - len(hashes)))  # the unhashed rest fills the cache too
        for _ in range(len(lru) - keep):
            lru.popitem(last=False)

    def trim(self, hashes: Sequence[str], depth: Mapping[str, int]) -> dict[str, int]:
        """``depth`` (backend -> leading chunks the index says it holds) cut to what each backend's
        LRU still has. A head is always sent with its tail and after it, so what is held is a
        prefix: a binary search finds where it ends."""
        out: dict[str, int] = {}
        for node, d in depth.items():
            cache = self._caches.get(node)
            if cache is not None and hashes[d - 1] not in cache.lru:
                lo, hi = 0, d - 1  # the deepest held count is in [lo, hi]
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if hashes[mid - 1] in cache.lru:
                        lo = mid
                    else:
                        hi = mid - 1
                d = lo
            if d > 0:
                out[node] = d
        return out

    def describe(self, node: str) -> dict[str, float] | None:
        """The model of ``node``'s cache (``/v1/backends``): chunks it holds, of how many."""
        cache = self._caches.get(node)
        return None if cache is None else {"chunks": len(cache.lru), "capacity_chunks": cache.capacity}

    def restart(self, node: str) -> None:
        """``node``'s engine started again with an empty cache: nothing the index credits it with
        is held there any more (a node of unknown cache size stays trusted as the index says)."""
        cache = self._caches.get(node)
        if cache is not None:
            cache.lru.clear()

    def forget(self, keep: Collection[str]) -> None:
        """Backends that left the registry take their LRUs with them."""
        for node in [n for n in self._caches if n not in keep]:
            del self._caches[node]
