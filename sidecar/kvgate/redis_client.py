"""The sidecar's Redis client: one server, a Sentinel-managed primary, or a Cluster, by URL.

``redis://``, ``rediss://`` and ``unix://`` name one server. ``redis+sentinel://[user:pass@]h1:p1,
h2:p2/SERVICE[/DB]`` asks those Sentinels for SERVICE's primary, and again after every connection
error, so a failover is followed on the next connect. ``redis+cluster://[user:pass@]h1:p1,h2:p2`` is
a Redis Cluster reached through any of those nodes; keys are hashed to slots, so every multi-key
operation kvgate makes stays in one slot (the membership pair shares a hash tag) or is a pipeline the
cluster client splits by node.

Every client gets kvgate's budgets (timeouts on connect and on each command, no retries): redis-py's
defaults (no timeout, retries with backoff) would stall routing. ``REDIS_ERRORS`` is what a call may
raise when Redis is away or moving; each caller turns it into its designed fallback.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from kvgate.config import RedisConfig
from kvgate.config.infra import CLUSTER, SENTINEL, parse_nodes

# A cluster client raises RedisClusterException (not a RedisError) when no node answers.
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)

RedisClient = aioredis.Redis | RedisCluster


class _SentinelPrimary(aioredis.Redis):
    """The primary's client, which closes its Sentinels' connections with its own."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await self.connection_pool.sentinel_manager.aclose()  # type: ignore[attr-defined]


def is_cluster(rc: RedisConfig) -> bool:
    return rc.url is not None and rc.url.startswith(CLUSTER)


def connect(rc: RedisConfig) -> RedisClient | None:
    """A client for ``rc.url`` with kvgate's budgets; None without Redis (sessions in memory)."""
    if rc.url is None:
        return None
    budgets: dict[str, Any] = {
        "socket_timeout": rc.timeout_s,
        "socket_connect_timeout": rc.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if rc.url.startswith((SENTINEL, CLUSTER)):
        nodes = parse_nodes(rc.url)
        credentials: dict[str, Any] = {
            "username": rc.username or nodes.username,
            "password": rc.password or nodes.password,
        }
        if nodes.service is not None:
            sentinel = Sentinel(
                list(nodes.hosts),
                # The Sentinels themselves: the same budgets, their own credentials (none by default).
                sentinel_kwargs={k: v for k, v in budgets.items() if k != "health_check_interval"},
                **budgets,
            )
            return sentinel.master_for(  # type: ignore[no-any-return]
                nodes.service,
                redis_class=_SentinelPrimary,
                db=nodes.db,
                max_connections=64,
                retry_on_timeout=False,
                **credentials,
            )
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in nodes.hosts],
            max_connections=64,
            require_full_coverage=False,  # a slot whose node is down fails alone, the rest serve
            **credentials,
            **budgets,
        )
    tls: dict[str, Any] = {"ssl_ca_certs": rc.tls_ca_file} if rc.url.startswith("rediss://") else {}
    credentials = {}  # (typed above)
    if rc.username is not None:
        credentials["username"] = rc.username
    if rc.password is not None:
        credentials["password"] = rc.password
    return aioredis.Redis.from_url(
        rc.url, **credentials, **tls, **budgets, retry_on_timeout=False, max_connections=64
    )


async def scan_values(
    client: RedisClient, pattern: str, most: int, step: int = 1000
) -> dict[str, str] | None:
    """Every string key matching ``pattern`` with its value (keys gone meanwhile left out), ``step``
    keys per SCAN step and one MGET each; None as soon as there are more than ``most``. A cluster's
    every primary is scanned, and its MGETs split by slot."""
    out: dict[str, str] = {}
    keys: list[bytes] = []

    async def read() -> None:
        if isinstance(client, RedisCluster):
            values = await client.mget_nonatomic(keys)
        else:
            values = await client.mget(keys)
        for k, v in zip(keys, values, strict=True):
            if v is not None:
                out[reply_text(k)] = reply_text(v)
        keys.clear()

    async for key in client.scan_iter(match=pattern, count=step):
        keys.append(key)
        if len(keys) >= step:
            await read()
            if len(out) > most:
                return None
    if keys:
        await read()
    return None if len(out) > most else out


def reply_text(value: bytes | str) -> str:
    """A Redis reply as text (the client returns bytes unless told to decode). Anyone who can write
    to Redis can write any bytes: what is not UTF-8 becomes text that names no backend (U+FFFD), so
    a binding is treated as gone and rebound, never a crash of the decision."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
