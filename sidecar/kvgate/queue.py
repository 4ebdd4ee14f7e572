"""The gateway queue: while every backend a request could go to is saturated, it waits here instead of
in one backend's FCFS queue, and is bound to a backend when one frees up (late binding: the choice
uses the load and cache state of that moment).

This module holds the waiting requests and their order; ``kvgate.service`` decides when a request
must wait and dispatches them; Nginx holds the request itself (its connection to the sidecar stays
open while it waits, with a heartbeat, so a sidecar that dies never strands it).

Order: lower priority value first (vLLM's sense), then by the configured order: first come first
served; least prefill first with ageing (a request that waited ``ageing_s``, or ``ageing_fair_share``
times the wait first come first served would have given it, goes ahead of every younger one, in
arrival order); or fair between tenants (``kvgate.tenants``: the smallest virtual
finish tag first, first come first served within a tenant). Bounds: ``max_size`` waiting requests
(past it a new one is refused), ``max_key_share`` of them for one tenant with a name, an API key or
a tenant header's (so that one cannot fill the queue and refuse everyone else), and ``max_wait_s``
(past it a waiting one is refused); every refusal says when to retry.

Several replicas each run their own queue over the same backends. That they do not all pour into
the slot one freed is the dispatch rule's business: each replica may keep only its share of a
backend's prefill budget in flight (``kvgate.snapshot.Snapshot.saturated`` with ``replicas``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.config import DispatchOrder, PolicyName, QueueConfig
from kvgate.features import Features
from kvgate.messages import Outcome, OutcomeKind
from kvgate.outliers import refused
from kvgate.tenants import TenantLedger, named, service, tenant_of

RATE_HALF_LIFE_S = 10.0  # the dispatch-rate estimate behind Retry-After forgets at this pace
# Shortest-first: a request ordered by the prefill its prefix's holder would do, but placeable now only
# where it would prefill more than this many times that (and more than one step's budget), is put back
# in line as the longer request it now is.
REORDER_RATIO = 2.0
MAX_CHARGED = 100_000  # routed requests whose charge awaits their end (bounded: reports can be lost)


class QueueFull(Exception):
    def __init__(self, retry_after: int, key: str | None = None) -> None:
        super().__init__(
            "the gateway queue is full" if key is None else f"{key}'s share of the queue is full"
        )
        self.retry_after = retry_after
        self.key = key  # the named tenant whose share is full, or None: the whole queue is


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
    # The shortest-first key: the prompt tokens it would prefill where most of it is cached (shortest
    # order), else its estimated prompt tokens.
    tokens: int
    fair_s: float = math.inf  # the wait FCFS would have given it (set when it joins the queue)
    ready: float = 0.0  # not dispatched before this (queue.gather_ms: a long prompt lets a burst by)
    cost: int = 0  # its tenant's service it asks for, as counted when it joined (``GatewayQueue.cost``)
    # Live: the request's answer (a Routed, or QueueTimeout); None in virtual time.
    future: asyncio.Future[object] | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Charge:
    """What a routed request's tenant was charged, kept until its end says what it wrote."""

    tenant: str
    cost: int  # all of it: a request that never ran gives it back
    output: int  # the part for the output it asked for (max_tokens, else fair_output_tokens), weighed
    at: float  # when: a correction is what the charge would have been then, decayed as it was since
    asked: int | None  # the output tokens its max_tokens allow (None: it set none)


