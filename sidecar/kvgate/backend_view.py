"""What ``/v1/backends`` shows of each backend: the registry's state of it (membership, health,
load, in flight here and at the other replicas, outlier state) and what the decision service has
learned of it (its first-byte fit, the model of its prefix cache)."""

from __future__ import annotations

from kvgate.load import spare_capacity
from kvgate.registry import Registry
from kvgate.service import DecisionService


def describe(registry: Registry, service: DecisionService, now: float) -> list[dict[str, object]]:
    out = []
    for bid in sorted(registry.backends):
        s = registry.backends[bid]
        load = registry.load_of(s, now, 0.0)
        out.append(
            {
                "id": bid,
                "url": s.spec.url,
                "weight": s.spec.weight,
                "labels": dict(s.spec.labels),
                # metrics as configured; "auto" resolved to "none" while the backend has no /metrics
                "metrics": "none"
                if s.spec.metrics == "auto" and s.scraped is not None and s.scraped.metrics_less
                else s.spec.metrics,
                "state": s.state,
                "models": sorted(s.models),
                "inflight": registry.ledger.counts.get(bid, 0),
                "inflight_tokens": registry.ledger.tokens.get(bid, 0),
                "inflight_kv_tokens": registry.ledger.kv.get(bid, 0),
                # what the other gateway replicas have in flight there (kvgate.shared_load)
                "inflight_other_replicas": registry.shared.counts.get(bid, 0),
                "inflight_tokens_other_replicas": registry.shared.tokens.get(bid, 0),
                "inflight_kv_tokens_other_replicas": registry.shared.kv.get(bid, 0),
                "load": {
                    "known": load.known,
                    "requests": load.requests,
                    "waiting": load.waiting,
                    "kv_usage": None if not load.known else load.kv_usage,
                    "waiting_for_kv": None if s.scraped is None else s.scraped.waiting_for_kv,
                },
                "cache": None
                if s.scraped is None or s.scraped.block_size is None
                else {"block_size": s.scraped.block_size, "blocks": s.scraped.kv_blocks},
                "spare_capacity": spare_capacity(s.spec.weight, load),
                "scrape_age_s": None if s.scraped is None else round(now - s.scraped.at, 3),
                "ttft_ewma_s": s.ttft_ewma,
                "errors": s.errors,
                "last_error": s.last_error,
                "outlier": {
                    "consecutive_failures": s.outlier.consecutive,
                    "ejections": s.outlier.ejections,
                    "ejected_for_s": None
                    if s.outlier.ejected_until is None
                    else round(max(0.0, s.outlier.ejected_until - now), 3),
                    "probation": s.outlier.probation,
                    "last_failure": s.outlier.last_reason,
                },
                "first_byte": service.first_byte.describe(bid),
                "prefix_cache_model": service.planner.describe_cache(bid),
            }
        )
    return out
