from vllm_sim.kv_cache import BLOCK_SIZE, BlockPool, block_hashes


def test_hashes_chain_over_full_blocks_only() -> None:
    tokens = list(range(40))
    hs = block_hashes(tokens)
    assert len(hs) == 40 // BLOCK_SIZE
    other = list(range(1, 17)) + list(range(16, 32))  # different first block, same second block
    assert block_hashes(other)[1] != hs[1], "a block's hash covers its whole prefix"
    assert block_hashes(tokens, start=1, parent=hs[0]) == hs[1:]


def test_usage_excludes_the_null_block_and_counts_cached_free_blocks_as_free() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(2)
    assert pool.usage() == 0.5
    pool.cache_block(blocks[0], 111)
    pool.release(blocks)
    assert pool.usage() == 0.0
    assert pool.lookup([111], 4) == [blocks[0]]


def test_least_recently_used_free_blocks_are_evicted_first_tail_blocks_first() -> None:
    """Freed blocks keep their hash; a request's tail blocks are evicted before its head blocks."""
    pool = BlockPool(7)  # 6 usable
    a = pool.allocate(3)
    for i, b in enumerate(a):
        pool.cache_block(b, 100 + i)
    pool.release(a)  # free queue tail: a[2], a[1], a[0]
    b = pool.allocate(3)  # the 3 never-used blocks go first
    assert set(b).isdisjoint(a)
    assert pool.lookup([100, 101, 102], 3) == a
    c = pool.allocate(1)  # evicts the LRU cached block: a's tail block
    assert c == [a[2]]
    assert pool.lookup([100, 101, 102], 3) == a[:2]
    assert pool.evictions == 1


def test_a_hit_takes_blocks_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_block(a[0], 5)
    pool.release(a)
    hit = pool.lookup([5], 1)
    assert pool.num_free_after_touch(hit) == 2
    pool.touch(hit)
    assert pool.num_free == 2
    assert pool.ref_cnt[a[0]] == 1
