"""The Redis client by URL: one server, a Sentinel-managed primary, a Cluster; kvgate's budgets on
each; and, on real redis-server processes, what the sidecar's Redis users do on a Sentinel failover
and on a Cluster (slots, the membership transaction, the preload's scan of every primary)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from kvgate.config import Config, ConfigError
from kvgate.config.infra import parse_nodes
from kvgate.membership import Membership
from kvgate.metrics import SidecarMetrics
from kvgate.redis_client import REDIS_ERRORS, connect, is_cluster, scan_values
from kvgate.registry import Registry
from kvgate.sessions import SessionStore
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_ports
from kvgate.tools.redis_topologies import cluster_ports, start_cluster, start_sentinel_set
from redis.asyncio.cluster import RedisCluster

from tests.cores import run
from tests.helpers import PATIENT_REDIS


def config(url: str | None, **redis: object) -> Config:
    return Config.from_mapping({"redis": {"url": url, **redis}, "backends": [{"url": "http://h:1"}]})


def test_no_url_no_client() -> None:
    assert connect(config(None).redis) is None


def test_one_server_gets_kvgates_budgets_not_the_librarys() -> None:
    client = connect(config("redis://127.0.0.1:1/0", timeout_ms=15, connect_timeout_ms=40).redis)
    assert client is not None and not isinstance(client, RedisCluster)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 0.015 and kwargs["socket_connect_timeout"] == 0.04
    assert kwargs["retry_on_timeout"] is False and kwargs["retry"]._retries == 0
    asyncio.run(client.aclose())


def test_sentinel_and_cluster_clients_get_the_same_budgets() -> None:
    sentinel = connect(config("redis+sentinel://127.0.0.1:1,127.0.0.1:2/main/3", timeout_ms=15).redis)
    assert sentinel is not None and not isinstance(sentinel, RedisCluster)
    kwargs = sentinel.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 0.015 and kwargs["retry"]._retries == 0 and kwargs["db"] == 3
    cluster = connect(config("redis+cluster://user:pw@127.0.0.1:1,127.0.0.1:2", timeout_ms=15).redis)
    assert isinstance(cluster, RedisCluster)
    node_kwargs = cluster.get_connection_kwargs()
    assert node_kwargs["socket_timeout"] == 0.015 and node_kwargs["password"] == "pw"
    assert is_cluster(config("redis+cluster://127.0.0.1:1").redis)
    assert not is_cluster(config("redis+sentinel://127.0.0.1:1/s").redis)


def test_sentinel_and_cluster_urls_are_checked_when_the_config_loads() -> None:
    n = parse_nodes("redis+sentinel://u:p%40ss@a:26379,[::1]:26380/primary/2")
    assert n.hosts == (("a", 26379), ("::1", 26380)) and n.service == "primary" and n.db == 2
    assert (n.username, n.password) == ("u", "p@ss")
    assert parse_nodes("redis+cluster://a:1,b:2").service is None
    for bad in (
        "redis+sentinel://a:1",  # no service
        "redis+sentinel://a/service",  # no port
        "redis+sentinel://a:99999/service",
        "redis+cluster://a:1/0",  # a cluster has one database
        "redis+sentinel://a:1/s/x",
        "redis+cluster://a:1,:2",
        "memcached://a:1",
    ):
        with pytest.raises(ConfigError):
            config(bad)


def store(url: str, **redis: object) -> SessionStore:
    rc = config(url, **redis).redis
    return SessionStore(rc, SidecarMetrics(), connect(rc))


def test_a_sentinel_failover_is_followed_and_what_was_bound_in_the_gap_is_written_back(
    stack: Supervisor,
) -> None:
    """The primary dies: claims fall back to the local map (no error reaches a decision); once the
    Sentinels have promoted the replica, the client finds it, and the bindings made meanwhile are
    written there."""
    primary, replica, *sentinels = (free_ports(5) + i for i in range(5))
    url = start_sentinel_set(stack, primary, replica, sentinels)

    async def scenario() -> None:
        s = store(url, timeout_ms=200, connect_timeout_ms=200, retry_after_ms=200)
        assert await s.claim("before", "a") == ("a", False)
        # Replication is asynchronous: a failover may lose the last writes. WAIT until the replica
        # has this one, so what the test checks is kvgate's part.
        # (A client of its own: WAIT lasts up to the replica's next ack, past the store's budget.)
        direct = aioredis.Redis(port=primary, socket_timeout=10)
        assert await direct.execute_command("WAIT", 1, 5000) == 1
        await direct.aclose()
        stack.kill("redis-primary")
        assert await s.claim("during", "b") == ("b", False)  # from memory, no exception
        assert not s.redis_ok
        deadline = time.monotonic() + 20
        written = False
        while time.monotonic() < deadline and not written:
            await asyncio.sleep(0.3)
            await s.claim("probe", "c")  # any claim flushes the bindings Redis missed
            written = s.redis_ok and await s.client.get("kvgate:s:during") == b"b"  # type: ignore[union-attr]
        assert written, "the new primary never got the binding made during the failover"
        assert await s.client.get("kvgate:s:before") == b"a"  # type: ignore[union-attr]
        assert await s.claim("before", "z") == ("a", True)  # the binding in force survived
        await s.client.aclose()  # type: ignore[union-attr]

    run(scenario())


def test_on_a_cluster_sessions_spread_over_slots_membership_and_the_preload_work(stack: Supervisor) -> None:
    url = start_cluster(stack, cluster_ports(3))

    async def scenario() -> None:
        # Patient budgets: this test is about slots, not timeouts (a claim past the default budget
        # on a loaded host is routed from memory and not written, by design).
        s = store(url, **PATIENT_REDIS)
        client = s.client
        assert isinstance(client, RedisCluster)
        fresh = store(url, **PATIENT_REDIS)
        try:
            await check(s, client, fresh)
        finally:  # a failed check must not leave clients for the collector to close in a later test
            await client.aclose()
            await fresh.client.aclose()  # type: ignore[union-attr]

    async def check(s: SessionStore, client: RedisCluster, fresh: SessionStore) -> None:
        for i in range(200):
            assert await s.claim(f"h:{{tag}}{i}", f"b{i % 3}") == (f"b{i % 3}", False)
        # A client's braces do not choose the slot: its keys land on every node.
        slots = {client.keyslot(s._key(f"h:{{tag}}{i}")) for i in range(200)}
        assert len(slots) > 100
        found = await scan_values(client, s._key("*"), 10_000)
        assert found is not None and len(found) == 200  # every primary scanned
        fresh.mode = fresh.mode.READING
        await fresh.preload()
        assert fresh.mode is fresh.mode.ALONE and len(fresh.local) == 200
        # The membership pair is written in one MULTI: one slot, through its hash tag.
        registry = Registry(config(url).scrape, config(url).routing, SidecarMetrics())
        members = Membership(client, "kvgate", registry, SidecarMetrics(), cluster=True)
        await members.seed(config(url).backends)
        assert client.keyslot(members.hash_key) == client.keyslot(members.version_key)
        assert members.version is not None and set(registry.backends) == {b.id for b in config(url).backends}

    run(scenario())


def test_a_cluster_primary_lost_under_claims_fails_no_claim_and_its_replica_takes_over(
    stack: Supervisor,
) -> None:
    url = start_cluster(stack, cluster_ports(6))

    async def scenario() -> None:
        s = store(url, timeout_ms=200, connect_timeout_ms=200, retry_after_ms=200)
        client = s.client
        assert isinstance(client, RedisCluster)
        await client.initialize()  # the slot map, from any node
        victim = client.get_node_from_key(s._key("k0"))
        assert victim is not None
        stack.kill(f"redis-cluster-{victim.port}")
        bound: dict[str, str] = {}
        deadline = time.monotonic() + 20
        i = 0
        while time.monotonic() < deadline:
            node, existed = await s.claim(f"k{i}", f"b{i % 3}")  # never raises
            assert not existed and node == f"b{i % 3}"
            bound[f"k{i}"] = node
            i += 1
            await asyncio.sleep(0.05)
            if s.redis_ok and i > 40 and await _all_in_redis(s, bound):
                break
        assert await _all_in_redis(s, bound), "bindings made while the primary was lost are missing"
        await client.aclose()

    run(scenario())


async def _all_in_redis(s: SessionStore, bound: dict[str, str]) -> bool:
    assert s.client is not None
    try:
        for key, node in bound.items():
            if await s.client.get(s._key(key)) != node.encode():
                await s.claim("flush", "x")  # a claim writes back what Redis missed
                return False
    except REDIS_ERRORS:
        return False
    return True


def test_a_preload_scan_reads_bytes_that_are_not_utf8_as_text_that_names_no_backend(redis_url: str) -> None:
    """Anyone who can write to Redis can write any bytes: the scan keeps going, the value becomes
    text no backend is named (so the binding is rebound), never an exception."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        prefix = f"kvgate-{time.monotonic_ns()}"
        await client.set(f"{prefix}:s:good", "b1")
        await client.set(f"{prefix}:s:bad", b"\xff\xfe")
        found = await scan_values(client, f"{prefix}:s:*", 10)
        assert found is not None and found[f"{prefix}:s:good"] == "b1"
        assert "\ufffd" in found[f"{prefix}:s:bad"]
        assert await scan_values(client, f"{prefix}:s:*", 1) is None  # more than asked for
        await client.aclose()

    run(scenario())
