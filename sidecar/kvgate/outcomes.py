"""Outcomes: what Nginx reports about each decision, applied to what the sidecar knows.

A ``first`` report (a stream's first byte) ends the request's share of its backend's prefill queue,
teaches the first-byte budget and the bytes-per-token ratio, and binds a Responses API id to the
backend that stores it. A ``drop`` (the request never ran) takes it out of the gateway queue and the
in-flight ledger and gives its admission back (and its tenant's charge, in the fair order). An ``end``
finishes it in flight, corrects its token count and its tenant's charge (``GatewayQueue.settle``), and
feeds health and the metrics; a ``try`` (a candidate that failed before the one that
answered) feeds health alone. Every decision ends in exactly one ``end`` or ``drop``.

A request Nginx routed on its own (fail-open: the sidecar was slow or away) had no decision, so
nothing counted it when it started: its ``end`` carries its tenant, and is counted then, by its
usage, against the tenant's rate limits and service. Else a client could flood past its limits and
its fair share whenever it made the sidecar slow, and after; the ends of the requests routed while
the sidecar was down wait in Nginx's outbox and arrive when it is back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvgate.admission import Admission
from kvgate.features import session_key
from kvgate.first_byte import FirstByteBudget
from kvgate.messages import Outcome, OutcomeKind
from kvgate.metrics import SidecarMetrics
from kvgate.queue import GatewayQueue
from kvgate.registry import Registry
from kvgate.sessions import SessionStore
from kvgate.slo import SloGate
from kvgate.tenants import service, tenant_for
from kvgate.tokens import TokenEstimator


class Outcomes:
    def __init__(
        self,
        registry: Registry,
        sessions: SessionStore,
        admission: Admission,
        tokens: TokenEstimator,
        first_byte: FirstByteBudget,
        metrics: SidecarMetrics,
        leave_queue: Callable[[str], None],
        slo: SloGate,
        queue: GatewayQueue | None = None,
    ) -> None:
        self.registry = registry
        self.sessions = sessions
        self.admission = admission
        self.tokens = tokens
        self.first_byte = first_byte
        self.metrics = metrics
        self._leave_queue = leave_queue  # a dropped request still waiting leaves the gateway queue
        self.slo = slo  # each routed request's objective, met or missed at its end
        self.queue = queue  # the fair order corrects each routed request's tenant charge at its end

    def apply(self, outcomes: Iterable[Outcome]) -> None:
        now = time.monotonic()
        for o in outcomes:
            if o.kind is OutcomeKind.FIRST:
                self._first(o, now)
            elif o.kind is OutcomeKind.DROP:
                assert o.decision_id is not None
                self._leave_queue(o.decision_id)
                self.registry.ledger.drop(o.decision_id, self.registry.ledger.clock())
                self.admission.unadmit(o.decision_id)
                self.slo.settle(o)
                if self.queue is not None:
                    self.queue.settle(o)
                self.metrics.dropped.inc()
            else:
                self._ended(o, now)

    def _first(self, o: Outcome, now: float) -> None:
        assert o.decision_id is not None
        self._learn_tokens(o.decision_id)
        self.registry.alive(o.backend, now)
        ledger = self.registry.ledger
        answered = ledger.prefill_done(o.decision_id, o.backend, ledger.clock())
        if answered is not None:
            if answered.predicted is not None and answered.seconds > 0:
                error = abs(answered.seconds - answered.predicted) / answered.seconds
                self.metrics.of(self.metrics.ttft_prediction_error, o.backend).observe(error)
            self.first_byte.learn(answered.backend, answered.work, answered.seconds, answered.attention)
            if len(self.first_byte) > len(self.registry.backends):
                self.first_byte.forget(set(self.registry.backends))
        if o.response_id is not None:
            # The backend stores this response: the conversation's next turn must come back.
            self.sessions.remember(session_key("r", o.response_id), o.backend)

    def _ended(self, o: Outcome, now: float) -> None:
        """An ``end`` (with a decision id, or none when Nginx routed on its own) or a ``try``."""
        if o.decision_id is not None:
            if o.status == 200 and not o.cut:
                self._learn_tokens(o.decision_id)  # a JSON answer: its first byte came with its end
            self.registry.ledger.finish(o.decision_id)
            self.admission.settle(o)
            self.slo.settle(o)
            if self.queue is not None:
                self.queue.settle(o)
        elif o.kind is OutcomeKind.END:
            self._count_unrouted(o)
        if o.response_id is not None and o.backend and o.status == 200:
            # The backend stores this response: the conversation's next turn must come back.
            self.sessions.remember(session_key("r", o.response_id), o.backend)
        if not o.backend:
            return
        if o.cached_tokens is not None and o.status == 200:
            self.metrics.of(self.metrics.reuse_tokens, "delivered").inc(o.cached_tokens)
        self.registry.outcome(o.backend, o.status, o.ttft, o.cut, now)
        self.metrics.of(self.metrics.outcomes, o.backend, "cut" if o.cut else str(o.status)).inc()
        if o.ttft is not None:
            self.metrics.of(self.metrics.ttft, o.backend).observe(o.ttft)
        elif o.duration is not None and o.kind is OutcomeKind.END:
            self.metrics.of(self.metrics.e2e, o.backend).observe(o.duration)

    def _count_unrouted(self, o: Outcome) -> None:
        """A fail-open request ended: its usage counts against its tenant's limits and service (with
        the gateway queue on, as ``GatewayQueue.cost`` charges a routed one, from what it used)."""
        self.admission.count_unrouted(o)
        tenant = tenant_for(o.client_key, o.client_addr, o.tenant)
        label = self.metrics.tenant_label(tenant)
        self.metrics.of(self.metrics.failopen_ends, label).inc()
        if self.queue is None or o.prompt_tokens is None:
            return
        cost = service(o.prompt_tokens, o.completion_tokens or 0, self.queue.config.fair_output_weight)
        self.queue.served(tenant, cost)
        self.metrics.of(self.metrics.tenant_tokens, label).inc(o.prompt_tokens)
        self.metrics.of(self.metrics.tenant_service, label).inc(cost)

    def _learn_tokens(self, decision_id: str) -> None:
        """The backend has counted this request's prompt: its bytes go beside that count."""
        served = self.registry.ledger.served(decision_id)
        if served is not None:
            self.tokens.served(served.backend, served.model, served.prompt_bytes)
