"""The kv_index section and the backends' KV-event endpoints."""

import pytest
from kvgate.config import Config, ConfigError, TokenizerSource


def test_defaults_and_a_backend_that_publishes() -> None:
    cfg = Config.from_mapping(
        {
            "backends": [
                {"url": "http://a:8000", "kv_events": "tcp://a:5557", "kv_events_replay": "tcp://a:5558"}
            ]
        }
    )
    assert cfg.kv_index.tokenizer is TokenizerSource.BACKEND
    assert cfg.kv_index.tokenize_timeout_s == 0.03 and cfg.kv_index.stale_s == 10.0
    assert cfg.backends[0].kv_events == "tcp://a:5557" and cfg.backends[0].kv_events_replay == "tcp://a:5558"


@pytest.mark.parametrize(
    "endpoint", ["http://a:5557", "tcp://a", "tcp://:5557", "tcp://a:5557/x", 5557, "x" * 400]
)
def test_an_endpoint_that_is_not_tcp_host_port_is_refused(endpoint: object) -> None:
    with pytest.raises(ConfigError, match=r"kv_events: .* must look like tcp://HOST:PORT"):
        Config.from_mapping({"backends": [{"url": "http://a:8000", "kv_events": endpoint}]})


def test_discovered_backends_get_their_publishers_from_ports() -> None:
    cfg = Config.from_mapping(
        {
            "discovery": [
                {"dns": "vllm.svc", "port": 8000, "kv_events_port": 5557, "kv_events_replay_port": 5558}
            ]
        }
    )
    spec = cfg.discovery[0].spec("10.0.0.5")
    assert spec.kv_events == "tcp://10.0.0.5:5557" and spec.kv_events_replay == "tcp://10.0.0.5:5558"
    assert cfg.discovery[0].spec("fd00::1").kv_events == "tcp://[fd00::1]:5557"


def test_ranges_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"kv_index\.max_blocks"):
        Config.from_mapping({"backends": [{"url": "http://a:1"}], "kv_index": {"max_blocks": 10}})
    with pytest.raises(ConfigError, match=r"kv_index\.tokenizer_files: expected a mapping of model"):
        Config.from_mapping({"backends": [{"url": "http://a:1"}], "kv_index": {"tokenizer_files": ["/m"]}})
    with pytest.raises(ConfigError, match=r"kv_index\.tokenizer"):
        Config.from_mapping({"backends": [{"url": "http://a:1"}], "kv_index": {"tokenizer": "magic"}})
