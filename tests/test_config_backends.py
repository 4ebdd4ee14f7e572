"""Where the backends are: listed ones, DNS discovery entries, and the addresses membership allows."""

import ipaddress

import pytest
from kvgate.config import ConfigError
from kvgate.config.backends import AllowRule, BackendSpec, DiscoverySpec


def test_a_listed_backend_gets_an_id_from_its_address() -> None:
    b = BackendSpec.from_mapping({"url": "http://10.0.0.5:8000/"}, "backends[0]")
    assert (b.id, b.url, b.address, b.weight, b.metrics) == (
        "10.0.0.5:8000",
        "http://10.0.0.5:8000",
        "10.0.0.5:8000",
        1.0,
        "auto",
    )
    with pytest.raises(
        ConfigError, match=r"backends\[0\].url: 'https://h:1' must look like http://HOST:PORT"
    ):
        BackendSpec.from_mapping({"url": "https://h:1"}, "backends[0]")
    with pytest.raises(ConfigError, match=r"backends\[0\].url: required"):
        BackendSpec.from_mapping({"id": "x"}, "backends[0]")


def test_allow_rules_name_a_host_or_network_and_ports() -> None:
    net = AllowRule.parse("10.0.0.0/8:8000-8010", "m")
    assert net.network == ipaddress.ip_network("10.0.0.0/8") and net.admits("10.1.2.3", 8005)
    assert not net.admits("10.1.2.3", 9000) and not net.admits("11.0.0.1", 8000)
    glob = AllowRule.parse("*.svc.cluster.local:*", "m")
    assert glob.admits("vllm-0.vllm.svc.cluster.local", 1) and not glob.admits("evil.com", 1)
    assert AllowRule.parse("[fd00::/8]:8000", "m").admits("fd00::1", 8000)
    for bad in ("10.0.0.5", "h:0", "h:9-2", "[fd00::/8]8000"):
        with pytest.raises(ConfigError, match=r"must name a host and its ports|no valid port range"):
            AllowRule.parse(bad, "m")


def test_a_discovered_address_is_a_backend_named_by_the_dns_name() -> None:
    d = DiscoverySpec.from_mapping(
        {"dns": "vllm.default.svc", "port": 8000, "labels": {"pool": "a"}}, "discovery[0]"
    )
    assert d.spec("10.0.0.7").id == "vllm.default.svc@10.0.0.7:8000"
    assert d.spec("fd00::7").url == "http://[fd00::7]:8000" and d.spec("fd00::7").labels == {"pool": "a"}
    with pytest.raises(ConfigError, match=r"discovery\[0\].port: required"):
        DiscoverySpec.from_mapping({"dns": "vllm"}, "discovery[0]")
    with pytest.raises(ConfigError, match=r"discovery\[0\].dns: 'a b' is not a DNS name"):
        DiscoverySpec.from_mapping({"dns": "a b", "port": 1}, "discovery[0]")
