"""Per-backend load: scraped vLLM gauges plus the sidecar's own in-flight accounting.

The scrape tells what a backend was doing up to ``scrape.interval`` ago, across every gateway replica;
the in-flight count tells what this sidecar sent since. A burst therefore does not all land on the node
that looked idle at the last scrape. Stats older than ``stale_after`` are unknown, never zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Scraped:
    running: float
    waiting: float
    kv_usage: float | None
    prefix_queries: float | None
    prefix_hits: float | None
    at: float  # monotonic time of the scrape
    prompt_tokens: float | None = None  # vllm:prompt_tokens_total: calibrates bytes per token
    metrics_less: bool = False  # metrics: auto found no /metrics route: load is the in-flight count
    # vllm:num_requests_waiting_by_reason{reason="capacity"}: requests waiting because no KV block is
    # free (None: not exposed). The cache is full for running requests: preemption territory.
    waiting_for_kv: float | None = None
    block_size: int | None = None  # vllm:cache_config_info: tokens per KV block (128 on CPU, 16 on GPUs)
    kv_blocks: int | None = None  # its num_gpu_blocks: the cache holds kv_blocks x block_size tokens


@dataclass(frozen=True, slots=True)
class LoadView:
    """What a policy sees of one backend's load."""

    requests: float  # running + waiting, or a pessimistic estimate when unknown
    kv_usage: float  # 0..1, 0.0 when unknown (``known`` tells)
    waiting: float
    known: bool
    kv_short: bool = False  # requests wait there for free KV blocks (preemption is likely)
    kv_tokens: int = 0  # the KV cache's size in tokens, where the backend exports it (else 0)

    def saturated(self, max_waiting: int, max_kv: float) -> bool:
        # Unknown load is not saturation: stale stats must not make every session move.
        return self.known and (self.waiting >= max_waiting or self.kv_usage >= max_kv)


def view(scraped: Scraped | None, now: float, stale_after: float, unknown_requests: float) -> LoadView:
    """A backend's load from its last scrape; ``unknown_requests`` stands in for missing or stale
    stats. This sidecar's live in-flight counts are added by ``snapshot.Snapshot.requests``."""
    if scraped is None:
        return LoadView(unknown_requests, 0.0, 0.0, False)
    size = (scraped.kv_blocks or 0) * (scraped.block_size or 0)  # a fixed fact: kept when stale
    if now - scraped.at > stale_after:
        return LoadView(unknown_requests, 0.0, 0.0, False, kv_tokens=size)
    kv = scraped.kv_usage if scraped.kv_usage is not None else 0.0
    short = bool(scraped.waiting_for_kv)
    return LoadView(scraped.running + scraped.waiting, kv, scraped.waiting, True, short, size)


def spare_capacity(weight: float, load: LoadView) -> float:
    """A backend's load weight: its static weight scaled by the KV cache it has left."""
    return weight * max(0.0, 1.0 - load.kv_usage) / (1.0 + load.requests)
