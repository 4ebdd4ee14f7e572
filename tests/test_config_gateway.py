"""Nginx's side of the config: timeouts, retries, body size, the edge's Lua module."""

import pytest
from kvgate.config import ConfigError
from kvgate.config.fields import load
from kvgate.config.gateway import RETRY_STATUSES, GatewayConfig


def test_defaults() -> None:
    g = load(GatewayConfig, {}, "gateway")
    assert (g.decision_timeout_ms, g.first_byte_min_ms, g.retry_statuses) == (50, 5000, RETRY_STATUSES)
    assert g.edge_access is None and not g.route_headers


def test_retry_statuses_are_retryable_ones_sorted_once() -> None:
    assert load(GatewayConfig, {"retry_statuses": [503, 502, 503]}, "gateway").retry_statuses == (502, 503)
    for bad in ([418], ["502"], [True], 502):
        with pytest.raises(ConfigError, match=r"gateway.retry_statuses: expected a list of statuses among"):
            load(GatewayConfig, {"retry_statuses": bad}, "gateway")


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"client_max_body_size": "16 m"}, "is not an Nginx size like 16m"),
        ({"edge_access": "edge; os.exit()"}, "expected a Lua module name like edge.auth"),
        ({"first_byte_margin": 0.5}, r"first_byte_margin: 0.5 is out of range; use 1..100"),
    ],
)
def test_values_that_would_break_nginx_or_lua_are_refused(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load(GatewayConfig, data, "gateway")
