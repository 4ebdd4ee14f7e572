import pytest
from kvgate.config import Config, ConfigError
from kvgate.policies import PolicyName

BASE = {
    "backends": [
        {"url": "http://127.0.0.1:8001"},
        {"id": "b", "url": "http://10.0.0.2:8000", "weight": 2, "labels": {"pool": "a"}},
    ]
}


def test_defaults_and_units() -> None:
    c = Config.from_mapping(
        {**BASE, "scrape": {"interval_ms": 100, "timeout_ms": 50}, "redis": {"timeout_ms": 5}}
    )
    assert c.scrape.interval_s == 0.1 and c.scrape.timeout_s == 0.05 and c.redis.timeout_s == 0.005
    assert c.backends[0].id == "127.0.0.1:8001" and c.backends[1].weight == 2.0
    assert c.backends[1].address == "10.0.0.2:8000" and c.backends[1].labels == {"pool": "a"}
    assert c.routing.policy is PolicyName.KVGATE


def test_environment_overrides_the_file() -> None:
    c = Config.from_mapping(
        BASE,
        env={
            "KVGATE_ROUTING_POLICY": "least_load",
            "KVGATE_ADMIN_TOKEN": "123",
            "KVGATE_REDIS_URL": "redis://127.0.0.1:7000/1",
        },
    )
    assert c.routing.policy is PolicyName.LEAST_LOAD
    assert c.listen.admin_token == "123" and c.redis.url == "redis://127.0.0.1:7000/1"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"backends": [{"url": "ftp://x"}]}, "backends[0].url"),
        ({"backends": [{"url": "http://a:1", "wieght": 2}]}, "unknown key(s) wieght"),
        ({"routing": {"policy": "fastest"}}, "choose one of round_robin"),
        ({"scrape": {"interval_ms": 10}}, "scrape.interval_ms: 10 ms is out of range"),
        ({"scrape": {"interval_ms": 100, "timeout_ms": 200}}, "must not exceed"),
        ({"listen": {"http_host": "0.0.0.0"}}, "not loopback"),
        ({"redis": {"url": "http://x"}}, "redis.url"),
        ({"backends": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "share an id"),
        ({"extra": 1}, "unknown key(s) extra"),
        ({"gateway": {"retry_statuses": [500, 501]}}, "gateway.retry_statuses"),
        ({"gateway": {"retry_statuses": "500"}}, "gateway.retry_statuses"),
    ],
)
def test_bad_values_are_named_with_a_fix(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({**BASE, **data})
    assert needle in str(err.value)


def test_example_config_in_the_repo_is_valid() -> None:
    from pathlib import Path

    c = Config.from_file(Path(__file__).parents[1] / "kvgate.example.yaml", env={})
    assert len(c.backends) >= 1
    assert c.gateway.retry_statuses == (429, 500, 502, 503, 504)


@pytest.mark.parametrize("bid", ["a b", "x\x1fy", "sim\n0", "é", "x" * 129])
def test_backend_ids_are_visible_ascii(bid: str) -> None:
    """Ids name backends in response headers and metric labels, and key the prefix index."""
    with pytest.raises(ConfigError, match="id"):
        Config.from_mapping({"backends": [{"id": bid, "url": "http://127.0.0.1:8000"}]}, {})


def test_a_misspelt_environment_override_is_an_error_not_ignored() -> None:
    with pytest.raises(ConfigError, match="KVGATE_REDIS_ULR"):
        Config.from_mapping(BASE, env={"KVGATE_REDIS_ULR": "redis://x"})


def test_a_backends_metrics_mode_is_checked() -> None:
    c = Config.from_mapping({"backends": [{"url": "http://10.0.0.1:8000", "metrics": "none"}]}, env={})
    assert c.backends[0].metrics == "none"
    with pytest.raises(ConfigError, match="metrics"):
        Config.from_mapping({"backends": [{"url": "http://10.0.0.1:8000", "metrics": "tgi"}]}, env={})


@pytest.mark.parametrize("data", [{}, {"backends": []}, {"backends": None}])
def test_a_config_without_backends_is_an_error(data: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="backends: none listed"):
        Config.from_mapping(data, env={})
