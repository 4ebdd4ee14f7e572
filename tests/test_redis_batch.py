"""Redis pipelines: commands queued behind one that fails fail with it, at once."""

from __future__ import annotations

import asyncio

import pytest
from kvgate.redis_batch import PIPELINES, Batch
from kvgate.redis_client import connect
from redis.exceptions import RedisError

from tests.cores import config, run


def test_commands_queued_behind_a_pipeline_that_times_out_fail_with_it() -> None:
    """A Redis that hangs, every pipeline out: the commands queued behind them fail when the first
    one does (they would wait on the same server), not after a timeout of their own."""

    async def scenario() -> None:
        async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # accepts, reads, never answers
            writer.close()

        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cfg = config(f"redis://127.0.0.1:{port}/0", redis_extra={"timeout_ms": 200})
        client = connect(cfg.redis)
        assert client is not None
        batch = Batch(client)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = []
        for i in range(PIPELINES):
            out.append(batch.call("get", f"k{i}"))
            await asyncio.sleep(0.01)  # each its own pipeline
        queued = batch.call("get", "queued")
        ended: dict[str, float] = {}
        for name, fut in [("first", out[0]), ("queued", queued)]:
            with pytest.raises(RedisError):
                await fut
            ended[name] = loop.time() - t0
        assert 0.15 < ended["first"] < 0.6, ended
        assert ended["queued"] - ended["first"] < 0.1, ended  # not a second 200 ms timeout
        for fut in out[1:]:
            with pytest.raises(RedisError):
                await fut
        await client.aclose()
        server.close()

    run(scenario())
