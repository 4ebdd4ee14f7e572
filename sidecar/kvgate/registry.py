"""Backend registry: membership, health, drain state, served models and load (decisions in flight
are kept in its ledger, ``kvgate.inflight``).

State changes come from the control loops (scrapes, membership sync, admin calls) and from outcome
reports; the decision path only reads. The ring is rebuilt, and the fail-open peer list re-versioned,
only when the set of eligible backends changes, never per request.

Over 300 lines: membership, health, drain, models and load are one state per backend
(``BackendState``) that every snapshot reads together; what changes per request, the in-flight
ledger, lives apart.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvgate.config import BackendSpec, OutlierConfig, RoutingConfig, ScrapeConfig
from kvgate.inflight import InflightLedger
from kvgate.load import LoadView, Scraped, view
from kvgate.messages import Candidate
from kvgate.metrics import SidecarMetrics
from kvgate.outliers import CLIENT_CLOSED, OutlierDetector, OutlierState, failure_reason
from kvgate.ring import Ring
from kvgate.shared_load import SharedLoad, Summed
from kvgate.snapshot import NodeView, Snapshot

logger = logging.getLogger(__name__)
# A backend that delivered a response (a first byte, a successful end) this recently is alive: health
# checks that time out say it is busy, not dead, and do not take it out.
ALIVE_S = 10.0


@dataclass(slots=True)
class BackendState:
    spec: BackendSpec
    draining: bool = False
    healthy: bool = True  # optimistic until the first failed checks
    fails: int = 0
    oks: int = 0
    models: frozenset[str] = frozenset()
    cards: Mapping[str, Mapping[str, object]] = field(default_factory=dict)  # its /v1/models, by id
    scraped: Scraped | None = None
    last_error: str | None = None
    ttft_ewma: float | None = None
    errors: int = 0
    address: str = ""  # host:port for Nginx, parsed once
    outlier: OutlierState = field(default_factory=OutlierState)
    alive_at: float = -math.inf  # when it last delivered a response (first byte or success)
    kept: bool = False  # its health checks time out, and it is kept in (logged once per spell)

    def __post_init__(self) -> None:
        self.address = self.spec.address

    @property
    def ejected(self) -> bool:
        return self.outlier.ejected_until is not None

    @property
    def eligible(self) -> bool:
        return self.healthy and not self.draining and not self.ejected

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        if not self.healthy:
            return "unhealthy"
        return "ejected" if self.ejected else "healthy"


@dataclass(slots=True)
class Registry:
    scrape: ScrapeConfig
    routing: RoutingConfig
    metrics: SidecarMetrics
    outliers: OutlierDetector = field(default_factory=lambda: OutlierDetector(OutlierConfig()))
    backends: dict[str, BackendState] = field(default_factory=dict)
    ring: Ring = field(default_factory=lambda: Ring({}))
    peers_version: int = 0
    _eligible_key: tuple[str, ...] = ()
    _weights: dict[str, float] = field(default_factory=dict)
    _generation: int = 0  # bumped when cached snapshots must be rebuilt
    _snapshots: dict[tuple[str | None, str | None], tuple[int, Snapshot]] = field(default_factory=dict)
    replicas: int = 1  # gateway replicas sharing these backends (from Redis; 1 without it)
    pool_label: str = "pool"  # the backend label naming its pool
    _served: tuple[int, frozenset[str] | None] | None = None
    ledger: InflightLedger = field(init=False)  # decisions in flight, per backend (kvgate.inflight)
    shared: SharedLoad = field(default_factory=lambda: SharedLoad(""))  # other replicas' (Redis)
    # Told a backend's id when its engine started again (``started_again``): what was learned of
    # the old process (its first-byte fit, what its prefix cache held) starts over.
    on_restart: list[Callable[[str], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ledger = InflightLedger(self.backends.__contains__)

    # -- membership ---------------------------------------------------------------------------------
    def set_membership(self, specs: Iterable[tuple[BackendSpec, bool]]) -> bool:
        """Make the registry hold exactly these backends (spec, draining); True when anything changed."""
        wanted = {spec.id: (spec, draining) for spec, draining in specs}
        changed = False
        for bid in list(self.backends):
            if bid not in wanted:
                del self.backends[bid]
                changed = True
        for bid, (spec, draining) in wanted.items():
            state = self.backends.get(bid)
            if state is None:
                self.backends[bid] = BackendState(spec=spec, draining=draining)
                changed = True
            elif state.spec != spec or state.draining != draining:
                state.spec, state.draining, state.address = spec, draining, spec.address
                changed = True
        if changed:
            self._rebuild()
        return changed

    def _rebuild(self) -> None:
        self.changed()
        eligible = tuple(sorted(b for b, s in self.backends.items() if s.eligible))
        weights = {b: s.spec.weight for b, s in self.backends.items() if s.eligible}
        if eligible != self._eligible_key or weights != self._weights:
            self.ring = Ring(weights, self.routing.vnodes)
            self._eligible_key = eligible
            self._weights = weights
            self.peers_version += 1
            self.metrics.ring_rebuilds.inc()
            logger.info(
                "ring rebuilt over %d backend(s): %s (peers v%d)",
                len(eligible),
                ", ".join(eligible),
                self.peers_version,
            )
        for bid, s in self.backends.items():
            self.metrics.backend_healthy.labels(bid).set(1.0 if s.eligible else 0.0)

    # -- health -------------------------------------------------------------------------------------
    def scrape_ok(self, bid: str, scraped: Scraped) -> None:
        s = self.backends.get(bid)
        if s is None:
            return
        was = s.scraped
        if scraped.metrics_less and (was is None or not was.metrics_less):
            logger.warning(
                "backend %s has no /metrics: routed on kvgate's own in-flight counts (set metrics: none "
                "to say so, or enable its metrics)",
                bid,
            )
        elif was is not None and was.metrics_less and not scraped.metrics_less:
            logger.warning("backend %s serves /metrics now: its load comes from them again", bid)
        s.scraped, s.last_error = scraped, None
        if was is not None and s.healthy and _went_back(was, scraped):
            # A backend out of health starts over when it is healthy again: counted once.
            logger.warning("backend %s restarted: its counters went back", bid)
            self.started_again(bid)
        self._health_ok(bid, s)

    def load_unknown(self, bid: str, error: str) -> None:
        """Healthy, but its metrics did not come: its load goes stale (unknown, never zero)."""
        self.note_error(bid, error)
        s = self.backends.get(bid)
        if s is not None:
            self._health_ok(bid, s)

    def note_error(self, bid: str, error: str) -> None:
        """A scrape that failed to bring a signal (shown in /v1/backends, counted)."""
        s = self.backends.get(bid)
        if s is not None:
            s.last_error = error
            self.metrics.scrape_errors.labels(bid).inc()

    def _health_ok(self, bid: str, s: BackendState) -> None:
        s.fails, s.oks, s.kept = 0, s.oks + 1, False
        if not s.healthy and s.oks >= self.scrape.healthy_after:
            s.healthy = True
            logger.warning("backend %s is healthy again", bid)
            self.started_again(bid)
            self._rebuild()

    def started_again(self, bid: str) -> None:
        """``bid`` may run a new engine: its counters went back, or it is healthy again after failing
        its checks (a restart too quick for the checks to see leaves only the counters; a backend
        without /metrics, only the checks)."""
        self.metrics.restarts.labels(bid).inc()
        for hook in self.on_restart:
            hook(bid)

    def failure(self, bid: str, error: str, timeout: bool = False, now: float | None = None) -> None:
        """A failed health check (active health; request failures are ``outcome``'s). One that timed
        out is no proof of death: a backend that served within ``ALIVE_S`` stays in, and timeouts
        never take out more of the fleet than outlier ejection may (``max_ejection_percent``, never
        all): a fleet whose health checks all time out under load is busy, not gone."""
        s = self.backends.get(bid)
        if s is None:
            return
        s.last_error = error
        s.oks, s.fails = 0, s.fails + 1
        self.metrics.scrape_errors.labels(bid).inc()
        if not s.healthy or s.fails < self.scrape.unhealthy_after:
            return
        now = time.monotonic() if now is None else now
        if timeout and (now - s.alive_at < ALIVE_S or not self._may_take_out()):
            self.metrics.health_kept.labels(bid).inc()
            if not s.kept:
                s.kept = True
                logger.warning(
                    "backend %s: health checks time out (%s); kept in: %s",
                    bid,
                    error,
                    f"it served {now - s.alive_at:.1f}s ago"
                    if now - s.alive_at < ALIVE_S
                    else "taking it out would leave too little of the fleet",
                )
            return
        s.healthy = False
        logger.warning("backend %s marked unhealthy after %d failures: %s", bid, s.fails, error)
        self._rebuild()

    def _may_take_out(self) -> bool:
        """Whether one more backend may leave the fleet on ambiguous evidence (a timeout)."""
        fleet = [b for b in self.backends.values() if not b.draining]
        out = sum(1 for b in fleet if not b.eligible)
        return out < self.outliers.max_ejected(len(fleet))

    def alive(self, bid: str, now: float) -> None:
        """``bid`` delivered a response: whatever its health checks say, it serves."""
        s = self.backends.get(bid)
        if s is not None:
            s.alive_at = now

    # -- load ---------------------------------------------------------------------------------------
    def load_of(self, s: BackendState, now: float, unknown: float) -> LoadView:
        return view(s.scraped, now, self.scrape.stale_after_s, unknown)

    def changed(self) -> None:
        """Scrapes, health or membership moved: rebuild snapshots on next use."""
        self._generation += 1

    def snapshot(
        self, model: str | None, now: float | None = None, pool: str | None = None, label: str | None = None
    ) -> Snapshot:
        """The eligible backends for ``model`` (in ``pool`` when given: backends whose ``label``,
        by default the pools' label, names it); cached until the next scrape round or change, with
        the live in-flight counts read through, so a decision costs no per-backend work."""
        label = self.pool_label if label is None else label
        cache_key = (model, None if pool is None else f"{label}={pool}")
        cached = self._snapshots.get(cache_key)
        if cached is not None and cached[0] == self._generation:
            return cached[1]
        now = time.monotonic() if now is None else now
        chosen = [
            s
            for s in self.backends.values()
            if s.eligible
            and (model is None or not s.models or model in s.models)
            and (pool is None or s.spec.labels.get(label) == pool)
        ]
        known = [
            s.scraped.running + s.scraped.waiting
            for s in chosen
            if s.scraped is not None and now - s.scraped.at <= self.scrape.stale_after_s
        ]
        unknown = max(known) if known else 0.0  # pessimistic stand-in for stale stats
        nodes = {s.spec.id: NodeView(s.spec.id, s.spec.weight, self.load_of(s, now, unknown)) for s in chosen}
        ledger, shared = self.ledger, self.shared
        snap = Snapshot(
            nodes,
            self.ring,
            self.routing.limits,
            Summed(ledger.counts, shared.counts),
            Summed(ledger.tokens, shared.tokens),
            self.replicas,
            ledger.tokens,
            Summed(ledger.kv, shared.kv),
        )
        self._snapshots[cache_key] = (self._generation, snap)
        return snap

    def set_replicas(self, n: int) -> None:
        if n != self.replicas:
            self.replicas = max(1, n)
            self.changed()

    def serves(self, model: str) -> bool | None:
        """True/False once models are known; None while no backend has answered /v1/models yet."""
        cached = self._served
        if cached is None or cached[0] != self._generation:
            known = [s.models for s in self.backends.values() if s.models]
            cached = (self._generation, frozenset().union(*known) if known else None)
            self._served = cached
        return None if cached[1] is None else model in cached[1]

    def models(self) -> list[str]:
        return sorted({m for s in self.backends.values() if s.eligible for m in s.models})

    def model_cards(self) -> list[dict[str, object]]:
        """``/v1/models`` entries for the models eligible backends serve: the card a backend gave
        (the first by id that gave one: vLLM's has ``root``, ``max_model_len``, ``created``), else
        a minimal one."""
        eligible = sorted((s for s in self.backends.values() if s.eligible), key=lambda s: s.spec.id)
        out = []
        for m in self.models():
            card = next((s.cards[m] for s in eligible if m in s.cards), None)
            out.append(
                dict(card)
                if card is not None
                else {"id": m, "object": "model", "created": 0, "owned_by": "vllm"}
            )
        return out

    def set_models(
        self, bid: str, models: frozenset[str], cards: Mapping[str, Mapping[str, object]] | None = None
    ) -> None:
        """The models a backend serves, from its /v1/models (with the cards it gave)."""
        s = self.backends.get(bid)
        if s is None:
            return
        s.cards = cards or {}
        if s.models != models:
            s.models = models
            self.changed()

    def peers(self) -> tuple[int, tuple[Candidate, ...]]:
        """The fail-open peer list Nginx keeps: (version, eligible backends sorted by id)."""
        eligible = sorted((s for s in self.backends.values() if s.eligible), key=lambda x: x.spec.id)
        return self.peers_version, tuple(Candidate(s.spec.id, s.address) for s in eligible)

    def address(self, bid: str) -> str:
        return self.backends[bid].address

    def outcome(self, bid: str, status: int, ttft: float | None, cut: bool = False, now: float = 0.0) -> None:
        """One request's result on ``bid``, for its TTFT average and its passive health."""
        s = self.backends.get(bid)
        if s is None:
            return
        if ttft is not None and ttft > 0:
            s.ttft_ewma = ttft if s.ttft_ewma is None else 0.8 * s.ttft_ewma + 0.2 * ttft
        reason = failure_reason(status, cut)
        if reason is not None:
            s.errors += 1
        elif 0 < status < 500 and status != CLIENT_CLOSED:
            s.alive_at = now
        fleet = [b for b in self.backends.values() if b.healthy and not b.draining]
        ejected = sum(1 for b in fleet if b.ejected)
        if self.outliers.record(s.outlier, reason, now, ejected, len(fleet)):
            assert s.outlier.ejected_until is not None
            logger.warning(
                "backend %s ejected for %.0fs after %d failure(s) in a row (last: %s)",
                bid,
                s.outlier.ejected_until - now,
                s.outlier.consecutive,
                reason,
            )
            self.metrics.ejections.labels(bid).inc()
            self._rebuild()

    def tick(self, now: float) -> None:
        """Readmit backends whose ejection is over (on probation); runs with every scrape round."""
        back = [bid for bid, s in self.backends.items() if self.outliers.expire(s.outlier, now)]
        if back:
            logger.warning("backend(s) %s back from ejection, on probation", ", ".join(back))
            self._rebuild()


def _went_back(was: Scraped, now: Scraped) -> bool:
    """Whether a counter fell since the last scrape: a counter only falls when its process restarts."""
    pairs = ((was.prompt_tokens, now.prompt_tokens), (was.prefix_queries, now.prefix_queries))
    return any(a is not None and b is not None and b < a for a, b in pairs)
