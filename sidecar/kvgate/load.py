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


@dataclass(frozen=True, slots=True)
class LoadView:
    """What a policy sees of one backend's load."""

    requests: float  # running + waiting, or a pessimistic estimate when unknown
    inflight: int  # routed by this sidecar and not yet reported finished
    inflight_tokens: int  # their estimated uncached prompt tokens
    kv_usage: float  # 0..1, 0.0 when unknown (``known`` tells)
    waiting: float
    known: bool

    def saturated(self, max_waiting: int, max_kv: float) -> bool:
        # Unknown load is not saturation: stale stats must not make every session move.
        return self.known and (self.waiting >= max_waiting or self.kv_usage >= max_kv)


def view(
    scraped: Scraped | None,
    inflight: int,
    inflight_tokens: int,
    now: float,
    stale_after: float,
    unknown_requests: float,
) -> LoadView:
    """Combine a scrape and in-flight counts; ``unknown_requests`` stands in for missing stats."""
    if scraped is None or now - scraped.at > stale_after:
        return LoadView(max(unknown_requests, float(inflight)), inflight, inflight_tokens, 0.0, 0.0, False)
    requests = max(scraped.running + scraped.waiting, float(inflight))
    kv = scraped.kv_usage if scraped.kv_usage is not None else 0.0
    return LoadView(requests, inflight, inflight_tokens, kv, scraped.waiting, True)


def spare_capacity(weight: float, load: LoadView) -> float:
    """A backend's load weight: its static weight scaled by the KV cache it has left."""
    return weight * max(0.0, 1.0 - load.kv_usage) / (1.0 + load.requests)
