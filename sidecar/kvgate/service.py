"""The decision service: gathers what a policy needs, calls it, and records what it decided.

One ``decide`` costs: one Redis round trip at most for keyed requests under the ``kvgate`` policy
(GETEX, plus SET NX on a first binding), a walk of the prefix index over the request's chunk hashes,
and the pure policy. Everything else (scraping, membership, ring builds) happens in the control loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvgate.config import Config, PolicyName
from kvgate.features import Features, session_key
from kvgate.first_byte import FirstByteBudget
from kvgate.limits import DEFAULT_OUTPUT_TOKENS, RateLimiter
from kvgate.metrics import SidecarMetrics
from kvgate.policies import Decision, Request, SessionAction, Snapshot, decide, uncached_tokens
from kvgate.prefix_index import Match, PrefixIndex
from kvgate.protocol import Candidate, KeysReply, Outcome, OutcomeKind
from kvgate.queue import GatewayQueue, QueueFull, QueueTimeout, Waiting
from kvgate.registry import Registry
from kvgate.sessions import SessionStore
from kvgate.tokens import TokenEstimator

logger = logging.getLogger(__name__)
RECENT_DECISIONS = 256  # kept for GET /debug/decisions


class UnknownModel(Exception):
    """No backend serves the model; the message is vLLM's own (0.32 names the models it serves)."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.")


class RateLimited(Exception):
    def __init__(self, retry_after: float) -> None:
        super().__init__(f"rate limited; retry after {retry_after:.0f}s")
        self.retry_after = retry_after


MAX_ADMITTED = 100_000  # decisions whose token count awaits its correction (bounded: reports can be lost)


@dataclass(frozen=True, slots=True)
class Routed:
    """One decision as the service made it: the policy's choice with the backends' addresses."""

    decision_id: str
    policy: PolicyName
    decision: Decision
    candidates: tuple[Candidate, ...]
    pool: str | None = None  # the pool it was decided in, when pools are configured
    priority: int = 0  # the request's effective priority (the gateway queue's class)
    prefill: tuple[Candidate, ...] = ()  # disaggregated: where the prefill leg goes
    first_byte_ms: tuple[int, ...] = ()  # each candidate's first-byte timeout (kvgate.first_byte)

    @property
    def label(self) -> str:
        """``X-Kvgate-Route``: the policy's reason, ``pd/`` when disaggregated, ``@pool`` in a pool."""
        label = self.decision.label
        if self.prefill:
            label = f"pd/{label}"
        return label if self.pool is None or self.prefill else f"{label}@{self.pool}"


