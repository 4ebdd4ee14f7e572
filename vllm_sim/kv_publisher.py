"""KV-cache events on ZMQ, as vLLM's ``ZmqEventPublisher`` sends them (measured on vLLM 0.32).

A PUB socket bound to ``tcp://HOST:PORT`` sends one message per engine step that changed the cache:
``[topic, seq (8 bytes, big-endian), msgpack(batch)]``, the batch ``[ts, [event, ...], None]`` and
each event a map tagged ``"type"`` (``encoding="array"``: the positional arrays older vLLM sent).
Sequence numbers start at 0 with the engine. The last ``buffer_steps`` messages stay in a buffer
that a ROUTER replay socket serves: ``[identity, b"", start]`` gets every buffered message from
``start`` on as ``[identity, b"", seq, payload]``, then ``seq = -1`` and an empty payload.

Fault injection for the subscriber's tests (``skip_next``): a message that is never sent (a gap the
replay can fill).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from vllm_sim.kv_cache import Cleared, KvEvent, Removed, Stored

logger = logging.getLogger("vllm_sim.kv_events")
END = (-1).to_bytes(8, "big", signed=True)


def _event(ev: KvEvent, encoding: str) -> Any:
    if isinstance(ev, Stored):
        fields: dict[str, Any] = {
            "block_hashes": list(ev.hashes),
            "parent_block_hash": ev.parent,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": "GPU",
        }
        tag = "BlockStored"
    elif isinstance(ev, Removed):
        fields, tag = {"block_hashes": list(ev.hashes), "medium": "GPU"}, "BlockRemoved"
    else:
        assert isinstance(ev, Cleared)
        fields, tag = {}, "AllBlocksCleared"
    if encoding == "array":
        return [tag, *fields.values()]
    return {"type": tag, **fields}


def encode_batch(events: list[KvEvent], encoding: str = "map") -> bytes:
    """One step's events as a message's payload: ``[ts, [event, ...], data_parallel_rank]``."""
    return msgpack.packb([time.time(), [_event(e, encoding) for e in events], None])  # type: ignore[no-any-return]


class KvPublisher:
    def __init__(
        self,
        host: str,
        port: int,
        replay_port: int | None = None,
        topic: str = "kv-events",
        encoding: str = "map",
        buffer_steps: int = 10_000,
    ) -> None:
        if encoding not in ("map", "array"):
            raise ValueError("encoding is map or array")
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(f"tcp://{host}:{port}")
        self.replay: zmq.asyncio.Socket | None = None
        if replay_port is not None:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(f"tcp://{host}:{replay_port}")
        self.topic = topic.encode()
        self.encoding = encoding
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.skip_next = 0  # fault injection: messages to leave out of the live stream
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.replay is not None:
            self._task = asyncio.create_task(self._serve_replays(), name="kv-events replay")

    def publish(self, events: list[KvEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events, self.encoding)
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if self.skip_next > 0:
            self.skip_next -= 1
            return
        # Past the high-water mark a message is dropped, as vLLM's publisher drops: a gap downstream.
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    async def _serve_replays(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([ident, b"", END, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.ctx.destroy(linger=0)
