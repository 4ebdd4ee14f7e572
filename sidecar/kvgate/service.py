"""The decision service: the coordinator of one decision, from features to the candidates Nginx gets.

``decide`` admits the request (``kvgate.admission``), plans it (``kvgate.planner``: the pure policy
over a snapshot), then either parks it in the gateway queue while every backend it could go to is
saturated, or commits it: counts it in flight (``kvgate.registry``), settles its session
(``kvgate.affinity``) and records its prefix (``kvgate.prefix_index``). ``dispatch`` commits queued
requests as backends free up; ``report`` hands Nginx's outcome reports to ``kvgate.outcomes``.

One ``decide`` costs: one Redis round trip at most for keyed requests under the ``kvgate`` policy
(GETEX, plus SET NX on a first binding), a walk of the prefix index over the request's chunk hashes,
and the pure policy. Everything else (scraping, membership, ring builds) happens in the control loops.

Over 300 lines: ``decide`` and ``dispatch`` are two entries to one commit path (the objective's
judgement, the queue, the commit), and each step they share is a few lines over the others' state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.admission import MAX_ADMITTED, Admission, RateLimited
from kvgate.affinity import Affinity
from kvgate.config import Config, DispatchOrder, PolicyName
from kvgate.exact_index import ExactIndex
from kvgate.features import Features
from kvgate.first_byte import FirstByteBudget, Work
from kvgate.limits import RateLimiter
from kvgate.messages import Outcome
from kvgate.metrics import SidecarMetrics
from kvgate.outcomes import Outcomes
from kvgate.planner import Plan, Planner, Routed
from kvgate.prefix_index import PrefixIndex
from kvgate.queue import GatewayQueue, QueueFull, QueueTimeout, Waiting
from kvgate.registry import Registry
from kvgate.sessions import SessionStore
from kvgate.slo import Judgement, SloGate, SloShed, Verdict
from kvgate.tenants import DepthCollector, ServiceCollector, tenant_of
from kvgate.tokenize import TokenSource
from kvgate.tokens import TokenEstimator

__all__ = ["DecisionService", "Queued", "RateLimited", "Routed", "UnknownModel"]

logger = logging.getLogger(__name__)
RECENT_DECISIONS = 256  # kept for GET /debug/decisions


class UnknownModel(Exception):
    """No backend serves the model; the message is vLLM's own (0.32 names the models it serves)."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.")


@dataclass(frozen=True, slots=True)
class Queued:
    """The request waits in the gateway queue; ``waiting.future`` (live) gets its Routed."""

    decision_id: str
    waiting: Waiting


