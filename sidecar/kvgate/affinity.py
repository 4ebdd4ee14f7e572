"""Settling a session: making the shared session store agree with the decision just made.

One Redis round trip at most, none when the binding came fresh from the local cache and still
holds. A binding the decision kept from an older local entry is confirmed by the claim (Redis
answers with the one in force); a session another replica bound first is decided again knowing it.
A lone replica answers first and claims behind (``SessionStore.claim_behind``). Each outcome is
counted as hit, miss, rebind or unconfirmed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from kvgate.config import Config, PolicyName
from kvgate.metrics import SidecarMetrics
from kvgate.policies import Decision, Request, SessionAction, decide
from kvgate.sessions import SessionStore
from kvgate.snapshot import Snapshot

logger = logging.getLogger(__name__)


class Affinity:
    def __init__(self, config: Config, sessions: SessionStore, metrics: SidecarMetrics) -> None:
        self.config = config
        self.sessions = sessions
        self.metrics = metrics

    async def settle(
        self, key: str, d: Decision, req: Request, snap: Snapshot, policy: PolicyName, confirmed: bool
    ) -> Decision:
        """The decision as the session store lets it stand (the same one, or one decided again)."""

        def count(outcome: str) -> Any:
            return self.metrics.of(self.metrics.affinity, outcome)

        if d.session is SessionAction.KEEP and confirmed:
            count("hit").inc()
            return d
        if d.session is SessionAction.REBIND:
            count("rebind").inc()
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
            count("unconfirmed").inc()
            return d
        winner, existed = claimed
        if not existed:
            count("miss").inc()
            return d
        if winner == req.bound:  # the binding the decision assumed still holds
            count("hit").inc()
            return d
        # The session was bound already (earlier, or by another replica): decide again knowing it.
        again = decide(
            policy, dataclasses.replace(req, bound=winner), snap, self.config.routing.max_candidates
        )
        if again.session is SessionAction.KEEP:
            count("hit").inc()
            return again
        count("rebind").inc()
        await self.sessions.within(self.sessions.rebind(key, again.candidates[0]))
        return again

    def _count_claim(self, task: asyncio.Task[tuple[str, bool]], pick: str) -> None:
        """The affinity of a decision that went before its claim, counted when the claim lands: a
        binding found elsewhere was moved to the pick (``SessionStore.claim_behind``)."""
        if task.cancelled() or task.exception() is not None:
            return
        bound, existed = task.result()
        outcome = "miss" if not existed else "hit" if bound == pick else "rebind"
        self.metrics.of(self.metrics.affinity, outcome).inc()
