"""The cluster as one request's policy sees it: the eligible backends with their load, the in-flight
counts that move between scrapes, and the tests every policy reads through them (room, saturation,
the bounded-load share, a tenant past its share's room). Pure: built by the registry
(``Registry.snapshot``), read by ``kvgate.policies`` and the planner.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvgate.config import LoadLimits
from kvgate.load import LoadView
from kvgate.ring import Ring


@dataclass(frozen=True, slots=True)
class NodeView:
    id: str
    weight: float
    load: LoadView


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The backends eligible for one request (healthy, not draining, serving its model)."""

    nodes: Mapping[str, NodeView]
    ring: Ring
    limits: LoadLimits = field(default_factory=LoadLimits)
    # Live in-flight counts, read-only here: the node views are cached between scrape rounds, while
    # these move with every decision and report. This sidecar's plus the other replicas' as last
    # shared (kvgate.shared_load); ``own_tokens`` is this sidecar's alone (None: the same).
    inflight: Mapping[str, int] = field(default_factory=dict)
    inflight_tokens: Mapping[str, int] = field(default_factory=dict)
    replicas: int = 1  # gateway replicas sharing these backends (the gateway queue's dispatch share)
    own_tokens: Mapping[str, int] | None = None
    # The KV cache tokens the requests in flight may newly take (the prompt tokens they prefill
    # there, the output they may write; every replica's, as last shared).
    inflight_kv: Mapping[str, int] = field(default_factory=dict)

    total_weight: float = field(init=False, default=1.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_weight", sum(n.weight for n in self.nodes.values()) or 1.0)

    def requests(self, node: str) -> float:
        """Running + waiting at the last scrape, or this sidecar's in-flight count if higher."""
        return max(self.nodes[node].load.requests, float(self.inflight.get(node, 0)))

    def walk(self, key: str) -> Iterator[str]:
        """Eligible nodes in ring order from ``key`` (the ring spans every backend of every model)."""
        return (n for n in self.ring.walk(key) if n in self.nodes)

    def saturated(self, node: str) -> bool:
        """Queueing (waiting requests or prefill tokens routed here) or out of KV cache."""
        limits = self.limits
        if self.inflight_tokens.get(node, 0) >= limits.saturation_prefill_tokens:
            return True
        return self.nodes[node].load.saturated(limits.saturation_waiting, limits.saturation_kv)

    def has_room(self, node: str, budget: int | None = None) -> bool:
        """Whether this replica may send ``node`` one more request now: not saturated (by every
        replica's load, as last shared), and this replica's own prefill tokens there within its split
        of the budget, so that replicas dispatching from their queues at once, between two shares,
        cannot together pour more than one budget into a node that freed up. ``budget``: a prefill
        budget tighter than ``saturation_prefill_tokens`` (``room_past_share``)."""
        own = self.inflight_tokens if self.own_tokens is None else self.own_tokens
        limit = self.limits.saturation_prefill_tokens if budget is None else budget
        if own.get(node, 0) >= limit / max(1, self.replicas) or self.inflight_tokens.get(node, 0) >= limit:
            return False
        return not self.saturated(node)

    def fits(self, node: str, tokens: int) -> bool:
        """``has_room`` for a request of ``tokens`` to prefill: nothing else awaiting prefill on
        ``node``, or that and these within the prefill budget. An engine packs its waiting prefills
        into one step of its token budget and answers none of them before the step ends, so a short
        prompt sent with a long one waits for the long one's chunk."""
        ahead = self.inflight_tokens.get(node, 0)
        limit = self.limits.saturation_prefill_tokens
        return self.has_room(node) and (ahead == 0 or ahead + tokens <= limit)

    def holds(self, node: str, tokens: int) -> bool:
        """Whether ``node``'s KV cache had free blocks for ``tokens`` more at its last scrape (a
        backend that does not export its cache's size: yes). A prompt sent where it does not fit
        waits there for blocks, or starts and is preempted as the running requests grow (vLLM
        preempts the newest first). Read from the scrape, not ``kv_committed``: counting every
        request's ``max_tokens`` as taken made a busy backend look full and measured worse
        (docs/benchmarks.md, "A prompt where the KV cache can hold it")."""
        load = self.nodes[node].load
        return not load.kv_tokens or load.kv_usage + tokens / load.kv_tokens <= 1.0

    def room_past_share(self, node: str, budget: int, reserve: int, kv: float = 1.0) -> bool:
        """``has_room`` for a tenant past its share of the service (``queue.fair_*``): fewer than
        ``budget`` prompt tokens waiting for prefill on ``node`` and its KV cache under ``kv``
        used, and ``reserve`` other backends left clear (no prefill waiting, KV under ``kv``), so
        that another tenant's next request finds one where it starts at once (the engine finishes
        the prefills it runs before it starts a waiting one, and a request without KV blocks
        waits for some to free)."""
        if not self.has_room(node, budget) or self.kv_committed(node) >= kv:
            return False
        clear = sum(
            1
            for n in self.nodes
            if n != node and self.inflight_tokens.get(n, 0) == 0 and self.kv_committed(n) < kv
        )
        return clear >= min(reserve, len(self.nodes) - 1)

    def kv_committed(self, node: str) -> float:
        """The share of ``node``'s KV cache used at the last scrape, or what the requests in flight
        there may newly take when that is more. A flood's streams grow into the cache as they
        decode, after the scrape that let them in: with the scrape alone, its requests kept coming
        until the cache ran out and the others' next prompt waited seconds for blocks. The prompt
        tokens a request finds cached are not counted: counting them held the flood back more and
        measured worse (docs/benchmarks.md, "The flood's KV in flight")."""
        load = self.nodes[node].load
        if not load.kv_tokens:  # the backend does not export its cache's size
            return load.kv_usage
        return max(load.kv_usage, self.inflight_kv.get(node, 0) / load.kv_tokens)

    def out_of_kv(self, node: str) -> bool:
        """Full in a way no count of queued work can see: KV cache at the saturation mark, or
        requests waiting there for free blocks (a request sent there waits for some to free)."""
        load = self.nodes[node].load
        return load.known and (load.kv_usage >= self.limits.saturation_kv or load.kv_short)

    def bound_admits(
        self, c: float | Callable[[str], float] | None = None, queued: bool = False
    ) -> Callable[[str], bool]:
        """Bounded-load test: a node may take one more request while under c x its fair share
        (``routing.load_factor`` unless given; a function: each node's own c) and not saturated;
        ``queued``: saturated by its queue is no bar, only ``out_of_kv`` is (for a placement whose
        expected first byte counts the queue)."""
        total = sum(self.requests(n) for n in self.nodes)
        weights = self.total_weight
        factor = self.limits.load_factor if c is None else c

        def admits(node: str) -> bool:
            v = self.nodes[node]
            c = factor(node) if callable(factor) else factor
            cap = math.ceil(c * (total + 1) * v.weight / weights)
            if self.requests(node) + 1 > cap:
                return False
            return not self.out_of_kv(node) if queued else not self.saturated(node)

        return admits
