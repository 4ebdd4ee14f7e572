"""The sidecar's HTTP API with aiohttp's test client, the control loops running over simulated
backends served in the same event loop, and a real redis-server."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from kvgate.app import create_app
from kvgate.config import Config
from kvgate.tools.readiness import free_ports

from tests.conftest import MODEL
from tests.cores import config, run
from tests.helpers import chat
from vllm_sim.facts import InstanceConfig
from vllm_sim.profiles import LLAMA3_8B_H100
from vllm_sim.request import EngineConfig
from vllm_sim.server import Instance


@asynccontextmanager
async def sidecar_app(redis_url: str | None) -> AsyncIterator[tuple[TestClient[Any, Any], Config]]:
    port = free_ports(2)
    tmp = tempfile.TemporaryDirectory(prefix="kvgate-")
    instances = []
    for i in range(2):
        inst = Instance(InstanceConfig(MODEL, EngineConfig.from_profile(LLAMA3_8B_H100, seed=i)))
        await inst.start("127.0.0.1", port + i)
        instances.append(inst)
    cfg = config(redis_url, backends=2, base_port=port)
    sock = os.path.join(tmp.name, "d.sock")
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
        tmp.cleanup()


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
            # own (tests/e2e/test_sidecar.py): here it would walk the whole test session's heap.

    run(scenario())
