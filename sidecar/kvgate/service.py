"""The decision service: gathers what a policy needs, calls it, and records what it decided.

One ``decide`` costs: one Redis round trip at most for keyed requests under the ``kvgate`` policy
(GETEX, plus SET NX on a first binding), a walk of the prefix index over the request's chunk hashes,
and the pure policy. Everything else (scraping, membership, ring builds) happens in the control loops.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvgate.config import Config
from kvgate.features import Features
from kvgate.metrics import SidecarMetrics
from kvgate.policies import TOKENS_PER_CHUNK, Decision, PolicyName, Request, decide
from kvgate.prefix_index import PrefixIndex
from kvgate.registry import Registry
from kvgate.sessions import SessionStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    decision_id: int
    backend: str
    status: int  # 0 when no response came back (connection failure)
    ttft: float | None
    sent: bool  # whether response bytes reached the client
    first_byte: bool = False  # an early report: headers arrived, the request finished its prefill

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Outcome:
        ttft = d.get("t")
        if d.get("f"):
            return cls(int(d.get("i") or 0), str(d.get("b") or ""), 0, None, False, True)
        return cls(
            int(d.get("i") or 0),
            str(d.get("b") or ""),
            int(d.get("s") or 0),
            float(ttft) if isinstance(ttft, int | float) else None,
            bool(d.get("x")),
        )


class UnknownModel(Exception):
    pass


class DecisionService:
    def __init__(
        self,
        config: Config,
        registry: Registry,
        sessions: SessionStore,
        index: PrefixIndex,
        metrics: SidecarMetrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.sessions = sessions
        self.index = index
        self.metrics = metrics
        self._seq = itertools.count(1)
        self.recent: deque[dict[str, Any]] = deque(maxlen=256)  # for GET /debug/decisions

    def policy_for(self, model: str | None) -> PolicyName:
        r = self.config.routing
        return r.per_model.get(model, r.policy) if model else r.policy

    async def decide(self, f: Features) -> dict[str, Any]:
        t0 = time.perf_counter()
        if f.model is not None and self.registry.serves(f.model) is False:
            self.metrics.unknown_model.inc()
            raise UnknownModel(f.model)
        seq = next(self._seq)
        policy = self.policy_for(f.model)
        snap = self.registry.snapshot(f.model)
        limit = self.config.routing.max_candidates
        depth: dict[str, int] = {}
        shared = 0
        if policy in (PolicyName.KVGATE, PolicyName.PREFIX) and f.hashes and snap.nodes:
            match = self.index.match(f.hashes, snap.nodes)
            depth, shared = match.depth, match.shared
        keyed = policy is PolicyName.KVGATE and f.key is not None and bool(snap.nodes)
        bound = self.sessions.cached(f.key) if keyed and f.key else None
        req = Request(f, seq, bound, depth, shared)
        decision = decide(policy, req, snap, limit)
        if not decision.candidates:
            self.metrics.no_backend.inc()
            return {"i": seq, "c": [], "a": [], "r": "no_backend", "v": self.registry.peers_version}
        if keyed and f.key:
            decision = await self._settle_session(f.key, decision, req, snap, limit, policy)
        primary = decision.candidates[0]
        if f.hashes and policy in (PolicyName.KVGATE, PolicyName.PREFIX):
            self.index.record(f.hashes, primary)
        uncached = max(0, f.est_tokens - depth.get(primary, 0) * TOKENS_PER_CHUNK)
        self.registry.start(seq, primary, uncached, time.monotonic())
        self.metrics.decisions.labels(policy.value, decision.reason).inc()
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        out = {
            "i": seq,
            "c": list(decision.candidates),
            "a": [self.registry.address(b) for b in decision.candidates],
            "r": decision.reason,
            "k": f.key,
            "v": self.registry.peers_version,
        }
        self.recent.append(
            {
                **out,
                "ks": f.key_source,
                "m": f.model,
                "h": list(f.hashes[:64]),
                "nh": len(f.hashes),
                "b": f.prompt_bytes,
                "p": policy.value,
            }
        )
        return out

    async def _settle_session(
        self,
        key: str,
        d: Decision,
        req: Request,
        snap: Any,
        limit: int,
        policy: PolicyName,
    ) -> Decision:
        """Make the session store agree with the decision: one Redis round trip at most, none when
        the binding came from the local cache and still holds."""
        if d.reason == "session":
            self.metrics.affinity.labels("hit").inc()
            return d
        if d.bind == "rebind":
            self.metrics.affinity.labels("rebind").inc()
            await self.sessions.rebind(key, d.candidates[0])
            logger.debug("rebound %s from %s to %s (%s)", key, req.bound, d.candidates[0], d.reason)
            return d
        # Not in the local cache: claim the key for our pick; Redis answers with the binding in force.
        winner, existed = await self.sessions.claim(key, d.candidates[0])
        if not existed:
            self.metrics.affinity.labels("miss").inc()
            return d
        # The session was bound already (earlier, or by another replica): decide again knowing it.
        again = decide(
            policy, Request(req.features, req.seq, winner, req.prefix_depth, req.shared_depth), snap, limit
        )
        if again.reason == "session":
            self.metrics.affinity.labels("hit").inc()
            return again
        self.metrics.affinity.labels("rebind").inc()
        await self.sessions.rebind(key, again.candidates[0])
        return again

    def report(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            if o.first_byte:
                self.registry.prefill_done(o.decision_id)
                continue
            self.registry.finish(o.decision_id)
            if not o.backend:
                continue
            self.registry.outcome(o.backend, o.status, o.ttft)
            self.metrics.outcomes.labels(o.backend, str(o.status)).inc()
            if o.ttft is not None:
                self.metrics.ttft.observe(o.ttft)
            if o.status in (0, 502, 504) and not o.sent:
                self.registry.failure(o.backend, f"gateway saw status {o.status}")
