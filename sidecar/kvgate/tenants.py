"""Tenants and the service each has had lately, for the gateway queue's fair order.

A tenant is an API key (its name, when the gateway checks keys), else the client's address. Each
routed request adds its estimated prompt tokens to its tenant's *attained service*, which decays
with a half-life of ``queue.fair_window`` so that what a tenant got a minute ago counts less than
what it got now. The fair order (``kvgate.queue``) then gives each waiting request a virtual finish
tag: its tenant's attained service plus the tokens of that tenant's requests ahead of it in the
queue, plus its own; the smallest tag goes first. A tenant that floods gets its share and no more;
one that sends little is served almost as soon as it asks (least attained service, in tokens, as a
virtual token counter does it).

The order alone is not enough: once the gateway has sent a quiet tenant's request first, it still
waits inside the backend behind the flood's prefills already admitted there (an engine finishes the
prefills it runs before starting a waiting one). So while a tenant is past an equal share of the
recent service (``over_share``), its requests go only where they leave room for the others
(``policies.Snapshot.room_past_share``: little prefill waiting there and KV cache to spare, and
``queue.fair_reserve`` backends clear of prefill with KV cache to spare: a flood's decodes would
otherwise fill every cache, and a request without KV blocks waits for some).

Bounded: a tenant whose decayed service falls under one token is forgotten when the next one is
counted, so the map holds about the tenants of the last few windows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.features import Features

ANONYMOUS = "anonymous"  # the metric label of tenants that are addresses, not keys
FORGET_BELOW = 1.0  # tokens of decayed service under which a tenant is dropped
SWEEP_EVERY = 1024  # counts between two sweeps of forgotten tenants
SHARE_EVERY_S = 0.1  # the total service and the active tenants are summed again this often
ACTIVE_SHARE = 0.01  # a tenant with less of the recent service does not count as competing


def tenant_of(f: Features) -> str:
    if f.client_key:
        return f"key:{f.client_key}"
    return f"addr:{f.client_addr}" if f.client_addr else ANONYMOUS


def label_of(tenant: str) -> str:
    """A bounded metric label: the API key's name (configured, so bounded), else ``anonymous``."""
    return tenant[4:] if tenant.startswith("key:") else ANONYMOUS


@dataclass(slots=True)
class _Service:
    tokens: float
    at: float


class TenantLedger:
    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._service: dict[str, _Service] = {}
        self._counted = 0
        self._shares: tuple[float, float, int] | None = None  # (when, total service, active tenants)

    def __len__(self) -> int:
        return len(self._service)

    def attained(self, tenant: str, now: float) -> float:
        s = self._service.get(tenant)
        if s is None:
            return 0.0
        return s.tokens * math.exp2(-(now - s.at) / self.half_life_s)

    def over_share(self, tenant: str, now: float) -> bool:
        """Whether ``tenant`` had more than an equal share of the recent service, among the tenants
        that had at least 1 % of it (when there are two or more)."""
        if len(self._service) < 2:
            return False
        if self._shares is None or now - self._shares[0] >= SHARE_EVERY_S:
            total = sum(self.attained(t, now) for t in self._service)
            active = sum(1 for t in self._service if self.attained(t, now) >= ACTIVE_SHARE * total)
            self._shares = (now, total, active)
        at, total, active = self._shares
        decay = math.exp2(-(now - at) / self.half_life_s)  # the sum decays as each term does
        return active > 1 and self.attained(tenant, now) > decay * total / active

    def served(self, tenant: str, tokens: float, now: float) -> None:
        """``tenant`` had a request routed with ``tokens`` estimated prompt tokens."""
        self._service[tenant] = _Service(self.attained(tenant, now) + tokens, now)
        self._counted += 1
        if self._counted % SWEEP_EVERY == 0:
            self._service = {t: s for t, s in self._service.items() if self.attained(t, now) >= FORGET_BELOW}


class DepthCollector(Collector):
    """``kvgate_tenant_queue_depth{tenant}``, counted from the queue when Prometheus asks: nothing to
    bring down by hand, a tenant with nothing waiting is simply absent."""

    def __init__(self, waiting: Callable[[], Iterable[Features]]) -> None:
        self._waiting = waiting

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvgate_tenant_queue_depth",
            "Requests waiting in the gateway queue, per tenant.",
            labels=["tenant"],
        )
        for label, n in sorted(Counter(label_of(tenant_of(f)) for f in self._waiting()).items()):
            family.add_metric([label], n)
        yield family
