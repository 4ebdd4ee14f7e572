"""Redis commands sent as pipelines, at most ``PIPELINES`` in flight on connections opened at startup.

A burst of N commands (N new sessions claimed at once) then costs a few round trips on open
connections, not N round trips on N new ones: each new connection is a connect and two handshake
round trips (redis-py names itself with CLIENT SETINFO), which under load took a burst's claims to
15-40 ms. Several in flight, not one: Redis answers all its readable clients in one wakeup, so under
CPU contention parallel pipelines cost one wait for a core where a chain of them costs one each
(measured: one in flight left a burst's claims at 20-41 ms).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from kvgate.redis_client import REDIS_ERRORS, RedisClient

logger = logging.getLogger(__name__)
PIPELINES = 4  # Redis pipelines in flight at once, on connections opened at startup


class Batch:
    """Redis commands sent as pipelines, at most ``PIPELINES`` in flight: those issued in the same
    turn of the event loop, or while every pipeline was out, go together in the next to leave."""

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._pending: list[tuple[str, tuple[Any, ...], dict[str, Any], asyncio.Future[Any]]] = []
        self._in_flight: set[asyncio.Task[Exception | None]] = set()
        self._scheduled = False

    async def warm(self) -> None:
        """Open the connections the pipelines will use, before the first command needs them. A
        Redis that is down now is found by the first command, as at any other time."""
        if isinstance(self.client, RedisCluster):
            return  # a cluster client opens a pool per node, as it first sends there
        pool = self.client.connection_pool
        held: list[Any] = []
        try:
            # Held together, so each is a connection of its own: pings in parallel can finish and
            # hand their connection back before the last one asks for one, and open fewer (seen on
            # a busy machine: three of four).
            for _ in range(PIPELINES):
                held.append(await pool.get_connection())  # type: ignore[no-untyped-call]  # redis-py
        except REDIS_ERRORS as exc:
            logger.warning("redis did not answer at startup (%s); sessions will retry it", exc)
        finally:
            for conn in held:
                await pool.release(conn)

    def call(self, command: str, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((command, args, kwargs, future))
        if len(self._in_flight) < PIPELINES and not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._send)  # after every decision that is ready in this turn
        return future

    def _send(self) -> None:
        self._scheduled = False
        if not self._pending or len(self._in_flight) >= PIPELINES:
            return
        batch, self._pending = self._pending, []
        task = asyncio.create_task(self._run(batch))
        self._in_flight.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[Exception | None]) -> None:
        self._in_flight.discard(task)
        failed: BaseException | None = None
        if not task.cancelled():
            failed = task.exception() or task.result()  # an unforeseen error fails the queue too
        if failed is not None:
            # What waits for a pipeline would wait on the same server: it fails now, and its
            # callers route from local memory at once instead of after a second timeout.
            waiting, self._pending = self._pending, []
            for *_, future in waiting:
                if not future.done():
                    future.set_exception(failed)
            return
        self._send()  # what was issued while every pipeline was out

    async def _run(
        self, batch: list[tuple[str, tuple[Any, ...], dict[str, Any], asyncio.Future[Any]]]
    ) -> Exception | None:
        """Send one pipeline and resolve its callers' futures; returns the error that failed it."""
        # Cancelled (shutdown) or failed in an unforeseen way: no caller may wait forever.
        failed: Exception = RedisError("the pipeline ended without a reply")
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for command, args, kwargs, _ in batch:
                    getattr(pipe, command)(*args, **kwargs)
                results = await pipe.execute(raise_on_error=False)
            for (*_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            return None
        except REDIS_ERRORS as exc:
            failed = exc
            return exc
        finally:
            for *_, future in batch:
                if not future.done():
                    future.set_exception(failed)
