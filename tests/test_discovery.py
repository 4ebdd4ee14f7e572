"""Backends from DNS (a Kubernetes headless Service): the config, and one round at a time against a
resolver the test controls (a real gateway whose only backends come from resolving a name:
``tests/e2e/test_discovery.py``)."""

from __future__ import annotations

import asyncio

import pytest
from kvgate.config import BackendSpec, Config, ConfigError
from kvgate.discovery import discover_once
from kvgate.membership import AddressPolicy, Membership
from kvgate.sidecar import build_sidecar

DNS = {"dns": "vllm.default.svc.cluster.local", "port": 8000}


def test_the_config_takes_discovery_in_place_of_a_backend_list() -> None:
    c = Config.from_mapping({"discovery": [{**DNS, "labels": {"pool": "long"}, "interval_ms": 5000}]}, {})
    d = c.discovery[0]
    assert (d.dns, d.port, d.interval_s, c.backends) == (DNS["dns"], 8000, 5.0, ())
    spec = d.spec("10.1.2.3")
    assert (spec.id, spec.url, dict(spec.labels)) == (
        "vllm.default.svc.cluster.local@10.1.2.3:8000",
        "http://10.1.2.3:8000",
        {"pool": "long"},
    )
    assert d.spec("fd00::7").url == "http://[fd00::7]:8000"
    for bad, says in (
        ({"dns": "bad name!", "port": 1}, "not a DNS name"),
        ({"dns": "vllm"}, "port: required"),
        ({**DNS, "scheme": "ftp"}, "scheme"),
        ({**DNS, "what": 1}, "what"),
    ):
        with pytest.raises(ConfigError, match=says):
            Config.from_mapping({"discovery": [bad]}, {})
    with pytest.raises(ConfigError, match="or a discovery: entry"):
        Config.from_mapping({"backends": []}, {})


def test_rounds_add_what_appears_remove_what_goes_and_survive_a_failed_lookup() -> None:
    config = Config.from_mapping(
        {"backends": [{"id": "static", "url": "http://10.9.9.9:8000"}], "discovery": [DNS]}, {}
    )
    core = build_sidecar(config, None)
    policy = AddressPolicy(config.membership, config.backends)
    membership = Membership(None, "t", core.registry, core.metrics, policy)
    answers: list[list[str] | Exception] = [
        ["10.0.0.1", "10.0.0.2"],
        ["10.0.0.2", "10.0.0.3"],
        OSError("SERVFAIL"),
        [],
    ]

    async def resolver(name: str, port: int) -> list[str]:
        assert (name, port) == (DNS["dns"], 8000)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def hosts() -> set[str]:
        return {bid.split("@")[-1] for bid in core.registry.backends if "@" in bid}

    async def scenario() -> None:
        await membership.seed(config.backends)
        d = config.discovery[0]
        owned = await discover_once(d, membership, set(), resolver)
        assert hosts() == {"10.0.0.1:8000", "10.0.0.2:8000"} and "static" in core.registry.backends
        # Discovered addresses pass the address policy (whose allow list is the config's hosts).
        assert policy.allows(d.spec("10.0.0.2")) and not policy.allows(d.spec("10.0.0.99"))
        # Only the port it was found on: another port of the same host is no backend of ours.
        assert not policy.allows(BackendSpec("rogue", "http://10.0.0.2:9999"))
        assert not policy.allows(BackendSpec("rogue", "http://10.9.9.9:8001"))
        owned = await discover_once(d, membership, owned, resolver)
        assert hosts() == {"10.0.0.2:8000", "10.0.0.3:8000"}
        owned = await discover_once(d, membership, owned, resolver)  # lookup failed: nothing moves
        assert hosts() == {"10.0.0.2:8000", "10.0.0.3:8000"}
        await membership.replace(config.backends)  # a config reload keeps what DNS found
        assert hosts() == {"10.0.0.2:8000", "10.0.0.3:8000"}
        owned = await discover_once(d, membership, owned, resolver)  # the Service has no ready pods
        assert hosts() == set() and owned == set() and set(core.registry.backends) == {"static"}

    asyncio.run(scenario())
