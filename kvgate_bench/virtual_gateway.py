"""The gateway side of a virtual replay: one kvgate replica, or several over the same engines.

Each replica is a whole routing core (``build_sidecar``): its own registry, in-flight ledger, prefix
index, gateway queue and scrape phase, as separate sidecar processes have. What real replicas share
through Redis they share here through one in-process session map (Redis without latency: the first
claim wins for all of them), and each knows the replica count its heartbeat would find, which splits
the queue's dispatch budget and the learned bytes-per-token between them. The client spreads requests
as a Kubernetes Service spreads new connections: at random, or in turn. Each replica shares its
in-flight load with the others as the sidecar does through Redis (``kvgate.shared_load``), unless
the replay asks for islands.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Coroutine, Iterable, Sequence
from enum import Enum
from typing import Any, TypeVar

from kvgate.public import (
    Config,
    Features,
    Outcome,
    Queued,
    QueueTimeout,
    Routed,
    Scraped,
    Sidecar,
    SloShed,
    build_sidecar,
    kv_events,
)

from vllm_sim.engine import Engine

T = TypeVar("T")


class Spread(Enum):
    RANDOM = "random"  # each request a new connection, to any replica
    ROUND_ROBIN = "round_robin"  # each request to the next replica in turn


class Gateways:
    """``n`` replicas of kvgate over the backends of ``config``; replica 0 scrapes first at
    ``scrape_phase`` (one replica runs exactly as before replicas existed), the others at phases drawn
    from ``seed`` within one ``scrape_interval``, as independent processes would."""

    def __init__(
        self,
        config: Config,
        n: int,
        spread: Spread,
        seed: int,
        scrape_phase: float,
        scrape_interval: float,
        clock: Callable[[], float],
        models: frozenset[str],
        share: bool = True,
    ) -> None:
        self.replicas: list[Sidecar] = [build_sidecar(config, None) for _ in range(max(1, n))]
        shared = self.replicas[0].sessions.local  # Redis's bindings, one map for all
        for core in self.replicas:
            core.sessions.local = shared
            core.registry.set_replicas(len(self.replicas))
            if core.service.queue is not None:
                core.service.queue.clock = clock
            core.registry.ledger.clock = clock  # first bytes learned in virtual seconds
            core.registry.set_membership((b, False) for b in config.backends)
            for bid in core.registry.backends:
                core.registry.set_models(bid, models)
        self.ids = [b.id for b in config.backends]
        self.spread = spread
        self._rng = random.Random(seed)
        self._turn = 0
        self.phases = [scrape_phase] + [
            self._rng.uniform(0.0, scrape_interval) for _ in range(len(self.replicas) - 1)
        ]
        # Every replica shares its in-flight load through Redis's hash (``kvgate.shared_load``) each
        # ``share_s`` from a phase of its own; 0: islands, each sees only its own between scrapes.
        self.share_s = config.redis.load_share_s if share and len(self.replicas) > 1 else 0.0
        self.share_phases = [self._rng.uniform(0.0, self.share_s) for _ in self.replicas]
        self._hash: dict[str, str] = {}  # the load hash in Redis
        for k, core in enumerate(self.replicas):
            core.registry.shared.me = f"replica-{k}"

    def __len__(self) -> int:
        return len(self.replicas)

    def pick(self) -> int:
        """The replica the client's next request reaches."""
        if len(self.replicas) == 1:
            return 0
        if self.spread is Spread.RANDOM:
            return self._rng.randrange(len(self.replicas))
        self._turn = (self._turn + 1) % len(self.replicas)
        return self._turn

    def decide(self, k: int, f: Features) -> Routed | Queued:
        """Replica ``k`` decides (raises ``QueueFull`` when its queue is full)."""
        return _sync(self.replicas[k].service.decide(f))

    def report(self, k: int, outcome: Outcome) -> None:
        """An outcome reaches the replica whose Nginx proxied the request."""
        self.replicas[k].service.report([outcome])

    def scrape(self, k: int, engines: Sequence[Engine], at: float) -> None:
        """Replica ``k`` reads every engine's load, as its scraper would from ``/metrics``."""
        core = self.replicas[k]
        for bid, e in zip(self.ids, engines, strict=True):
            core.registry.scrape_ok(
                bid,
                Scraped(
                    float(e.num_running),
                    float(e.num_waiting),
                    e.pool.usage(),
                    float(e.counters.prefix_queries),
                    float(e.counters.prefix_hits),
                    at,
                    float(e.counters.prompt_tokens),
                    block_size=e.block_size,
                    kv_blocks=e.config.num_gpu_blocks,
                ),
            )
            unreported = core.registry.ledger.unreported.get(bid, 0)
            core.service.tokens.counted(bid, float(e.counters.prompt_tokens), len(self.replicas), unreported)
        core.registry.changed()

    def share(self, k: int, now: float) -> None:
        """Replica ``k``'s load-share round trip: its field written, every field read back."""
        shared, ledger = self.replicas[k].registry.shared, self.replicas[k].registry.ledger
        self._hash[shared.me] = shared.payload(ledger)
        for gone in shared.absorb(self._hash, now):
            self._hash.pop(gone, None)

    def publish(self, backend: str, seq: int, payload: bytes) -> None:
        """A publisher's message reaches every replica's subscriber (each subscribes on its own)."""
        batch = kv_events.decode(payload)
        for core in self.replicas:
            core.exact.apply(backend, seq, batch)

    def dispatch(self) -> Iterable[tuple[int, str, Routed | QueueTimeout | SloShed]]:
        """What each replica's gateway queue releases now: (replica, decision id, answer)."""
        for k, core in enumerate(self.replicas):
            if core.service.queue is None:
                continue
            for w, result in _sync(core.service.dispatch()):
                yield k, w.decision_id, result


def _sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never really waits (no Redis client: every await returns at once)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("the decision path awaited real I/O in virtual time")
