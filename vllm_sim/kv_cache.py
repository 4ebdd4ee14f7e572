"""Paged KV cache with automatic prefix caching, as vLLM V1's BlockPool / KVCacheManager do it.

* Blocks of ``block_size`` tokens (the profile's; ``BLOCK_SIZE`` by default, vLLM's on GPUs). Block 0
  is vLLM's null block, so ``num_gpu_blocks - 1`` are usable
  and usage is ``1 - free / (num_gpu_blocks - 1)``.
* A full block's hash chains its parent's hash and its token ids, so it identifies the whole prefix.
  Only full blocks are hashed and cached.
* Freed blocks keep their hash and go to the tail of an LRU free queue (a request's blocks in reverse
  order, so its tail blocks, the longest prefixes, are evicted first). A hit on a free block takes it
  back out of the queue. Allocation pops from the head and evicts the hash it still carries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK_SIZE = 16  # vLLM's default on GPUs; a profile may set its own (128 on CPU)
NONE_HASH = 0  # parent hash of the first block; cache_salt is mixed in by the caller


def block_hashes(
    tokens: Sequence[int], start: int = 0, parent: int | None = None, block_size: int = BLOCK_SIZE
) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` from block index ``start`` on.

    ``parent`` is the hash of block ``start - 1`` (or the salted root hash when ``start == 0``).
    Python's hash of a tuple of ints is deterministic across processes, unlike a hash of str.
    """
    out: list[int] = []
    h = NONE_HASH if parent is None else parent
    n_full = len(tokens) // block_size
    for i in range(start, n_full):
        h = hash((h, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


class BlockPool:
    """Reference-counted blocks, a hash index of cached blocks and an LRU queue of free blocks."""

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2")
        self.num_gpu_blocks = num_gpu_blocks
        self.usable = num_gpu_blocks - 1
        self.ref_cnt = [0] * num_gpu_blocks
        self.block_hash: list[int | None] = [None] * num_gpu_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # Insertion order is LRU order: the head is evicted first. Block 0 is the null block.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_gpu_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.usable

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
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
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def cache_block(self, block: int, h: int) -> None:
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
        return True
