"""Membership shared through a real Redis: what one sidecar adds another routes over, and entries
whose address the config does not allow are ignored."""

from __future__ import annotations

import os

import redis.asyncio as aioredis
from kvgate.config import BackendSpec, Config, MembershipConfig
from kvgate.config.backends import AllowRule
from kvgate.membership import AddressPolicy, Membership
from kvgate.sidecar import build_sidecar

from tests.cores import run


def spec(bid: str, url: str) -> BackendSpec:
    return BackendSpec.from_mapping({"id": bid, "url": url}, "t")


def test_the_address_policy_is_the_configured_backends_unless_rules_say_more() -> None:
    configured = [spec("a", "http://10.0.0.1:8000")]
    exact = AddressPolicy(MembershipConfig(), configured)
    assert exact.allows(spec("renamed", "http://10.0.0.1:8000"))
    assert not exact.allows(spec("a", "http://10.0.0.1:8001"))  # same host, another port
    ruled = AddressPolicy(MembershipConfig((AllowRule.parse("10.0.0.0/24:8000", "m"),)), configured)
    assert ruled.allows(spec("b", "http://10.0.0.9:8000")) and not ruled.allows(
        spec("c", "http://10.1.0.9:8000")
    )


def test_replicas_share_members_and_ignore_addresses_they_do_not_allow(redis_url: str) -> None:
    prefix = f"kvgate-{os.urandom(4).hex()}"
    config = Config.from_mapping(
        {"redis": {"url": None}, "backends": [{"id": "a", "url": "http://10.0.0.1:8000"}]}
    )
    policy = AddressPolicy(MembershipConfig((AllowRule.parse("10.0.0.0/24:8000", "m"),)), config.backends)

    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=2)
        one, two = build_sidecar(config, None), build_sidecar(config, None)
        m1 = Membership(client, prefix, one.registry, one.metrics, policy)
        m2 = Membership(client, prefix, two.registry, two.metrics, policy)
        await m1.seed(config.backends)
        await m2.seed(config.backends)
        await m1.put(spec("b", "http://10.0.0.2:8000"), draining=True)
        await client.hset(f"{prefix}:backends", "evil", '{"id": "evil", "url": "http://203.0.113.9:80"}')
        await client.incr(f"{prefix}:backends:v")
        await m2.refresh()
        assert set(m2.local) == {"a", "b"} and m2.local["b"][1] is True
        assert set(two.registry.backends) == {"a", "b"}
        assert two.metrics.membership_rejected._value.get() == 1
        assert await m1.remove("b") and not await m1.remove("b")
        await m2.refresh()
        assert set(m2.local) == {"a"}
        await client.aclose()

    run(go())
