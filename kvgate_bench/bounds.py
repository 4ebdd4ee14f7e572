"""What no router could beat on a workload, the reference every report shows beside the routers:
the hits of one pooled prefix cache as large as the whole fleet's, and each request's TTFT with
no queue ahead of it."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvgate_bench.workloads import TRACE_BLOCK_TOKENS, BenchRequest
from vllm_sim.kv_cache import block_hashes
from vllm_sim.profiles import Profile


# -- yardsticks ---------------------------------------------------------------------------------------
def pooled_cache_ideal(requests: Sequence[BenchRequest], backends: int, profile: Profile) -> list[int]:
    """Cached tokens per request under one LRU cache holding every backend's KV capacity: what perfect
    routing could at best approach. Trace requests are counted in their 512-token blocks, leading
    blocks only (the trace's own yardstick); chat requests in the profile's chained blocks (vLLM's
    16 tokens on GPUs)."""
    capacity_tokens = backends * (profile.num_gpu_blocks - 1) * profile.block_size
    lru: OrderedDict[Any, None] = OrderedDict()
    out = []
    for r in sorted(requests, key=lambda x: x.arrival):
        if r.blocks:
            unit = TRACE_BLOCK_TOKENS
            keys: list[Any] = list(r.blocks)
            sizes = [min(unit, r.prompt_tokens - k * unit) for k in range(len(keys))]
        else:
            unit = profile.block_size
            keys = block_hashes(r.prompt_ids(), block_size=unit)
            sizes = [unit] * len(keys)
        hit = 0
        for k, size in zip(keys, sizes, strict=True):
            if k not in lru:
                break
            hit += size
        out.append(min(hit, r.prompt_tokens - 1) if not r.blocks else hit)
        for k in keys:
            lru[k] = None
            lru.move_to_end(k)
        cap = capacity_tokens // unit
        while len(lru) > cap:
            lru.popitem(last=False)
    return out


def zero_queue_ttft(requests: Sequence[BenchRequest], cached: Sequence[int], profile: Profile) -> list[float]:
    """TTFT with no queueing and the pooled-ideal cache: frontend plus prefill of uncached tokens."""
    out = []
    budget = profile.max_num_batched_tokens
    for r, c in zip(sorted(requests, key=lambda x: x.arrival), cached, strict=True):
        u = max(1, r.prompt_tokens - c)
        out.append(profile.frontend_s + math.ceil(u / budget) * profile.t0_s + profile.alpha_s * u)
    return out
