"""The sidecar's own Prometheus metrics, on a registry owned by the app (no global state)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvgate.looplag import CpuWaitCollector
from kvgate.tenants import TenantLabels

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# 10 ms to 60 s in steps of about 1.5x: fine enough to tell a cache hit from a miss at any load.
LATENCY_BUCKETS = (
    0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip


class SidecarMetrics:
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.tenant_label = TenantLabels()  # the tenant label of every per-tenant metric
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("kvgate_decisions", "Routing decisions.", ["policy", "reason"], registry=r)
        self.decision_latency = Histogram(
            "kvgate_decision_seconds",
            "Time to make one routing decision.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "kvgate_event_loop_lag_seconds",
            "How late the sidecar's event loop runs a timer: how long an arriving line can wait unread.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        r.register(CpuWaitCollector())
        self.affinity = Counter(
            "kvgate_affinity",
            "Session-key outcomes: hit, miss, rebind, unconfirmed (Redis answered after the decision).",
            ["outcome"],
            registry=r,
        )
        self.unknown_model = Counter(
            "kvgate_unknown_model", "Requests for a model no backend serves.", registry=r
        )
        self.no_backend = Counter("kvgate_no_backend", "Decisions with no eligible backend.", registry=r)
        self.rate_limited = Counter(
            "kvgate_rate_limited",
            "Requests refused by a rate limit, by what it limits (key, ip).",
            ["by"],
            registry=r,
        )
        self.redis_errors = Counter("kvgate_redis_errors", "Failed Redis calls.", ["op"], registry=r)
        self.redis_late = Counter(
            "kvgate_redis_late",
            "Session round trips a decision stopped waiting for (redis.decision_wait_ms); they completed "
            "in the background.",
            registry=r,
        )
        self.redis_fallbacks = Counter(
            "kvgate_redis_fallbacks", "Session lookups answered from local memory (Redis down).", registry=r
        )
        self.response_waits = Counter(
            "kvgate_response_binding_waits",
            "Responses turns whose previous response no replica knew yet: the decision waited for its "
            "report (result: found, or unknown after the wait).",
            ["result"],
            registry=r,
        )
        self.scrape_latency = Histogram(
            "kvgate_scrape_seconds", "Latency of backend /metrics scrapes.", registry=r
        )
        self.scrape_errors = Counter(
            "kvgate_scrape_errors", "Failed scrapes or health checks.", ["backend"], registry=r
        )
        self.config_mismatch = Gauge(
            "kvgate_config_mismatch",
            "1 while a gateway's Nginx runs settings rendered from another config than this sidecar's.",
            registry=r,
        )
        self.health_kept = Counter(
            "kvgate_health_kept",
            "Health checks that timed out while the backend stayed in: it had served within "
            "kvgate.registry.ALIVE_S, or taking it out would leave too little of the fleet.",
            ["backend"],
            registry=r,
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
        self.ejections = Counter(
            "kvgate_backend_ejections",
            "Backends ejected by passive health (outlier detection).",
            ["backend"],
            registry=r,
        )
        self.restarts = Counter(
            "kvgate_backend_restarts",
            "Backends whose engine started again: counters that went back, or healthy again after "
            "failing health checks. What the gateway learned of the old engine starts over.",
            ["backend"],
            registry=r,
        )
        self.membership_rejected = Counter(
            "kvgate_membership_rejected",
            "Backend entries from Redis ignored: their host is not in membership.allow.",
            registry=r,
        )
        self.ring_rebuilds = Counter(
            "kvgate_ring_rebuilds", "Rings built after membership changes.", registry=r
        )
        self.outcomes = Counter(
            "kvgate_outcomes", "Outcomes reported by Nginx.", ["backend", "status"], registry=r
        )
        self.ttft = Histogram(
            "kvgate_gateway_ttft_seconds",
            "Streams: time from the request's arrival at Nginx to the first body byte sent back.",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvgate_gateway_e2e_seconds",
            "Non-streaming requests: time from arrival at Nginx to the end of the response.",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.dropped = Counter(
            "kvgate_decisions_dropped",
            "Decisions Nginx did not use (late answer, fail-open, client gone before dispatch).",
            registry=r,
        )
        self.queue_depth = Gauge("kvgate_queue_depth", "Requests waiting in the gateway queue.", registry=r)
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds",
            "Time a request waited in the gateway queue before it was dispatched.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_reordered = Counter(
            "kvgate_queue_reordered",
            "Shortest-first: waiting requests put back in line as longer ones, because the backend "
            "holding their prefix had no room and any other would prefill much more of it.",
            registry=r,
        )
        self.ttft_prediction_error = Histogram(
            "kvgate_ttft_prediction_error",
            "|observed - predicted| / observed seconds to a decision's first byte, per backend: how "
            "well the learned prefill model (kvgate.first_byte) knows each backend.",
            ["backend"],
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0),
            registry=r,
        )
        self.prefix_served_share = Gauge(
            "kvgate_prefix_served_share",
            "Share of the prefix the index credits a backend with that its engine serves from cache, "
            "from its scraped hit rate against the credited one (kvgate.realized; 1 until known).",
            ["backend"],
            registry=r,
        )
        # Per tenant (kvgate.tenants.TenantLabels: its header, its key's name, else "anonymous").
        self.tenant_tokens = Counter(
            "kvgate_tenant_routed_tokens",
            "Estimated prompt tokens routed, per tenant.",
            ["tenant"],
            registry=r,
        )
        self.tenant_service = Counter(
            "kvgate_tenant_service_tokens",
            "The service the fair order balances, per tenant, as charged when routed: each request's "
            "estimated prompt tokens plus the output it may write at queue.fair_output_weight "
            "(GatewayQueue.cost). The fair order's own count (kvgate_tenant_attained_tokens) is then "
            "corrected at each request's end by the output its usage reports.",
            ["tenant"],
            registry=r,
        )
        self.failopen_ends = Counter(
            "kvgate_failopen_ends",
            "Requests Nginx routed on its own (the sidecar slow or away) whose end came, per tenant: "
            "their usage then counts against its rate limits and service (with the queue on).",
            ["tenant"],
            registry=r,
        )
        self.tenant_wait = Histogram(
            "kvgate_tenant_queue_wait_seconds",
            "Time a tenant's requests waited in the gateway queue.",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_past_share = Counter(
            "kvgate_tenant_past_share_queued",
            "Requests queued while their tenant took more than an equal share (its recent service and "
            "its requests waiting), so that backends stay clear for the others (queue.fair_reserve).",
            ["tenant"],
            registry=r,
        )
        self.pd_colocated = Counter(
            "kvgate_pd_colocated",
            "Requests for a disaggregated model served co-located: no prefill or no decode backend.",
            registry=r,
        )
        self.queue_rejected = Counter(
            "kvgate_queue_rejected",
            "Requests that left the gateway queue without a backend: full, key_share (a key or tenant "
            "held its share), timeout, abandoned.",
            ["reason"],
            registry=r,
        )
        self.slo_verdicts = Counter(
            "kvgate_slo_verdicts",
            "Requests with a TTFT objective, by what their predicted TTFT decided: go (as planned), moved "
            "(to a backend that meets it), wait (in the gateway queue while it can still make it), shed "
            "(refused with 429), late (cannot make it, not sheddable: sent anyway).",
            ["verdict"],
            registry=r,
        )
        self.slo_requests = Counter(
            "kvgate_slo_requests",
            "Requests with an objective, by how they ended: met, missed, shed. met / all is the goodput "
            "share the gateway sees; shed / all its shed rate.",
            ["outcome"],
            registry=r,
        )
        self.pool_spills = Counter(
            "kvgate_pool_spills",
            "Requests routed to another pool than their rule's: no room there, or far more prefill waiting.",
            ["pool", "to"],
            registry=r,
        )
        self.kv_events = Counter(
            "kvgate_kv_events",
            "KV-cache events applied to the exact index, by backend and type (BlockStored, BlockRemoved, "
            "AllBlocksCleared, unknown).",
            ["backend", "type"],
            registry=r,
        )
        self.kv_messages = Counter(
            "kvgate_kv_event_messages",
            "KV-event messages received, by backend and what they did: ok, gap (events missed), restart "
            "(the engine started again), old (already applied), malformed.",
            ["backend", "result"],
            registry=r,
        )
        self.kv_replays = Counter(
            "kvgate_kv_event_replays",
            "Replays asked of a backend's replay socket after a gap: filled, partial, failed.",
            ["backend", "result"],
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            "kvgate_kv_index_blocks", "Blocks the exact index holds per backend.", ["backend"], registry=r
        )
        self.kv_index_view = Gauge(
            "kvgate_kv_index_view",
            "1 for the exact index's view of a backend: none, full, partial (events missed: the approximate "
            "index fills in), stale (events stopped: the approximate index serves it).",
            ["backend", "view"],
            registry=r,
        )
        self.kv_event_age = Gauge(
            "kvgate_kv_event_age_seconds", "Seconds since a backend's last KV event.", ["backend"], registry=r
        )
        self.tokenize = Counter(
            "kvgate_tokenize",
            "Prompts tokenized for the exact index: ok, timeout, error, skipped (too long, or a cache_salt).",
            ["result"],
            registry=r,
        )
        self.reuse_tokens = Counter(
            "kvgate_route_reuse_tokens",
            "Prompt tokens a decision could reuse: available (on the best eligible backend), captured "
            "(on the chosen backend, as the index predicted), delivered (as the engine reported).",
            ["kind"],
            registry=r,
        )

    def of(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once: prometheus_client checks the values and takes a
        lock on every ``labels`` call, a few microseconds each, several times per decision (measured:
        3 % of the sidecar's time at 1,700 decisions/s). For labelled metrics the hot path touches and
        whose children are never removed."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found
