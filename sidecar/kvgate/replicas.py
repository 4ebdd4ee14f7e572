"""How many gateway replicas share the backends, so each dispatches only its share from its queue.

Each sidecar keeps a heartbeat in a Redis sorted set (member: its replica id, score: wall time);
members silent for ``STALE_S`` are dropped and the rest counted. Without Redis a sidecar counts only
itself. A Redis error keeps the last count (one replica's guess is better than a wrong zero).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from kvgate.redis_client import REDIS_ERRORS, RedisClient
from kvgate.registry import Registry
from kvgate.sessions import SessionStore

logger = logging.getLogger(__name__)
BEAT_S = 1.0
STALE_S = 5.0
JOIN_BEATS = 1.5  # a newcomer's wait before serving: one beat of the others, and their lateness


def replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


async def count_once(client: RedisClient, key: str, me: str, now: float) -> int:
    async with client.pipeline(transaction=False) as pipe:
        pipe.zadd(key, {me: now})
        pipe.zremrangebyscore(key, "-inf", now - STALE_S)
        pipe.zcard(key)
        pipe.expire(key, int(STALE_S * 4))
        results = await pipe.execute()
    return max(1, int(results[2]))


async def join(client: RedisClient, prefix: str, me: str) -> None:
    """Count this replica in before it serves. Others running already count it at their next beat;
    until then one alone would answer decisions before their claims (``SessionStore.answers_first``)
    and could bind a session this one binds elsewhere, so a replica that finds others waits a beat."""
    try:
        n = await count_once(client, f"{prefix}:replicas", me, time.time())
    except REDIS_ERRORS as exc:
        logger.debug("replica heartbeat failed: %s", exc)
        return
    if n > 1:
        await asyncio.sleep(BEAT_S * JOIN_BEATS)


async def replicas_loop(
    client: RedisClient, prefix: str, me: str, registry: Registry, sessions: SessionStore
) -> None:
    key = f"{prefix}:replicas"
    while True:
        try:
            n = await count_once(client, key, me, time.time())
        except REDIS_ERRORS as exc:
            logger.debug("replica heartbeat failed: %s", exc)
        else:
            registry.set_replicas(n)
            sessions.set_replicas(n)
        await asyncio.sleep(BEAT_S)
