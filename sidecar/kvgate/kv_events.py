"""vLLM's KV-cache events, decoded from the publisher's msgpack payload into typed events.

A ZMQ message is ``[topic, seq (8 bytes, big-endian), payload]``; the payload is a ``KVEventBatch``:
``[ts, [event, ...], data_parallel_rank]``. vLLM has shipped two encodings of it, and both are
taken here, at batch and at event level: positional arrays whose first element is the event's tag
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, ...]``, up to about
0.26), and maps tagged by ``"type"`` (0.32, measured). A block hash is a 64-bit integer (vLLM's
default, the digest's low 64 bits) or the digest's bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``);
both become the integer, which is what ``kvgate.kv_hashes`` computes from token ids.

Everything here is pure: a payload that is not an event batch raises ``MalformedEvents`` and an
event of a type kvgate does not know is skipped (counted by the caller), so a newer vLLM that adds
event types does not stop the index.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

MASK64 = (1 << 64) - 1
MAX_PAYLOAD_BYTES = 16 << 20  # far above a step's events; a larger frame is refused unread


class MalformedEvents(ValueError):
    """The payload is not a KV event batch vLLM would send."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    hashes: tuple[int, ...]
    parent: int | None
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KvEvent, ...]
    rank: int  # the data-parallel rank (0 when the engine has none)
    unknown: int = 0  # events of a type kvgate does not read


def seq_of(frame: bytes) -> int:
    """The message's sequence number (signed: the replay socket ends with -1)."""
    if len(frame) != 8:
        raise MalformedEvents(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def decode(payload: bytes) -> EventBatch:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MalformedEvents(f"payload of {len(payload)} bytes")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedEvents(f"not msgpack: {exc}") from None
    if isinstance(raw, Mapping):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        if isinstance(raw[0], str):  # a tagged batch: ["KVEventBatch", ts, events, rank]
            raw = raw[1:]
        if len(raw) < 2:
            raise MalformedEvents("payload is not an event batch")
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise MalformedEvents("payload is not an event batch")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise MalformedEvents("event batch without a timestamp or an event list")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1024):
        raise MalformedEvents("bad data_parallel_rank")
    out: list[KvEvent] = []
    unknown = 0
    for ev in events:
        parsed = _event(ev)
        if parsed is None:
            unknown += 1
        else:
            out.append(parsed)
    return EventBatch(float(ts), tuple(out), rank or 0, unknown)


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _event(ev: Any) -> KvEvent | None:
    if isinstance(ev, Mapping):
        tag = ev.get("type")
        fields = _FIELDS.get(tag) if isinstance(tag, str) else None
        values = [ev.get(k) for k in fields] if fields is not None else []
    elif isinstance(ev, list) and ev and isinstance(ev[0], str):
        tag = ev[0]
        fields = _FIELDS.get(tag)
        values = list(ev[1 : 1 + len(fields)]) if fields is not None else []
        if fields is not None and len(values) < len(fields):
            raise MalformedEvents(f"{tag} with {len(values)} of {len(fields)} fields")
    else:
        raise MalformedEvents("event is neither a tagged map nor a tagged array")
    if fields is None:
        return None
    if tag == "BlockStored":
        size = values[3]
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 65536:
            raise MalformedEvents("BlockStored without a valid block_size")
        parent = None if values[1] is None else _hash(values[1])
        return BlockStored(_hashes(values[0]), parent, size)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(values[0]))
    return AllBlocksCleared()


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise MalformedEvents("block_hashes is not a list")
    return tuple(_hash(h) for h in value)


def _hash(h: Any) -> int:
    if isinstance(h, bool):
        raise MalformedEvents("a block hash is a boolean")
    if isinstance(h, int):
        return h & MASK64
    if isinstance(h, bytes) and h:
        return int.from_bytes(h[-8:], "big")
    raise MalformedEvents(f"a block hash of type {type(h).__name__}")
