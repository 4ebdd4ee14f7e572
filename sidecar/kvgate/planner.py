"""The planner: what a decision would be now, before anything is written, and how Nginx gets it.

It gathers what the policy needs (the snapshot of the request's pool, or the pool it spills to, or
the prefill and decode sides of a disaggregated model; the prefix index's match; the session binding
this sidecar holds) and calls the pure policy (``kvgate.policies``). It writes nothing: the in-flight
count, the binding and the index change only when the decision is committed (``kvgate.service``).

Over 300 lines: one plan passes pools, disaggregation, the session and both indexes, then the
placement in seconds and the objective; each step is short and reads the same ``Plan``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvgate.config import Config, DispatchOrder, Objective, PolicyName
from kvgate.exact_index import ExactIndex
from kvgate.expected import expected, fastest, to_front
from kvgate.features import CHUNK_BYTES, Features
from kvgate.first_byte import FirstByteBudget, Work, attention_of
from kvgate.load import Scraped
from kvgate.messages import Candidate
from kvgate.metrics import SidecarMetrics
from kvgate.policies import (
    Decision,
    Reason,
    Request,
    SessionAction,
    decide,
    placement_admits,
    uncached_tokens,
)
from kvgate.prefix_index import Match, PrefixIndex
from kvgate.realized import Realized
from kvgate.registry import Registry
from kvgate.residency import Residency
from kvgate.sessions import SessionStore
from kvgate.slo import Judgement, Verdict, judge
from kvgate.snapshot import Snapshot

# A Responses turn waits this long for its previous response's report (sent at its first byte).
RESPONSE_REPORT_WAIT_S = 0.02


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
    # Prompt tokens the index says are held: on the best eligible backend, on the chosen one.
    reuse: tuple[int, int] = (0, 0)
    predicted_ttft_s: float | None = None  # expected seconds to the first byte (kvgate.first_byte)

    @property
    def label(self) -> str:
        """``X-Kvgate-Route``: the policy's reason, ``pd/`` when disaggregated, ``@pool`` in a pool."""
        label = self.decision.label
        if self.prefill:
            label = f"pd/{label}"
        return label if self.pool is None or self.prefill else f"{label}@{self.pool}"


@dataclass(frozen=True, slots=True)
class Plan:
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
    spilled_from: str | None = None  # the pool its rule picked, when it goes to another


