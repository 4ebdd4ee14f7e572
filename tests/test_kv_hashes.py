"""kvgate's block hashes are vLLM's: the same chain the simulator's engine (written apart, as vLLM's
stand-in) caches blocks by, and the formula measured on vLLM 0.32."""

import hashlib
import pickle

from kvgate.kv_hashes import chain

from vllm_sim.kv_cache import block_hashes, event_hash


def test_the_first_block_is_vllms_formula() -> None:
    tokens = list(range(100, 116))
    none = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    digest = hashlib.sha256(pickle.dumps((none, tuple(tokens), None), protocol=5)).digest()
    assert chain(tokens, 16) == [int.from_bytes(digest, "big") & ((1 << 64) - 1)]


def test_the_chain_matches_the_simulators_engine_for_any_block_size() -> None:
    tokens = [(i * 7919) % 1000 for i in range(1000)]
    for size in (16, 128):
        assert chain(tokens, size) == [event_hash(d) for d in block_hashes(tokens, block_size=size)]
    assert len(chain(tokens, 128)) == 1000 // 128  # full blocks only
    assert chain(tokens, 16, limit=3) == chain(tokens, 16)[:3]


def test_a_block_hash_covers_its_whole_prefix() -> None:
    a = chain([1] * 32, 16)
    b = chain([2] * 16 + [1] * 16, 16)
    assert a[1] != b[1]
