"""The session store against a real Redis: a binding last seen long ago is assumed and confirmed, Redis
down is survived from memory and written back, a burst opens no connection past the warm ones, a
slow Redis never holds a decision, and a lone replica answers before its claims."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from kvgate.features import Features, session_key
from kvgate.messages import Outcome
from kvgate.policies import SessionAction
from kvgate.redis_batch import PIPELINES
from kvgate.redis_client import connect
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.cores import MODEL, config, features, ready, run
from tests.helpers import PATIENT_REDIS


def test_a_session_last_seen_long_ago_is_decided_where_it_is_bound_and_confirmed_by_redis(
    redis_url: str,
) -> None:
    """A chat's next turn comes seconds or minutes later, when the local binding is no longer fresh.
    The decision still assumes it (counted on the bound backend while Redis confirms), instead of
    deciding as for a new key, counting it where load says, then moving it; and a binding another
    replica wrote meanwhile wins."""

    async def scenario() -> None:
        cfg = config(redis_url)
        client = connect(cfg.redis)
        assert client is not None
        sc = ready(cfg, client)
        sessions = sc.service.sessions
        first = await sc.service.route(features(7, session="later"), "t1")
        home = first.candidates[0].id
        sc.service.report([Outcome.end("t1", home, 200, True, 0.1, 0.2)])
        # Prefill work queued on home (under saturation): a new key would go elsewhere.
        sc.registry.ledger.start("busy", home, 20_000, time.monotonic())
        stale = time.monotonic() - 60.0
        sessions.local.set("h:later", home, stale)
        assert sessions.cached("h:later") == (home, False)
        task = asyncio.create_task(sc.service.route(features(7, 2, session="later"), "t2"))
        await asyncio.sleep(0)  # the decision is made and counted; its Redis claim is in flight
        assert sc.registry.ledger.counts.get(home) == 2, sc.registry.ledger.counts  # "busy" and this turn
        second = await task
        assert second.candidates[0].id == home and second.decision.session is SessionAction.KEEP
        assert sessions.cached("h:later") == (home, True)  # confirmed by that round trip
        # Another replica moved the session while this one's entry aged: Redis's binding wins.
        other = next(b.id for b in cfg.backends if b.id != home)
        await client.set(f"{cfg.redis.prefix}:s:h:later", other)
        sessions.local.set("h:later", home, stale)
        third = await sc.service.route(features(7, 3, session="later"), "t3")
        assert third.candidates[0].id == other and third.decision.session is SessionAction.KEEP
        assert sc.registry.ledger.counts.get(home) == 2 and sc.registry.ledger.counts.get(other) == 1
        for did, bid in (("t2", home), ("t3", other), ("busy", home)):
            sc.service.report([Outcome.end(did, bid, 200, True, 0.1, 0.2)])
        assert sum(sc.registry.ledger.counts.values()) == 0 and sum(sc.registry.ledger.tokens.values()) == 0
        await client.aclose()

    run(scenario())


def test_sessions_route_from_memory_while_redis_is_down_and_write_back_after() -> None:
    async def scenario(sup: Supervisor) -> None:
        port = free_port()
        cfg = config(f"redis://127.0.0.1:{port}/0")
        client = connect(cfg.redis)
        assert client is not None
        sc = ready(cfg, client)
        during = await sc.service.route(features(5, session="down"))  # nothing listens yet
        assert not sc.sessions.redis_ok
        again = await sc.service.route(features(5, 2, session="down"))
        assert again.candidates[0] == during.candidates[0]
        sup.start_redis(port)
        await asyncio.sleep(0.06)  # past retry_after: the next decision tries Redis again
        await sc.service.route(features(6, session="other"))
        stored = await client.get(f"{cfg.redis.prefix}:s:h:down")
        assert stored is not None and stored.decode() == during.candidates[0].id
        await client.aclose()

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        sup = Supervisor(Path(d))
        try:
            run(scenario(sup))
        finally:
            sup.stop_all()


@pytest.mark.parametrize("spread", [False, True], ids=["one-turn", "one-per-turn"])
def test_a_burst_of_new_sessions_opens_no_redis_connection_past_the_warm_ones(
    redis_url: str, spread: bool
) -> None:
    """64 new sessions decided together (in one turn of the loop) or, as live, one per turn: claims
    go in pipelines, at most PIPELINES out at once on the connections opened at startup, and those
    issued while every pipeline is out wait for the next to leave, so the burst opens no connection
    (each new one is a connect and two handshake round trips: a burst's claims once took 15-40 ms)."""

    async def scenario() -> None:
        cfg = config(redis_url, redis_extra=PATIENT_REDIS)
        client = connect(cfg.redis)
        assert client is not None
        sc = ready(cfg, client)
        probe = aioredis.Redis.from_url(redis_url)
        base = len(await probe.client_list())
        await sc.sessions.warm()
        before = len(await probe.client_list())
        assert before - base == PIPELINES, (base, before)
        tasks = []
        for i in range(64):
            tasks.append(asyncio.create_task(sc.service.route(features(i, session=f"burst-{spread}-{i}"))))
            if spread:
                await asyncio.sleep(0)  # the next decision arrives in the next turn
        routed = await asyncio.gather(*tasks)
        after = len(await probe.client_list())
        assert after == before, (before, after)
        assert all(r.decision.session is SessionAction.BIND for r in routed)
        stored = await probe.mget([f"{cfg.redis.prefix}:s:h:burst-{spread}-{i}" for i in range(64)])
        assert [s.decode() for s in stored] == [r.candidates[0].id for r in routed]
        await probe.aclose()
        await client.aclose()

    run(scenario())


class _DelayingProxy:
    """A TCP proxy in front of a real Redis that holds every reply ``delay_s``: Redis waiting for a
    core, as it does on a loaded machine."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        rr, rw = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [cw, rw]
        await asyncio.gather(self._pipe(cr, rw, 0.0), self._pipe(rr, cw, self.delay_s))

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()
        await asyncio.sleep(0.05)  # the pipes see their sockets close and end


def test_a_decision_does_not_wait_for_a_slow_redis_and_its_claim_still_lands(redis_url: str) -> None:
    """Redis answering in 150 ms (up, but behind busy cores): the decision waits its 20 ms and is
    answered with its own pick; the claim goes on, binds the session in Redis and in the local map,
    and Redis is not taken for down (its timeout is 1 s)."""

    async def scenario() -> None:
        proxy = _DelayingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]), 0.15)
        cfg = config(await proxy.start(), redis_extra={"timeout_ms": 1000, "decision_wait_ms": 20})
        client = connect(cfg.redis)
        assert client is not None
        sc = ready(cfg, client)
        await sc.sessions.warm()  # the connections (their handshakes are delayed too)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        routed = await sc.service.route(features(7, session="slow-redis"))
        waited = loop.time() - t0
        assert waited < 0.1, waited
        assert sc.metrics.registry.get_sample_value("kvgate_redis_late_total") == 1
        pick = routed.candidates[0].id
        await _until(lambda: sc.sessions.cached("h:slow-redis") is not None)  # the claim's late reply
        probe = aioredis.Redis.from_url(redis_url)
        assert await probe.get(f"{cfg.redis.prefix}:s:h:slow-redis") == pick.encode()
        cached = sc.sessions.cached("h:slow-redis")
        assert cached is not None and cached.node == pick and cached.fresh
        assert sc.sessions.redis_ok
        await probe.aclose()
        await client.aclose()
        await proxy.close()

    run(scenario())


async def _until(condition: Any, within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_lone_replica_answers_before_its_claims_and_a_shared_one_waits(redis_url: str) -> None:
    """Redis answering in 150 ms. Counted alone (once it has read Redis's bindings) a sidecar answers
    a new session's decision at once: the session is bound locally then, and in Redis when the claim
    lands. Counted with another replica it waits for the claim, which could name the other's pick."""

    async def scenario() -> None:
        proxy = _DelayingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]), 0.15)
        cfg = config(await proxy.start(), redis_extra={"timeout_ms": 1000, "decision_wait_ms": 1000})
        client = connect(cfg.redis)
        assert client is not None
        sc = ready(cfg, client)
        sessions = sc.sessions
        await sessions.warm()
        probe = aioredis.Redis.from_url(redis_url)
        loop = asyncio.get_running_loop()
        preload = sessions.set_replicas(1)
        assert preload is not None and not sessions.answers_first  # not before the bindings are read
        await preload
        assert sessions.answers_first
        t0 = loop.time()
        routed = await sc.service.route(features(8, session="alone"))
        assert loop.time() - t0 < 0.1
        pick = routed.candidates[0].id
        assert sessions.cached("h:alone") == (pick, True)  # the next turn may come at once
        assert sessions.sizes()["redis_writes_in_flight"] == 1  # the claim, on its way
        await _until(lambda: sessions.sizes()["redis_writes_in_flight"] == 0)
        assert await probe.get(f"{cfg.redis.prefix}:s:h:alone") == pick.encode()
        assert sc.metrics.registry.get_sample_value("kvgate_affinity_total", {"outcome": "miss"}) == 1

        sessions.set_replicas(2)
        assert not sessions.answers_first
        t0 = loop.time()
        routed = await sc.service.route(features(9, session="shared"))
        assert loop.time() - t0 >= 0.15  # it waited for the claim's round trip
        assert await probe.get(f"{cfg.redis.prefix}:s:h:shared") == routed.candidates[0].id.encode()
        await probe.aclose()
        await client.aclose()
        await proxy.close()

    run(scenario())


