"""The sidecar's own Prometheus metrics, on a registry owned by the app (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class SidecarMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("kvgate_decisions", "Routing decisions.", ["policy", "reason"], registry=r)
        self.decision_latency = Histogram(
            "kvgate_decision_seconds",
            "Time to make one routing decision.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.affinity = Counter(
            "kvgate_affinity", "Session-key outcomes: hit, miss, rebind.", ["outcome"], registry=r
        )
        self.unknown_model = Counter(
            "kvgate_unknown_model", "Requests for a model no backend serves.", registry=r
        )
        self.no_backend = Counter("kvgate_no_backend", "Decisions with no eligible backend.", registry=r)
        self.redis_errors = Counter("kvgate_redis_errors", "Failed Redis calls.", ["op"], registry=r)
        self.redis_fallbacks = Counter(
            "kvgate_redis_fallbacks", "Session lookups answered from local memory (Redis down).", registry=r
        )
        self.scrape_latency = Histogram(
            "kvgate_scrape_seconds", "Latency of backend /metrics scrapes.", registry=r
        )
        self.scrape_errors = Counter(
            "kvgate_scrape_errors", "Failed scrapes or health checks.", ["backend"], registry=r
        )
        self.scrape_age = Gauge(
            "kvgate_scrape_age_seconds", "Age of the last good scrape.", ["backend"], registry=r
        )
        self.backend_healthy = Gauge(
            "kvgate_backend_healthy", "1 when the backend takes traffic.", ["backend"], registry=r
        )
        self.backend_load = Gauge(
            "kvgate_backend_requests", "Running + waiting (or estimate) per backend.", ["backend"], registry=r
        )
        self.backend_inflight = Gauge(
            "kvgate_backend_inflight", "Requests routed and not yet reported.", ["backend"], registry=r
        )
        self.ring_rebuilds = Counter(
            "kvgate_ring_rebuilds", "Rings built after membership changes.", registry=r
        )
        self.outcomes = Counter(
            "kvgate_outcomes", "Outcomes reported by Nginx.", ["backend", "status"], registry=r
        )
        self.ttft = Histogram(
            "kvgate_gateway_ttft_seconds",
            "Time to first byte from upstream, per Nginx.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
