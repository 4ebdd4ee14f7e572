"""Session-to-backend bindings in Redis, shared by every gateway replica, with a local fallback.

* ``get`` refreshes the TTL on use (GETEX), ``bind`` is first-binding-wins (SET NX, then read the
  winner), ``rebind`` overwrites when the bound backend is unhealthy, drained or saturated.
* Every Redis call has a short explicit timeout. After a failure the store routes from a bounded
  in-process map for ``retry_after`` before trying Redis again, so a dead Redis costs one timeout per
  interval, not one per request. Bindings made meanwhile are written back when Redis returns.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvgate.config import RedisConfig
from kvgate.metrics import SidecarMetrics

logger = logging.getLogger(__name__)


class LocalSessions:
    """Bounded LRU map used while Redis is unreachable (and as a read-through cache)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        node = self._map.get(key)
        if node is not None:
            self._map.move_to_end(key)
        return node

    def set(self, key: str, node: str) -> None:
        self._map[key] = node
        self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def items(self) -> list[tuple[str, str]]:
        return list(self._map.items())


class SessionStore:
    def __init__(self, config: RedisConfig, metrics: SidecarMetrics, client: aioredis.Redis | None) -> None:
        self.config = config
        self.metrics = metrics
        self.client = client
        self.local = LocalSessions(config.local_sessions)
        self._down_until = 0.0
        self._dirty: dict[str, str] = {}  # bindings made while Redis was down
        self.ttl = int(config.session_ttl_s)

    def _key(self, key: str) -> str:
        return f"{self.config.prefix}:s:{key}"

    @property
    def redis_ok(self) -> bool:
        return self.client is not None and time.monotonic() >= self._down_until

    def _failed(self, exc: Exception, op: str) -> None:
        if time.monotonic() >= self._down_until:
            logger.warning(
                "redis %s failed (%s); routing from local memory for %.1fs",
                op,
                exc,
                self.config.retry_after_s,
            )
        self._down_until = time.monotonic() + self.config.retry_after_s
        self.metrics.redis_errors.labels(op).inc()

    async def get(self, key: str) -> str | None:
        if self.redis_ok:
            assert self.client is not None
            try:
                await self._flush_dirty()
                value = await self.client.getex(self._key(key), ex=self.ttl)
            except (RedisError, OSError) as exc:
                self._failed(exc, "get")
            else:
                node = value.decode() if isinstance(value, bytes) else value
                if node is not None:
                    self.local.set(key, node)
                return node
        self.metrics.redis_fallbacks.inc()
        return self.local.get(key)

    async def bind(self, key: str, node: str) -> str:
        """Bind ``key`` to ``node`` unless another decision bound it first; returns the binding."""
        if self.redis_ok:
            assert self.client is not None
            try:
                rkey = self._key(key)
                if await self.client.set(rkey, node, nx=True, ex=self.ttl):
                    self.local.set(key, node)
                    return node
                winner = await self.client.getex(rkey, ex=self.ttl)
            except (RedisError, OSError) as exc:
                self._failed(exc, "bind")
            else:
                bound = winner.decode() if isinstance(winner, bytes) else winner
                bound = bound or node
                self.local.set(key, bound)
                return str(bound)
        self.local.set(key, node)
        self._dirty[key] = node
        return node

    async def rebind(self, key: str, node: str) -> None:
        self.local.set(key, node)
        if self.redis_ok:
            assert self.client is not None
            try:
                await self.client.set(self._key(key), node, ex=self.ttl)
                return
            except (RedisError, OSError) as exc:
                self._failed(exc, "rebind")
        self._dirty[key] = node

    async def _flush_dirty(self) -> None:
        """Write back bindings made while Redis was down; first binding still wins."""
        if not self._dirty or self.client is None:
            return
        dirty, self._dirty = self._dirty, {}
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key, node in dirty.items():
                    pipe.set(self._key(key), node, nx=True, ex=self.ttl)
                await pipe.execute()
        except (RedisError, OSError):
            self._dirty = {**dirty, **self._dirty}  # keep them for the next attempt
            raise
