"""Tenants and the service each has had lately, for the gateway queue's fair order.

A tenant is what the request's tenant header names (``queue.tenant_header``: an edge in front that
authenticates clients sets it), else its API key (its name, when the gateway checks keys), else the
client's address. Each
routed request adds its cost to its tenant's *attained service*, which decays with a half-life of
``queue.fair_window`` so that what a tenant got a minute ago counts less than what it got now. The
cost is its estimated prompt tokens plus the output it may write at ``queue.fair_output_weight``
each (``GatewayQueue.cost``), as a virtual token counter weighs them: a tenant that sends short
prompts asking for long answers takes the engines' steps and KV cache in decodes, and counted by
its prompts alone it looked under its share while the tenant it crowded out looked over it and was
held for the reserve. The output is what the request's end says it wrote (the usage Nginx reads,
``GatewayQueue.settle``); until then, the share of its ``max_tokens`` its tenant's requests have
written lately (``writes``; 1 until an end says), else ``queue.fair_output_tokens``. Charged for
all of its ``max_tokens``, a tenant whose clients ask for 4,096 tokens and get a few hundred was
past its share and held for the reserve (on the benchmark, its p90 hundreds of times its value
alone). The fair order
(``kvgate.queue``) then gives each waiting request a virtual finish tag: its tenant's attained
service plus the cost of that tenant's requests ahead of it in the queue, plus its own; the
smallest tag goes first. A tenant that floods gets its share and no more; one that sends little is
served almost as soon as it asks (least attained service, in tokens, as a virtual token counter
does it).

The order alone is not enough: once the gateway has sent a quiet tenant's request first, it still
waits inside the backend behind the flood's prefills already admitted there (an engine finishes the
prefills it runs before starting a waiting one). So while a tenant takes more than an equal share
(``over_share``), its requests go only where they leave room for the others
(``snapshot.Snapshot.room_past_share``: little prefill waiting there and KV cache to spare, and
``queue.fair_reserve`` backends clear of prefill with KV cache to spare: a flood's decodes would
otherwise fill every cache, and a request without KV blocks waits for some). A tenant's share is
the service it had lately plus what it has waiting in the gateway queue, counted whole: the flood's
requests that wait are served less than they ask, and by service alone the quiet tenant would then
look past its share and wait for the reserve too. Not its arrivals, decayed: a flood whose
backlog is still being served minutes after its last arrival then looked smaller than the quiet
tenant's steady arrivals, and the quiet tenant waited for the room that backlog kept taking.

Bounded: a tenant whose decayed service falls under one token is forgotten when the next one is
counted, so the map holds about the tenants of the last few windows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.features import Features

ANONYMOUS = "anonymous"  # the metric label of tenants that are addresses, not keys
OTHER = "other"  # the metric label of header tenants past the first MAX_NAMED
MAX_NAMED = 64  # header tenants named in metrics: a header is text a client may have written
FORGET_BELOW = 1.0  # tokens of decayed service under which a tenant is dropped
SWEEP_EVERY = 1024  # counts between two sweeps of forgotten tenants
SHARE_EVERY_S = 0.1  # the total service and the active tenants are summed again this often
ACTIVE_SHARE = 0.01  # a tenant with less of the recent service does not count as competing
# Of the max_tokens a tenant's requests ask for, the share they write: learned from each end's usage
# (the first replaces the prior of 1, then a moving mean at this pace), never under MIN_WRITES (a
# tenant that wrote little once cannot then ask for long answers at almost no charge).
WRITES_PACE = 0.2
MIN_WRITES = 1 / 32


def tenant_of(f: Features) -> str:
    return tenant_for(f.client_key, f.client_addr, f.tenant)


def tenant_for(client_key: str | None, client_addr: str | None, header: str | None = None) -> str:
    """The tenant a tenant header names, else an API key's name, else a client address (sent when
    rate limits apply)."""
    if header:
        return f"tenant:{header}"
    if client_key:
        return f"key:{client_key}"
    return f"addr:{client_addr}" if client_addr else ANONYMOUS


def named(tenant: str) -> str | None:
    """``tenant`` when it has a name (a tenant header's, an API key's), else None: requests known
    by their address alone (all of them, when limits are off) are not held apart."""
    return tenant if tenant.startswith(("key:", "tenant:")) else None


def service(prompt: int, output: int, output_weight: float) -> int:
    """The service a request takes, in prompt tokens: its prompt, and its output at
    ``output_weight`` each (``queue.fair_output_weight``, a virtual token counter's weighing)."""
    return prompt + round(output_weight * output)


class TenantLabels:
    """Bounded metric labels of tenants: an API key's name (configured, so bounded); a tenant
    header's value for the first ``MAX_NAMED`` values seen, ``other`` past them (Nginx checks the
    value's form, but an edge that passes a client's header on would let it write any number of
    them, and each label is a series kept for good); ``anonymous`` for addresses."""

    def __init__(self) -> None:
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        kind, _, name = tenant.partition(":")
        if kind == "key":
            return name
        if kind != "tenant":
            return ANONYMOUS
        if name not in self._named:
            if len(self._named) >= MAX_NAMED:
                return OTHER
            self._named.add(name)
        return name


@dataclass(slots=True)
class _Service:
    tokens: float
    at: float
    writes: float = 1.0  # of the max_tokens its requests ask for, the share they write
    learned: bool = False  # whether ``writes`` has heard of an end yet


class TenantLedger:
    """Tokens per tenant, each decayed with the half-life: the service each had."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._service: dict[str, _Service] = {}
        self._counted = 0
        self._total = _Service(0.0, 0.0)  # the sum over tenants, decayed as each term is
        self._active: tuple[float, int] | None = None  # (when, tenants with 1 % of the total or more)

    def __len__(self) -> int:
        return len(self._service)

    def tenants(self) -> list[str]:
        return list(self._service)

    def decay(self, since: float, now: float) -> float:
        """What a token of service counted at ``since`` counts at ``now``."""
        return math.exp2(-(now - since) / self.half_life_s)

    def attained(self, tenant: str, now: float) -> float:
        s = self._service.get(tenant)
        if s is None:
            return 0.0
        return s.tokens * self.decay(s.at, now)

    def over_share(self, tenant: str, now: float, waiting: Mapping[str, int] | None = None) -> bool:
        """Whether ``tenant`` had more than an equal share of the recent total, among the tenants
        that had at least 1 % of it (when there are two or more). ``waiting``: tokens each tenant
        still asks for now (its requests waiting at the gateway), counted whole beside the decayed
        past; a tenant with requests waiting and none served yet counts too."""
        waiting = waiting or {}
        if len(self._service) < 2 and not waiting:
            return False
        total = self._total.tokens * math.exp2(-(now - self._total.at) / self.half_life_s)
        total += sum(waiting.values())

        def asks(t: str) -> float:
            return self.attained(t, now) + waiting.get(t, 0)

        if self._active is None or now - self._active[0] >= SHARE_EVERY_S:
            active = sum(1 for t in self._service.keys() | waiting.keys() if asks(t) >= ACTIVE_SHARE * total)
            self._active = (now, active)
        active = self._active[1]
        return active > 1 and asks(tenant) > total / active

    def correct(self, tenant: str, tokens: float, now: float) -> None:
        """``tenant``'s service moves by ``tokens`` (either sign, never under 0): a request it was
        charged for wrote more or less than it asked, or never ran. A tenant already forgotten
        stays so."""
        s = self._service.get(tenant)
        if s is None:
            return
        had = self.attained(tenant, now)
        s.tokens, s.at = max(0.0, had + tokens), now
        # Kept exact as it goes, not summed now and then: in a burst, a total some counts old would
        # put every tenant past its share.
        decay = self.decay(self._total.at, now)
        self._total = _Service(max(0.0, self._total.tokens * decay + s.tokens - had), now)

    def writes(self, tenant: str) -> float:
        """Of the ``max_tokens`` ``tenant``'s requests ask for, the share they write (1 until an
        end says otherwise): what a request is charged for when routed, before its end says."""
        s = self._service.get(tenant)
        return 1.0 if s is None else s.writes

    def wrote(self, tenant: str, share: float) -> None:
        """A request of ``tenant`` ended having written ``share`` of the ``max_tokens`` it asked."""
        s = self._service.get(tenant)
        if s is None:
            return
        share = min(1.0, max(MIN_WRITES, share))
        s.writes = share if not s.learned else s.writes + WRITES_PACE * (share - s.writes)
        s.learned = True

    def add(self, tenant: str, tokens: float, now: float) -> None:
        """``tenant`` had a request of ``tokens`` routed (its cost)."""
        self._service.setdefault(tenant, _Service(0.0, now))
        self.correct(tenant, tokens, now)
        self._counted += 1
        if self._counted % SWEEP_EVERY == 0:
            self._service = {t: s for t, s in self._service.items() if self.attained(t, now) >= FORGET_BELOW}


class DepthCollector(Collector):
    """``kvgate_tenant_queue_depth{tenant}``, counted from the queue when Prometheus asks: nothing to
    bring down by hand, a tenant with nothing waiting is simply absent."""

    def __init__(self, waiting: Callable[[], Iterable[Features]], label: Callable[[str], str]) -> None:
        self._waiting = waiting
        self._label = label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvgate_tenant_queue_depth",
            "Requests waiting in the gateway queue, per tenant.",
            labels=["tenant"],
        )
        for label, n in sorted(Counter(self._label(tenant_of(f)) for f in self._waiting()).items()):
            family.add_metric([label], n)
        yield family


class ServiceCollector(Collector):
    """``kvgate_tenant_attained_tokens{tenant}``: the service the fair order counts for each tenant
    now (decayed, and corrected at each request's end), read from the ledger when Prometheus asks.
    Beside ``kvgate_tenant_service_tokens`` (what each request was charged when routed), it says
    why a tenant is judged past its share."""

    def __init__(self, ledger: TenantLedger, clock: Callable[[], float], label: Callable[[str], str]) -> None:
        self._ledger = ledger
        self._clock = clock
        self._label = label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvgate_tenant_attained_tokens",
            "The service the fair order counts for each tenant now, in prompt tokens: its requests' "
            "costs, halved every queue.fair_window, each corrected at its end by the output its "
            "usage reports.",
            labels=["tenant"],
        )
        now, sums = self._clock(), dict[str, float]()
        for tenant in self._ledger.tenants():
            label = self._label(tenant)
            sums[label] = sums.get(label, 0.0) + self._ledger.attained(tenant, now)
        for label, tokens in sorted(sums.items()):
            family.add_metric([label], round(tokens, 1))
        yield family
