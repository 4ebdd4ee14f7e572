"""The gateway queue: while every backend a request could go to is saturated, it waits here instead of
in one backend's FCFS queue, and is bound to a backend when one frees up (late binding: the choice
uses the load and cache state of that moment).

This module holds the waiting requests and their order; ``kvgate.service`` decides when a request
must wait and dispatches them; Nginx holds the request itself (its connection to the sidecar stays
open while it waits, with a heartbeat, so a sidecar that dies never strands it).

Order: lower priority value first (vLLM's sense), then by the configured order: first come first
served, or shortest estimated prompt first with ageing (a request that waited ``ageing_s``, or
``ageing_fair_share`` times the wait first come first served would have given it, goes ahead of every
younger one, in arrival order). Bounds: ``max_size`` waiting requests (past it a new one is
refused) and ``max_wait_s`` (past it a waiting one is refused); both answers say when to retry.

Several replicas each run their own queue over the same backends. That they do not all pour into
the slot one freed is the dispatch rule's business: each replica may keep only its share of a
backend's prefill budget in flight (``kvgate.policies.Snapshot.saturated`` with ``replicas``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.config import DispatchOrder, PolicyName, QueueConfig
from kvgate.features import Features

RATE_HALF_LIFE_S = 10.0  # the dispatch-rate estimate behind Retry-After forgets at this pace


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__("the gateway queue is full")
        self.retry_after = retry_after


class QueueTimeout(Exception):
    def __init__(self, retry_after: int, waited: float) -> None:
        super().__init__(f"waited {waited:.1f}s in the gateway queue")
        self.retry_after = retry_after


@dataclass(eq=False, slots=True)
class Waiting:
    decision_id: str
    features: Features
    policy: PolicyName
    priority: int
    arrived: float
    tokens: int  # estimated prompt tokens, the shortest-first key
    fair_s: float = math.inf  # the wait FCFS would have given it (set when it joins the queue)
    # Live: the request's answer (a Routed, or QueueTimeout); None in virtual time.
    future: asyncio.Future[object] | None = field(default=None, repr=False)


class GatewayQueue:
    def __init__(self, config: QueueConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._waiting: dict[str, Waiting] = {}
        self._rate = 0.0  # dispatches per second, smoothed
        self._last_dispatch: float | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, decision_id: str) -> bool:
        return decision_id in self._waiting

    def add(self, w: Waiting) -> None:
        if len(self._waiting) >= self.config.max_size:
            raise QueueFull(self.retry_after())
        if self._rate > 0:
            w.fair_s = len(self._waiting) / self._rate
        self._waiting[w.decision_id] = w

    def remove(self, decision_id: str) -> Waiting | None:
        return self._waiting.pop(decision_id, None)

    def dispatched(self, w: Waiting) -> float:
        """``w`` leaves for a backend; returns how long it waited."""
        self._waiting.pop(w.decision_id, None)
        now = self.clock()
        if self._last_dispatch is not None:
            gap = max(now - self._last_dispatch, 1e-6)
            keep = 0.5 ** (gap / RATE_HALF_LIFE_S)
            self._rate = keep * self._rate + (1 - keep) / gap
        self._last_dispatch = now
        return now - w.arrived

    def expired(self) -> list[Waiting]:
        """Requests that waited ``max_wait_s``, removed."""
        limit = self.clock() - self.config.max_wait_s
        out = [w for w in self._waiting.values() if w.arrived <= limit]
        for w in out:
            del self._waiting[w.decision_id]
        return out

    def in_order(self) -> list[Waiting]:
        """Waiting requests in dispatch order."""
        now = self.clock()
        ageing, multiple = self.config.ageing_s, self.config.ageing_fair_share

        def aged(w: Waiting) -> bool:
            waited = now - w.arrived
            return waited >= ageing or (multiple is not None and waited >= multiple * w.fair_s)

        if self.config.order is DispatchOrder.SHORTEST:
            return sorted(
                self._waiting.values(),
                key=lambda w: (
                    (w.priority, 0, w.arrived, 0) if aged(w) else (w.priority, 1, w.tokens, w.arrived)
                ),
            )
        return sorted(self._waiting.values(), key=lambda w: (w.priority, w.arrived))

    def retry_after(self) -> int:
        """Seconds until the queue should have room: its length over the recent dispatch rate."""
        if self._rate <= 0:
            return 1
        return max(1, min(60, math.ceil(len(self._waiting) / self._rate)))