class DecisionService:
    def __init__(
        self,
        config: Config,
        registry: Registry,
        sessions: SessionStore,
        index: PrefixIndex,
        metrics: SidecarMetrics,
        limiter: RateLimiter | None = None,
        tokens: TokenEstimator | None = None,
        exact: ExactIndex | None = None,
    ) -> None:
        self.config = config
        self.limiter = limiter
        self.registry = registry
        self.sessions = sessions
        self.index = index
        self.metrics = metrics
        self.tokens = tokens if tokens is not None else TokenEstimator(config.tokens)
        self.tokenizer: TokenSource | None = None  # set by the app, which owns the HTTP session
        self.first_byte = FirstByteBudget(config.gateway, lambda: registry.ledger.clock())
        # the ledger counts the prefill in progress on a backend less what its fit says is done
        registry.ledger.progress = self.first_byte.progress
        registry.on_restart.append(self.first_byte.restart)
        self.queue = GatewayQueue(config.queue) if config.queue.enabled else None
        if self.queue is not None:
            metrics.registry.register(DepthCollector(self.queue.waiting_features, metrics.tenant_label))
            metrics.registry.register(
                ServiceCollector(self.queue.tenants, self.queue.clock, metrics.tenant_label)
            )
        self.admission = Admission(config, metrics, limiter)
        self.slo = SloGate(config.slo, metrics)
        self.planner = Planner(config, registry, sessions, index, metrics, self.first_byte, exact)
        registry.on_restart.append(self.planner.residency.restart)
        self.affinity = Affinity(config, sessions, metrics)
        parts = (self.admission, self.tokens, self.first_byte, metrics, self.abandon, self.slo, self.queue)
        self.outcomes = Outcomes(registry, sessions, *parts)
        self._wake: asyncio.Event | None = None  # live: sets off the dispatcher (dispatch_loop)
        self._seq = itertools.count(1)
        # For GET /debug/decisions (formatted there, by kvgate.http_api, only when asked for).
        self.recent: deque[tuple[Routed, Features]] = deque(maxlen=RECENT_DECISIONS)

    def policy_for(self, model: str | None) -> PolicyName:
        r = self.config.routing
        return r.per_model.get(model, r.policy) if model else r.policy

    async def decide(
        self, f: Features, decision_id: str | None = None, dry_run: bool = False, body: str | None = None
    ) -> Routed | Queued:
        """Route one request, or queue it while every backend it could go to is saturated (with the
        gateway queue on). ``decision_id`` is Nginx's name for it (its outcome reports use it);
        callers that have none get one from the sidecar. A ``dry_run`` (``POST /v1/decide``) says what
        would be decided and changes nothing (``body``: the request's, tokenized for the exact index)."""
        t0 = time.perf_counter()
        if f.model is not None and self.registry.serves(f.model) is False:
            self.metrics.unknown_model.inc()
            raise UnknownModel(f.model, self.registry.models())
        seq = next(self._seq)
        did = decision_id if decision_id is not None else f"s{seq}"
        f = self.calibrated(f)
        if not dry_run:
            self.admission.admit(did, f)
        policy = self.policy_for(f.model)
        # Token ids only once admitted, and only for a policy that reads the prefix index.
        if body is not None and self.tokenizer is not None and policy.reads_prefixes:
            f = await self.tokenizer.with_tokens(f, body)
        priority = self.admission.priority_of(f)
        plan = await self.planner.plan(f, policy, seq, dry_run)
        if not plan.decision.candidates:  # Nginx routes it on its own: it counts at its end
            self.metrics.no_backend.inc()
            self.admission.unadmit(did)
            return Routed(did, policy, plan.decision, (), plan.pool, priority)
        if dry_run:
            return self.planner.routed(did, policy, plan, priority)
        queue = self.queue
        plan, held = self._judge(did, f, plan, priority, 0.0)
        if queue is None:
            return await self._commit(did, policy, f, plan, priority, t0)
        past = queue.past_share(f)
        wait = held or self.planner.must_wait(plan, past)
        gather = self._gathers(f)
        if not (wait or gather):
            return await self._commit(did, policy, f, plan, priority, t0)
        if past and wait:
            self.metrics.of(self.metrics.tenant_past_share, self.metrics.tenant_label(tenant_of(f))).inc()
        live = asyncio.get_running_loop().create_future() if self._wake is not None else None
        now = queue.clock()
        key = self.planner.least_prefill(plan) if queue.by_prefill else f.est_tokens
        waiting = Waiting(did, f, policy, priority, now, key, future=live, ready=now + gather)
        try:
            queue.add(waiting)
        except QueueFull as full:
            self.metrics.queue_rejected.labels("full" if full.key is None else "key_share").inc()
            self.admission.unadmit(did)
            raise
        if gather and self._wake is not None:
            asyncio.get_running_loop().call_later(gather, self.kick)
        self.metrics.queue_depth.set(len(queue))
        return Queued(did, waiting)

    def _gathers(self, f: Features) -> float:
        """Seconds a request waits before it is placed (``queue.gather_ms``): a prompt too long to
        share a step with another lets the shorter ones that arrived with it go first (0: none)."""
        q = self.config.queue
        long = f.est_tokens > self.config.routing.limits.saturation_prefill_tokens
        return q.gather_s if q.order is DispatchOrder.SHORTEST and long else 0.0

    def _judge(self, did: str, f: Features, plan: Plan, priority: int, waited: float) -> tuple[Plan, bool]:
        """The plan as the request's TTFT objective lets it go (``kvgate.slo``), and whether it waits
        in the gateway queue for it; raises SloShed (its admission given back) when it is refused."""
        objective = self.slo.objective(f)
        if objective is None:
            return plan, False
        sheddable = self.slo.sheddable(priority)
        plan, j = self.planner.against(plan, objective, waited, sheddable, self.queue is not None)
        self.slo.judged(j)
        if j.verdict is Verdict.SHED:
            self.admission.unadmit(did)
            raise SloShed(j.retry_after, waited + j.expected, objective.ttft_s or 0.0)
        return plan, j.verdict is Verdict.WAIT

    async def route(self, f: Features, decision_id: str | None = None) -> Routed:
        """``decide`` for callers that have no queue to wait in (tools, tests, the gateway queue off):
        a request that would wait is a bug there."""
        routed = await self.decide(f, decision_id)
        if not isinstance(routed, Routed):
            raise RuntimeError("route() got a queued request; use decide() with the gateway queue on")
        return routed

    async def explain(self, f: Features) -> Routed:
        """A dry run: what would be decided for ``f`` now (never queued, nothing written)."""
        routed = await self.decide(f, dry_run=True)
        assert isinstance(routed, Routed)
        return routed

    def calibrated(self, f: Features) -> Features:
        """``f`` with its model's bytes-per-token ratio: the token estimate every choice uses."""
        ratio = self.tokens.ratio(f.model)
        return f if ratio == f.bytes_per_token else dataclasses.replace(f, bytes_per_token=ratio)

    async def _commit(
        self, did: str, policy: PolicyName, f: Features, plan: Plan, priority: int, t0: float
    ) -> Routed:
        """Carry the decision out: the in-flight count, the session binding, the prefix index.

        The count goes up before the session's Redis round trip: decisions made while this one
        waits for Redis must see it (a burst of new conversations would otherwise all pick the
        same least-loaded backend, each blind to the others). If Redis says the session lives
        elsewhere, the count moves there."""
        decision, req, snap = plan.decision, plan.req, plan.snap

        def work(backend: str) -> Work:
            return self.planner.work(f, req.prefix_depth.get(backend, 0), backend)

        primary = decision.candidates[0]
        ledger, own = self.registry.ledger, work(primary)
        if ledger.overtaken(did):  # dead: its request fell open, and counts at its end (kvgate.outcomes)
            self.admission.unadmit(did)
            return self.planner.routed(did, policy, plan, priority)
        queue, fair = self.queue, self.config.queue.fair_output_tokens
        output = queue.output(f) if queue is not None else f.output_tokens(fair)
        ledger.start(
            did, primary, own[0], ledger.clock(), f.model, f.prompt_bytes, own[1], f.completions, output
        )
        if policy is PolicyName.KVGATE and f.key and snap.nodes:
            decision = await self.affinity.settle(f.key, decision, req, snap, policy, plan.confirmed)
            plan = dataclasses.replace(plan, decision=decision)
            if decision.candidates[0] != primary:
                primary, own = decision.candidates[0], work(decision.candidates[0])
                self.registry.ledger.move(did, primary, *own)
        if f.hashes and policy.reads_prefixes:
            self.index.record(f.hashes, primary, plan.matched)
            self.planner.count_routed(f, req.prefix_depth.get(primary, 0), primary)
        self.metrics.of(self.metrics.decisions, policy.value, decision.label).inc()
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        predicted = self.registry.ledger.expect(did, self.first_byte.predict)
        routed = self.planner.routed(did, policy, plan, priority, (primary, own), predicted)
        self.metrics.of(self.metrics.reuse_tokens, "available").inc(routed.reuse[0])
        self.metrics.of(self.metrics.reuse_tokens, "captured").inc(routed.reuse[1])
        if (objective := self.slo.objective(f)) is not None:
            self.slo.promise(did, objective)
        if self.queue is not None:  # every routed request is service its tenant had (fair order)
            tenant, cost = self.queue.charge(did, f)
            self.metrics.of(self.metrics.tenant_tokens, self.metrics.tenant_label(tenant)).inc(f.est_tokens)
            self.metrics.of(self.metrics.tenant_service, self.metrics.tenant_label(tenant)).inc(cost)
        self.recent.append((routed, f))
        return routed

    # -- the gateway queue ---------------------------------------------------------------------------
    async def dispatch(self) -> list[tuple[Waiting, Routed | QueueTimeout | SloShed]]:
        """Send the waiting requests whose backend has room now (and, with an objective, where it is
        expected in time), in the queue's order, and refuse those that waited too long or can no
        longer make their objective. Each leaves with its Routed, QueueTimeout or SloShed (set on its
        future too, live)."""
        out: list[tuple[Waiting, Routed | QueueTimeout | SloShed]] = []
        queue = self.queue
        if queue is None or not len(queue):
            return out
        for w in queue.expired():
            refusal = QueueTimeout(queue.retry_after(), queue.clock() - w.arrived)
            self.metrics.queue_rejected.labels("timeout").inc()
            self.admission.unadmit(w.decision_id)
            out.append((w, refusal))
        blocked: set[str | None] = set()  # models with no room left in this round
        # Tenants past their share that found no room they may take: the reserve they must leave is
        # room the others may still take, so only their own later requests wait behind them.
        reserved: set[tuple[str | None, str]] = set()
        for w in queue.in_order():
            if w.ready > queue.clock():
                continue  # gathering: shorter requests arriving now go first (queue.gather_ms)
            f = w.features
            strict = f.key_source == "response"
            if (f.model in blocked or (f.model, tenant_of(f)) in reserved) and not strict:
                if (overdue := self._overdue(w)) is not None:
                    out.append((w, overdue))
                continue
            t0 = time.perf_counter()
            plan = await self.planner.plan(f, w.policy, next(self._seq), False)
            if w.decision_id not in queue:
                continue  # dropped (the client went away) while the plan awaited
            held = False
            if plan.decision.candidates:
                try:
                    plan, held = self._judge(w.decision_id, f, plan, w.priority, queue.clock() - w.arrived)
                except SloShed as shed:
                    queue.remove(w.decision_id)
                    out.append((w, shed))
                    continue
            # No room, or nothing makes its objective now: the ones after it in its model wait too.
            past = queue.past_share(f)
            if held or (plan.decision.candidates and self.planner.must_wait(plan, past)):
                if not strict:
                    if past and not held:
                        reserved.add((f.model, tenant_of(f)))
                    else:
                        blocked.add(f.model)
                continue
            budget = self.config.routing.limits.saturation_prefill_tokens
            if (
                queue.by_prefill
                and plan.decision.candidates
                and queue.reorder(w, self.planner.prefill_at(plan), budget)
            ):
                self.metrics.queue_reordered.inc()
                continue  # its prefix's holder has no room: it waits its turn as the longer prompt
            if plan.decision.candidates:
                routed = await self._commit(w.decision_id, w.policy, f, plan, w.priority, t0)
            else:
                self.metrics.no_backend.inc()
                routed = Routed(w.decision_id, w.policy, plan.decision, (), plan.pool, w.priority)
            waited = queue.dispatched(w)
            self.metrics.queue_wait.observe(waited)
            self.metrics.of(self.metrics.tenant_wait, self.metrics.tenant_label(tenant_of(f))).observe(waited)
            out.append((w, routed))
        self.metrics.queue_depth.set(len(queue))
        for w, result in out:
            if w.future is not None and not w.future.done():
                if isinstance(result, QueueTimeout | SloShed):
                    w.future.set_exception(result)
                else:
                    w.future.set_result(result)
        return out

    def _overdue(self, w: Waiting) -> SloShed | None:
        """A waiting request not planned this round (others of its model wait for room): refused, out
        of the queue, once it has waited its whole TTFT objective when it may be shed (no backend
        can make it any more, whatever a plan would say)."""
        queue, objective = self.queue, self.slo.objective(w.features)
        if queue is None or objective is None or not self.slo.sheddable(w.priority):
            return None
        waited = queue.clock() - w.arrived
        if objective.ttft_s is None or waited < objective.ttft_s:
            return None
        queue.remove(w.decision_id)
        self.admission.unadmit(w.decision_id)
        self.slo.judged(Judgement(Verdict.SHED))
        return SloShed(queue.retry_after(), waited, objective.ttft_s)

    def kick(self) -> None:
        """Something freed up (a first byte, an end, a scrape): the dispatcher looks at the queue."""
        if self._wake is not None and self.queue is not None and len(self.queue):
            self._wake.set()

    async def dispatch_loop(self, tick_s: float = 0.05) -> None:
        """Live: dispatch whenever something freed up, and at least every ``tick_s`` (expiry, and
        load that a scrape changed)."""
        self._wake = asyncio.Event()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick_s)
            self._wake.clear()
            try:
                await self.dispatch()
            except Exception:  # the loop must outlive one bad round; the requests fall back on expiry
                logger.exception("gateway queue dispatch failed")

    def abandon(self, decision_id: str) -> None:
        """A waiting request's client or connection went away: it leaves the queue unrouted."""
        queue = self.queue
        waiting = queue.remove(decision_id) if queue is not None else None
        if queue is None or waiting is None:
            return
        if waiting.future is not None and not waiting.future.done():
            waiting.future.cancel()  # its connection's wait ends (decision_socket closes it)
        self.admission.unadmit(decision_id)
        self.metrics.queue_rejected.labels("abandoned").inc()
        self.metrics.queue_depth.set(len(queue))

    def sizes(self) -> dict[str, int]:
        """How full each structure the sidecar keeps per request, session or client is, beside its
        bound: what ``GET /debug/memory`` shows, so that memory growth has a name."""
        return {
            **self.sessions.sizes(),
            **self.index.sizes(),
            "decisions_in_flight": len(self.registry.ledger),
            "admitted_awaiting_usage": len(self.admission),
            "admitted_bound": MAX_ADMITTED,
            "rate_limit_identities": len(self.limiter) if self.limiter is not None else 0,
            "queue_waiting": len(self.queue) if self.queue is not None else 0,
            "queue_keys_waiting": self.queue.keys_waiting() if self.queue is not None else 0,
            "tenant_charges_awaiting_end": self.queue.charges() if self.queue is not None else 0,
            "recent_decisions": len(self.recent),
            "objectives_awaiting_end": len(self.slo),
            "models_learned": len(self.tokens.learned),
        }

    def report(self, outcomes: Iterable[Outcome]) -> None:
        """Nginx's outcome reports (``kvgate.outcomes``); what they freed may let a queued request go."""
        self.outcomes.apply(outcomes)
        self.kick()