class Planner:
    def __init__(
        self,
        config: Config,
        registry: Registry,
        sessions: SessionStore,
        index: PrefixIndex,
        metrics: SidecarMetrics,
        first_byte: FirstByteBudget,
        exact: ExactIndex | None = None,
    ) -> None:
        self.config = config
        self.exact = exact
        self.realized = Realized()
        self.residency = Residency()
        self.registry = registry
        self.sessions = sessions
        self.index = index
        self.metrics = metrics
        self.first_byte = first_byte

    async def plan(self, f: Features, policy: PolicyName, seq: int, dry_run: bool) -> Plan:
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
        pool = rule_pool = None
        snap = self.registry.snapshot(f.model)
        pools = self.config.pools
        if pools.enabled:
            rule = pools.pick(f.model, f.est_tokens)
            if rule is not None:
                rule_pool = rule.pool
                pool, snap = self._pool_snapshot(f.model, rule.pool, f.est_tokens)
        plan = await self._plan_in(f, policy, seq, dry_run, snap, pool)
        if pool != rule_pool:
            plan = dataclasses.replace(plan, spilled_from=rule_pool)
        return self._placed(plan, policy)

    async def _plan_in(
        self, f: Features, policy: PolicyName, seq: int, dry_run: bool, snap: Snapshot, pool: str | None
    ) -> Plan:
        limit = self.config.routing.max_candidates
        depth: dict[str, int] = {}
        shared = 0
        match = None
        uses_index = policy.reads_prefixes
        if uses_index and f.hashes and snap.nodes:
            match = self.index.match(f.hashes, snap.nodes)
            depth, shared = self.residency.trim(f.hashes, match.depth), match.shared
        if uses_index and f.token_ids and self.exact is not None and snap.nodes:
            depth, shared = self.exact.prefix_depths(f, f.token_ids, list(snap.nodes), depth, shared)
        keyed = policy is PolicyName.KVGATE and f.key is not None and bool(snap.nodes)
        bound, confirmed = None, True
        if keyed and f.key:
            if dry_run:
                bound = await self.sessions.peek(f.key)
            elif (known := self.sessions.cached(f.key)) is not None:
                bound, confirmed = known
            elif f.key_source == "response":
                # Only the backend storing it can continue it (others: 404); within the decision budget.
                budget = min(RESPONSE_REPORT_WAIT_S, self.config.gateway.decision_timeout_ms / 3000)
                bound = await self.sessions.reported(f.key, budget)
                self.metrics.of(self.metrics.response_waits, "unknown" if bound is None else "found").inc()
        req = Request(f, seq, bound, depth, shared)
        return Plan(snap, req, decide(policy, req, snap, limit), pool, confirmed=confirmed, matched=match)

    def _pool_snapshot(self, model: str | None, pool: str, tokens: int) -> tuple[str, Snapshot]:
        """The pool's backends, or another's in its spill order: the first that has room when the
        pool has none; with ``backlog_ratio``, also the first where the request would wait for less
        prefill (the least backlog plus its own ``tokens``) by that ratio, with room when the pool
        has room, and even without when no pool has room (it waits less there). The pool itself
        when no other will do: the request then waits there, or queues at the gateway."""
        first = self.registry.snapshot(model, pool=pool)
        room = any(first.has_room(n) for n in first.nodes)
        ratio = self.config.pools.backlog_ratio or None  # 0: spill only when full
        if room and ratio is None:
            return pool, first
        mine = _backlog(first) + tokens
        others = [(p, self.registry.snapshot(model, pool=p)) for p in self.config.pools.spill.get(pool, ())]
        roomy = [(p, snap) for p, snap in others if any(snap.has_room(n) for n in snap.nodes)]
        if not room and roomy:
            return roomy[0]
        if ratio is not None:
            for other, snap in roomy if room else others:
                if mine > ratio * (_backlog(snap) + tokens):
                    return other, snap
        return pool, first

    def must_wait(self, plan: Plan, past_share: bool = False) -> bool:
        """Whether the request waits at the gateway: its backend has no room now, and neither has
        any other it could go to (a /v1/responses turn can only go to its own); for a tenant
        ``past_share``, unless its backend has ``Snapshot.room_past_share``."""
        snap, first, q = plan.snap, plan.decision.candidates[0], self.config.queue
        if past_share:
            return not snap.room_past_share(first, q.fair_prefill_tokens, q.fair_reserve, q.fair_kv)
        own = self._own(plan)
        if snap.fits(first, own[first][0]):
            return False
        strict = plan.req.features.key_source == "response"
        return strict or not any(snap.fits(n, own[n][0]) for n in snap.nodes)

    def _own(self, plan: Plan) -> dict[str, Work]:
        """What each backend of the plan would prefill for its request (``work``)."""
        f, depth = plan.req.features, plan.req.prefix_depth
        return {n: self.work(f, depth.get(n, 0), n) for n in plan.snap.nodes}

    def least_prefill(self, plan: Plan) -> int:
        """The fewest prompt tokens any backend of the plan would prefill for its request: where most
        of its prefix is held (the shortest-first key)."""
        return min((w[0] for w in self._own(plan).values()), default=plan.req.features.est_tokens)

    def prefill_at(self, plan: Plan) -> int:
        """The prompt tokens the plan's pick would prefill for its request."""
        first = plan.decision.candidates[0]
        return self.uncached(plan.req.features, plan.req.prefix_depth.get(first, 0), first)

    def work(self, f: Features, depth_chunks: int, bid: str) -> Work:
        """The prefill ``bid`` would do for this request: its uncached tokens and their attention."""
        tokens = self.uncached(f, depth_chunks, bid)
        return tokens, attention_of(tokens, f.est_tokens)

    def uncached(self, f: Features, depth_chunks: int, bid: str) -> int:
        """Prompt tokens ``bid`` will likely prefill for this request (``kvgate.realized``)."""
        s = self.registry.backends.get(bid)
        return self.realized.uncached(f, depth_chunks, bid, None if s is None else s.scraped)

    def count_routed(self, f: Features, depth_chunks: int, bid: str) -> None:
        """A request was committed to ``bid``: its prompt's chunks are the freshest in that
        backend's cache, and what the index credited it with there is counted against what the
        engine then serves."""
        r, s = self.realized, self.registry.backends.get(bid)
        scraped = None if s is None else s.scraped
        share = r.share(bid, scraped)  # the scrapes before this request
        self.residency.sent(bid, f.hashes, self._cache_chunks(f, bid, scraped), f.prompt_bytes // CHUNK_BYTES)
        self.metrics.of(self.metrics.prefix_served_share, bid).set(share)
        r.routed(bid, f.est_tokens, f.est_tokens - uncached_tokens(f, depth_chunks))
        if len(r) > len(self.registry.backends) or len(self.residency) > len(self.registry.backends):
            r.forget(self.registry.backends)
            self.residency.forget(self.registry.backends)

    def describe_cache(self, bid: str) -> dict[str, float] | None:
        """The model of ``bid``'s prefix cache (``/v1/backends``), with this replica's share of its
        prompt tokens."""
        cache = self.residency.describe(bid)
        if cache is not None:
            cache["own_share"] = round(self.realized.own(bid), 3)
        return cache

    def _cache_chunks(self, f: Features, bid: str, scraped: Scraped | None) -> int | None:
        """This replica's part of ``bid``'s prefix cache, in chunks (``kvgate.residency``): None
        when its size is unknown or ``routing.prefix_eviction`` is off."""
        if not self.config.routing.prefix_eviction or scraped is None:
            return None
        if not scraped.kv_blocks or not scraped.block_size:
            return None
        tokens = scraped.kv_blocks * scraped.block_size * self.realized.own(bid)
        return max(1, int(tokens * f.bytes_per_token / CHUNK_BYTES))

    def _expected(self, plan: Plan, own: dict[str, Work] | None = None) -> dict[str, tuple[float, float]]:
        """Each backend's expected seconds to the plan's first byte, now and idle (``kvgate.expected``),
        from what it would prefill there (``own``, else counted here)."""
        own = self._own(plan) if own is None else own
        return expected(plan.snap.nodes, self.registry.ledger.ahead, own.__getitem__, self.first_byte.predict)

    @staticmethod
    def _movable(plan: Plan) -> bool:
        """A session staying where it is bound, a Responses turn and a disaggregated request stay put."""
        d = plan.decision
        return (
            bool(d.candidates)
            and not plan.decode
            and d.session is not SessionAction.KEEP
            and (plan.req.features.key_source != "response")
        )

    def _placed(self, plan: Plan, policy: PolicyName) -> Plan:
        """The kvgate policy's plan, its pick given way to the backend expected first (``ttft_margin``)
        among those not saturated and within the holders' bound (``holder_load_factor``: the
        expectation already counts the prefill queued there; the bound still stops a hot spot). A
        backend holding a deeper-than-shared prefix of the prompt stays in the comparison when it is
        saturated by its queue alone (not ``Snapshot.out_of_kv``): its figure counts that queue, and
        leaving it costs the held prefix's prefill elsewhere (the policy rebinds a session off a
        saturated backend; with the gateway queue's one waiting request a backend is saturated
        whenever it queues); not under the fair order. A session moved back where it is bound
        stays bound (no rebind). A backend whose fit has no cost per token worth the name
        (``FirstByteBudget.sees_queue``) is expected as soon behind any queue, so a move there keeps
        the bound the policy gives it (``placement_admits``): twelve requests at once all went to
        such a backend on two real vLLM servers.
        A pick without room for the request (``Snapshot.fits``) gives way to the backend expected
        first among those with room, when one has: sent there, the request would share a step
        with the prefill already waiting, or wait behind it. Room includes free KV cache for what
        it prefills there (``Snapshot.holds``), which no expected figure sees: nor is a move made
        to a backend without it."""
        margin, snap = self.config.routing.ttft_margin, plan.snap
        if margin >= 1.0 or policy is not PolicyName.KVGATE or not self._movable(plan):
            return plan
        lim, first = snap.limits, plan.decision.candidates[0]
        own = self._own(plan)
        figures = self._expected(plan, own)

        def room(n: str) -> bool:
            return snap.fits(n, own[n][0]) and snap.holds(n, own[n][0])

        if not room(first):
            roomy = [n for n in snap.nodes if room(n)]
            if roomy:
                best = min(roomy, key=lambda n: figures.get(n, (math.inf,))[0])  # unknown: last
                return dataclasses.replace(plan, decision=to_front(plan.decision, best, Reason.TTFT))
        c = max(lim.load_factor, lim.holder_load_factor)
        holders, queued = snap.bound_admits(c), snap.bound_admits(c, queued=True)
        own_bound = placement_admits(plan.req, snap)
        req, q = plan.req, self.config.queue
        # Under the fair order a queue may be a flood's, which the order's reserve keeps the others
        # clear of: moved behind it, the quiet tenant's p90 rose from 1.14 to 1.22x alone
        # (kvgate-bench fairness), so there no saturated holder is compared.
        fair = q.enabled and q.order is DispatchOrder.FAIR
        held = {} if fair else req.holders()

        def admits(n: str) -> bool:
            if not snap.holds(n, own[n][0]):
                return False
            if not self.first_byte.sees_queue(n):
                return own_bound(n)
            return queued(n) if n in held else holders(n)

        now = {n: e[0] for n, e in figures.items() if n == first or admits(n)}
        decision = fastest(plan.decision, now, margin)
        if decision.session is SessionAction.REBIND and decision.candidates[0] == req.bound:
            decision = dataclasses.replace(decision, session=SessionAction.KEEP, rebind_cause=None)
        return dataclasses.replace(plan, decision=decision)

    def against(
        self, plan: Plan, objective: Objective, waited: float, sheddable: bool, can_wait: bool
    ) -> tuple[Plan, Judgement]:
        """The plan judged against the request's TTFT objective (``kvgate.slo``), from each backend's
        expected seconds to the first byte now and idle. Moved: the plan with the backend that meets
        it first (``_movable`` plans only)."""
        assert objective.ttft_s is not None
        first, movable = plan.decision.candidates[0], self._movable(plan)
        j = judge(objective.ttft_s, waited, self._expected(plan), first, sheddable, can_wait, movable)
        if j.verdict is Verdict.MOVED and j.backend is not None:
            plan = dataclasses.replace(plan, decision=to_front(plan.decision, j.backend, Reason.SLO))
        return plan, j

    def routed(
        self,
        did: str,
        policy: PolicyName,
        plan: Plan,
        priority: int,
        counted: tuple[str, Work] = ("", (0, 0.0)),
        predicted: float | None = None,
    ) -> Routed:
        """The decision as Nginx gets it; ``counted``: the backend this request is already counted
        in flight on, with its tokens (not work ahead of itself): a committed decision, so a spill
        counts here (not at each plan: a waiting request is planned again each round)."""
        if counted[0] and plan.spilled_from is not None:
            self.metrics.pool_spills.labels(plan.spilled_from, plan.pool).inc()

        def pairs(ids: tuple[str, ...]) -> tuple[Candidate, ...]:
            return tuple(Candidate(b, self.registry.address(b)) for b in ids)

        if plan.decode:  # disaggregated: Nginx runs the prefill leg, then proxies to a decoder
            prefill, ids = pairs(plan.decision.candidates), plan.decode
        else:
            prefill, ids = (), plan.decision.candidates
        budgets = self._first_byte(plan, ids, counted)
        f = plan.req.features
        held = {n: f.est_tokens - uncached_tokens(f, d) for n, d in plan.req.prefix_depth.items()}
        reuse = (max(held.values(), default=0), held.get(plan.decision.candidates[0], 0))
        return Routed(
            did, policy, plan.decision, pairs(ids), plan.pool, priority, prefill, budgets, reuse, predicted
        )

    def _first_byte(self, plan: Plan, ids: tuple[str, ...], counted: tuple[str, Work]) -> tuple[int, ...]:
        """Each candidate's first-byte timeout: the prefill ahead of this request there, as the
        policy saw it. Backends outside the plan's snapshot (decoders) or with untrusted load get
        the ceiling."""
        snap, req, ledger = plan.snap, plan.req, self.registry.ledger
        out = []
        for b in ids:
            tokens, attention = self.work(req.features, req.prefix_depth.get(b, 0), b)
            if b == counted[0]:  # the ledger has it already
                tokens, attention = tokens - counted[1][0], attention - counted[1][1]
            work, attention = ledger.ahead(b, tokens, attention)
            attention = max(0.0, attention)
            node = snap.nodes.get(b)
            trusted = (
                node is not None and node.load.known and not node.load.kv_short and not snap.saturated(b)
            )
            out.append(self.first_byte.budget_ms(b, work, trusted, attention))
        return tuple(out)


def _backlog(snap: Snapshot) -> float:
    """The tokens a request sent to the least busy backend would wait behind (none: inf)."""
    return min((snap.inflight_tokens.get(n, 0) for n in snap.nodes), default=float("inf"))
