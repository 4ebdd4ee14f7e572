"""What no router could beat on a workload, the references every report shows beside the routers:
the hits of one pooled prefix cache as large as the whole fleet's, each request's TTFT with no
queue ahead of it, and its TTFT when the fleet's backends take the work as one scheduler would
that knew every prompt's cost (``fleet_ttft``): the queueing that bursts and load make unavoidable."""

from __future__ import annotations

import heapq
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
    """TTFT with no queueing and the pooled-ideal cache: frontend plus prefill of uncached tokens
    (and their attention to the context, where the profile prices it)."""
    out = []
    budget = profile.max_num_batched_tokens
    for r, c in zip(sorted(requests, key=lambda x: x.arrival), cached, strict=True):
        u = max(1, r.prompt_tokens - c)
        attention = u * (r.prompt_tokens - u / 2) / 1000.0
        steps = math.ceil(u / budget) * profile.t0_s
        out.append(profile.frontend_s + steps + profile.alpha_s * u + profile.delta_s * attention)
    return out


def fleet_ttft(
    requests: Sequence[BenchRequest], cached: Sequence[int], profile: Profile, backends: int, speedup: float
) -> list[float]:
    """TTFT (in arrival order) when ``backends`` prefill the requests, each on one backend, shortest
    remaining prefill first across the whole fleet, a shorter arrival taking the place of a longer
    one in progress; the pooled-ideal cache. A reference, not a strict bound: an engine's step can
    share its fixed cost between prefills, and decodes take none of its time here."""
    reqs = sorted(requests, key=lambda x: x.arrival)
    zero = zero_queue_ttft(reqs, cached, profile)
    arrival = [r.arrival / speedup for r in reqs]
    work = [z - profile.frontend_s for z in zero]
    out = [0.0] * len(reqs)
    waiting: list[tuple[float, int]] = []  # (remaining seconds, request)
    running: dict[int, float] = {}  # request -> remaining seconds
    t, i = 0.0, 0
    while i < len(reqs) or waiting or running:
        until = min(min(running.values(), default=math.inf), arrival[i] - t if i < len(reqs) else math.inf)
        running = {k: rem - until for k, rem in running.items()}
        t += until
        for k in [k for k, rem in running.items() if rem <= 1e-12]:
            del running[k]
            out[k] = t - arrival[k] + profile.frontend_s
        while i < len(reqs) and arrival[i] <= t:
            heapq.heappush(waiting, (work[i], i))
            i += 1
        while waiting and len(running) < backends:
            rem, k = heapq.heappop(waiting)
            running[k] = rem
        while waiting and running:  # preemption: a shorter waiting one takes a longer one's place
            longest = max(running, key=running.__getitem__)
            if waiting[0][0] >= running[longest]:
                break
            rem, k = heapq.heappop(waiting)
            heapq.heappush(waiting, (running.pop(longest), longest))
            running[k] = rem
    return out
