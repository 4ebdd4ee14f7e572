"""Paged KV cache with automatic prefix caching, as vLLM V1's BlockPool / KVCacheManager do it.

* Blocks of ``block_size`` tokens (the profile's; ``BLOCK_SIZE`` by default, vLLM's on GPUs). Block 0
  is vLLM's null block, so ``num_gpu_blocks - 1`` are usable
  and usage is ``1 - free / (num_gpu_blocks - 1)``.
* A full block's hash chains its parent's hash and its token ids, so it identifies the whole prefix.
  Only full blocks are hashed and cached. The hash is vLLM's default (``sha256``: SHA-256 of the
  pickled ``(parent digest, token ids, extra keys)``, the first block's parent a fixed digest), so a
  router that computes vLLM's hashes from token ids finds the simulator's blocks too.
* ``take_events`` hands out what changed since the last call, as vLLM's ``BlockPool.take_events``
  does for its KV-event publisher: blocks stored (one event per request per step), blocks evicted
  (lazily, when a free cached block is reused), every block cleared (a prefix-cache reset).
* Freed blocks keep their hash and go to the tail of an LRU free queue (a request's blocks in reverse
  order, so its tail blocks, the longest prefixes, are evicted first). A hit on a free block takes it
  back out of the queue. Allocation pops from the head and evicts the hash it still carries.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_SIZE = 16  # vLLM's default on GPUs; a profile may set its own (128 on CPU)
# The first block's parent: vLLM's NONE_HASH when PYTHONHASHSEED is unset (measured on vLLM 0.32).
NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


def block_hashes(
    tokens: Sequence[int],
    start: int = 0,
    parent: bytes | None = None,
    block_size: int = BLOCK_SIZE,
    salt: str | None = None,
) -> list[bytes]:
    """Chained hashes (SHA-256 digests) of the full blocks of ``tokens`` from block ``start`` on.

    ``parent`` is the digest of block ``start - 1`` (NONE_HASH when ``start == 0``); a request's
    ``cache_salt`` is the first block's extra key, as in vLLM, so salted prompts share nothing."""
    out: list[bytes] = []
    h = NONE_HASH if parent is None else parent
    n_full = len(tokens) // block_size
    for i in range(start, n_full):
        extra = (salt,) if i == 0 and salt is not None else None
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        h = hashlib.sha256(pickle.dumps((h, block, extra), protocol=5)).digest()
        out.append(h)
    return out


def event_hash(digest: bytes) -> int:
    """A block hash as vLLM's KV events carry it: the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


class BlockPool:
    """Reference-counted blocks, a hash index of cached blocks and an LRU queue of free blocks."""

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2")
        self.num_gpu_blocks = num_gpu_blocks
        self.usable = num_gpu_blocks - 1
        self.ref_cnt = [0] * num_gpu_blocks
        self.block_hash: list[bytes | None] = [None] * num_gpu_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Insertion order is LRU order: the head is evicted first. Block 0 is the null block.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_gpu_blocks))
        self.evictions = 0
        self.events: list[KvEvent] | None = None  # a list once a publisher wants them

    def take_events(self) -> list[KvEvent]:
        """The events since the last call (none until the first call: nobody listened before)."""
        out, self.events = self.events or [], []
        return out

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.usable

    def lookup(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``, at most ``max_blocks`` long."""
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def num_free_after_touch(self, hit: Sequence[int]) -> int:
        """Free blocks left once the hit blocks sitting in the free queue are taken out of it."""
        return len(self.free) - sum(1 for b in hit if self.ref_cnt[b] == 0)

    def touch(self, hit: Sequence[int]) -> None:
        for b in hit:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("allocate() called without enough free blocks")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self.evictions += 1
                if self.cached.get(h) == b:
                    del self.cached[h]
                if self.events is not None:
                    self.events.append(Removed((event_hash(h),)))
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, tokens: Sequence[int], size: int) -> None:
        """Report blocks that became full and cached in one step of one request."""
        if self.events is not None and hashes:  # the caller skips the call when nobody listens
            ids = tuple(event_hash(h) for h in hashes)
            self.events.append(
                Stored(ids, None if parent is None else event_hash(parent), tuple(tokens), size)
            )

    def cache_block(self, block: int, h: bytes) -> None:
        """Record that ``block`` is full and holds the prefix identified by ``h``."""
        self.block_hash[block] = h
        # An identical block may already be cached (two requests prefilled the same prefix at once);
        # vLLM keeps both, lookups find the first.
        self.cached.setdefault(h, block)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; free blocks join the LRU tail, last block first."""
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, as vLLM's /reset_prefix_cache does when nothing is running."""
        if len(self.free) != self.usable:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_gpu_blocks
        if self.events is not None:
            self.events.append(Cleared())
        return True
