"""One ZMQ subscription per backend that publishes KV events, feeding the exact index.

vLLM's publisher is a PUB socket sending ``[topic, seq, payload]``; kvgate connects a SUB socket to
each backend's ``kv_events`` endpoint (all topics) and applies each message to
``kvgate.exact_index``. A message whose sequence number skips ahead means events were missed: when
the backend has a ``kv_events_replay`` endpoint (vLLM's ROUTER replay socket) the subscriber asks it
for everything from the first missing number (``[b"", start]``; it answers ``[b"", seq, payload]``
per buffered message and ends with seq -1) and applies those first, within ``replay_timeout``; a
replay that could not fill the gap leaves that backend's view partial. A late subscriber asks for
a replay from 0: an engine whose buffer still holds its whole history gives a full view at once.

Nothing here can stop routing: a malformed message is counted and dropped, a flood is bounded by the
socket's high-water mark (ZMQ drops past it, which the next sequence number reveals as a gap), and
each subscription is a task of its own that a failure restarts after a pause. Every second the
staleness check compares each backend's scraped prefix-cache misses with its events
(``ExactIndex.scraped``) and the per-backend gauges are refreshed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import zmq
import zmq.asyncio

from kvgate.exact_index import Applied, ExactIndex, View
from kvgate.kv_events import EventBatch, MalformedEvents, decode, seq_of
from kvgate.metrics import SidecarMetrics
from kvgate.registry import Registry

logger = logging.getLogger("kvgate.kv_events")

RCVHWM = 100_000  # messages queued per subscription before ZMQ drops (vLLM's own hwm)
RESTART_PAUSE_S = 1.0
CHECK_INTERVAL_S = 1.0
Endpoints = tuple[str, str | None]  # (publisher, replay socket or None)


class KvSubscriber:
    def __init__(
        self,
        index: ExactIndex,
        metrics: SidecarMetrics,
        replay_timeout_s: float,
        registry: Registry,
    ) -> None:
        """``registry``: which backends publish events now (membership changes at run time), and
        their scraped prefix-cache counters."""
        self.index = index
        self.metrics = metrics
        self.replay_timeout_s = replay_timeout_s
        self.registry = registry
        self.ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[Endpoints, asyncio.Task[None]]] = {}

    async def run(self) -> None:
        """Follow the membership and check staleness every second, until cancelled."""
        try:
            while True:
                self.sync(publishers(self.registry))
                self.check()
                await asyncio.sleep(CHECK_INTERVAL_S)
        finally:
            await self.close()

    def sync(self, wanted: Mapping[str, Endpoints]) -> None:
        """Subscribe to exactly these backends' publishers (called whenever membership changes)."""
        for bid, (endpoints, task) in list(self._tasks.items()):
            if wanted.get(bid) != endpoints:
                task.cancel()
                del self._tasks[bid]
                self.index.forget(bid)
                self._clear_gauges(bid)
        for bid, endpoints in wanted.items():
            if bid not in self._tasks:
                task = asyncio.create_task(self._run(bid, endpoints), name=f"kv-events {bid}")
                self._tasks[bid] = (endpoints, task)

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        self.ctx.destroy(linger=0)

    async def _run(self, bid: str, endpoints: Endpoints) -> None:
        while True:
            try:
                await self._subscribe(bid, endpoints)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("kv events from %s: subscription failed; restarting", bid)
                await asyncio.sleep(RESTART_PAUSE_S)

    async def _subscribe(self, bid: str, endpoints: Endpoints) -> None:
        publisher, replay = endpoints
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(publisher)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    seq, batch = _message(frames)
                except MalformedEvents as exc:
                    self.metrics.kv_messages.labels(bid, "malformed").inc()
                    logger.debug("kv events from %s: dropped a malformed message: %s", bid, exc)
                    continue
                expected = self.index.next_seq(bid)
                if expected is not None and seq < expected:
                    # Numbers went back on the live stream: a new engine, whose first messages
                    # may have gone before this socket reconnected (a replay may still have them).
                    self.index.restart(bid)
                    self.metrics.kv_messages.labels(bid, Applied.RESTART.value).inc()
                    logger.info("kv events from %s: the engine restarted (seq %d)", bid, seq)
                    expected = None
                if replay is not None and (expected is None or seq > expected) and seq > 0:
                    await self._replay(bid, replay, expected or 0, seq)
                self._apply(bid, seq, batch)
        finally:
            sock.close(linger=0)

    def _apply(self, bid: str, seq: int, batch: EventBatch, replayed: bool = False) -> Applied:
        result = self.index.apply(bid, seq, batch, replayed)
        self.metrics.kv_messages.labels(bid, result.value).inc()
        if result is not Applied.OLD:
            for ev in batch.events:
                self.metrics.kv_events.labels(bid, type(ev).__name__).inc()
            if batch.unknown:
                self.metrics.kv_events.labels(bid, "unknown").inc(batch.unknown)
        if result in (Applied.GAP, Applied.RESTART):
            logger.info(
                "kv events from %s: %s at seq %d (view %s)",
                bid,
                result.value,
                seq,
                self.index.view(bid).value,
            )
        return result

    async def _replay(self, bid: str, endpoint: str, start: int, upto: int) -> None:
        """Apply the messages ``start`` .. ``upto - 1`` from the backend's replay socket."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        outcome = "failed"
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) < 2:
                        raise MalformedEvents("short replay message")
                    seq = seq_of(frames[1])
                    if seq < 0:
                        break  # the end of the buffer
                    if seq >= upto or len(frames) < 3:
                        continue
                    self._apply(bid, seq, decode(frames[2]), replayed=True)
            outcome = "filled" if self.index.next_seq(bid) == upto else "partial"
        except (TimeoutError, MalformedEvents, zmq.ZMQError) as exc:
            logger.warning("kv events from %s: replay from %d failed: %s", bid, start, exc)
        finally:
            sock.close(linger=0)
        self.metrics.kv_replays.labels(bid, outcome).inc()

    def check(self) -> None:
        """Staleness from the scraped misses, and the per-backend gauges."""
        now = self.index.clock()
        for bid in list(self._tasks):
            misses = prefix_misses(self.registry, bid)
            if misses is not None:
                self.index.scraped(bid, misses)
            view = self.index.view(bid)
            for v in View:
                self.metrics.kv_index_view.labels(bid, v.value).set(1.0 if v is view else 0.0)
            self.metrics.kv_index_blocks.labels(bid).set(self.index.size(bid))
            last = self.index.last_event(bid)
            if last is not None:
                self.metrics.kv_event_age.labels(bid).set(max(0.0, now - last))

    def _clear_gauges(self, bid: str) -> None:
        for gauge in (self.metrics.kv_index_blocks, self.metrics.kv_event_age):
            with contextlib.suppress(KeyError):
                gauge.remove(bid)
        for v in View:
            with contextlib.suppress(KeyError):
                self.metrics.kv_index_view.remove(bid, v.value)


def publishers(registry: Registry) -> dict[str, Endpoints]:
    """The backends that publish KV events: (publisher, replay socket) each."""
    return {
        b: (s.spec.kv_events, s.spec.kv_events_replay)
        for b, s in registry.backends.items()
        if s.spec.kv_events is not None
    }


def prefix_misses(registry: Registry, bid: str) -> float | None:
    """Prompt tokens the backend prefilled (prefix-cache queries less hits), as last scraped."""
    s = registry.backends.get(bid)
    scraped = s.scraped if s is not None else None
    if scraped is None or scraped.prefix_queries is None or scraped.prefix_hits is None:
        return None
    return scraped.prefix_queries - scraped.prefix_hits


def _message(frames: list[bytes]) -> tuple[int, EventBatch]:
    if len(frames) != 3:
        raise MalformedEvents(f"{len(frames)} frames, expected 3 (topic, seq, payload)")
    seq = seq_of(frames[1])
    if seq < 0:
        raise MalformedEvents("negative sequence number")
    return seq, decode(frames[2])
