"""The sidecar's parts in one process: the decision service, registry, sessions and HTTP API, with
aiohttp's test client, a real redis-server and simulated backends served in the same event loop."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer
from kvgate.app import create_app, redis_client
from kvgate.config import BackendSpec, Config
from kvgate.features import Features, extract
from kvgate.load import Scraped
from kvgate.policies import SessionAction
from kvgate.protocol import Outcome
from kvgate.replicas import BEAT_S, join
from kvgate.sessions import PIPELINES, Batch
from kvgate.sidecar import Sidecar, build_sidecar
from kvgate.tools.launcher import Supervisor, free_port, free_ports
from redis.exceptions import RedisError

from tests.conftest import MODEL
from tests.helpers import PATIENT_REDIS, chat
from vllm_sim.engine import EngineConfig
from vllm_sim.profiles import LLAMA3_8B_H100
from vllm_sim.server import Instance, InstanceConfig

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sup = Supervisor(tmp_path_factory.mktemp("redis"))
    port = free_port()
    sup.start_redis(port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        sup.stop_all()


def config(
    redis_url: str | None,
    backends: int = 3,
    base_port: int = 1,
    redis_extra: Mapping[str, Any] | None = None,
    **routing: Any,
) -> Config:
    redis: dict[str, Any] = {
        "url": redis_url,
        "prefix": f"kvgate-{os.urandom(4).hex()}",
        "retry_after_ms": 50,
    }
    redis.update(redis_extra or {})
    return Config.from_mapping(
        {
            "listen": {"socket": "unused.sock", "http_port": 0, "admin_token": "t0ken"},
            "redis": redis,
            "scrape": {"interval_ms": 100, "timeout_ms": 80, "unhealthy_after": 2, "healthy_after": 2},
            "routing": routing,
            "backends": [
                {"id": f"b{i}", "url": f"http://127.0.0.1:{base_port + i}"} for i in range(backends)
            ],
        },
        {},
    )


def core(cfg: Config, client: aioredis.Redis | None) -> Sidecar:
    """A routing core with every backend healthy, serving MODEL, load known and idle."""
    sc = build_sidecar(cfg, client)
    sc.registry.set_membership((b, False) for b in cfg.backends)
    for b in cfg.backends:
        sc.registry.set_models(b.id, frozenset({MODEL}))
        sc.registry.scrape_ok(b.id, Scraped(0, 0, 0.1, None, None, asyncio.get_running_loop().time()))
    return sc


def features(conversation: int, turns: int = 1, session: str | None = None) -> Features:
    return extract(chat(conversation, turns), {"X-Session-ID": session} if session else None)


# -- decision service and sessions against a real Redis ---------------------------------------------
def test_two_services_racing_for_a_new_session_agree_on_one_backend(redis_url: str) -> None:
    """The claim race: both replicas decide a new key at once; the first SET NX wins, the other
    re-decides from the winner, and both answer the same backend."""

    async def scenario() -> None:
        cfg = config(redis_url, redis_extra=PATIENT_REDIS)
        ca, cb = redis_client(cfg), redis_client(cfg)
        assert ca is not None and cb is not None
        a, b = core(cfg, ca), core(cfg, cb)
        for i in range(40):
            f = features(i, session=f"race-{i}")
            # Skew the loads so the two would pick differently if they did not agree through Redis.
            a.registry.inflight.update({"b0": 0, "b1": 9, "b2": 9})
            b.registry.inflight.update({"b0": 9, "b1": 9, "b2": 0})
            ra, rb = await asyncio.gather(a.service.route(f), b.service.route(f))
            assert ra.candidates[0] == rb.candidates[0], i
            actions = {ra.decision.session, rb.decision.session}
            assert SessionAction.BIND in actions, actions  # exactly one claimed it first
        await ca.aclose()
        await cb.aclose()

    run(scenario())


def test_a_burst_of_new_sessions_spreads_while_their_claims_wait_for_redis(redis_url: str) -> None:
    """Ten new conversations decided at once: each waits for its Redis claim, and the decisions made
    meanwhile must count it in flight. Before they did not, and all ten went to the backend that
    looked least loaded when the burst began."""

    async def scenario() -> None:
        cfg = config(redis_url, backends=2)
        client = redis_client(cfg)
        sc = core(cfg, client)
        # b0 has a long prefill queued; b1 is idle. Each new prompt is ~8,000 tokens.
        sc.registry.start("earlier", "b0", 24_000, time.monotonic())
        burst = [features(500 + i, session=f"burst-{i}") for i in range(10)]
        routed = await asyncio.gather(*(sc.service.route(f, f"d{i}") for i, f in enumerate(burst)))
        picks = [r.candidates[0].id for r in routed]
        assert picks.count("b1") < 10, picks  # not all on the one that was idle at the start
        assert picks.count("b0") >= 2, picks
        # What is counted is where they went.
        assert sc.registry.inflight == {"b0": picks.count("b0") + 1, "b1": picks.count("b1")}
        for i, r in enumerate(routed):
            sc.service.report([Outcome.end(f"d{i}", r.candidates[0].id, 200, True, 0.1, 0.2)])
        sc.service.report([Outcome.end("earlier", "b0", 200, True, 0.1, 0.2)])
        assert sc.registry.inflight == {"b0": 0, "b1": 0}
        assert sc.registry.inflight_tokens == {"b0": 0, "b1": 0}
        assert client is not None
        await client.aclose()

    run(scenario())


def test_a_bound_session_is_kept_and_moves_only_when_its_backend_saturates(redis_url: str) -> None:
    async def scenario() -> None:
        cfg = config(redis_url)
        client = redis_client(cfg)
        sc = core(cfg, client)
        first = await sc.service.route(features(1, session="s"))
        home = first.candidates[0].id
        again = await sc.service.route(features(1, 2, session="s"))
        assert again.candidates[0].id == home and again.decision.session is SessionAction.KEEP
        sc.registry.scrape_ok(home, Scraped(4, 20, 0.5, None, None, asyncio.get_running_loop().time()))
        sc.registry.changed()
        moved = await sc.service.route(features(1, 3, session="s"))
        assert moved.candidates[0].id != home and moved.decision.session is SessionAction.REBIND
        assert client is not None
        stored = await client.get(f"{cfg.redis.prefix}:s:h:s")
        assert stored.decode() == moved.candidates[0].id
        await client.aclose()

    run(scenario())


def test_a_session_last_seen_long_ago_is_decided_where_it_is_bound_and_confirmed_by_redis(
    redis_url: str,
) -> None:
    """A chat's next turn comes seconds or minutes later, when the local binding is no longer fresh.
    The decision still assumes it (counted on the bound backend while Redis confirms), instead of
    deciding as for a new key, counting it where load says, then moving it; and a binding another
    replica wrote meanwhile wins."""

    async def scenario() -> None:
        cfg = config(redis_url)
        client = redis_client(cfg)
        assert client is not None
        sc = core(cfg, client)
        sessions = sc.service.sessions
        first = await sc.service.route(features(7, session="later"), "t1")
        home = first.candidates[0].id
        sc.service.report([Outcome.end("t1", home, 200, True, 0.1, 0.2)])
        # Prefill work queued on home (under saturation): a new key would go elsewhere.
        sc.registry.start("busy", home, 20_000, time.monotonic())
        stale = time.monotonic() - 60.0
        sessions.local.set("h:later", home, stale)
        assert sessions.cached("h:later") == (home, False)
        task = asyncio.create_task(sc.service.route(features(7, 2, session="later"), "t2"))
        await asyncio.sleep(0)  # the decision is made and counted; its Redis claim is in flight
        assert sc.registry.inflight.get(home) == 2, sc.registry.inflight  # "busy" and this turn
        second = await task
        assert second.candidates[0].id == home and second.decision.session is SessionAction.KEEP
        assert sessions.cached("h:later") == (home, True)  # confirmed by that round trip
        # Another replica moved the session while this one's entry aged: Redis's binding wins.
        other = next(b.id for b in cfg.backends if b.id != home)
        await client.set(f"{cfg.redis.prefix}:s:h:later", other)
        sessions.local.set("h:later", home, stale)
        third = await sc.service.route(features(7, 3, session="later"), "t3")
        assert third.candidates[0].id == other and third.decision.session is SessionAction.KEEP
        assert sc.registry.inflight.get(home) == 2 and sc.registry.inflight.get(other) == 1
        for did, bid in (("t2", home), ("t3", other), ("busy", home)):
            sc.service.report([Outcome.end(did, bid, 200, True, 0.1, 0.2)])
        assert sum(sc.registry.inflight.values()) == 0 and sum(sc.registry.inflight_tokens.values()) == 0
        await client.aclose()

    run(scenario())


def test_sessions_route_from_memory_while_redis_is_down_and_write_back_after() -> None:
    async def scenario(sup: Supervisor) -> None:
        port = free_port()
        cfg = config(f"redis://127.0.0.1:{port}/0")
        client = redis_client(cfg)
        assert client is not None
        sc = core(cfg, client)
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


# -- registry ----------------------------------------------------------------------------------------
def test_inflight_counts_rise_with_decisions_and_end_with_reports() -> None:
    async def scenario() -> None:
        sc = core(config(None), None)
        routed = [await sc.service.route(features(i)) for i in range(12)]
        assert sum(sc.registry.inflight.values()) == 12 and sum(sc.registry.inflight_tokens.values()) > 0
        sc.service.report([Outcome.first(r.decision_id, r.candidates[0].id) for r in routed])
        assert sum(sc.registry.inflight_tokens.values()) == 0  # first bytes: prefill done
        assert sum(sc.registry.inflight.values()) == 12
        sc.service.report(
            [Outcome.end(r.decision_id, r.candidates[0].id, 200, True, 0.1, 0.5) for r in routed]
        )
        assert sum(sc.registry.inflight.values()) == 0 and sc.registry.inflight_total() == 0
        sc.service.report(
            [Outcome.end(r.decision_id, r.candidates[0].id, 200, True, 0.1, 0.5) for r in routed]
        )
        assert all(v == 0 for v in sc.registry.inflight.values())  # a second report changes nothing

    run(scenario())


def test_each_candidate_gets_a_first_byte_budget_learned_from_its_answers() -> None:
    """A backend that has answered quickly gets the floor; one that never answered, or is saturated,
    the ceiling; a first byte from a fallback (the primary failed) teaches nothing about either."""

    async def scenario() -> None:
        sc = core(config(None, backends=2, policy="round_robin"), None)
        ceiling, floor = 60_000, 5_000
        first = await sc.service.route(features(0), "d0")
        assert first.first_byte_ms == (ceiling, ceiling)  # nothing learned yet
        sc.service.report([Outcome.first("d0", "other-backend")])  # answered by a fallback
        assert sc.service.first_byte.describe(first.candidates[0].id) is None
        for i in range(1, 20):
            r = await sc.service.route(features(i), f"d{i}")
            sc.service.report([Outcome.first(f"d{i}", r.candidates[0].id)])
            sc.service.report([Outcome.end(f"d{i}", r.candidates[0].id, 200, True, 0.01, 0.02)])
        sc.service.report([Outcome.end("d0", first.candidates[0].id, 200, True, 0.01, 0.02)])
        learned = await sc.service.route(features(50), "d50")
        assert learned.first_byte_ms == (floor, floor)
        busy = learned.candidates[0].id
        sc.registry.scrape_ok(busy, Scraped(4, 20, 0.5, None, None, asyncio.get_running_loop().time()))
        sc.registry.changed()
        again = await sc.service.route(features(51), "d51")
        budgets = dict(zip((c.id for c in again.candidates), again.first_byte_ms, strict=True))
        assert budgets[busy] == ceiling and min(budgets.values()) == floor
        sc.service.report([Outcome.end(d, "", 499, False) for d in ("d50", "d51")])

    run(scenario())


def test_a_drop_ends_a_decision_even_when_it_overtakes_the_decision() -> None:
    async def scenario() -> None:
        sc = core(config(None), None)
        counted = await sc.service.route(features(1), "gw.1")
        sc.service.report([Outcome.drop("gw.1")])
        assert sc.registry.inflight_total() == 0 and sum(sc.registry.inflight.values()) == 0
        sc.service.report([Outcome.drop("gw.2")])  # Nginx gave up before the sidecar saw the request
        late = await sc.service.route(features(2), "gw.2")
        assert late.candidates and sc.registry.inflight_total() == 0
        assert sum(sc.registry.inflight.values()) == 0 and counted.decision_id == "gw.1"

    run(scenario())


def test_health_turns_on_consecutive_failures_and_back_on_successes() -> None:
    async def scenario() -> None:
        sc = core(config(None), None)
        reg = sc.registry
        v0, _ = reg.peers()
        reg.failure("b1", "refused")
        assert reg.backends["b1"].healthy
        reg.failure("b1", "refused")
        assert not reg.backends["b1"].healthy
        v1, peers = reg.peers()
        assert v1 > v0 and [p.id for p in peers] == ["b0", "b2"]
        now = asyncio.get_running_loop().time()
        reg.scrape_ok("b1", Scraped(0, 0, 0.1, None, None, now))
        assert not reg.backends["b1"].healthy
        reg.scrape_ok("b1", Scraped(0, 0, 0.1, None, None, now))
        assert reg.backends["b1"].healthy and reg.peers()[0] > v1

    run(scenario())


def test_metrics_that_fail_leave_a_backend_healthy_with_its_load_unknown() -> None:
    """A failed /metrics (slow, garbage) is a missing signal: the backend stays in, its load goes
    stale and so unknown, never zero."""

    async def scenario() -> None:
        sc = core(config(None), None)
        reg = sc.registry
        for _ in range(5):
            reg.load_unknown("b1", "/metrics: no answer within 80 ms")
        assert reg.backends["b1"].eligible and reg.backends["b1"].last_error is not None
        later = asyncio.get_running_loop().time() + 60.0
        assert not reg.snapshot(MODEL, later).nodes["b1"].load.known

    run(scenario())


def test_health_timeouts_take_out_neither_a_backend_that_served_nor_the_whole_fleet() -> None:
    """A health check that times out is no proof of death: a backend that delivered a response
    within ALIVE_S stays in, and timeouts never take out more than outlier ejection may (half of
    three: one). A refusal is proof: it takes a backend out whatever the rest of the fleet does."""

    async def scenario() -> None:
        sc = core(config(None), None)
        reg = sc.registry
        now = asyncio.get_running_loop().time()
        reg.alive("b0", now)
        for b in ("b0", "b1", "b2"):
            for _ in range(5):
                reg.failure(b, "/health: no answer within 80 ms", timeout=True, now=now + 1)
        eligible = sorted(b for b, s in reg.backends.items() if s.eligible)
        assert "b0" in eligible and len(eligible) == 2, eligible  # b0 served; one of b1, b2 out
        assert sc.metrics.health_kept.labels("b0")._value.get() > 0
        # Later, b0 silent for longer than ALIVE_S: its timeouts still cannot empty the fleet.
        for b in ("b0", "b1", "b2"):
            for _ in range(5):
                reg.failure(b, "/health: no answer within 80 ms", timeout=True, now=now + 60)
        assert len([s for s in reg.backends.values() if s.eligible]) == 2
        for b in ("b0", "b1", "b2"):
            for _ in range(2):
                reg.failure(b, "ClientConnectorError: refused")
        assert not any(s.eligible for s in reg.backends.values())

    run(scenario())


def test_membership_changes_rebuild_the_ring_only_when_the_eligible_set_changes() -> None:
    async def scenario() -> None:
        cfg = config(None)
        sc = core(cfg, None)
        version = sc.registry.peers_version
        assert not sc.registry.set_membership((b, False) for b in cfg.backends)
        assert sc.registry.peers_version == version
        extra = BackendSpec("b9", "http://127.0.0.1:9")
        assert sc.registry.set_membership([*((b, False) for b in cfg.backends), (extra, False)])
        assert sc.registry.peers_version == version + 1
        assert sc.registry.set_membership([*((b, False) for b in cfg.backends), (extra, True)])  # drained
        assert "b9" not in {p.id for p in sc.registry.peers()[1]}

    run(scenario())


# -- the HTTP API, with the control loops running over real (in-process) simulated backends -----------
@asynccontextmanager
async def sidecar_app(redis_url: str | None) -> AsyncIterator[tuple[TestClient[Any, Any], Config]]:
    port = free_ports(2)
    instances = []
    for i in range(2):
        inst = Instance(InstanceConfig(MODEL, EngineConfig.from_profile(LLAMA3_8B_H100, seed=i)))
        await inst.start("127.0.0.1", port + i)
        instances.append(inst)
    cfg = config(redis_url, backends=2, base_port=port)
    sock = f"/tmp/kvgate-inprocess-{os.getpid()}-{port}.sock"
    cfg = Config.from_mapping(
        {
            "listen": {"socket": sock, "admin_token": "t0ken"},
            "redis": {"url": redis_url, "prefix": cfg.redis.prefix},
            "backends": [{"id": b.id, "url": b.url} for b in cfg.backends],
        },
        {},
    )
    client = TestClient(TestServer(create_app(cfg)))
    await client.start_server()
    try:
        yield client, cfg
    finally:
        await client.close()
        for inst in instances:
            await inst.stop()


def test_health_says_redis_is_off_when_none_is_configured_not_down() -> None:
    async def scenario() -> None:
        async with sidecar_app(None) as (client, _):
            health = await (await client.get("/healthz")).json()
            assert health["redis"] == "off" and health["status"] == "ok"

    run(scenario())


def test_http_api_serves_health_backends_models_and_decisions(redis_url: str) -> None:
    async def scenario() -> None:
        async with sidecar_app(redis_url) as (client, _):
            health = await (await client.get("/healthz")).json()
            assert (
                health["status"] == "ok" and health["eligible_backends"] == 2 and health["pid"] == os.getpid()
            )
            assert health["redis"] == "ok" and health["config"] == "unknown"  # no Nginx has asked yet
            backends = (await (await client.get("/v1/backends")).json())["backends"]
            assert [b["id"] for b in backends] == ["b0", "b1"] and all(b["load"]["known"] for b in backends)
            models = await (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            peers = await (await client.get("/peers")).json()
            assert [p["id"] for p in peers["peers"]] == ["b0", "b1"]
            r = await client.post("/v1/decide", json={"body": chat(1, 1), "headers": {"X-Session-ID": "x"}})
            d = await r.json()
            assert r.status == 200 and d["candidates"][0]["id"] in ("b0", "b1") and d["session"] == "bind"
            # A dry run: nothing bound, nothing in flight, so it says "bind" again.
            again = await (
                await client.post("/v1/decide", json={"body": chat(1, 1), "headers": {"X-Session-ID": "x"}})
            ).json()
            assert again["session"] == "bind" and again["candidates"] == d["candidates"]
            backends = (await (await client.get("/v1/backends")).json())["backends"]
            assert all(b["inflight"] == 0 for b in backends)
            r = await client.post("/v1/decide", json={"body": {"model": "nope", "prompt": "x"}})
            assert r.status == 404 and (await r.json())["error"]["code"] == 404
            r = await client.post("/v1/decide", data=b"not json")
            assert r.status == 400
            metrics = await (await client.get("/metrics")).text()
            assert "kvgate_decisions_total" in metrics

    run(scenario())


def test_admin_routes_need_the_bearer_token(redis_url: str) -> None:
    async def scenario() -> None:
        async with sidecar_app(redis_url) as (client, _):
            assert (await client.post("/admin/backends/b0/drain")).status == 401
            bad = {"Authorization": "Bearer nope"}
            assert (await client.post("/admin/backends/b0/drain", headers=bad)).status == 401
            ok = {"Authorization": "Bearer t0ken"}
            assert (await client.post("/admin/backends/b0/drain", headers=ok)).status == 200
            backends = (await (await client.get("/v1/backends")).json())["backends"]
            assert backends[0]["state"] == "draining"
            recent = await (await client.get("/debug/decisions", headers=ok)).json()
            assert recent == {"decisions": []}
            assert (await client.get("/debug/memory")).status == 401

    run(scenario())


def test_debug_memory_names_every_bounded_structure_beside_its_bound(redis_url: str) -> None:
    async def scenario() -> None:
        async with sidecar_app(redis_url) as (client, cfg):
            ok = {"Authorization": "Bearer t0ken"}
            mem = await (await client.get("/debug/memory", headers=ok)).json()
            s = mem["structures"]
            assert mem["rss_kb"] > 10_000 and "objects" not in mem
            assert s["local_sessions_bound"] == cfg.redis.local_sessions
            assert s["prefix_index_bound"] == cfg.routing.prefix_index_blocks
            assert s["local_sessions"] == s["decisions_in_flight"] == s["queue_waiting"] == 0
            # ?objects=1 (a collection and a heap walk) is tested against a sidecar process of its
            # own (test_sidecar_integration): here it would walk the whole test session's heap.

    run(scenario())


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
        client = redis_client(cfg)
        assert client is not None
        sc = core(cfg, client)
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
        client = redis_client(cfg)
        assert client is not None
        sc = core(cfg, client)
        await sc.sessions.warm()  # the connections (their handshakes are delayed too)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        routed = await sc.service.route(features(7, session="slow-redis"))
        waited = loop.time() - t0
        assert waited < 0.1, waited
        assert sc.metrics.registry.get_sample_value("kvgate_redis_late_total") == 1
        pick = routed.candidates[0].id
        await asyncio.sleep(0.4)  # the claim's reply arrives
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
        client = redis_client(cfg)
        assert client is not None
        sc = core(cfg, client)
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
        client = redis_client(cfg)
        assert client is not None
        for i in range(60):
            await client.set(f"{cfg.redis.prefix}:s:h:old-{i}", "b2")
        sc = core(cfg, client)
        sc.registry.inflight.update({"b0": 0, "b1": 0, "b2": 5})  # a new key would not go to b2
        preload = sc.sessions.set_replicas(1)
        assert preload is not None
        await preload
        assert sc.sessions.answers_first
        back = await sc.service.route(features(3, 2, session="old-3"))
        assert back.candidates[0].id == "b2" and back.decision.session is SessionAction.KEEP

        crowded = config(redis_url, redis_extra={"local_sessions": 100})
        for i in range(150):
            await client.set(f"{crowded.redis.prefix}:s:h:many-{i}", "b1")
        other = core(crowded, client)
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
        client = redis_client(cfg)
        assert client is not None
        sc = core(cfg, client)
        preload = sc.sessions.set_replicas(1)
        assert preload is not None
        await preload
        await client.set(f"{cfg.redis.prefix}:s:h:intruder", "b1")  # written after the preload
        sc.registry.inflight.update({"b0": 0, "b1": 9, "b2": 9})
        routed = await sc.service.route(features(4, session="intruder"))
        assert routed.candidates[0].id == "b0"
        await _until(lambda: sc.sessions.sizes()["redis_writes_in_flight"] == 0)
        assert await client.get(f"{cfg.redis.prefix}:s:h:intruder") == b"b0"
        assert sc.sessions.cached("h:intruder") == ("b0", True)
        assert not sc.sessions.answers_first
        assert sc.metrics.registry.get_sample_value("kvgate_affinity_total", {"outcome": "rebind"}) == 1
        await client.aclose()

    run(scenario())


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
        client = redis_client(cfg)
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