@dataclass(frozen=True, slots=True)
class Queued:
    """The request waits in the gateway queue; ``waiting.future`` (live) gets its Routed."""

    decision_id: str
    waiting: Waiting


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a decision would be now, before anything is written. Disaggregated, ``decision`` is the
    prefill leg's (prefix affinity, sessions, the in-flight prefill count all live there) and
    ``decode`` the decode leg's backends (by load)."""

    snap: Snapshot
    req: Request
    decision: Decision
    pool: str | None
    decode: tuple[str, ...] = ()
    confirmed: bool = True  # the session binding the decision assumed needs no Redis round trip
    matched: Match | None = None  # the prefix index's match, which ``record`` continues from


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
    ) -> None:
        self.config = config
        self.limiter = limiter
        # decision id -> (identities, tokens counted at admission, max_tokens given), until it ends
        self._admitted: OrderedDict[str, tuple[list[str], int, int | None]] = OrderedDict()
        self.registry = registry
        self.sessions = sessions
        self.index = index
        self.metrics = metrics
        self.tokens = tokens if tokens is not None else TokenEstimator(config.tokens)
        self.first_byte = FirstByteBudget(config.gateway)
        self.queue = GatewayQueue(config.queue) if config.queue.enabled else None
        self._key_priority = {k.name: k.priority for k in config.auth.keys if k.priority is not None}
        self._wake: asyncio.Event | None = None  # live: sets off the dispatcher (dispatch_loop)
        self._seq = itertools.count(1)
        # For GET /debug/decisions; kept as they are and formatted only when asked for.
        self._recent: deque[tuple[Routed, Features]] = deque(maxlen=RECENT_DECISIONS)

    def policy_for(self, model: str | None) -> PolicyName:
        r = self.config.routing
        return r.per_model.get(model, r.policy) if model else r.policy

    def priority_of(self, f: Features) -> int:
        """The request's class in the gateway queue: what the client asked for when clients may
        choose, else its API key's, else 0 (vLLM's sense: lower goes first)."""
        if f.priority is not None and self.config.queue.client_priority:
            return f.priority
        if f.client_key is not None:
            return self._key_priority.get(f.client_key, 0)
        return 0

    async def decide(
        self, f: Features, decision_id: str | None = None, dry_run: bool = False
    ) -> Routed | Queued:
        """Route one request, or queue it while every backend it could go to is saturated (with the
        gateway queue on). ``decision_id`` is Nginx's name for it (its outcome reports use it);
        callers that have none get one from the sidecar. A ``dry_run`` (``POST /v1/decide``) says what
        would be decided and changes nothing: no binding written, nothing counted in flight."""
        t0 = time.perf_counter()
        if f.model is not None and self.registry.serves(f.model) is False:
            self.metrics.unknown_model.inc()
            raise UnknownModel(f.model, self.registry.models())
        seq = next(self._seq)
        did = decision_id if decision_id is not None else f"s{seq}"
        f = self.calibrated(f)
        if self.limiter is not None and not dry_run:
            self._admit(did, f)
        policy = self.policy_for(f.model)
        priority = self.priority_of(f)
        plan = await self._plan(f, policy, seq, dry_run)
        if not plan.decision.candidates:
            self.metrics.no_backend.inc()
            return Routed(did, policy, plan.decision, (), plan.pool, priority)
        if dry_run:
            return self._routed(did, policy, plan, priority)
        if self.queue is not None and self._must_wait(plan):
            live = asyncio.get_running_loop().create_future() if self._wake is not None else None
            waiting = Waiting(did, f, policy, priority, self.queue.clock(), f.est_tokens, future=live)
            try:
                self.queue.add(waiting)
            except QueueFull as full:
                self.metrics.queue_rejected.labels("full" if full.key is None else "key_share").inc()
                self._unadmit(did)
                raise
            self.metrics.queue_depth.set(len(self.queue))
            return Queued(did, waiting)
        return await self._commit(did, policy, f, plan, priority, t0)

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

    async def _plan(self, f: Features, policy: PolicyName, seq: int, dry_run: bool) -> _Plan:
        """The decision the policy makes now, in the request's pool (or the pool it spills to), or
        disaggregated: the prefill leg by the policy among prefill backends, the decode leg to the
        least loaded decode backends. With either side empty the request is served co-located."""
        disagg = self.config.disaggregation
        if disagg.applies(f.model):
            prefill = self.registry.snapshot(f.model, pool=disagg.prefill_pool, label=disagg.label)
            decode = self.registry.snapshot(f.model, pool=disagg.decode_pool, label=disagg.label)
            if prefill.nodes and decode.nodes:
                plan = await self._plan_in(f, policy, seq, dry_run, prefill, disagg.prefill_pool)
                limit = self.config.routing.max_candidates
                legs = decide(PolicyName.LEAST_LOAD, Request(f, seq), decode, limit).candidates
                return dataclasses.replace(plan, decode=legs)
            self.metrics.pd_colocated.inc()
        pool = None
        snap = self.registry.snapshot(f.model)
        pools = self.config.pools
        if pools.enabled:
            rule = pools.pick(f.model, f.est_tokens)
            if rule is not None:
                pool, snap = self._pool_snapshot(f.model, rule.pool)
        return await self._plan_in(f, policy, seq, dry_run, snap, pool)

    async def _plan_in(
        self, f: Features, policy: PolicyName, seq: int, dry_run: bool, snap: Snapshot, pool: str | None
    ) -> _Plan:
        limit = self.config.routing.max_candidates
        depth: dict[str, int] = {}
        shared = 0
        match = None
        uses_index = policy in (PolicyName.KVGATE, PolicyName.PREFIX)
        if uses_index and f.hashes and snap.nodes:
            match = self.index.match(f.hashes, snap.nodes)
            depth, shared = match.depth, match.shared
        keyed = policy is PolicyName.KVGATE and f.key is not None and bool(snap.nodes)
        bound, confirmed = None, True
        if keyed and f.key:
            if dry_run:
                bound = await self.sessions.peek(f.key)
            elif (known := self.sessions.cached(f.key)) is not None:
                bound, confirmed = known
        req = Request(f, seq, bound, depth, shared)
        return _Plan(snap, req, decide(policy, req, snap, limit), pool, confirmed=confirmed, matched=match)

    def _pool_snapshot(self, model: str | None, pool: str) -> tuple[str, Snapshot]:
        """The pool's backends, or the first pool in its spill order that has room (the pool itself
        when none has: the request then waits there, or queues at the gateway)."""
        first = snap = self.registry.snapshot(model, pool=pool)
        if any(snap.has_room(n) for n in snap.nodes):
            return pool, snap
        for other in self.config.pools.spill.get(pool, ()):
            snap = self.registry.snapshot(model, pool=other)
            if any(snap.has_room(n) for n in snap.nodes):
                self.metrics.pool_spills.labels(pool, other).inc()
                return other, snap
        return pool, first

    def _must_wait(self, plan: _Plan) -> bool:
        """Whether the request waits at the gateway: its backend has no room now, and neither has
        any other it could go to (a /v1/responses turn can only go to its own)."""
        snap = plan.snap
        if snap.has_room(plan.decision.candidates[0]):
            return False
        strict = plan.req.features.key_source == "response"
        return strict or not any(snap.has_room(n) for n in snap.nodes)

    def _routed(
        self, did: str, policy: PolicyName, plan: _Plan, priority: int, counted: tuple[str, int] = ("", 0)
    ) -> Routed:
        """The decision as Nginx gets it; ``counted``: the backend this request is already counted
        in flight on, with its tokens (not work ahead of itself)."""

        def pairs(ids: tuple[str, ...]) -> tuple[Candidate, ...]:
            return tuple(Candidate(b, self.registry.address(b)) for b in ids)

        if plan.decode:  # disaggregated: Nginx runs the prefill leg, then proxies to a decoder
            return Routed(
                did,
                policy,
                plan.decision,
                pairs(plan.decode),
                plan.pool,
                priority,
                pairs(plan.decision.candidates),
                self._first_byte(plan, plan.decode, counted),
            )
        ids = plan.decision.candidates
        return Routed(
            did,
            policy,
            plan.decision,
            pairs(ids),
            plan.pool,
            priority,
            (),
            self._first_byte(plan, ids, counted),
        )

    def _first_byte(self, plan: _Plan, ids: tuple[str, ...], counted: tuple[str, int]) -> tuple[int, ...]:
        """Each candidate's first-byte timeout: the prefill ahead of this request there, as the
        policy saw it. Backends outside the plan's snapshot (decoders) or with untrusted load get
        the ceiling."""
        snap, req = plan.snap, plan.req
        queued = self.registry.inflight_tokens
        out = []
        for b in ids:
            work = queued.get(b, 0) - (counted[1] if b == counted[0] else 0)
            work += uncached_tokens(req.features, req.prefix_depth.get(b, 0))
            node = snap.nodes.get(b)
            trusted = (
                node is not None and node.load.known and not node.load.kv_short and not snap.saturated(b)
            )
            out.append(self.first_byte.budget_ms(b, work, trusted))
        return tuple(out)

    async def _commit(
        self, did: str, policy: PolicyName, f: Features, plan: _Plan, priority: int, t0: float
    ) -> Routed:
        """Carry the decision out: the in-flight count, the session binding, the prefix index.

        The count goes up before the session's Redis round trip: decisions made while this one
        waits for Redis must see it (a burst of new conversations would otherwise all pick the
        same least-loaded backend, each blind to the others). If Redis says the session lives
        elsewhere, the count moves there."""
        decision, req, snap = plan.decision, plan.req, plan.snap

        def uncached(backend: str) -> int:
            return uncached_tokens(f, req.prefix_depth.get(backend, 0))

        primary = decision.candidates[0]
        self.registry.start(did, primary, uncached(primary), time.monotonic(), f.model, f.prompt_bytes)
        if policy is PolicyName.KVGATE and f.key and snap.nodes:
            decision = await self._settle_session(f.key, decision, req, snap, policy, plan.confirmed)
            plan = dataclasses.replace(plan, decision=decision)
            if decision.candidates[0] != primary:
                primary = decision.candidates[0]
                self.registry.move(did, primary, uncached(primary))
        if f.hashes and policy in (PolicyName.KVGATE, PolicyName.PREFIX):
            self.index.record(f.hashes, primary, plan.matched)
        self.metrics.decisions.labels(policy.value, decision.label).inc()
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        routed = self._routed(did, policy, plan, priority, (primary, uncached(primary)))
        self._recent.append((routed, f))
        return routed

    # -- the gateway queue ---------------------------------------------------------------------------
    async def dispatch(self) -> list[tuple[Waiting, Routed | QueueTimeout]]:
        """Send the waiting requests whose backend has room now, in the queue's order, and refuse
        those that waited too long. Each leaves with its Routed or its QueueTimeout (set on its future
        too, live)."""
        out: list[tuple[Waiting, Routed | QueueTimeout]] = []
        queue = self.queue
        if queue is None or not len(queue):
            return out
        for w in queue.expired():
            refusal = QueueTimeout(queue.retry_after(), queue.clock() - w.arrived)
            self.metrics.queue_rejected.labels("timeout").inc()
            self._unadmit(w.decision_id)
            out.append((w, refusal))
        blocked: set[str | None] = set()  # models with no room left in this round
        for w in queue.in_order():
            f = w.features
            strict = f.key_source == "response"
            if f.model in blocked and not strict:
                continue
            t0 = time.perf_counter()
            plan = await self._plan(f, w.policy, next(self._seq), False)
            if w.decision_id not in queue:
                continue  # dropped (the client went away) while the plan awaited
            if plan.decision.candidates and self._must_wait(plan):
                if not strict:
                    blocked.add(f.model)
                continue
            if plan.decision.candidates:
                routed = await self._commit(w.decision_id, w.policy, f, plan, w.priority, t0)
            else:
                self.metrics.no_backend.inc()
                routed = Routed(w.decision_id, w.policy, plan.decision, (), plan.pool, w.priority)
            self.metrics.queue_wait.observe(queue.dispatched(w))
            out.append((w, routed))
        self.metrics.queue_depth.set(len(queue))
        for w, result in out:
            if w.future is not None and not w.future.done():
                if isinstance(result, QueueTimeout):
                    w.future.set_exception(result)
                else:
                    w.future.set_result(result)
        return out

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
        self._unadmit(decision_id)
        self.metrics.queue_rejected.labels("abandoned").inc()
        self.metrics.queue_depth.set(len(queue))

    def _unadmit(self, did: str) -> None:
        """A request that never ran gives its admitted tokens back."""
        admitted = self._admitted.pop(did, None)
        if admitted is not None and self.limiter is not None:
            identities, counted, _ = admitted
            self.limiter.correct(identities, -counted, time.time())

    def sizes(self) -> dict[str, int]:
        """How full each structure the sidecar keeps per request, session or client is, beside its
        bound: what ``GET /debug/memory`` shows, so that memory growth has a name."""
        return {
            **self.sessions.sizes(),
            **self.index.sizes(),
            "decisions_in_flight": self.registry.inflight_total(),
            "admitted_awaiting_usage": len(self._admitted),
            "admitted_bound": MAX_ADMITTED,
            "rate_limit_identities": len(self.limiter) if self.limiter is not None else 0,
            "queue_waiting": len(self.queue) if self.queue is not None else 0,
            "queue_keys_waiting": self.queue.keys_waiting() if self.queue is not None else 0,
            "recent_decisions": len(self._recent),
            "models_learned": len(self.tokens.learned),
        }

    def recent(self) -> list[dict[str, Any]]:
        """The last decisions, oldest first, as ``GET /debug/decisions`` shows them."""
        return [
            {
                "id": r.decision_id,
                "policy": r.policy.value,
                "route": r.decision.label,
                "candidates": list(r.decision.candidates),
                "model": f.model,
                "key": f.key,
                "key_source": f.key_source,
                "hashes": list(f.hashes[:64]),
                "chunks": len(f.hashes),
                "prompt_bytes": f.prompt_bytes,
            }
            for r, f in self._recent
        ]

    def _admit(self, did: str, f: Features) -> None:
        """Count the request against its key's and its address's limits, or refuse it. Under a token
        limit, a request without max_tokens is given one (what the limit has left after its prompt,
        at most ``limits.default_max_tokens``), counted as such: no stream outruns its budget."""
        assert self.limiter is not None
        identities = ([f"key:{f.client_key}"] if f.client_key else []) + (
            [f"ip:{f.client_addr}"] if f.client_addr else []
        )
        if not identities:
            return
        now = time.time()
        output, given = f.max_tokens, None
        if output is None:
            room = self.limiter.headroom(identities, now)
            if room is not None:
                output = given = max(1, min(self.config.limits.default_max_tokens, int(room) - f.est_tokens))
        tokens = f.est_tokens + (output if output is not None else DEFAULT_OUTPUT_TOKENS)
        retry = self.limiter.admit(identities, tokens, now)
        if retry is not None:
            self.metrics.rate_limited.labels(identities[0].partition(":")[0]).inc()
            raise RateLimited(retry)
        self._admitted[did] = (identities, tokens, given)
        if len(self._admitted) > MAX_ADMITTED:
            self._admitted.popitem(last=False)

    def given_max_tokens(self, did: str) -> int | None:
        """The max_tokens admission gave this request (to write into its body), if any."""
        admitted = self._admitted.get(did)
        return None if admitted is None else admitted[2]

    def _learn_tokens(self, decision_id: str) -> None:
        """The backend has counted this request's prompt: its bytes go beside that count."""
        served = self.registry.served(decision_id)
        if served is not None:
            self.tokens.served(served.backend, served.model, served.prompt_bytes)

    def _settle_tokens(self, o: Outcome) -> None:
        """The request ended: correct its token count from the usage the backend reported."""
        if o.decision_id is None or self.limiter is None:
            return
        admitted = self._admitted.pop(o.decision_id, None)
        if admitted is None or o.prompt_tokens is None or o.completion_tokens is None:
            return
        identities, counted, _ = admitted
        self.limiter.correct(identities, o.prompt_tokens + o.completion_tokens - counted, time.time())

    def keys(self) -> KeysReply:
        """The hashed API keys Nginx checks (versioned, so Nginx re-reads them only on change)."""
        keys = {k.sha256: k.name for k in self.config.auth.keys}
        version = zlib.crc32(json.dumps(keys, sort_keys=True).encode())
        return KeysReply(version, keys)

    async def _settle_session(
        self, key: str, d: Decision, req: Request, snap: Snapshot, policy: PolicyName, confirmed: bool
    ) -> Decision:
        """Make the session store agree with the decision: one Redis round trip at most, none when
        the binding came fresh from the local cache and still holds. A binding the decision kept
        from an older local entry is confirmed by the claim (Redis answers with the one in force)."""
        if d.session is SessionAction.KEEP and confirmed:
            self.metrics.affinity.labels("hit").inc()
            return d
        if d.session is SessionAction.REBIND:
            self.metrics.affinity.labels("rebind").inc()
            await self.sessions.within(self.sessions.rebind(key, d.candidates[0]))
            logger.debug("rebound %s from %s to %s (%s)", key, req.bound, d.candidates[0], d.label)
            return d
        # A key new to this sidecar, or one kept from an older local entry: claim it for our pick;
        # Redis answers with the binding in force. A Redis too slow to answer within the decision's
        # wait leaves the decision as made: its claim lands later, and the next turn follows it.
        if self.sessions.answers_first:  # alone: no one else binds, the answer is ours
            pick = d.candidates[0]
            self.sessions.claim_behind(key, pick).add_done_callback(lambda t: self._count_claim(t, pick))
            return d
        claimed = await self.sessions.within(self.sessions.claim(key, d.candidates[0]))
        if claimed is None:
            self.metrics.affinity.labels("unconfirmed").inc()
            return d
        winner, existed = claimed
        if not existed:
            self.metrics.affinity.labels("miss").inc()
            return d
        if winner == req.bound:  # the binding the decision assumed still holds
            self.metrics.affinity.labels("hit").inc()
            return d
        # The session was bound already (earlier, or by another replica): decide again knowing it.
        again = decide(
            policy, dataclasses.replace(req, bound=winner), snap, self.config.routing.max_candidates
        )
        if again.session is SessionAction.KEEP:
            self.metrics.affinity.labels("hit").inc()
            return again
        self.metrics.affinity.labels("rebind").inc()
        await self.sessions.within(self.sessions.rebind(key, again.candidates[0]))
        return again

    def _count_claim(self, task: asyncio.Task[tuple[str, bool]], pick: str) -> None:
        """The affinity of a decision that went before its claim, counted when the claim lands: a
        binding found elsewhere was moved to the pick (``SessionStore.claim_behind``)."""
        if task.cancelled() or task.exception() is not None:
            return
        bound, existed = task.result()
        self.metrics.affinity.labels("miss" if not existed else "hit" if bound == pick else "rebind").inc()

    def report(self, outcomes: Iterable[Outcome]) -> None:
        now = time.monotonic()
        for o in outcomes:
            if o.kind is OutcomeKind.FIRST:
                assert o.decision_id is not None
                self._learn_tokens(o.decision_id)
                self.registry.alive(o.backend, now)
                answered = self.registry.prefill_done(o.decision_id, o.backend, now)
                if answered is not None:
                    self.first_byte.learn(*answered)
                    if len(self.first_byte) > len(self.registry.backends):
                        self.first_byte.forget(set(self.registry.backends))
                if o.response_id is not None:
                    # The backend stores this response: the conversation's next turn must come back.
                    self.sessions.remember(session_key("r", o.response_id), o.backend)
                continue
            if o.kind is OutcomeKind.DROP:
                assert o.decision_id is not None
                self.abandon(o.decision_id)
                self.registry.drop(o.decision_id, now)
                self._admitted.pop(o.decision_id, None)
                self.metrics.dropped.inc()
                continue
            if o.decision_id is not None:
                if o.status == 200 and not o.cut:
                    self._learn_tokens(o.decision_id)  # a JSON answer: its first byte came with its end
                self.registry.finish(o.decision_id)
                self._settle_tokens(o)
            if o.response_id is not None and o.backend and o.status == 200:
                # The backend stores this response: the conversation's next turn must come back.
                self.sessions.remember(session_key("r", o.response_id), o.backend)
            if not o.backend:
                continue
            self.registry.outcome(o.backend, o.status, o.ttft, o.cut, now)
            self.metrics.outcomes.labels(o.backend, "cut" if o.cut else str(o.status)).inc()
            if o.ttft is not None:
                self.metrics.ttft.labels(o.backend).observe(o.ttft)
            elif o.duration is not None and o.kind is OutcomeKind.END:
                self.metrics.e2e.labels(o.backend).observe(o.duration)
        self.kick()