class GatewayQueue:
    def __init__(self, config: QueueConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.tenants = TenantLedger(config.fair_window_s)  # service per tenant, for the fair order
        self._waiting: dict[str, Waiting] = {}
        self._per_key: dict[str, int] = {}  # waiting requests of each named tenant (tenants.named)
        self._asking: dict[str, int] = {}  # the ``cost`` of each tenant's waiting requests (the reserve)
        self._charged: OrderedDict[str, Charge] = OrderedDict()  # fair order: decision id -> its charge
        self._rate = 0.0  # dispatches per second, smoothed
        self._last_dispatch: float | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, decision_id: str) -> bool:
        return decision_id in self._waiting

    def key_limit(self) -> int:
        """Waiting requests one named tenant (an API key, a tenant header's value) may hold."""
        return max(1, math.floor(self.config.max_size * self.config.max_key_share))

    def add(self, w: Waiting) -> None:
        if len(self._waiting) >= self.config.max_size:
            raise QueueFull(self.retry_after())
        tenant = tenant_of(w.features)
        key = named(tenant)
        if key is not None and self._per_key.get(key, 0) >= self.key_limit():
            raise QueueFull(self.retry_after(), key)
        if self._rate > 0:
            w.fair_s = len(self._waiting) / self._rate
        self._waiting[w.decision_id] = w
        if key is not None:
            self._per_key[key] = self._per_key.get(key, 0) + 1
        w.cost = self.cost(w.features)
        self._asking[tenant] = self._asking.get(tenant, 0) + w.cost

    def _take(self, decision_id: str) -> Waiting | None:
        """Where a waiting request leaves the queue, and its key's and its tenant's counts come down."""
        w = self._waiting.pop(decision_id, None)
        if w is None:
            return None
        _less(self._asking, tenant := tenant_of(w.features), w.cost)
        _less(self._per_key, named(tenant), 1)
        return w

    def remove(self, decision_id: str) -> Waiting | None:
        return self._take(decision_id)

    def waiting_features(self) -> list[Features]:
        return [w.features for w in self._waiting.values()]

    def keys_waiting(self) -> int:
        """Named tenants with requests waiting (bounded: it empties with the queue)."""
        return len(self._per_key)

    def dispatched(self, w: Waiting) -> float:
        """``w`` leaves for a backend; returns how long it waited."""
        self._take(w.decision_id)
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
            self._take(w.decision_id)
        return out

    def _aged(self, w: Waiting, now: float) -> bool:
        """Shortest-first: ``w`` waited long enough to go ahead of every younger request."""
        waited, multiple = now - w.arrived, self.config.ageing_fair_share
        return waited >= self.config.ageing_s or (multiple is not None and waited >= multiple * w.fair_s)

    def in_order(self) -> list[Waiting]:
        """Waiting requests in dispatch order."""
        now = self.clock()
        if self.config.order is DispatchOrder.FAIR:
            return self._fair(now)
        if self.config.order is DispatchOrder.SHORTEST:
            return sorted(
                self._waiting.values(),
                key=lambda w: (
                    (w.priority, 0, w.arrived, 0)
                    if self._aged(w, now)
                    else (w.priority, 1, w.tokens, w.arrived)
                ),
            )
        return sorted(self._waiting.values(), key=lambda w: (w.priority, w.arrived))

    @property
    def by_prefill(self) -> bool:
        """Shortest-first: the order keys on the prefill a request needs (``Waiting.tokens``)."""
        return self.config.order is DispatchOrder.SHORTEST

    def reorder(self, w: Waiting, prefill: int, budget: int) -> bool:
        """Shortest-first, as ``w`` is about to leave: it was ordered by the prefill where its prefix
        is cached, but the backend it can go to now would prefill ``prefill`` tokens. Past
        ``REORDER_RATIO`` times its key and one step's ``budget``, it takes that as its key and stays
        (True): the shorter requests behind it go first, and it leaves in its new place, to its
        prefix's holder if that has room by then. An aged request leaves as it is."""
        if not self.by_prefill or prefill <= max(budget, REORDER_RATIO * w.tokens):
            return False
        if self._aged(w, self.clock()):
            return False
        w.tokens = prefill
        return True

    def _fair(self, now: float) -> list[Waiting]:
        """Each request's virtual finish tag: its tenant's attained service, plus the cost of that
        tenant's requests waiting ahead of it, plus its own; the smallest first."""
        ahead: dict[str, float] = {}
        tagged = []
        for w in sorted(self._waiting.values(), key=lambda w: w.arrived):
            tenant = tenant_of(w.features)
            if tenant not in ahead:
                ahead[tenant] = self.tenants.attained(tenant, now)
            ahead[tenant] += self.cost(w.features)
            tagged.append((w.priority, ahead[tenant], w.arrived, w))
        tagged.sort(key=lambda t: t[:3])
        return [t[3] for t in tagged]

    def past_share(self, f: Features) -> bool:
        """Whether the request's tenant takes more than an equal share, in the fair order with a
        reserve (``fair_reserve``): it then leaves room for the others. A share is the service a
        tenant had lately and what it has waiting here, whole (``TenantLedger.over_share``)."""
        if self.config.order is not DispatchOrder.FAIR or not self.config.fair_reserve:
            return False
        return self.tenants.over_share(tenant_of(f), self.clock(), self._asking)

    def cost(self, f: Features) -> int:
        """The service a request takes, in prompt tokens: its own, and its expected ``output`` at
        ``fair_output_weight`` each (``kvgate.tenants``)."""
        return service(f.est_tokens, self.output(f), self.config.fair_output_weight)

    def output(self, f: Features) -> int:
        """The output tokens ``f`` is expected to write: of its ``max_tokens``, the share its
        tenant's requests have written lately (learned in the fair order, else all), else
        ``fair_output_tokens``. Its charge when routed, and what the reserve's KV mark counts it
        as taking (``kvgate.inflight``)."""
        tokens = f.output_tokens(self.config.fair_output_tokens)
        if f.max_tokens is not None:
            tokens = round(tokens * self.tenants.writes(tenant_of(f)))
        return tokens

    def served(self, tenant: str, tokens: int) -> None:
        """``tenant`` had ``tokens`` of service: a routed request's cost (``charge``)."""
        self.tenants.add(tenant, tokens, self.clock())

    def charge(self, decision_id: str, f: Features) -> tuple[str, int]:
        """A request was routed (from the queue or not): its tenant's service grows by its ``cost``,
        which ``settle`` corrects at its end. Returns the tenant and the cost."""
        tenant, cost = tenant_of(f), self.cost(f)
        self.served(tenant, cost)
        if self.config.charges_output:
            asked = f.output_tokens(0) if f.max_tokens is not None else None
            self._charged[decision_id] = Charge(tenant, cost, cost - f.est_tokens, self.clock(), asked)
            if len(self._charged) > MAX_CHARGED:
                self._charged.popitem(last=False)
        return tenant, cost

    def settle(self, o: Outcome) -> None:
        """A routed request ended, or was dropped: its tenant's service is corrected. A request is
        charged for what its backend's usage says it wrote, not for the ``max_tokens`` it asked (a
        client that asks for far more than it gets would otherwise be held as past its share), and
        the share of it written teaches what its tenant's next requests are charged when routed. One
        that never ran gives its whole cost back, one its backend refused (4xx) its output; any other
        end without usage keeps its charge. The one place a charge leaves (besides the bound)."""
        charge = self._charged.pop(o.decision_id, None) if o.decision_id is not None else None
        if charge is None:
            return
        if o.kind is OutcomeKind.DROP:
            change = -charge.cost
        elif o.completion_tokens is not None:
            # No more than it asked: a backend's usage is a number Nginx read from its answer.
            wrote = o.completion_tokens if charge.asked is None else min(o.completion_tokens, charge.asked)
            change = round(self.config.fair_output_weight * wrote) - charge.output
            if charge.asked:
                self.tenants.wrote(charge.tenant, wrote / charge.asked)
        elif refused(o.status):
            change = -charge.output  # it wrote nothing (its prompt stays: it took a turn)
        else:
            return
        now = self.clock()  # the correction decays as the charge did
        self.tenants.correct(charge.tenant, change * self.tenants.decay(charge.at, now), now)

    def charges(self) -> int:
        """Routed requests whose charge awaits their end (``GET /debug/memory``)."""
        return len(self._charged)

    def retry_after(self) -> int:
        """Seconds until the queue should have room: its length over the recent dispatch rate."""
        if self._rate <= 0:
            return 1
        return max(1, min(60, math.ceil(len(self._waiting) / self._rate)))


def _less(counts: dict[str, int], name: str | None, n: int) -> None:
    """``name``'s count down by ``n``; gone at zero, so the map holds only what waits."""
    if name is None:
        return
    left = counts[name] - n
    if left > 0:
        counts[name] = left
    else:
        del counts[name]
