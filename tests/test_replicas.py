"""The replicas' heartbeat: a replica that finds others waits a beat before it serves."""

from __future__ import annotations

import asyncio
import os

import redis.asyncio as aioredis
from kvgate.replicas import BEAT_S, join

from tests.cores import run


def test_a_replica_that_finds_others_waits_a_beat_before_it_serves(redis_url: str) -> None:
    """Replicas running already count a newcomer at their next beat; until then they answer before
    their claims. The newcomer serves only after that beat, so no two answer a session differently."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        loop = asyncio.get_running_loop()
        prefix = f"kvgate-{os.urandom(4).hex()}"
        t0 = loop.time()
        await join(client, prefix, "first")
        assert loop.time() - t0 < BEAT_S  # alone: serves at once
        t0 = loop.time()
        await join(client, prefix, "second")
        assert loop.time() - t0 >= BEAT_S
        await client.aclose()

    run(scenario())
