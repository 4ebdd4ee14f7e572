"""The decision service: gathers what a policy needs, calls it, and records what it decided.

One ``decide`` costs: one Redis round trip at most for keyed requests under the ``kvgate`` policy
(GETEX, plus SET NX on a first binding), a walk of the prefix index over the request's chunk hashes,
and the pure policy. Everything else (scraping, membership, ring builds) happens in the control loops.
"""

from __future__ import annotations

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
from kvgate.limits import DEFAULT_OUTPUT_TOKENS, RateLimiter
from kvgate.metrics import SidecarMetrics
from kvgate.policies import Decision, Request, SessionAction, Snapshot, decide, uncached_tokens
from kvgate.prefix_index import PrefixIndex
from kvgate.protocol import Candidate, KeysReply, Outcome, OutcomeKind
from kvgate.registry import Registry
from kvgate.sessions import SessionStore

logger = logging.getLogger(__name__)
RECENT_DECISIONS = 256  # kept for GET /debug/decisions


class UnknownModel(Exception):
    pass


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


class DecisionService:
    def __init__(
        self,
        config: Config,
        registry: Registry,
        sessions: SessionStore,
        index: PrefixIndex,
        metrics: SidecarMetrics,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.config = config
        self.limiter = limiter
        # decision id -> (identities, tokens counted at admission), until the request ends
        self._admitted: OrderedDict[str, tuple[list[str], int]] = OrderedDict()
        self.registry = registry
        self.sessions = sessions
        self.index = index
        self.metrics = metrics
        self._seq = itertools.count(1)
        # For GET /debug/decisions; kept as they are and formatted only when asked for.
        self._recent: deque[tuple[Routed, Features]] = deque(maxlen=RECENT_DECISIONS)

    def policy_for(self, model: str | None) -> PolicyName:
        r = self.config.routing
        return r.per_model.get(model, r.policy) if model else r.policy

    async def decide(self, f: Features, decision_id: str | None = None, dry_run: bool = False) -> Routed:
        """Route one request. ``decision_id`` is Nginx's name for it (its outcome reports use it);
        callers that have none get one from the sidecar. A ``dry_run`` (``POST /v1/decide``) says what
        would be decided and changes nothing: no binding written, nothing counted in flight."""
        t0 = time.perf_counter()
        if f.model is not None and self.registry.serves(f.model) is False:
            self.metrics.unknown_model.inc()
            raise UnknownModel(f.model)
        seq = next(self._seq)
        did = decision_id if decision_id is not None else f"s{seq}"
        if self.limiter is not None and not dry_run:
            self._admit(did, f)
        policy = self.policy_for(f.model)
        snap = self.registry.snapshot(f.model)
        limit = self.config.routing.max_candidates
        depth: dict[str, int] = {}
        shared = 0
        uses_index = policy in (PolicyName.KVGATE, PolicyName.PREFIX)
        if uses_index and f.hashes and snap.nodes:
            match = self.index.match(f.hashes, snap.nodes)
            depth, shared = match.depth, match.shared
        keyed = policy is PolicyName.KVGATE and f.key is not None and bool(snap.nodes)
        bound = None
        if keyed and f.key:
            bound = await self.sessions.peek(f.key) if dry_run else self.sessions.cached(f.key)
        req = Request(f, seq, bound, depth, shared)
        decision = decide(policy, req, snap, limit)
        if not decision.candidates:
            self.metrics.no_backend.inc()
            return Routed(did, policy, decision, ())
        if dry_run:
            return Routed(
                did,
                policy,
                decision,
                tuple(Candidate(b, self.registry.address(b)) for b in decision.candidates),
            )
        if keyed and f.key:
            decision = await self._settle_session(f.key, decision, req, snap, policy)
        primary = decision.candidates[0]
        if f.hashes and uses_index:
            self.index.record(f.hashes, primary)
        self.registry.start(did, primary, uncached_tokens(f, depth.get(primary, 0)), time.monotonic())
        self.metrics.decisions.labels(policy.value, decision.label).inc()
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        routed = Routed(
            did, policy, decision, tuple(Candidate(b, self.registry.address(b)) for b in decision.candidates)
        )
        self._recent.append((routed, f))
        return routed

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
        """Count the request against its key's and its address's limits, or refuse it."""
        assert self.limiter is not None
        identities = ([f"key:{f.client_key}"] if f.client_key else []) + (
            [f"ip:{f.client_addr}"] if f.client_addr else []
        )
        if not identities:
            return
        tokens = f.est_tokens + (f.max_tokens if f.max_tokens is not None else DEFAULT_OUTPUT_TOKENS)
        retry = self.limiter.admit(identities, tokens, time.time())
        if retry is not None:
            self.metrics.rate_limited.labels(identities[0].partition(":")[0]).inc()
            raise RateLimited(retry)
        self._admitted[did] = (identities, tokens)
        if len(self._admitted) > MAX_ADMITTED:
            self._admitted.popitem(last=False)

    def _settle_tokens(self, o: Outcome) -> None:
        """The request ended: correct its token count from the usage the backend reported."""
        if o.decision_id is None or self.limiter is None:
            return
        admitted = self._admitted.pop(o.decision_id, None)
        if admitted is None or o.prompt_tokens is None or o.completion_tokens is None:
            return
        identities, counted = admitted
        self.limiter.correct(identities, o.prompt_tokens + o.completion_tokens - counted, time.time())

    def keys(self) -> KeysReply:
        """The hashed API keys Nginx checks (versioned, so Nginx re-reads them only on change)."""
        keys = {k.sha256: k.name for k in self.config.auth.keys}
        version = zlib.crc32(json.dumps(keys, sort_keys=True).encode())
        return KeysReply(version, keys)

    async def _settle_session(
        self, key: str, d: Decision, req: Request, snap: Snapshot, policy: PolicyName
    ) -> Decision:
        """Make the session store agree with the decision: one Redis round trip at most, none when
        the binding came from the local cache and still holds."""
        if d.session is SessionAction.KEEP:
            self.metrics.affinity.labels("hit").inc()
            return d
        if d.session is SessionAction.REBIND:
            self.metrics.affinity.labels("rebind").inc()
            await self.sessions.rebind(key, d.candidates[0])
            logger.debug("rebound %s from %s to %s (%s)", key, req.bound, d.candidates[0], d.label)
            return d
        # Not in the local cache: claim the key for our pick; Redis answers with the binding in force.
        winner, existed = await self.sessions.claim(key, d.candidates[0])
        if not existed:
            self.metrics.affinity.labels("miss").inc()
            return d
        # The session was bound already (earlier, or by another replica): decide again knowing it.
        again = decide(
            policy, dataclasses.replace(req, bound=winner), snap, self.config.routing.max_candidates
        )
        if again.session is SessionAction.KEEP:
            self.metrics.affinity.labels("hit").inc()
            return again
        self.metrics.affinity.labels("rebind").inc()
        await self.sessions.rebind(key, again.candidates[0])
        return again

    def report(self, outcomes: Iterable[Outcome]) -> None:
        now = time.monotonic()
        for o in outcomes:
            if o.kind is OutcomeKind.FIRST:
                assert o.decision_id is not None
                self.registry.prefill_done(o.decision_id)
                if o.response_id is not None:
                    # The backend stores this response: the conversation's next turn must come back.
                    self.sessions.remember(session_key("r", o.response_id), o.backend)
                continue
            if o.kind is OutcomeKind.DROP:
                assert o.decision_id is not None
                self.registry.drop(o.decision_id, now)
                self._admitted.pop(o.decision_id, None)
                self.metrics.dropped.inc()
                continue
            if o.decision_id is not None:
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
