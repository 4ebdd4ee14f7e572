"""The sidecar's routing core, wired once: metrics, registry, sessions, prefix index, decision service.

``build_sidecar`` is the one place these parts are put together. The aiohttp app
(``kvgate.app.create_app``) adds I/O around it (the decision socket, HTTP API, scrapes, membership
sync); the benchmark's virtual-time replay drives the very same core with no Redis and a virtual clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.agreement import Agreement
from kvgate.config import Config
from kvgate.exact_index import ExactIndex
from kvgate.limits import RateLimiter
from kvgate.metrics import SidecarMetrics
from kvgate.outliers import OutlierDetector
from kvgate.prefix_index import PrefixIndex
from kvgate.redis_client import RedisClient
from kvgate.registry import Registry
from kvgate.service import DecisionService
from kvgate.sessions import SessionStore


@dataclass(frozen=True, slots=True)
class Sidecar:
    config: Config
    metrics: SidecarMetrics
    registry: Registry
    sessions: SessionStore
    index: PrefixIndex
    exact: ExactIndex  # fed by kvgate.kv_subscriber from the backends that publish KV events
    service: DecisionService
    agreement: Agreement  # whether the Nginx in front runs this config too


def build_sidecar(config: Config, redis: RedisClient | None) -> Sidecar:
    """The routing core over ``config``; ``redis`` None keeps sessions in process memory only."""
    metrics = SidecarMetrics()
    registry = Registry(
        config.scrape, config.routing, metrics, OutlierDetector(config.outlier), pool_label=config.pools.label
    )
    sessions = SessionStore(config.redis, metrics, redis)
    index = PrefixIndex(config.routing.prefix_index_blocks)
    limiter = RateLimiter(config.limits, config.auth, redis, config.redis.prefix) if config.limited else None
    exact = ExactIndex(config.kv_index.max_blocks, config.kv_index.stale_s)
    service = DecisionService(config, registry, sessions, index, metrics, limiter, exact=exact)
    return Sidecar(config, metrics, registry, sessions, index, exact, service, Agreement(config))