def test_a_lone_replica_reads_redis_bindings_first_and_follows_them(redis_url: str) -> None:
    """Bindings a previous life of the sidecar (or a replica that left) made: alone, the sidecar
    reads them in before it stops waiting for claims, so a returning session goes where it is bound.
    More bindings than its local map holds leave it waiting for claims: the rest would go blind."""

    async def scenario() -> None:
        cfg = config(redis_url, redis_extra={"local_sessions": 100})
        client = connect(cfg.redis)
        assert client is not None
        for i in range(60):
            await client.set(f"{cfg.redis.prefix}:s:h:old-{i}", "b2")
        sc = ready(cfg, client)
        sc.registry.ledger.counts.update({"b0": 0, "b1": 0, "b2": 5})  # a new key would not go to b2
        preload = sc.sessions.set_replicas(1)
        assert preload is not None
        await preload
        assert sc.sessions.answers_first
        back = await sc.service.route(features(3, 2, session="old-3"))
        assert back.candidates[0].id == "b2" and back.decision.session is SessionAction.KEEP

        crowded = config(redis_url, redis_extra={"local_sessions": 100})
        for i in range(150):
            await client.set(f"{crowded.redis.prefix}:s:h:many-{i}", "b1")
        other = ready(crowded, client)
        preload = other.sessions.set_replicas(1)
        assert preload is not None
        await preload
        assert not other.sessions.answers_first
        await client.aclose()

    run(scenario())


