"""The other gateway replicas' in-flight load, shared through Redis, so that N replicas see what one sees.

Each replica's ledger (``kvgate.inflight``) counts only the requests it routed; between two scrapes
the backends' own counters cannot show the others'. Replicas sending long prompts at once to the same
idle-looking backend was the measured cost of scaling out (``kvgate-bench virtual --replicas``). So
every ``load_share`` interval each replica writes its ledger's per-backend totals into one Redis hash
(field: its replica id) and reads the others' fields back, in one pipeline; the policies then see its
own counts plus the others' (``Summed``).

One hash, so it lives in one Redis Cluster slot. No clocks are compared between hosts: each field
carries its writer's sequence number, and a reader drops a field whose number has not moved for
``STALE_S`` of its own monotonic time (a replica that died or lost Redis): that, and the next read
replacing the previous, is where others' counts come down. The hash expires when every replica is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.inflight import InflightLedger
from kvgate.redis_client import REDIS_ERRORS, RedisClient, reply_text

logger = logging.getLogger(__name__)
STALE_S = 2.0  # a replica whose field has not changed this long counts no more
MAX_FIELD_BYTES = 65_536  # a field longer than this is not a replica's (Redis is private, yet checked)


class Summed(Mapping[str, int]):
    """This replica's counts per backend plus the other replicas', read through (no copy)."""

    __slots__ = ("_others", "_own")

    def __init__(self, own: Mapping[str, int], others: Mapping[str, int]) -> None:
        self._own = own
        self._others = others

    def get(self, key: str, default: int = 0) -> int:  # type: ignore[override]
        own = self._own.get(key)
        other = self._others.get(key)
        if own is None and other is None:
            return default
        return (own or 0) + (other or 0)

    def __getitem__(self, key: str) -> int:
        if key not in self._own and key not in self._others:
            raise KeyError(key)
        return self.get(key)

    def __iter__(self) -> Iterator[str]:
        return iter(set(self._own) | set(self._others))

    def __len__(self) -> int:
        return len(set(self._own) | set(self._others))


@dataclass(slots=True)
class _Seen:
    seq: int
    changed: float  # this reader's monotonic time when ``seq`` last moved


@dataclass(slots=True)
class SharedLoad:
    """What this replica knows of the others' in-flight load (``counts``, ``tokens`` and ``kv`` per
    backend, updated in place so snapshots reading through them stay valid)."""

    me: str
    counts: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    _seq: int = 0
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def payload(self, ledger: InflightLedger) -> str:
        """This replica's field: its sequence number and, per backend, its requests and their prefill
        tokens (``b``) and the KV cache tokens they may take (``k``: a key of its own, which a
        replica of an earlier release skips, so a rolling upgrade reads every field both ways)."""
        self._seq += 1
        live = [b for b, n in ledger.counts.items() if n > 0]
        backends = {b: [ledger.counts[b], ledger.tokens.get(b, 0)] for b in live}
        kv = {b: ledger.kv.get(b, 0) for b in live}
        return json.dumps({"n": self._seq, "b": backends, "k": kv}, separators=(",", ":"))

    def absorb(self, fields: Mapping[Any, bytes | str], now: float) -> list[str]:
        """Replace the others' load by what the hash holds now (field names as bytes from Redis, or
        str); returns the fields found stale (or malformed), for the caller to delete."""
        counts: dict[str, int] = {}
        tokens: dict[str, int] = {}
        kv: dict[str, int] = {}
        stale: list[str] = []
        present: set[str] = set()
        for raw_name, raw in fields.items():
            name = reply_text(raw_name)
            if name == self.me:
                continue
            present.add(name)
            parsed = _parse(raw)
            if parsed is None:
                stale.append(name)
                continue
            seq, backends = parsed
            seen = self._seen.get(name)
            if seen is None or seen.seq != seq:
                self._seen[name] = seen = _Seen(seq, now)
            if now - seen.changed > STALE_S:
                stale.append(name)  # kept in _seen while it is in the hash: stale until it moves
                continue
            for b, (n, t, k) in backends.items():
                counts[b] = counts.get(b, 0) + n
                tokens[b] = tokens.get(b, 0) + t
                kv[b] = kv.get(b, 0) + k
        for gone in set(self._seen) - present:
            del self._seen[gone]
        self._replace(counts, tokens, kv)
        return stale

    def forget(self) -> None:
        """Redis cannot be read: the others' load is unknown, so it counts as none (as with one replica)."""
        self._seen.clear()
        self._replace({}, {}, {})

    def _replace(self, counts: dict[str, int], tokens: dict[str, int], kv: dict[str, int]) -> None:
        for mine, theirs in ((self.counts, counts), (self.tokens, tokens), (self.kv, kv)):
            mine.clear()
            mine.update(theirs)


def _parse(raw: bytes | str) -> tuple[int, dict[str, tuple[int, int, int]]] | None:
    """A replica's field; one of an earlier release (no ``k``) counts no KV."""
    if len(raw) > MAX_FIELD_BYTES:
        return None
    try:
        doc = json.loads(raw)
        seq = doc["n"]
        backends = doc["b"]
        kv = doc.get("k", {})
        if not isinstance(seq, int) or not isinstance(backends, dict) or not isinstance(kv, dict):
            return None
        out: dict[str, tuple[int, int, int]] = {}
        for b, pair in backends.items():
            n, t = pair
            k = kv.get(b, 0)
            if not all(isinstance(x, int) for x in (n, t, k)):
                return None
            out[b] = (max(0, n), max(0, t), max(0, k))
        return seq, out
    except (ValueError, KeyError, TypeError):
        return None


async def share_once(client: RedisClient, key: str, shared: SharedLoad, ledger: InflightLedger) -> None:
    """Write this replica's field and read every field, in one round trip; drop the stale ones."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.hset(key, shared.me, shared.payload(ledger))
        pipe.pexpire(key, int(STALE_S * 5 * 1000))
        pipe.hgetall(key)
        results = await pipe.execute()
    stale = shared.absorb(results[2], time.monotonic())
    if stale:
        await client.hdel(key, *stale)


async def share_loop(
    client: RedisClient, prefix: str, shared: SharedLoad, ledger: InflightLedger, interval_s: float
) -> None:
    key = f"{prefix}:load"
    failed_since: float | None = None
    while True:
        try:
            await share_once(client, key, shared, ledger)
            failed_since = None
        except REDIS_ERRORS as exc:
            logger.debug("load share failed: %s", exc)
            now = time.monotonic()
            failed_since = failed_since or now
            if now - failed_since > STALE_S:
                shared.forget()
        await asyncio.sleep(interval_s)
