"""Tenants and the service each has had lately, for the gateway queue's fair order.

A tenant is an API key (its name, when the gateway checks keys), else the client's address. Each
routed request adds its estimated prompt tokens to its tenant's *attained service*, which decays
with a half-life of ``queue.fair_window`` so that what a tenant got a minute ago counts less than
what it got now. The fair order (``kvgate.queue``) then gives each waiting request a virtual finish
tag: its tenant's attained service plus the tokens of that tenant's requests ahead of it in the
queue, plus its own; the smallest tag goes first. A tenant that floods gets its share and no more;
one that sends little is served almost as soon as it asks (least attained service, in tokens, as a
virtual token counter does it).

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

    def __len__(self) -> int:
        return len(self._service)

    def attained(self, tenant: str, now: float) -> float:
        s = self._service.get(tenant)
        if s is None:
            return 0.0
        return s.tokens * math.exp2(-(now - s.at) / self.half_life_s)

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