def test_a_binding_a_lone_replica_did_not_know_follows_the_request_and_claims_are_awaited_again(
    redis_url: str,
) -> None:
    """Alone, the sidecar answered before its claim; the claim found the session bound elsewhere (a
    replica not counted yet). The request went to the pick, whose cache now holds its whole prompt:
    the binding follows it, and decisions wait for their claims again for a while."""

    async def scenario() -> None:
        cfg = config(redis_url)
        client = connect(cfg.redis)
        assert client is not None
        sc = ready(cfg, client)
        preload = sc.sessions.set_replicas(1)
        assert preload is not None
        await preload
        await client.set(f"{cfg.redis.prefix}:s:h:intruder", "b1")  # written after the preload
        sc.registry.ledger.counts.update({"b0": 0, "b1": 9, "b2": 9})
        routed = await sc.service.route(features(4, session="intruder"))
        assert routed.candidates[0].id == "b0"
        await _until(lambda: sc.sessions.sizes()["redis_writes_in_flight"] == 0)
        assert await client.get(f"{cfg.redis.prefix}:s:h:intruder") == b"b0"
        assert sc.sessions.cached("h:intruder") == ("b0", True)
        assert not sc.sessions.answers_first
        assert sc.metrics.registry.get_sample_value("kvgate_affinity_total", {"outcome": "rebind"}) == 1
        await client.aclose()

    run(scenario())


def test_a_response_another_replica_reports_is_found_in_redis_within_the_wait(redis_url: str) -> None:
    """The previous response's report went to another replica, which writes it to Redis: the turn's
    decision, made a few milliseconds earlier, asks Redis again while it waits and follows it."""

    async def scenario() -> None:
        cfg = config(redis_url)
        client = connect(cfg.redis)
        assert client is not None
        sc = ready(cfg, client)
        key = session_key("r", "resp_elsewhere")
        f = Features(MODEL, key, "response", (), 100)
        guess = (await sc.service.explain(f)).candidates[0].id
        home = next(b.id for b in cfg.backends if b.id != guess)
        writer = connect(cfg.redis)
        assert writer is not None

        async def other_replica_reports() -> None:
            await asyncio.sleep(0.006)
            await writer.set(f"{cfg.redis.prefix}:s:{key}", home)

        reporting = asyncio.create_task(other_replica_reports())
        routed = await sc.service.route(f, "r1")
        await reporting
        assert routed.candidates[0].id == home
        assert await sc.sessions.reported(session_key("r", "resp_unknown"), 0.01) is None
        sc.service.report([Outcome.end("r1", home, 200)])
        assert sum(sc.registry.ledger.counts.values()) == 0
        await writer.aclose()
        await client.aclose()

    run(scenario())
