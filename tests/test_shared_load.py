"""The replicas' shared load view: each replica's in-flight totals through one Redis hash, others'
counts summed into the policies' view, a silent replica's load dropped, garbage ignored."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import redis.asyncio as aioredis
from kvgate.inflight import InflightLedger
from kvgate.shared_load import STALE_S, SharedLoad, Summed, share_loop, share_once
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tests.cores import run


def ledger_with(**tokens: int) -> InflightLedger:
    ledger = InflightLedger(lambda b: True)
    for i, (backend, n) in enumerate(tokens.items()):
        ledger.start(f"d{i}", backend, n, 0.0)
    return ledger


def test_summed_reads_own_plus_others_through_without_copying() -> None:
    own = {"a": 1}
    others = {"a": 2, "b": 5}
    s = Summed(own, others)
    assert s.get("a", 0) == 3 and s["b"] == 5 and s.get("c", 0) == 0
    own["c"] = 4  # read through: a count that moves is seen at once
    others["a"] = 0
    assert s.get("c", 0) == 4 and s.get("a", 0) == 1
    assert sorted(s) == ["a", "b", "c"] and len(s) == 3
    with pytest.raises(KeyError):
        s["zzz"]


def test_others_fields_are_summed_and_ones_own_is_skipped() -> None:
    a, b, c = SharedLoad("a"), SharedLoad("b"), SharedLoad("c")
    fields = {
        "a": a.payload(ledger_with(x=100)),
        "b": b.payload(ledger_with(x=300, y=50)),
        "c": c.payload(ledger_with(y=7)),
    }
    assert a.absorb(fields, now=0.0) == []
    assert a.counts == {"x": 1, "y": 2} and a.tokens == {"x": 300, "y": 57}


def test_the_kv_in_flight_is_shared_and_fields_of_an_earlier_release_read_both_ways() -> None:
    """Each replica shares the KV cache tokens its requests in flight may take, under a key of its
    own: a field written by an earlier release (requests and tokens only) reads as no KV, and an
    earlier release's reading of a new field (its ``n`` and ``b``) still finds what it knew."""
    me, other = SharedLoad("me"), SharedLoad("other")
    ledger = InflightLedger(lambda b: True)
    ledger.start("d0", "x", 100, 0.0, output=800)
    ledger.start("d1", "y", 0, 0.0, output=50)
    new = other.payload(ledger)
    assert json.loads(new)["b"] == {"x": [1, 100], "y": [1, 0]}  # the earlier release's shape
    fields = {"other": new, "old": json.dumps({"n": 1, "b": {"x": [2, 30]}})}
    assert me.absorb(fields, now=0.0) == []
    assert me.counts == {"x": 3, "y": 1} and me.tokens == {"x": 130, "y": 0}
    assert me.kv == {"x": 900, "y": 50}
    bad = json.dumps({"n": 1, "b": {"x": [1, 1]}, "k": {"x": "many"}})
    assert me.absorb({"bad": bad}, now=0.0) == ["bad"]
    me.forget()
    assert me.kv == {}


def test_a_replica_whose_field_stops_moving_counts_no_more_and_is_reported_stale() -> None:
    """No clocks compared between hosts: a field is stale when its sequence number has not moved for
    STALE_S of the reader's own time. That is where a dead replica's load comes down."""
    me, other = SharedLoad("me"), SharedLoad("other")
    busy = ledger_with(x=1000)
    fields = {"other": other.payload(busy)}
    me.absorb(fields, now=0.0)
    assert me.tokens == {"x": 1000}
    assert me.absorb(fields, now=STALE_S - 0.1) == [] and me.tokens == {"x": 1000}
    assert me.absorb(fields, now=STALE_S + 0.1) == ["other"]
    assert me.tokens == {} and me.counts == {}
    fields = {"other": other.payload(busy)}  # it writes again: counted again
    assert me.absorb(fields, now=STALE_S + 0.2) == [] and me.tokens == {"x": 1000}


def test_garbage_fields_are_dropped_not_trusted() -> None:
    me = SharedLoad("me")
    good = SharedLoad("good").payload(ledger_with(x=10))
    fields: dict[bytes | str, bytes | str] = {
        b"good": good.encode(),
        "not-json": "{{{",
        "wrong-shape": json.dumps({"n": 1, "b": {"x": ["many", 3]}}),
        "no-seq": json.dumps({"b": {}}),
        "huge": "x" * 70_000,
        "negative": json.dumps({"n": 1, "b": {"x": [-5, -100]}}),
    }
    stale = me.absorb(fields, now=0.0)
    assert sorted(stale) == ["huge", "no-seq", "not-json", "wrong-shape"]
    assert me.counts == {"x": 1} and me.tokens == {"x": 10}  # a negative count is clamped to 0


def test_forget_clears_the_others_in_place() -> None:
    """Snapshots read these dicts through: they are emptied, never replaced."""
    me = SharedLoad("me")
    me.absorb({"o": SharedLoad("o").payload(ledger_with(x=5))}, now=0.0)
    tokens = me.tokens
    me.forget()
    assert tokens == {} and tokens is me.tokens


def test_two_replicas_see_each_other_through_real_redis(redis_url: str) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=1)
        key = f"kvgate-{os.urandom(4).hex()}:load"
        a, b = SharedLoad("a"), SharedLoad("b")
        la, lb = ledger_with(x=400), ledger_with(x=100, y=20)
        await share_once(client, key, a, la)
        await share_once(client, key, b, lb)
        await share_once(client, key, a, la)
        assert a.tokens == {"x": 100, "y": 20} and b.tokens == {"x": 400}
        la.finish("d0")  # a's request ended: the next share says so
        await share_once(client, key, a, la)
        await share_once(client, key, b, lb)
        assert b.tokens == {} and b.counts == {}
        assert 0 < await client.pttl(key) <= STALE_S * 5 * 1000  # gone when every replica is
        await client.aclose()

    run(scenario())


def test_the_share_loop_outlives_redis_going_away_and_then_forgets_the_others(redis_url: str) -> None:
    """Redis unreachable: the loop keeps going, and after STALE_S the others' load counts as none."""

    async def scenario() -> None:
        good = aioredis.Redis.from_url(redis_url, socket_timeout=1)
        key_prefix = f"kvgate-{os.urandom(4).hex()}"
        other = SharedLoad("other")
        await share_once(good, f"{key_prefix}:load", other, ledger_with(x=900))
        me = SharedLoad("me")
        await share_once(good, f"{key_prefix}:load", me, ledger_with())
        assert me.tokens == {"x": 900}
        dead = aioredis.Redis(  # as the sidecar's client: no retries, short timeouts
            host="127.0.0.1",
            port=1,
            socket_connect_timeout=0.05,
            socket_timeout=0.05,
            retry=Retry(NoBackoff(), 0),
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.create_task(share_loop(dead, key_prefix, me, ledger_with(), 0.05))
        await asyncio.sleep(STALE_S / 2)
        assert me.tokens == {"x": 900} and not task.done()  # a blip: the last view holds
        for _ in range(int((STALE_S + 3) / 0.05)):  # polled: the loop under test has no event to wait on
            if not me.tokens:
                break
            await asyncio.sleep(0.05)
        assert me.tokens == {} and not task.done()
        assert loop.time() - t0 >= STALE_S
        task.cancel()
        await good.aclose()
        await dead.aclose()

    run(scenario())
